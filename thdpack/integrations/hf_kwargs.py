"""A :class:`thdpack.ThdBatch` as a transformers model's keyword arguments: :func:`to_hf_kwargs`,
:func:`hf_labels`."""

from __future__ import annotations

import torch

from thdpack.attention.backends import VARLEN_ATTENTION, attention_kind, dense_mask_dtype
from thdpack.attention.seq_idx import seq_idx_from_cu_seqlens
from thdpack.attention.static import pad_cu_seqlens
from thdpack.batching.batch import ThdBatch
from thdpack.batching.views import attention_mask_4d, block_mask, static_max_seqlen, whole_stream_offsets
from thdpack.batching.prefix_tree import refuse_tree
from thdpack.common.align import check_bool

# keys of ThdBatch.extras that to_hf_kwargs() passes to a transformers VLM
HF_VISION_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "second_per_grid_ts")
# ... and to an omni thinker (thdpack.vlm.omni): its audio clips, re-padded to one width, and their frames
HF_AUDIO_KEYS = ("input_features", "feature_attention_mask")


def hf_labels(batch: ThdBatch) -> torch.Tensor:
    """int64 ``[T]`` labels for a transformers causal LM, whose loss shifts by one:
    ``hf_labels[t + 1] == labels[t]``, so the model scores exactly the targets. Not for a
    shared-prefix batch (a prefix's last row has several targets): use :mod:`thdpack.losses`."""
    if batch.prefix_tree is not None:
        raise ValueError("hf_labels() / to_hf_kwargs(include_labels=True) cannot score a shared-prefix batch (a "
                         "prefix's last row predicts every member's first token): pass include_labels=False and "
                         "compute the loss with thdpack.losses (packed_loss, sequence_logps, dpo_loss, ...)")
    out = torch.full_like(batch.labels, batch.ignore_index)
    out[1:] = batch.labels[:-1]
    return out


def to_hf_kwargs(batch: ThdBatch, *, include_labels: bool = True, attn_implementation: str | None = None) -> dict:
    """Keyword arguments for ``model(**kw)`` of a transformers causal LM, exact on the pack whatever the
    model's ``use_cache`` default and whatever its layer types (docs/hybrid.md).

    Tensors get a batch axis of 1. Every backend gets the boundaries of every layer type:

    - ``position_ids`` int64 ``[1, T]`` (rotary positions; restart at 0 per sample);
    - ``cu_seq_lens_q/k`` int32 ``[n+1]`` (the padded layout) and ``max_length_q/k``: flash-attention varlen
      kernels, and the Gated DeltaNet / Mamba-2 scans of hybrid models (transformers passes
      ``cu_seq_lens_q`` to them as ``cu_seqlens``);
    - ``seq_idx`` int32 ``[1, T]`` (:func:`thdpack.batching.views.seq_idx`): the short causal convolutions of those
      layers, as transformers' ``DataCollatorWithFlattening(return_seq_idx=True)`` gives it.

    ``attn_implementation`` (the model's ``config._attn_implementation``) picks the attention mask
    (:mod:`thdpack.attention.backends`): None, flash names, hub kernels and custom names registered without
    a mask function get none (varlen kernels read the offsets); ``"flex_attention"`` gets ``attention_mask``
    = :func:`thdpack.batching.views.block_mask`; ``"sdpa"`` a bool and ``"eager"`` a float32 additive
    ``[1, 1, T, T]`` :func:`thdpack.batching.views.attention_mask_4d` (``T²``: for small packs, as transformers' own
    packed sdpa mask). A 4D mask is used as it is, cache or not, so ``use_cache=False`` is no longer needed.
    Attention layers ignore the keys they do not read. Models with sliding-window layers: call
    :func:`thdpack.integrations.packed_model` first (a whole-stream mask has no window).

    Hybrid models without their kernels, static shapes, CP shards, VLM and shared-prefix batches:
    docs/attention.md, "to_hf_kwargs: hybrid models, static shapes, CP shards, VLM and shared-prefix
    batches".
    """
    include_labels = check_bool(include_labels, "include_labels")
    kind = attention_kind(attn_implementation)
    if kind == "flash" and attn_implementation != VARLEN_ATTENTION:  # thdpack's own reads the segments' ancestors
        refuse_tree(f"attn_implementation={attn_implementation!r} (varlen cu_seqlens: flash-attn, TE THD)", batch)
    if kind != "flash" and batch.is_shard:
        whole_stream_offsets(batch, "to_hf_kwargs() for flex_attention / sdpa / eager", None)
    cu = batch.cu_seqlens_padded if not batch.is_shard else batch.shard.local_cu_seqlens_padded
    max_len = batch.max_seqlen if not batch.is_shard else batch.max_seqlen // batch.shard.cp_size
    seq_idx = seq_idx_from_cu_seqlens(cu)
    if batch.max_num_seqs is not None:  # static shapes: [max_num_seqs + 1] offsets, max_seqlen the stream's
        cu, max_len = pad_cu_seqlens(cu, batch.max_num_seqs), static_max_seqlen(batch) // batch.shard.cp_size
    kw = {
        "input_ids": batch.input_ids.unsqueeze(0),
        "position_ids": batch.position_ids.unsqueeze(0),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
        "seq_idx": seq_idx,
    }
    if batch.prefix_tree is not None:  # a trie: what hybrid layers fork their states by (packed_model), and what
        # thdpack_varlen gathers each segment's ancestors by
        kw["segment_lens"] = batch.seq_lens.to(torch.int64)
        kw["segment_parents"] = batch.prefix_tree.parents.to(torch.int64)
    if kind == "flex":
        kw["attention_mask"] = block_mask(batch)
    elif kind == "dense":
        kw["attention_mask"] = attention_mask_4d(batch, dense_mask_dtype(attn_implementation))
    return _vision_and_labels(batch, kw, include_labels)


def _vision_and_labels(batch: ThdBatch, kw: dict, include_labels: bool) -> dict:
    """``kw`` with a VLM's mRoPE rows, token types and vision inputs, and the labels (see :func:`to_hf_kwargs`)."""
    mrope = batch.token_extras.get("mrope_position_ids")
    if mrope is not None:  # VLM batch (thdpack.vlm)
        kw["position_ids"] = torch.cat([batch.position_ids.unsqueeze(0), mrope], 0).unsqueeze(1)
        if batch.extras.get("hf_token_types", True):  # an omni thinker takes no token types
            kw["mm_token_type_ids"] = batch.token_extras["mm_token_type_ids"].unsqueeze(0)
        kw.update({k: batch.extras[k] for k in HF_VISION_KEYS + HF_AUDIO_KEYS if batch.extras.get(k) is not None})
    if include_labels:
        if batch.is_shard:
            kw["labels"] = batch.labels.unsqueeze(0)
            kw["shift_labels"] = batch.labels.unsqueeze(0)
        else:
            kw["labels"] = hf_labels(batch).unsqueeze(0)
    return kw
