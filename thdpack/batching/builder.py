"""Build a THD batch straight from samples: one pass into preallocated arrays,
no ``[B, S]`` padded intermediate, no remove-padding step.

Which tokens are targets: a sample may give ``labels`` (HF style, ``ignore_index``
= no loss), a ``loss_mask`` (1 = target), both, or neither. With both, a token is a
target only where both say so (``labels[t] != ignore_index and loss_mask[t] == 1``):
the mask narrows the labels and never adds targets, so it is the same as passing
the labels alone with the masked-out tokens set to ``ignore_index``. With neither,
every token but the first is a target (its own id is the label).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from thdpack.attention.static import check_num_seqs
from thdpack.batching.assemble import BAD_LABEL, NEGATIVE_ID, OK, assemble_shard, assemble_stream
from thdpack.batching.batch import ThdBatch, _shard_for_cp, warn_if_no_targets
from thdpack.parallel.shard import Shard
from thdpack.batching.shared_prefix import DEFAULT_MIN_PREFIX_LEN, build_shared_batch, check_share_args, flat_layout
from thdpack.batching.vision_family import check_vlm
from thdpack.batching.layout import BatchLayout, layout_of, padded_lengths
from thdpack.common.align import is_int
from thdpack.common.samples import SampleError, get_field, refuse_bools, same_length, sample_list, to_int_array


def build_thd_batch(
    samples: Sequence,
    *,
    sample_index: Sequence[int] | None = None,
    source_index: Sequence[int] | None = None,
    vlm=None,
    sample_values: Sequence[str] | None = None,
    share_prefix: str | None = None,
    min_prefix_len: int = DEFAULT_MIN_PREFIX_LEN,
    **layout_keywords,
) -> ThdBatch:
    """Pack ``samples`` into one :class:`ThdBatch` on the CPU. What each argument accepts and its
    errors: docs/build.md, "Reference details", "build_thd_batch: what it takes".

    Args:
        samples: a list (any iterable) of mappings with ``input_ids`` (``[s]`` integers >= 0) and
            optionally ``labels`` (``[s]``, HF style: unshifted, ``ignore_index`` = no loss) and/or
            ``loss_mask`` (``[s]``, 1 = target); which tokens are targets: the module docstring.
        **layout_keywords: the :class:`thdpack.batching.layout.BatchLayout` fields (``layout=`` is a
            ``TypeError``): padding, alignment, cut, and which CP rank's shard is built.
        sample_index: ``[n]`` input row of each sample (defaults to ``0..n-1``).
        source_index: ``[n]`` source (of a mixture) of each sample, integers >= 0; default: the
            samples' :data:`SOURCE_INDEX_FIELD` field, else 0.
        vlm: for VLM samples, the model's family (``thdpack.vlm.get_family(model_config)``): adds
            the vision inputs, ``mm_token_type_ids`` and ``mrope_position_ids``.
        sample_values: names of per-sample fields to carry into ``batch.sample_values``.
        share_prefix: None, or the sample field holding a group id: each group's common prefix
            laid out once (:mod:`thdpack.batching.shared_prefix`); no CP.
        min_prefix_len: with ``share_prefix``, the shortest prefix worth sharing (default 32).

    Returns:
        A :class:`ThdBatch` on the CPU.
    """
    layout = layout_of("build_thd_batch", layout_keywords)
    check_vlm(vlm, "build_thd_batch")
    return build_batch(samples, layout, sample_index=sample_index, source_index=source_index,
                       vlm=vlm, sample_values=sample_values, share_prefix=share_prefix,
                       min_prefix_len=min_prefix_len, stacklevel=4)


def build_batch(samples: Sequence, layout: BatchLayout, *, sample_index=None, source_index=None, vlm=None,
                sample_values=None, share_prefix=None, min_prefix_len=DEFAULT_MIN_PREFIX_LEN,
                stacklevel: int = 3) -> ThdBatch:
    """:func:`build_thd_batch` with a validated ``layout`` (what the collators call per
    batch); a no-target warning names the frame ``stacklevel`` up (3: the caller's caller)."""
    if share_prefix is not None:
        def unshared(listed, shape):  # its warning 3 frames deeper: this, shared_batch, build_batch
            return build_batch(listed, shape, sample_index=sample_index, source_index=source_index, vlm=vlm,
                               sample_values=sample_values, stacklevel=stacklevel + 3)

        return shared_batch(unshared, samples, layout, share_prefix, min_prefix_len, vlm)
    samples = sample_list(samples, "build_thd_batch")
    if not samples:
        raise ValueError("build_thd_batch got no samples; a batch needs at least one")
    check_num_seqs(len(samples), layout.max_num_seqs)
    ids_parts, label_parts, mask_parts, tokens_truncated, pending = _read_samples(samples, layout.cut_length)
    seq_lens = np.fromiter((p.size for p in ids_parts), dtype=np.int64, count=len(ids_parts))
    batch = stream_batch(concat_int64(ids_parts), None if label_parts is None else concat_int64(label_parts),
                         None if mask_parts is None else concat_int64(mask_parts), seq_lens, layout,
                         shard=vlm is None, sample_index=sample_index,
                         sources=lambda: sources_of(samples, source_index), tokens_truncated=tokens_truncated,
                         pending=pending)
    if sample_values:
        from thdpack.common.values import attach_sample_values

        attach_sample_values(batch, samples, sample_values)
    batch = with_vision(batch, layout, vlm, samples)
    warn_if_no_targets(batch, stacklevel)
    return batch


def with_vision(batch: ThdBatch, layout: BatchLayout, vlm, samples: Sequence) -> ThdBatch:
    """``batch`` (the whole stream, built with ``shard=vlm is None``) with the VLM family's vision inputs, token
    types and mRoPE rows of ``samples`` (``[n]`` mappings with their vision fields), then ``layout``'s CP shard;
    ``batch`` itself when ``vlm`` is None."""
    if vlm is None:
        return batch
    vlm.attach(batch, samples)
    return batch if layout.cp_rank is None else _shard_for_cp(batch, layout.cp_size, layout.cp_rank)


def stream_batch(ids: np.ndarray, labels: np.ndarray | None, mask: np.ndarray | None, seq_lens: np.ndarray,
                 layout: BatchLayout, *, shard: bool = True, sample_index=None, sources=None, tokens_truncated: int = 0,
                 pending: list = ()) -> ThdBatch:
    """The batch of ``n`` samples given end to end (cut to ``layout.cut_length`` already): int64 ``ids``,
    ``labels`` (or None) and 0/1 ``mask`` (or None), ``[S]``, and int64 ``seq_lens`` ``[n]`` (each >= 1).
    With ``layout.cp_rank`` and ``shard``, that rank's shard, assembled directly. ``sources``: int64 ``[n]``
    source of each sample, or a function giving it (called once the tokens are checked), or None (zeros);
    ``pending``: the bool checks :func:`_read_samples` left (errors name the sample by its position)."""
    padded = padded_lengths(seq_lens, layout)
    cp_size, cp_rank = layout.cp_size, layout.cp_rank
    has_labels, has_mask = labels is not None, mask is not None
    source = labels if has_labels else _EMPTY
    mask = mask if has_mask else _EMPTY
    direct_shard = shard and cp_rank is not None
    args = (ids, source, has_labels, mask, has_mask, seq_lens, padded,
            int(layout.pad_token_id), int(layout.ignore_index))
    if direct_shard:
        status, token, zero_one, input_ids, labels, loss_mask, position_ids, cu, cu_padded, partition, local_lens = (
            assemble_shard(*args, cp_size, cp_rank)
        )
    else:
        status, token, zero_one, input_ids, labels, loss_mask, position_ids, cu, cu_padded = assemble_stream(*args)
    if pending and (zero_one or status != OK or tokens_truncated):  # a bool reads as 0 or 1; cut tokens unseen
        refuse_bools(pending)
    if status != OK:
        _raise_bad_value(status, token, ids, source, mask, cu, layout.ignore_index)

    index = _sample_index(sample_index, seq_lens.size)
    sources = sources() if callable(sources) else np.zeros(seq_lens.size, np.int64) if sources is None else sources
    cu_padded_t = torch.from_numpy(cu_padded)
    batch = ThdBatch(
        input_ids=torch.from_numpy(input_ids),
        labels=torch.from_numpy(labels),
        loss_mask=torch.from_numpy(loss_mask),
        position_ids=torch.from_numpy(position_ids),
        cu_seqlens=torch.from_numpy(cu),
        cu_seqlens_padded=cu_padded_t,
        max_seqlen=int(padded.max()),
        seq_lens=torch.from_numpy(cu[1:] - cu[:-1]),
        sample_index=torch.from_numpy(index),
        source_index=torch.from_numpy(sources),
        pad_multiple=layout.multiple,
        ignore_index=layout.ignore_index,
        tokens_truncated=tokens_truncated,
        max_num_seqs=layout.max_num_seqs,
    )
    if direct_shard:
        batch.shard = Shard("cp", cp_size, cp_rank, local_cu_seqlens_padded=cu_padded_t // cp_size,
                            local_seq_lens=torch.from_numpy(local_lens), partition_indices=torch.from_numpy(partition))
    return batch


def shared_batch(unshared, samples, layout: BatchLayout, share_prefix, min_prefix_len, vlm) -> ThdBatch:
    """The batch of ``samples`` with each group's shared prefix laid out once: ``unshared(samples, flat_layout)``
    first (its checks, its targets), then the tree gathered from it (:mod:`thdpack.batching.shared_prefix`);
    ``unshared(samples, layout)`` when no group shares. ``unshared(list, BatchLayout) -> ThdBatch`` builds
    the batch without sharing; ``samples``: ``[n]`` mappings holding each sample's group id and declared
    ``prefix_len`` (and its vision fields)."""
    check_share_args(share_prefix, min_prefix_len, layout)
    samples = sample_list(samples, "build_thd_batch")
    check_num_seqs(len(samples), layout.max_num_seqs)
    flat = unshared(samples, flat_layout(layout))
    limit = None if vlm is None else vlm.prefix_limit(flat)  # whole, equal images
    tree = build_shared_batch(flat, samples, layout, share_prefix, int(min_prefix_len), limit)
    if tree is not None:
        return tree if vlm is None else vlm.attach_tree(tree, flat)
    return unshared(samples, layout)


def _read_samples(samples, max_length):
    """Per-sample 1-D arrays of ids, labels (or None), loss masks (or None), the number of
    tokens cut by ``max_length``, and the lists whose bool check is left to the caller
    (:func:`thdpack.common.samples.refuse_bools`; an error while reading checks them first)."""
    pending = []
    try:
        return (*_read_fields(samples, max_length, pending), pending)
    except ValueError:
        refuse_bools(pending)  # a bool in an earlier sample or field is the error, as if checked at once
        raise


def _read_fields(samples, max_length, pending: list):
    """:func:`_read_samples` but the pending lists (appended to ``pending``)."""
    ids_parts, label_parts, mask_parts = [], [], []
    truncated = 0
    any_labels = any_mask = False
    for i, sample in enumerate(samples):
        ids = to_int_array(get_field(sample, "input_ids", i, required=True), sample=i, field="input_ids",
                           pending=pending)
        if ids.size == 0:
            raise SampleError.at(i, ": 'input_ids' is empty; every sample needs at least one token", field='input_ids')
        labels = get_field(sample, "labels", i)
        mask = get_field(sample, "loss_mask", i)
        if labels is not None:
            labels = same_length(to_int_array(labels, sample=i, field="labels", pending=pending), ids, i, "labels")
            any_labels = True
        if mask is not None:
            mask = same_length(to_int_array(mask, sample=i, field="loss_mask", allow_bool=True), ids, i, "loss_mask")
            any_mask = True
        if max_length is not None and ids.size > max_length:
            truncated += ids.size - max_length
            ids = ids[:max_length]
            labels = None if labels is None else labels[:max_length]
            mask = None if mask is None else mask[:max_length]
        ids_parts.append(ids)
        label_parts.append(labels)
        mask_parts.append(mask)
    if any_labels:
        label_parts = [ids if lab is None else lab for lab, ids in zip(label_parts, ids_parts)]
    if any_mask:
        mask_parts = [np.ones(ids.size, bool) if m is None else m for m, ids in zip(mask_parts, ids_parts)]
    return ids_parts, label_parts if any_labels else None, mask_parts if any_mask else None, truncated


def _sample_index(sample_index, n: int) -> np.ndarray:
    """int64 ``[n]``: the given input rows of the samples, or ``0..n-1``."""
    if sample_index is None:
        return np.arange(n, dtype=np.int64)
    index = np.asarray(sample_index, dtype=np.int64)
    if index.size != n:
        raise ValueError(f"sample_index has {index.size} entries for {n} samples")
    return index


SOURCE_INDEX_FIELD = "source_index"
"""The sample field that names a sample's source in a dataset mixture (an integer >= 0), which
:func:`build_thd_batch` records in ``batch.source_index``: :class:`thdpack.loaders.mixture_dataset.MixtureDataset`
sets it."""


def sources_of(samples: Sequence, source_index=None) -> np.ndarray:
    """int64 ``[n]``: ``source_index`` (given), else the samples' :data:`SOURCE_INDEX_FIELD`, else zeros.
    ``ValueError`` (``SampleError`` naming the sample) for a count that is not ``n``, for a value that is not
    an integer >= 0, and when only some samples have the field."""
    n = len(samples)
    if source_index is not None:
        index = np.asarray(source_index)
        if index.shape != (n,) or (index.size and index.dtype.kind not in "iu") or (index.size and index.min() < 0):
            raise ValueError(f"source_index must be {n} integers >= 0 (one source per sample), got {source_index!r}")
        return index.astype(np.int64)
    if all(type(s) is dict and SOURCE_INDEX_FIELD not in s for s in samples):  # the common case, checked cheaply
        return np.zeros(n, np.int64)
    values = [get_field(s, SOURCE_INDEX_FIELD, i) for i, s in enumerate(samples)]
    given = [v is not None for v in values]
    if not any(given):
        return np.zeros(n, np.int64)
    if not all(given):
        first, missing = given.index(True), given.index(False)
        raise SampleError.at(missing, f" has no '{SOURCE_INDEX_FIELD}' field, but sample {first} has one; give "
                             "every sample of a batch its source or none", field=SOURCE_INDEX_FIELD)
    index = np.empty(n, np.int64)
    for i, value in enumerate(values):
        try:  # a Python, numpy or one-element torch integer; not a bool
            number = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
        except TypeError:
            number = None
        if number is None or not is_int(number, 0):
            raise SampleError.at(i, f": '{SOURCE_INDEX_FIELD}' must be an integer >= 0 (the sample's source in a "
                                 f"mixture), got {value!r}", field=SOURCE_INDEX_FIELD)
        index[i] = number
    return index


def concat_int64(parts: list[np.ndarray]) -> np.ndarray:
    """int64 ``[S]``: the parts end to end (read only by the kernels, so a view is fine)."""
    if len(parts) == 1:
        return parts[0].astype(np.int64, copy=False)
    return np.concatenate(parts, dtype=np.int64, casting="unsafe")  # never via float64 for mixed int kinds


_EMPTY = np.zeros(0, np.int64)


def _raise_bad_value(status, token, ids, source, mask, cu, ignore_index) -> None:
    i = int(np.searchsorted(cu, token, side="right") - 1)
    at = f"at token {token - int(cu[i])}"
    if status == NEGATIVE_ID:
        raise SampleError.at(i, f": 'input_ids' has negative id {int(ids[token])} {at}", field='input_ids')
    if status == BAD_LABEL:
        raise SampleError.at(
            i, f": 'labels' has {int(source[token])} {at}; "
            f"labels must be token ids >= 0 or ignore_index ({ignore_index})",
            field='labels',
        )
    raise SampleError.at(i, f": 'loss_mask' has {mask[token].item()!r} {at}; expected 0 or 1", field='loss_mask')
