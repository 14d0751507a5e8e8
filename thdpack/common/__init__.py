"""Foundations every layer uses: reading sample fields, the integer rules, per-sample values, model configs, the numba switch and the extension hooks."""
