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


def jitable(fn):
    """Make ``fn`` callable from plain Python *and* from inside :func:`njit` kernels
    (``numba.extending.register_jitable``); without numba it is ``fn`` itself."""
    if HAVE_NUMBA:
        from numba.extending import register_jitable

        return register_jitable(fn)
    return fn
