"""Copy pieces of rows out of a tokenized Arrow table into a pack's token stream.

The tokenized rows (:mod:`thdpack.offline.tokenizing.tokenize_step`) are a memory-mapped table of many
record batches. ``table.take(rows)`` followed by a per-token index array costs two
copies and an int64 index per token, and ``take`` across hundreds of chunks in random
order dominated the write step (4 s of 6 s for 200k rows). :class:`RowPieces` reads
each chunk's Arrow buffers in place (int32 values as they are, booleans bit by bit)
and one compiled loop per source chunk copies each piece ``values[row][start : start +
length]`` straight into the output (plain arrays in, so the compiled code is cached on
disk; numba's typed lists cost every process ~0.7 s of compiling). VLM builds copy their
pixel rows the same way.
"""

from __future__ import annotations

import numpy as np

from thdpack.common.jit import njit
from thdpack.common.samples import IGNORE_INDEX

CHUNK_TOKENS = 1 << 22  # tokens per record batch / row group, and per step of counting targets


@njit
def _copy_values(src, src_pos, dst_pos, lengths, out):
    """``out[dst_pos[k] :][: lengths[k]] = src[src_pos[k] :][: lengths[k]]`` for every piece ``k``."""
    for k in range(src_pos.shape[0]):
        a, d = src_pos[k], dst_pos[k]
        for j in range(lengths[k]):
            out[d + j] = src[a + j]


@njit
def _copy_bits(bits, src_pos, dst_pos, lengths, out):
    """The same from Arrow's bit-packed booleans (LSB first; ``src_pos`` in bits)."""
    for k in range(src_pos.shape[0]):
        a, d = src_pos[k], dst_pos[k]
        for j in range(lengths[k]):
            i = a + j
            out[d + j] = (bits[i >> 3] >> (i & 7)) & 1


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
        # where each row's values start in its chunk's buffer (elements; bits for booleans)
        self._row_pos = (np.concatenate([o[:-1] + b for o, b in zip(offsets, base)]) if offsets
                         else np.zeros(0, np.int64))
        self._buffers = buffers

    def gather(self, rows, starts, lengths) -> np.ndarray:
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        src_pos = self._row_pos[rows] + np.asarray(starts, dtype=np.int64)
        dst_pos = np.cumsum(lengths) - lengths
        bits = self.dtype is np.bool_
        out = np.empty(int(lengths.sum()), np.uint8 if bits else self.dtype)
        copy = _copy_bits if bits else _copy_values
        chunk = self.chunk_of_row[rows]
        # one compiled call per chunk the pieces come from (each chunk is its own buffer)
        order = np.argsort(chunk, kind="stable")
        used, first = np.unique(chunk[order], return_index=True)
        for c, a, b in zip(used.tolist(), first.tolist(), [*first[1:].tolist(), order.size]):
            sel = order[a:b]
            copy(self._buffers[c], src_pos[sel], dst_pos[sel], lengths[sel], out)
        return out.view(np.bool_) if bits else out


def group_boundaries(tokens: np.ndarray, budget: int) -> list[int]:
    """Boundaries ``[0, ..., n]`` splitting consecutive items into groups of about ``budget`` tokens."""
    if tokens.size == 0:
        return [0, 0]
    group = (np.cumsum(tokens) - 1) // max(1, budget)
    starts = np.flatnonzero(np.diff(group)) + 1
    return [0] + starts.tolist() + [int(tokens.size)]


def count_targets(table, targets: str, rows, starts, lengths) -> np.ndarray:
    """int64 ``[k]``: the target tokens of each piece ``table[targets][rows[k]][starts[k] :][: lengths[k]]``
    (``targets``: ``loss_mask``, True = target, or ``labels``, not ``IGNORE_INDEX``), read
    :data:`CHUNK_TOKENS` tokens at a time (memory bounded by a chunk, not the rows)."""
    reader = RowPieces(table, targets)
    lengths = np.asarray(lengths, np.int64)
    out = np.zeros(lengths.size, np.int64)
    cuts = group_boundaries(lengths, CHUNK_TOKENS)
    for a, b in zip(cuts[:-1], cuts[1:]):
        values = reader.gather(rows[a:b], starts[a:b], lengths[a:b])
        is_t = values if targets == "loss_mask" else values != IGNORE_INDEX
        c = np.zeros(is_t.size + 1, np.int64)
        np.cumsum(is_t, out=c[1:])
        end = np.cumsum(lengths[a:b])
        out[a:b] = c[end] - c[end - lengths[a:b]]
    return out


def count_targets_of_dataset(shared: tuple, rows, starts, lengths) -> np.ndarray:
    """:func:`count_targets` with ``shared = (dataset, targets)``, ``dataset`` a file-backed
    ``datasets.Dataset`` of tokenized rows (it pickles as its file paths: a Ray task of
    ``engine: ray`` reads the rows where it runs, from the filesystem every node reaches)."""
    dataset, targets = shared
    return count_targets(dataset.data.table, targets, rows, starts, lengths)
