"""Optional numba acceleration.

Hot loops that cannot be vectorised (bin packing) are written once in plain
Python and compiled with numba when it is importable. Without numba the same
code runs as Python (slow on millions of samples, but correct).
"""

from __future__ import annotations

try:  # pragma: no cover - exercised implicitly
    from numba import njit as _njit

    HAVE_NUMBA = True
except Exception:  # pragma: no cover
    HAVE_NUMBA = False
    _njit = None


def njit(fn):
    """Compile ``fn`` with ``numba.njit(cache=True)`` if numba is available."""
    if HAVE_NUMBA:
        return _njit(cache=True, nogil=True)(fn)
    return fn
