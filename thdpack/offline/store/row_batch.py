"""Stored packs straight to a :class:`~thdpack.batching.batch.ThdBatch`: the rows' token arrays,
end to end, into the builder's kernels (:func:`thdpack.batching.builder.stream_batch`), never split
into samples and joined again. This module only turns stored rows into the arrays (ids, targets, seq_lens);
the builder's own steps add the vision fields (:func:`~thdpack.batching.builder.with_vision`) and the
shared-prefix tree (:func:`~thdpack.batching.builder.shared_batch`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from thdpack.attention.static import check_num_seqs
from thdpack.batching.batch import ThdBatch
from thdpack.batching.builder import concat_int64, shared_batch, stream_batch, with_vision
from thdpack.batching.layout import BatchLayout
from thdpack.common.samples import to_int_array


def rows_batch(rows: Sequence[tuple], layout: BatchLayout, *, sample_index: np.ndarray, sources=None, vlm=None,
               vision: Sequence = ()) -> ThdBatch:
    """The batch of the samples of ``rows``, each ``(ids [S], seq_lens int64 [n], {"loss_mask" | "labels": [S]})``
    (one pack row's integer or bool numpy arrays, checked to agree), as :func:`thdpack.build_thd_batch` builds
    it from the same samples in order: the same tensors, dtypes and errors (a sample named by its position in the batch). ``sample_index``: int64
    ``[n]``; ``sources``: as :func:`~thdpack.batching.builder.stream_batch` takes it. ``vlm``: the VLM family,
    with ``vision`` ``[n]`` mappings holding each sample's vision fields only
    (:func:`~thdpack.offline.store.vision_readback.add_vision`)."""
    n = sum(lens.size for _, lens, _ in rows)
    if n == 0:
        raise ValueError("build_thd_batch got no samples; a batch needs at least one")
    check_num_seqs(n, layout.max_num_seqs)
    has = {name: any(name in targets for _, _, targets in rows) for name in ("labels", "loss_mask")}
    ids_parts, label_parts, mask_parts, first = [], [], [], 0
    for ids, lens, targets in rows:  # per sample: ids, labels, mask (the order the samples' errors come in)
        ids = _ints(ids, lens, first, "input_ids")
        if has["labels"]:
            label_parts.append(_ints(targets["labels"], lens, first, "labels") if "labels" in targets else ids)
        if has["loss_mask"]:
            mask = targets.get("loss_mask")
            mask_parts.append(np.ones(ids.size, bool) if mask is None else _ints(mask, lens, first, "loss_mask"))
        ids_parts.append(ids)
        first += lens.size
    seq_lens = np.concatenate([lens for _, lens, _ in rows])
    streams = [concat_int64(p) if p else None for p in (ids_parts, label_parts, mask_parts)]
    streams, seq_lens, truncated = _cut(streams, seq_lens, layout.cut_length)
    batch = stream_batch(*streams, seq_lens, layout, shard=vlm is None, sample_index=sample_index, sources=sources,
                         tokens_truncated=truncated)
    return with_vision(batch, layout, vlm, vision)


def rows_shared_batch(rows: Sequence[tuple], layout: BatchLayout, *, share_prefix: str, min_prefix_len: int,
                      sample_index: np.ndarray, sources=None, vlm=None, vision: Sequence) -> ThdBatch:
    """:func:`rows_batch` with each group's shared prefix laid out once, as
    ``build_thd_batch(share_prefix=..., min_prefix_len=...)`` lays out the same samples
    (:func:`~thdpack.batching.builder.shared_batch`). ``vision``: ``[n]`` mappings holding each sample's
    ``share_prefix`` group id and declared ``prefix_len`` (and its vision fields)."""
    def unshared(_, shape):
        return rows_batch(rows, shape, sample_index=sample_index, sources=sources, vlm=vlm, vision=vision)

    return shared_batch(unshared, vision, layout, share_prefix, min_prefix_len, vlm)


def _ints(values: np.ndarray, lens: np.ndarray, first: int, field: str) -> np.ndarray:
    """One row's ``field`` ``[S]`` read as the builder reads each sample's (errors name sample ``first``,
    the row's first: its samples share one dtype); uint64, whose values can fail one sample, per sample."""
    loss_mask = field == "loss_mask"
    if values.dtype != np.uint64:
        return to_int_array(values, sample=first, field=field, allow_bool=loss_mask)
    parts = np.split(values, np.cumsum(lens)[:-1])
    return np.concatenate([to_int_array(p, sample=first + i, field=field, allow_bool=loss_mask)
                           for i, p in enumerate(parts)])


def _cut(streams: list, seq_lens: np.ndarray, cut: int | None) -> tuple[list, np.ndarray, int]:
    """``streams`` and ``seq_lens`` with each sample cut to its first ``cut`` tokens (``max_length``),
    and the number of tokens cut."""
    if cut is None or not seq_lens.size or int(seq_lens.max()) <= cut:
        return streams, seq_lens, 0
    starts = np.repeat(np.cumsum(seq_lens) - seq_lens, seq_lens)
    keep = np.arange(int(seq_lens.sum())) - starts < cut
    kept = np.minimum(seq_lens, cut)
    return [None if s is None else s[keep] for s in streams], kept, int((seq_lens - kept).sum())
