"""Per-sample alignment multiples for context / tensor / sequence parallelism and FP8."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping

import numpy as np

_FP8_MULTIPLES = {"fp8": 16, "mxfp8": 32}


def cp_pad_multiple(
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    fp8: bool | str | None = None,
) -> int:
    """The least multiple every sample's padded length must be a multiple of.

    ``lcm(2·cp if cp > 1 else 1, tp·cp if sequence_parallel and tp > 1 else 1)``,
    and additionally a multiple of 16 for FP8 (``fp8=True`` or ``"fp8"``) or 32
    for MXFP8 (``fp8="mxfp8"``). Never larger than needed: every extra pad slot
    costs compute on every layer. ``sequence_parallel``: a bool (:func:`check_bool`);
    ``fp8``: None, a bool, or one of those names (any case).
    """
    check_positive_int(cp_size, "cp_size")
    check_positive_int(tp_size, "tp_size")
    sequence_parallel = check_bool(sequence_parallel, "sequence_parallel")
    multiple = 2 * cp_size if cp_size > 1 else 1
    if sequence_parallel and tp_size > 1:
        multiple = math.lcm(multiple, tp_size * cp_size)
    fp8_multiple = _fp8_multiple(fp8)
    return multiple if fp8_multiple is None else math.lcm(multiple, fp8_multiple)


def _fp8_multiple(fp8) -> int | None:
    """The multiple FP8 needs: None for ``fp8`` None or False; ``TypeError`` / ``ValueError`` naming ``fp8`` for
    anything but a bool (:func:`is_bool`) or ``"fp8"`` / ``"mxfp8"`` (not ``0``, ``""`` or ``"no"``)."""
    if fp8 is None or is_bool(fp8):
        return _FP8_MULTIPLES["fp8"] if fp8 else None
    if not isinstance(fp8, str):
        raise TypeError(f"fp8 must be True, False, None, 'fp8' or 'mxfp8', got {fp8!r} ({type(fp8).__name__})")
    if fp8.lower() not in _FP8_MULTIPLES:
        raise ValueError(f"fp8 must be True, False, None, 'fp8' or 'mxfp8', got {fp8!r}")
    return _FP8_MULTIPLES[fp8.lower()]


def resolve_pad_multiple(
    cp_size: int = 1,
    tp_size: int = 1,
    sequence_parallel: bool = False,
    pad_multiple: int | None = None,
) -> int:
    """The multiple a builder pads to: the parallelism requirement, combined (lcm)
    with an explicit ``pad_multiple`` when one is given."""
    check_bool(sequence_parallel, "sequence_parallel")
    if type(cp_size) is int and type(tp_size) is int and cp_size == tp_size == 1 and pad_multiple is None:
        return 1  # the common case, checked cheaply
    multiple = cp_pad_multiple(cp_size, tp_size, sequence_parallel)
    if pad_multiple is not None:
        check_positive_int(pad_multiple, "pad_multiple")
        multiple = math.lcm(multiple, int(pad_multiple))
    return multiple


def round_up(lengths: np.ndarray, multiple: int) -> np.ndarray:
    """``lengths`` rounded up to ``multiple`` (int64 array in, int64 array out)."""
    if multiple == 1:
        return lengths
    return -(-lengths // multiple) * multiple


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def is_int(value, minimum: int | None = None, below: int | None = None) -> bool:
    """The one integer rule, as a test: ``value`` is a Python or numpy integer (not a bool),
    ``minimum <= value`` (any int64 when ``minimum`` is None) and ``value < below``, never past int64
    (``value < 2**63`` when ``below`` is None: every count and id is int64 downstream)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return False
    low = INT64_MIN if minimum is None else minimum
    return low <= value <= INT64_MAX and (below is None or value < below)


def check_int(value, name: str, minimum: int | None, *, below: int | None = None, hint: str = "",
              error: Callable[[str], Exception] = ValueError) -> None:
    """The one rule for integer arguments (:func:`is_int`): a Python or numpy integer (not a bool),
    ``minimum <= value`` (any int64 when ``minimum`` is None), ``value < below`` when ``below`` is given
    (the exclusive upper bound of a rank or an index: ``0 <= rank < world_size``) and ``value < 2**63``.
    Otherwise ``error`` (``ValueError``; ``IndexError`` for an index, a ``ValueError`` subclass, or a
    function of the message that returns the exception) with one message naming the argument, ``hint``
    appended to it:

    - ``NAME must be an integer in [MINIMUM, BELOW), got VALUE`` with ``below``;
    - ``NAME must be an integer >= MINIMUM, got VALUE`` without (`` and < 2**63`` added for a larger int);
    - ``NAME must be an integer in int64 range, got VALUE`` with neither bound."""
    if is_int(value, minimum, below):
        return
    if below is not None:
        what = f"an integer in [{INT64_MIN if minimum is None else minimum}, {below})"
    elif minimum is None:
        what = "an integer in int64 range"
    else:
        what = f"an integer >= {minimum}"
        if isinstance(value, int) and value > INT64_MAX:
            what += " and < 2**63"
    raise error(f"{name} must be {what}, got {value!r}{hint}")


def is_bool(value) -> bool:
    """The one boolean rule, as a test: a Python ``bool`` or a numpy bool (``np.bool_``); nothing else
    (not the strings ``"no"`` / ``"false"``, whose truthiness is True, nor 0 / 1)."""
    return isinstance(value, (bool, np.bool_))


def check_bool(value, name: str, *, hint: str = "",
               error: Callable[[str], Exception] = TypeError) -> bool:
    """The one rule for boolean arguments and options (:func:`is_bool`): ``value`` as a Python bool, or
    ``error`` (``TypeError``; a build config passes ``ValueError``, the error its command reports in one line)
    naming the argument (``NAME must be True or False, got 'no' (str)``), ``hint`` appended."""
    if is_bool(value):
        return bool(value)
    raise error(f"{name} must be True or False, got {value!r} ({type(value).__name__}){hint}")


def check_number(value, name: str, *, positive: bool, what: str = "") -> None:
    """The one rule for real-valued arguments (times, sizes, scales): a Python or numpy real number,
    not a bool, finite, ``> 0`` (``positive``) or ``>= 0``. ``ValueError`` naming the argument
    otherwise; ``what`` (e.g. `` (the DPO temperature)``) follows the rule in the message."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"{name} must be a {kind} finite number{what}, got {value!r}")


def host_array(x, name: str, what: str, shape: str) -> np.ndarray:
    """``x`` (a list or numpy array) as a numpy array: ``TypeError`` for a string, a mapping or None in place
    of it (``NAME must be WHAT, got TYPE``), ``ValueError`` for ragged nested lists (``NAME must be SHAPE, got
    ragged rows``). The array rules (:func:`integer_array`, the losses' real numbers) check the values."""
    if isinstance(x, (str, bytes, Mapping)) or x is None:
        got = "None" if x is None else type(x).__name__
        raise TypeError(f"{name} must be {what}, got {got}")
    try:
        return np.asarray(x)
    except ValueError:  # ragged nested lists
        raise ValueError(f"{name} must be {shape}, got ragged rows") from None


def integer_array(x, name: str, hint: str = ""):
    """``x`` as an array of integers (offsets, lengths, counts): a torch tensor is returned as it is, its
    dtype checked (not its values: reading accelerator memory would sync); anything else becomes a numpy
    array, int64 when empty. ``ValueError`` naming ``name`` for floats, bools, strings or objects (the
    first such value shown), or values beyond int64; ``TypeError`` for a string or a
    mapping in place of the array. ``hint`` follows the rule in the messages."""
    if type(x).__module__.startswith("torch"):
        dtype = x.dtype
        if dtype.is_floating_point or dtype.is_complex or str(dtype) == "torch.bool":
            raise ValueError(f"{name} must hold integers{hint}, got a {dtype} tensor")
        return x
    arr = host_array(x, name, f"integers (a list, numpy array or tensor){hint}",
                     f"a rectangular array of integers{hint}")
    if arr.size == 0:
        return arr.astype(np.int64)
    kind = arr.dtype.kind
    if kind in "iu" and not isinstance(x, (list, tuple)):
        if kind == "i" or arr.dtype.itemsize < 8 or arr.max() <= INT64_MAX:
            return arr
    values = (np.asarray(x, dtype=object) if isinstance(x, (list, tuple)) else arr).reshape(-1).tolist()
    bad = _first_not_integer(values)
    if bad is None:  # a list of ints (bools none), an object array of ints
        return arr if kind in "iu" else arr.astype(np.int64)
    t, value = bad
    at = f" at [{', '.join(map(str, np.unravel_index(t, arr.shape)))}]" if arr.ndim else ""
    dtype = f" (dtype {arr.dtype})" if isinstance(x, np.ndarray) else ""
    raise ValueError(f"{name} must hold integers in int64 range{hint}, got {value!r}{at}{dtype}")


def _first_not_integer(values: list) -> tuple[int, object] | None:
    """``(position, value)`` of the first value that is not an integer in int64 range (a bool is
    not), preferring one that is not integral (in a float array); None when all are integers."""
    first = None
    for t, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not INT64_MIN <= v <= INT64_MAX:
            if not isinstance(v, float) or not v.is_integer():
                return t, v
            first = (t, v) if first is None else first
    return first


def first_non_int64(values) -> tuple[int, object] | None:
    """``(position, value)`` of the first element of a flat sequence that is not an
    integer in int64 range (bools count as integers), or None when all are. For
    error messages: called once something is known to be wrong."""
    for t, v in enumerate(values):
        if not isinstance(v, (int, np.integer)) or not INT64_MIN <= v <= INT64_MAX:
            return t, v
    return None


def check_positive_int(value, name: str) -> None:
    """:func:`check_int` with ``minimum=1`` (sizes and counts)."""
    check_int(value, name, 1)
