"""Reading sample fields: lists, numpy arrays, torch tensors and Arrow values
become 1-D numpy integer arrays, with errors that name the sample and field."""

from __future__ import annotations

import struct
from collections.abc import Mapping

import numpy as np

from thdpack.common.align import INT64_MAX, first_non_int64, is_bool

TOKEN_FIELDS = ("input_ids", "labels", "loss_mask")
IGNORE_INDEX = -100  # a label that scores no loss (HF / PyTorch cross-entropy default)


class SampleError(ValueError):
    """A ``ValueError`` about one sample: its message is ``"sample {sample}{detail}"``,
    ``sample`` being the sample's position in the list the builder was given.

    ``field`` names the sample field at fault where one is (None otherwise).
    A caller that knows which input rows those samples are (the collator, whose packs
    are subsets of its call) renames the sample with :meth:`renamed` instead of
    parsing the message. Raised from a DataLoader worker, it arrives as a plain
    message (``sample`` None), like any other ``ValueError``.
    """

    sample: int | None = None
    field: str | None = None
    detail: str = ""

    @classmethod
    def at(cls, sample: int, detail: str, *, field: str | None = None) -> "SampleError":
        """The error for sample ``sample``; ``detail`` follows the name (``": ..."`` or ``" has ..."``);
        ``field``: the sample field at fault (``"input_ids"``, ``"labels"``, ...), None when no one field is."""
        exc = cls(f"sample {sample}{detail}")
        exc.sample, exc.detail, exc.field = sample, detail, field
        return exc

    def renamed(self, sample: int, note: str = "") -> "SampleError":
        """The same error naming the sample ``sample``, with ``note`` appended."""
        return SampleError.at(sample, self.detail + note, field=self.field)


def _holds_a_bool(values, arr: np.ndarray) -> bool:
    """Whether ``values`` (a list or tuple, read as the integer array ``arr``) holds a bool (:func:`is_bool`):
    only its slots read as 0 or 1 can, so only those are looked at (one vectorised reduction, then, only
    when some slot is 0 or 1, a compare and a few type checks)."""
    unsigned = arr.astype(np.int64, copy=False).view(np.uint64)  # a negative value reads as > 1
    if _MIN(unsigned) > 1:
        return False
    return any(is_bool(values[i]) for i in np.flatnonzero(unsigned <= 1).tolist())


_MIN = np.minimum.reduce  # the ufunc itself: ndarray.min's Python wrapper costs more than a short list's scan


def refuse_bools(pending: list) -> None:
    """The bool check :func:`to_int_array` left to its caller (its ``pending`` argument): a
    :class:`SampleError` for the first ``(sample, field, list, array)`` whose list holds a bool.

    A builder calls it once per batch, and only when some id or label of the batch is 0 or 1 (what a
    bool reads as), or before it reports another error (a bool in an earlier sample is reported first)."""
    for sample, field, values, arr in pending:
        if _holds_a_bool(values, arr):
            raise _bool_values(sample, field)


def to_int_array(value, *, sample: int, field: str, allow_bool: bool = False,
                 pending: list | None = None) -> np.ndarray:
    """One per-token field as a 1-D numpy array of integers (or bools with ``allow_bool``).

    Accepts Python sequences, numpy arrays, torch tensors (any device), and
    Arrow values (``pyarrow`` arrays and list scalars). A leading axis of size 1
    (what a tokenizer returns with ``return_tensors=...``) is dropped. The result
    may be a view of the input: callers must not write to it.

    Lists take a fast typed conversion (``struct.pack_into``, which rejects floats and
    other non-integers; 1.4x ``array.array("q")``'s speed on token ids) before the
    general path. It takes a bool as 0 or 1, so a bool is looked for afterwards
    (``SampleError`` ``... holds bools``): here, or, given ``pending`` (a list), by the
    caller: ``(sample, field, value, array)`` is appended to it, and the caller calls
    :func:`refuse_bools` on it (a builder, once per batch).
    """
    if type(value) is np.ndarray and value.ndim == 1:  # the common case, without further dispatch
        kind = value.dtype.kind
        if kind == "i":
            return value
        if kind == "u":
            return _within_int64(value, sample=sample, field=field)
    reader = _READERS.get(type(value))
    if reader is not None:  # a type seen before (Arrow arrays): skip the dispatch below
        arr = reader(value)
        if arr.ndim == 1:
            kind = arr.dtype.kind
            if kind == "i":
                return arr
            if kind == "u":
                return _within_int64(arr, sample=sample, field=field)
    if type(value) is list and value:
        arr = np.empty(len(value), np.int64)
        try:
            struct.pack_into(f"{len(value)}q", arr, 0, *value)
        except (struct.error, TypeError, ValueError, OverflowError):
            arr = None  # not all ints: the checked path below gives the error message
        if arr is not None:
            if allow_bool:
                return arr
            if pending is not None:
                pending.append((sample, field, value, arr))
            elif _holds_a_bool(value, arr):
                raise _bool_values(sample, field)
            return arr
    if isinstance(value, np.ndarray) and value.dtype == object:  # Python objects: read as a list of them
        value = value.tolist()
    arr = _as_numpy(value, sample=sample, field=field)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
        value = value[0] if isinstance(value, (list, tuple)) else value
    if arr.ndim != 1:
        raise SampleError.at(sample, f": field '{field}' must be 1-D, got shape {tuple(arr.shape)}", field=field)
    if arr.dtype.kind not in ("iub" if allow_bool else "iu"):
        if arr.size == 0:
            return arr.astype(np.int64)
        if arr.dtype.kind == "b":
            raise _bool_values(sample, field)
        raise SampleError.at(
            sample, f": field '{field}' must hold integers, got dtype {arr.dtype}"
            + (f" (first value {arr[0].item()!r})" if arr.size else ""),
            field=field,
        )
    if not allow_bool and isinstance(value, (list, tuple)) and arr.size and _holds_a_bool(value, arr):
        raise _bool_values(sample, field)  # numpy reads a bool among integers as 0 or 1
    return _within_int64(arr, sample=sample, field=field)


def _bool_values(sample: int, field: str) -> SampleError:
    detail = (f": field '{field}' holds bools; token ids and labels are integers (a bool mask belongs in "
              "'loss_mask'), so convert them (e.g. .long()) if they really are ids 0 and 1")
    return SampleError.at(sample, detail, field=field)


def _within_int64(arr: np.ndarray, *, sample: int, field: str) -> np.ndarray:
    """``arr`` unchanged, unless it is uint64 with values that int64 cannot hold
    (the builder reads every field as int64): then a ``ValueError`` naming the first."""
    if arr.dtype.kind != "u" or arr.dtype.itemsize < 8 or not arr.size:
        return arr
    over = np.flatnonzero(arr > np.uint64(INT64_MAX))
    if over.size:
        t = int(over[0])
        raise _not_int64(sample, field, arr[t].item(), t)
    return arr


def _not_int64(sample: int, field: str, value, token: int) -> SampleError:
    detail = f": field '{field}' must hold integers in int64 range, got {value!r} at token {token}"
    return SampleError.at(sample, detail, field=field)


def _arrow_array(value) -> np.ndarray:
    return value.to_numpy(zero_copy_only=False)


def _arrow_list_scalar(value) -> np.ndarray:
    return value.values.to_numpy(zero_copy_only=False)


# readers for value types met before, by exact type (filled as Arrow types are met)
_READERS: dict = {}


def _as_numpy(value, *, sample: int, field: str) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except ValueError as exc:  # ragged nested lists
            raise SampleError.at(sample, f": field '{field}' is not a flat sequence of integers ({exc})", field=field) from None
        not_int64 = arr.ndim == 1 and (arr.dtype.kind not in "iub" or arr.dtype == np.uint64)
        bad = first_non_int64(value) if not_int64 else None
        if bad is not None:  # None, str, float, beyond int64: name the value and its token
            raise _not_int64(sample, field, bad[1], bad[0])
        if arr.dtype == object:
            raise SampleError.at(
                sample, f": field '{field}' must hold integers, got {type(value[0]).__name__} values",
                field=field,
            )
        return arr
    module = type(value).__module__
    if module.startswith("torch"):
        return _torch_to_numpy(value, sample=sample, field=field)
    if module.startswith("pyarrow"):
        if getattr(type(value), "to_numpy", None) is None:  # ListScalar: read its child array
            _READERS[type(value)] = _arrow_list_scalar
            return _arrow_list_scalar(value)
        _READERS[type(value)] = _arrow_array
        return _arrow_array(value)
    try:
        arr = np.asarray(value)
    except Exception as exc:  # pragma: no cover - depends on exotic input types
        raise SampleError.at(sample, f": cannot read field '{field}' of type {type(value).__name__}: {exc}", field=field) from None
    if arr.dtype == object:
        raise SampleError.at(
            sample, f": field '{field}' of type {type(value).__name__} is not an integer sequence",
            field=field,
        )
    return arr


def _torch_to_numpy(value, *, sample: int, field: str) -> np.ndarray:
    """A tensor's values on the CPU; floating-point tensors (numpy has no bfloat16)
    and meta tensors (no data) are refused here, by name."""
    if getattr(value, "is_meta", False):
        raise SampleError.at(
            sample, f": field '{field}' is a meta tensor (no data); materialise it "
            "(e.g. build the tensor on 'cpu') before packing",
            field=field,
        )
    if value.is_floating_point() or value.is_complex():
        raise SampleError.at(
            sample, f": field '{field}' must hold integers, got {value.dtype}; "
            "pass token ids as an integer tensor (e.g. .long())",
            field=field,
        )
    return value.detach().cpu().numpy()


def check_sample_stream(samples, owner: str) -> None:
    """``samples`` must be an iterable of samples: ``ValueError`` for one mapping (a sample, not a list
    of them), ``TypeError`` naming ``owner`` for None, a number, a string or anything not iterable."""
    if isinstance(samples, Mapping):
        raise ValueError(f"{owner} expects a sequence of samples, got a single mapping; pass [sample]")
    if isinstance(samples, (str, bytes)) or not hasattr(samples, "__iter__"):
        raise TypeError(f"{owner} takes a list of samples (mappings with 'input_ids'), got "
                        f"{'None' if samples is None else type(samples).__name__}")


def sample_list(samples, owner: str) -> list:
    """``samples`` (an iterable of samples) as a list, checked by :func:`check_sample_stream`."""
    check_sample_stream(samples, owner)
    return samples if type(samples) is list else list(samples)


def get_field(sample, field: str, index: int, *, required: bool = False):
    """``sample[field]`` or None; a clear error when ``sample`` is not a mapping."""
    if type(sample) is dict:  # fast path: no abc isinstance check
        value = sample.get(field)
    elif isinstance(sample, Mapping) or hasattr(sample, "keys"):
        try:
            value = sample[field]
        except KeyError:
            value = None
    else:
        raise SampleError.at(
            index, f" is a {type(sample).__name__}; expected a mapping with 'input_ids' "
            "(and optionally 'labels' or 'loss_mask')",
            field='input_ids',
        )
    if value is None and required:
        if field in sample.keys():
            raise SampleError.at(
                index, f": field '{field}' is None; give the sample's token ids "
                "(a list, numpy array or tensor of integers)",
                field=field,
            )
        raise SampleError.at(index, f" has no '{field}' field (fields: {sorted(sample.keys())})", field=field)
    return value


def same_length(arr: np.ndarray, ids: np.ndarray, index: int, field: str) -> np.ndarray:
    """``arr`` (a per-token field of sample ``index``), checked to have one value per id."""
    if arr.size != ids.size:
        raise SampleError.at(index, f": '{field}' has {arr.size} values but 'input_ids' has {ids.size}", field=field)
    return arr


def slice_sample(sample, start: int, stop: int, *, index: int = -1) -> dict:
    """A copy of ``sample`` whose per-token fields keep tokens ``[start, stop)``; each
    field is read, and checked against the whole ``input_ids``, before it is cut
    (errors name the sample ``index``: its input row)."""
    out = dict(sample)
    ids = None
    for key in TOKEN_FIELDS:  # input_ids first
        if key in out and out[key] is not None:
            arr = to_int_array(out[key], sample=index, field=key, allow_bool=key == "loss_mask")
            if ids is None:
                ids = arr
            else:
                same_length(arr, ids, index, key)
            out[key] = arr[start:stop]
    return out
