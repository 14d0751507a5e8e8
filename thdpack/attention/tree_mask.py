"""Attention masks of a prefix tree in a THD stream: shared prefixes laid out once, members after them.

A shared-prefix stream is a sequence of *segments* (documents) given by ``cu_seqlens_padded``: a
root segment (a shared prefix, or a sample laid out alone) has parent ``-1``; a member segment
holds one member's own tokens after its group's prefix and names that prefix as its parent. A slot
``q`` of segment ``d`` may attend to ``kv`` iff

- ``s(q) <= kv <= q`` (its own segment, causally, as in a document mask), or
- ``kv`` is a *real* token of ``d``'s parent: ``a(d) <= kv < a(d) + len(parent)``, the parent's
  padded start plus its real length (the parent's alignment pad slots are never seen).

So the prefix is causal within itself, each member sees the whole prefix and itself causally, and
never another member. One level only (a parent is a root and comes before its members)::

    segments      prefix P (3) | member A (2) | member B (1)
    slot          0 1 2        | 3 4          | 5
    row 3 (A0) sees 0 1 2 3;  row 4 sees 0 1 2 3 4;  row 5 (B0) sees 0 1 2 5

Every layout here reads per-slot ranges (:func:`slot_ranges`) from the offsets, real lengths and
parents: a dense ``[1, 1, T, T]`` mask for SDPA / eager (:func:`dense_tree_mask`), and a
FlexAttention ``BlockMask`` built from tile arithmetic, no ``[T, T]`` tensor
(:func:`tree_block_mask`): equal, table for table, to ``create_block_mask`` over the same
mask_mod. Varlen kernels (flash-attn, TransformerEngine THD) take one causal range per sequence
and cannot express the parent range.
"""

from __future__ import annotations

import torch

from thdpack.attention.block_mask import DEFAULT_BLOCK_SIZE, block_mask_from_tiles, check_block_size
from thdpack.attention.dense_mask import check_mask_dtype
from thdpack.attention.documents import check_offsets, documents_of


def check_tree(cu_seqlens_padded, seq_lens, parents, total=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(cu, lens, parents, total)``: int64 ``[S+1]`` offsets, int64 ``[S]`` real lengths and parents, and
    the stream length. ``ValueError`` naming the bad value unless the offsets are valid
    (:func:`thdpack.attention.documents.check_offsets`), every real length fits its padded span,
    and every parent is ``-1`` or an earlier root segment."""
    cu, total = check_offsets(cu_seqlens_padded, total)
    lens = torch.as_tensor(seq_lens).to(device=cu.device, dtype=torch.int64).reshape(-1)
    par = torch.as_tensor(parents).to(device=cu.device, dtype=torch.int64).reshape(-1)
    S = cu.shape[0] - 1
    if lens.shape[0] != S or par.shape[0] != S:
        raise ValueError(f"seq_lens and parents need one entry per segment ({S}), got {lens.shape[0]} and {par.shape[0]}")
    over = torch.nonzero((lens < 0) | (lens > cu[1:] - cu[:-1]))
    if over.numel():
        d = int(over[0, 0])
        raise ValueError(f"segment {d} has real length {int(lens[d])}, outside its padded span of "
                         f"{int(cu[d + 1] - cu[d])} slots")
    index = torch.arange(S, device=cu.device)
    bad = (par < -1) | (par >= index) | ((par >= 0) & (par[par.clamp_min(0)] != -1))
    if bool(bad.any()):
        d = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"segment {d} has parent {int(par[d])}; a parent must be -1 or an earlier segment "
                         "whose own parent is -1 (one level: a shared prefix, then its members)")
    return cu, lens, par, total


def slot_ranges(cu: torch.Tensor, lens: torch.Tensor, parents: torch.Tensor, slots: torch.Tensor):
    """``(start, parent_lo, parent_hi)``, int64 like ``slots``: slot ``q`` sees ``start[q] <= kv <= q`` and
    ``parent_lo[q] <= kv < parent_hi[q]`` (an empty range, ``0, 0``, for a root). Validated inputs
    (:func:`check_tree`) on the device of ``slots``."""
    seg = documents_of(cu, slots)
    par = parents[seg]
    root = par < 0
    p = par.clamp_min(0)
    lo = torch.where(root, 0, cu[p])
    return cu[seg], lo, torch.where(root, 0, cu[p] + lens[p])


def dense_tree_mask(cu_seqlens_padded, seq_lens, parents, total=None, *, dtype=torch.bool, device=None) -> torch.Tensor:
    """The tree mask (the module docstring) as a dense ``[1, 1, T, T]`` tensor.

    Args:
        cu_seqlens_padded: int ``[S+1]`` cumulative padded segment lengths.
        seq_lens: int ``[S]`` real lengths of the segments.
        parents: int ``[S]`` parent segment of each, ``-1`` for a root.
        total: the stream length ``T`` (default ``cu_seqlens_padded[-1]``).
        dtype: ``torch.bool`` (True = attend) or a floating dtype (additive: 0 or ``finfo.min``).
        device: where to build it (default: the offsets' device).

    Returns:
        ``dtype`` ``[1, 1, T, T]``: ``T²`` elements, for small packs.
    """
    check_mask_dtype(dtype)
    cu, lens, par, total = check_tree(cu_seqlens_padded, seq_lens, parents, total)
    if device is not None:
        cu, lens, par = cu.to(device), lens.to(device), par.to(device)
    return build_dense_tree_mask(cu, lens, par, total, dtype)


def build_dense_tree_mask(cu, lens, parents, total: int, dtype) -> torch.Tensor:
    """:func:`dense_tree_mask` on validated inputs (their device is the mask's)."""
    slots = torch.arange(total, device=cu.device)
    start, lo, hi = slot_ranges(cu, lens, parents, slots)
    kv, q = slots[None, :], slots[:, None]
    allowed = ((kv <= q) & (kv >= start[:, None])) | ((kv >= lo[:, None]) & (kv < hi[:, None]))
    if dtype == torch.bool:
        return allowed[None, None]
    mask = torch.zeros((1, 1, total, total), dtype=dtype, device=cu.device)
    return mask.masked_fill_(~allowed[None, None], torch.finfo(dtype).min)


def tree_block_mask(cu_seqlens_padded, seq_lens, parents, total=None, *, block_size=DEFAULT_BLOCK_SIZE, device=None):
    """The tree mask (the module docstring) as a FlexAttention ``BlockMask``, ``shape (1, 1, T, T)``.

    Arguments as :func:`dense_tree_mask`; ``block_size`` an integer or a ``(q_block, kv_block)`` pair.
    Built from tile arithmetic (:func:`tree_block_layout`): ``O(T + S + (T / q_block)·(T / kv_block))``
    memory, no ``[T, T]`` tensor; the mask_mod is exact on partial tiles.
    """
    bq, bk = check_block_size(block_size)
    cu, lens, par, total = check_tree(cu_seqlens_padded, seq_lens, parents, total)
    if device is not None:
        cu, lens, par = cu.to(device), lens.to(device), par.to(device)
    return build_tree_block_mask(cu, lens, par, total, bq, bk)


def build_tree_block_mask(cu, lens, parents, total: int, q_block: int, kv_block: int):
    """:func:`tree_block_mask` on validated inputs (their device is the mask's)."""
    partial, full = tree_block_layout(cu, lens, parents, total, q_block, kv_block)
    q_rows = -(-total // q_block) * q_block  # the kernels may evaluate rows of the last tile past T
    start, lo, hi = slot_ranges(cu, lens, parents, torch.arange(q_rows, device=cu.device))

    def tree_causal(b, h, q_idx, kv_idx):
        own = (kv_idx <= q_idx) & (kv_idx >= start[q_idx])
        return own | ((kv_idx >= lo[q_idx]) & (kv_idx < hi[q_idx]))

    return block_mask_from_tiles(partial, full, tree_causal, total, q_block, kv_block)


def tree_block_layout(cu, lens, parents, total: int, q_block: int, kv_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``, bool ``[ceil(T / q_block), ceil(T / kv_block)]``: tiles with some but not all
    visible pairs, and tiles with only visible pairs.

    The query rows are cut into *pieces*, each within one tile and one segment (at most ``R + S``).
    The rows ``r0 .. r1`` of a piece of segment ``d`` see together the keys ``s(d) .. r1`` and the parent's
    real range; each of them sees ``s(d) .. r0`` and the parent's range (one range when the parent ends
    where ``d`` starts). A key tile is visible from a query tile when some piece's ranges touch it, full
    when it lies inside every piece's common ranges and the query tile lies inside the stream.
    """
    device = cu.device
    R, C = -(-total // q_block), -(-total // kv_block)
    tile_starts = torch.arange(R, device=device) * q_block
    inner = cu[1:-1][(cu[1:-1] > 0) & (cu[1:-1] < total)]
    bounds = torch.unique(torch.cat([tile_starts, inner]))  # sorted
    r0 = bounds
    r1 = torch.cat([bounds[1:], bounds.new_tensor([total])]) - 1
    tile = r0 // q_block
    start, lo, hi = slot_ranges(cu, lens, parents, r0)
    has_parent = hi > lo
    joined = has_parent & (hi == start)  # the parent's real tokens run straight into the segment
    # visible: [start, r1] and [lo, hi - 1], as inclusive column ranges
    visible = _mark(R, C, tile, start // kv_block, r1 // kv_block, torch.ones_like(has_parent))
    visible |= _mark(R, C, tile, lo // kv_block, (hi - 1).clamp_min(0) // kv_block, has_parent)
    # full: tiles inside [start, r0] (or [lo, r0] when joined) and inside [lo, hi - 1]
    own_lo = torch.where(joined, lo, start)
    count = _count(R, C, tile, -(-own_lo // kv_block), (r0 + 1) // kv_block - 1)
    count += _count(R, C, tile, -(-lo // kv_block), hi // kv_block - 1, has_parent & ~joined)
    pieces = torch.bincount(tile, minlength=R)
    inside = (tile_starts + q_block <= total)[:, None]
    full = inside & (count == pieces[:, None])
    return visible & ~full, full


def _count(R: int, C: int, rows, first, last, keep=None) -> torch.Tensor:
    """int32 ``[R, C]``: for each cell, how many of the ranges ``(rows[i], first[i] .. last[i])`` (inclusive
    column ranges; empty where ``last < first``; only where ``keep``) cover it (a difference array)."""
    ok = last >= first if keep is None else keep & (last >= first)
    diff = torch.zeros(R, C + 1, dtype=torch.int32, device=rows.device)
    ones = torch.ones(int(ok.sum()), dtype=torch.int32, device=rows.device)
    diff.index_put_((rows[ok], first[ok].clamp(0, C)), ones, accumulate=True)
    diff.index_put_((rows[ok], (last[ok] + 1).clamp(0, C)), -ones, accumulate=True)
    return diff.cumsum(1, dtype=torch.int32)[:, :C]


def _mark(R: int, C: int, rows, first, last, keep) -> torch.Tensor:
    """bool ``[R, C]``: cells covered by some kept range (see :func:`_count`)."""
    return _count(R, C, rows, first, last, keep) > 0
