"""The dense block-diagonal causal mask of a THD stream, ``[1, 1, T, T]``, for SDPA and eager attention.

Memory is ``T²`` elements: 1 GiB as bool and 4 GiB as float32 for a 32k-token pack (per copy;
eager attention also adds it to a ``[1, H, T, T]`` score tensor). Use it for small packs, for
kernels that take nothing else, or where transformers does not derive the mask from
``position_ids`` itself (it does for sdpa / eager when no attention mask and no cache is given,
see :func:`thdpack.integrations.to_hf_kwargs`). Prefer FlexAttention's ``BlockMask``
(:func:`thdpack.attention.block_mask.document_block_mask`, ``O(T)`` plus a tile table) or
flash-attn varlen over ``cu_seqlens_padded`` (no mask at all) for long packs.
"""

from __future__ import annotations

import torch

from thdpack.attention.documents import check_offsets, document_starts


def check_mask_dtype(dtype) -> None:
    """``ValueError`` unless ``dtype`` is ``torch.bool`` or a floating torch dtype."""
    if not isinstance(dtype, torch.dtype) or not (dtype == torch.bool or dtype.is_floating_point):
        raise ValueError(f"dtype must be torch.bool or a floating torch dtype (torch.float32, ...), got {dtype!r}")


def dense_document_mask(cu_seqlens_padded, total: int | None = None, *, dtype=torch.bool, device=None) -> torch.Tensor:
    """The document-causal mask of a THD stream as a dense ``[1, 1, T, T]`` tensor.

    Slot ``q`` attends to slot ``kv`` iff both lie in the same sample's padded span and ``kv <= q``
    (documents as :func:`thdpack.attention.documents.document_ids_from_offsets` assigns them). The dense form of
    :func:`thdpack.attention.block_mask.document_block_mask`.

    Args:
        cu_seqlens_padded: int ``[n+1]`` cumulative padded lengths (tensor on any device, numpy or list).
        total: the stream length ``T`` (default ``cu_seqlens_padded[-1]``).
        dtype: ``torch.bool`` (True = attend: ``scaled_dot_product_attention``'s convention) or a
            floating dtype for an additive mask (0 = attend, ``torch.finfo(dtype).min`` = masked), which
            eager attention adds to its scores: give eager the model's dtype, never a bool mask.
        device: where to build it (default: the device of ``cu_seqlens_padded``).

    Returns:
        ``dtype`` ``[1, 1, T, T]``; ``T²`` elements (see the module docstring).
    """
    check_mask_dtype(dtype)
    cu, total = check_offsets(cu_seqlens_padded, total)
    return build_dense_mask(cu if device is None else cu.to(device), total, dtype)


def build_dense_mask(cu: torch.Tensor, total: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`dense_document_mask` on validated offsets (``cu`` int64 ``[n+1]``, its device the mask's)."""
    slots = torch.arange(total, device=cu.device)
    starts = document_starts(cu, slots)
    allowed = (slots[None, :] <= slots[:, None]) & (slots[None, :] >= starts[:, None])
    if dtype == torch.bool:
        return allowed[None, None]
    mask = torch.zeros((1, 1, total, total), dtype=dtype, device=cu.device)
    return mask.masked_fill_(~allowed[None, None], torch.finfo(dtype).min)
