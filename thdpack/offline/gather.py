"""Copy pieces of rows out of a tokenized Arrow table into a pack's token stream.

The tokenized rows (:mod:`thdpack.offline.tokenize`) are a memory-mapped table of many
record batches. ``table.take(rows)`` followed by a per-token index array costs two
copies and an int64 index per token, and ``take`` across hundreds of chunks in random
order dominated the write step (4 s of 6 s for 200k rows). :class:`RowPieces` reads
each chunk's Arrow buffers in place (int32 values as they are, booleans bit by bit)
and one compiled loop copies each piece ``values[row][start : start + length]``
straight into the output. VLM builds copy their pixel rows the same way.
"""

from __future__ import annotations

import numpy as np

from thdpack._jit import HAVE_NUMBA, njit


@njit
def _gather_values(values, base, offsets, chunk_of_row, local_row, rows, starts, lengths, out):
    """Pieces of numeric rows: ``out[...] = values[c][base[c] + offsets[c][r] + start :][:length]``."""
    pos = 0
    for k in range(rows.shape[0]):
        row = rows[k]
        c = chunk_of_row[row]
        src = values[c]
        a = base[c] + offsets[c][local_row[row]] + starts[k]
        n = lengths[k]
        for j in range(n):
            out[pos + j] = src[a + j]
        pos += n


@njit
def _gather_bits(bits, base, offsets, chunk_of_row, local_row, rows, starts, lengths, out):
    """Boolean pieces from Arrow's bit-packed buffers (LSB first; ``base`` is a bit offset)."""
    pos = 0
    for k in range(rows.shape[0]):
        row = rows[k]
        c = chunk_of_row[row]
        src = bits[c]
        a = base[c] + offsets[c][local_row[row]] + starts[k]
        n = lengths[k]
        for j in range(n):
            i = a + j
            out[pos + j] = (src[i >> 3] >> (i & 7)) & 1
        pos += n


def _typed_list(arrays):
    if not HAVE_NUMBA:
        return list(arrays)
    from numba.typed import List

    out = List()
    for a in arrays:
        out.append(a)
    return out


class RowPieces:
    """Reads pieces of the rows of one list column of a ``pyarrow.Table`` (values int32,
    float32 or bool; ``list`` or ``large_list``) without copying the table.

    ``gather(rows, starts, lengths)`` -> the concatenation of
    ``column[rows[k]][starts[k] : starts[k] + lengths[k]]`` for every ``k``: a numpy
    array of ``lengths.sum()`` values of the column's type. ``lengths`` (int64
    ``[rows]``) holds every row's length, so ``gather(rows, 0, lengths[rows])`` copies
    whole rows.
    """

    _TYPES = {"bool": np.bool_, "int32": np.int32, "float": np.float32}

    def __init__(self, table, name: str):
        col = table.column(name)
        self.dtype = self._TYPES.get(str(getattr(col.type, "value_type", None)))
        if self.dtype is None:
            raise TypeError(f"column {name!r}: a list of int32, float32 or bool expected, got {col.type}")
        chunks = [c for c in col.chunks if len(c)]
        counts = np.fromiter((len(c) for c in chunks), np.int64, count=len(chunks))
        self.chunk_of_row = np.repeat(np.arange(len(chunks), dtype=np.int64), counts)
        first = np.zeros(len(chunks) + 1, np.int64)
        np.cumsum(counts, out=first[1:])
        self.local_row = np.arange(int(first[-1]), dtype=np.int64) - np.repeat(first[:-1], counts)
        offsets, buffers, base = [], [], np.zeros(len(chunks), np.int64)
        storage = np.uint8 if self.dtype is np.bool_ else self.dtype  # booleans stay bit-packed
        for c, chunk in enumerate(chunks):
            if chunk.null_count or chunk.values.null_count:
                raise ValueError(f"column {name!r} has null rows or values")
            values = chunk.values  # the whole child array; chunk.offsets already index into it
            offsets.append(np.asarray(chunk.offsets).astype(np.int64))
            data = values.buffers()[1]
            buffers.append(np.frombuffer(data, dtype=storage) if data is not None else np.zeros(0, storage))
            base[c] = values.offset
        self.lengths = np.concatenate([np.diff(o) for o in offsets]) if offsets else np.zeros(0, np.int64)
        self._offsets = _typed_list(offsets)
        self._buffers = _typed_list(buffers)
        self._base = base

    def gather(self, rows, starts, lengths) -> np.ndarray:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        starts = np.ascontiguousarray(starts, dtype=np.int64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        total = int(lengths.sum())
        if self.dtype is np.bool_:
            out = np.empty(total, np.uint8)
            if total:
                _gather_bits(self._buffers, self._base, self._offsets, self.chunk_of_row, self.local_row, rows, starts,
                             lengths, out)
            return out.view(np.bool_)
        out = np.empty(total, self.dtype)
        if total:
            _gather_values(self._buffers, self._base, self._offsets, self.chunk_of_row, self.local_row, rows, starts,
                           lengths, out)
        return out
