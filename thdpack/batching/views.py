"""A batch's attention views, one function each: its masks, document ids, pad slots, ``seq_idx`` and static-shape
offsets, over the offset functions of :mod:`thdpack.attention` (which take offsets, not a batch)."""

from __future__ import annotations

import torch

from thdpack.attention.block_mask import DEFAULT_BLOCK_SIZE, build_block_mask, check_block_size
from thdpack.attention.dense_mask import build_dense_mask, check_mask_dtype
from thdpack.attention.documents import documents_of
from thdpack.attention.seq_idx import seq_idx_from_cu_seqlens
from thdpack.attention.static import pad_cu_seqlens
from thdpack.attention.tree_mask import build_dense_tree_mask, build_tree_block_mask
from thdpack.batching.batch import ThdBatch
from thdpack.batching.prefix_tree import refuse_tree


def block_mask(batch: ThdBatch, block_size=DEFAULT_BLOCK_SIZE, *, device=None):
    """The document-causal FlexAttention ``BlockMask`` of the stream, ``shape (1, 1, T, T)``, built
    from ``cu_seqlens_padded`` (:func:`thdpack.attention.block_mask.document_block_mask`: no
    ``[T, T]`` tensor; equal to ``create_block_mask`` over a document mask_mod, block for block).

    Args:
        batch: a whole batch (a shard is a ``ValueError``).
        block_size: tile size, an integer or a ``(q_block, kv_block)`` pair.
        device: where to build it (default: the batch's); build it where attention runs.

    On a shared-prefix batch, the tree's mask (:func:`thdpack.attention.tree_mask.tree_block_mask`).
    """
    q_block, kv_block = check_block_size(block_size)
    cu = whole_stream_offsets(batch, "block_mask()", device)
    if batch.prefix_tree is not None:
        lens, parents = _tree_segments(batch, cu.device)
        return build_tree_block_mask(cu, lens, parents, batch.num_padded_tokens, q_block, kv_block)
    return build_block_mask(cu, batch.num_padded_tokens, q_block, kv_block)


def attention_mask_4d(batch: ThdBatch, dtype: torch.dtype = torch.bool, *, device=None) -> torch.Tensor:
    """The dense block-diagonal causal mask ``[1, 1, T, T]`` for SDPA (``torch.bool``, True =
    attend) or eager attention (a floating ``dtype``: additive, 0 or ``finfo(dtype).min``).
    ``T²`` elements (1 GiB as bool for 32k tokens): for small packs; prefer :func:`block_mask`
    or flash-attn varlen for long ones (:mod:`thdpack.attention.dense_mask`). On a shared-prefix
    batch, the tree's mask (:func:`thdpack.attention.tree_mask.dense_tree_mask`). A shard is a ``ValueError``."""
    check_mask_dtype(dtype)
    cu = whole_stream_offsets(batch, "attention_mask_4d()", device)
    if batch.prefix_tree is not None:
        return build_dense_tree_mask(cu, *_tree_segments(batch, cu.device), batch.num_padded_tokens, dtype)
    return build_dense_mask(cu, batch.num_padded_tokens, dtype)


def document_ids(batch: ThdBatch) -> torch.Tensor:
    """int32 ``[T]``: the sample (``0..n-1``) of every slot, by ``cu_seqlens_padded``: pad
    slots and a ``pad_to`` tail hold the id of the sample before them, as ``position_ids``
    continue its count (:mod:`thdpack.attention.documents`). On a CP or Ulysses shard: the
    sample of each local token (the whole stream's ids at ``partition_indices``). On a shared-prefix
    batch: the segment of every slot (:func:`document_parents` tells which prefix a member sees)."""
    cu = batch.cu_seqlens_padded.to(torch.int64)
    return documents_of(cu, _slots(batch, cu.device)).to(torch.int32)


def document_parents(batch: ThdBatch) -> torch.Tensor:
    """int32 ``[S]`` the parent of every document (segment) of :func:`document_ids`: on a shared-prefix
    batch a member's prefix (it attends to the prefix's real tokens, then to itself causally), ``-1``
    for a prefix or a sample alone; all ``-1`` for an unshared batch."""
    if batch.prefix_tree is not None:
        return batch.prefix_tree.parents.to(torch.int32)
    return torch.full((int(batch.seq_lens.numel()),), -1, dtype=torch.int32, device=batch.seq_lens.device)


def padding_mask(batch: ThdBatch) -> torch.Tensor:
    """bool ``[T]`` (a shard: its local slots), True on the slots that hold no token of a sample: the
    alignment pad slots after each sample's real tokens and a ``pad_to`` tail. On a CP (or Ulysses) shard
    the stream's mask taken by ``partition_indices``, the indices of its tokens. What megatron-core's
    ``GPTModel.forward(padding_mask=...)`` takes (``[1, T]``, True = pad) to keep pad slots out of its MoE
    routers' aux and z losses, token counts and expert-bias updates (``to_gpt_forward_kwargs``). A
    shared-prefix batch is a ``ValueError``."""
    refuse_tree("padding_mask (each sample's pad slots after its tokens)", batch)
    cu = batch.cu_seqlens_padded.to(torch.int64)
    slots = _slots(batch, cu.device)
    doc = documents_of(cu, slots)
    return slots - cu[doc] >= batch.seq_lens.to(device=cu.device, dtype=torch.int64)[doc]


def seq_idx(batch: ThdBatch) -> torch.Tensor:
    """int32 ``[1, T]``: the sample of every stream slot, as transformers'
    ``DataCollatorWithFlattening(return_seq_idx=True)`` and megatron-core's ``PackedSeqParams``
    (from ``total_tokens``) give it to Mamba-2 / Gated-DeltaNet layers. Pad slots and a ``pad_to``
    tail hold their sample's id (the span of ``cu_seqlens_padded`` they are in). On a CP shard:
    the whole stream's (``T`` global), since such a layer scans the whole stream. A scan cannot
    restart from a shared prefix: ``ValueError`` on a shared-prefix batch."""
    refuse_tree("seq_idx (a per-sequence scan)", batch)
    return seq_idx_from_cu_seqlens(batch.cu_seqlens_padded)


def static_cu_seqlens(batch: ThdBatch) -> torch.Tensor:
    """int32 ``[max_num_seqs + 1]``: ``cu_seqlens`` with its last value repeated (zero-length sequences,
    :func:`thdpack.attention.static.pad_cu_seqlens`); ``batch.cu_seqlens`` itself without ``max_num_seqs``."""
    return batch.cu_seqlens if batch.max_num_seqs is None else pad_cu_seqlens(batch.cu_seqlens, batch.max_num_seqs)


def static_cu_seqlens_padded(batch: ThdBatch) -> torch.Tensor:
    """int32 ``[max_num_seqs + 1]``: ``cu_seqlens_padded`` likewise (its repeated last value is ``T``)."""
    cu = batch.cu_seqlens_padded
    return cu if batch.max_num_seqs is None else pad_cu_seqlens(cu, batch.max_num_seqs)


def static_max_seqlen(batch: ThdBatch) -> int:
    """``max_seqlen`` for the kernels: with ``max_num_seqs`` the stream length ``T`` (global), an upper bound
    every batch of a ``pad_to`` epoch shares; else ``batch.max_seqlen``."""
    return batch.max_seqlen if batch.max_num_seqs is None else int(batch.cu_seqlens_padded[-1])


def whole_stream_offsets(batch: ThdBatch, what: str, device=None) -> torch.Tensor:
    """int64 ``cu_seqlens_padded`` of ``batch`` on ``device`` (default: the batch's); ``ValueError`` naming
    ``what`` on a shard (a whole-stream mask cannot be built from one rank's tokens)."""
    if batch.is_shard:
        sh = batch.shard
        kind = f"Ulysses shard (sp_size={sh.sp_size}" if sh.sp_size > 1 else f"CP shard (cp_size={sh.cp_size}"
        rank = sh.sp_rank if sh.sp_size > 1 else sh.cp_rank
        raise ValueError(f"{what} is for a whole batch, and this is a {kind}, rank {rank}): masks span "
                         "the whole stream; build them on the batch before sharding, or attend across ranks "
                         "with a CP attention (ring / all-gather) over the flash kwargs")
    cu = batch.cu_seqlens_padded.to(torch.int64)
    return cu if device is None else cu.to(device)


def _slots(batch: ThdBatch, device) -> torch.Tensor:
    """int64 stream position of every local slot: ``partition_indices`` on a shard, else ``0..T-1``."""
    if batch.is_shard:
        return batch.shard.partition_indices.to(device)
    return torch.arange(batch.num_padded_tokens, device=device)


def _tree_segments(batch: ThdBatch, device) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[S]`` real lengths and parents of a shared-prefix batch's segments, on ``device``."""
    return batch.seq_lens.to(device, torch.int64), batch.prefix_tree.parents.to(device, torch.int64)
