"""Attention masks of a prefix tree (a trie of any depth) in a THD stream: shared segments laid out once.

A shared-prefix stream is a sequence of *segments* (documents) given by ``cu_seqlens_padded``: a
root segment (a shared prefix, or a sample laid out alone) has parent ``-1``; any other segment names
an earlier segment as its parent (a member's own tokens after its prefix, or a deeper shared turn). A
slot ``q`` of segment ``d`` may attend to ``kv`` iff

- ``s(q) <= kv <= q`` (its own segment, causally, as in a document mask), or
- ``kv`` is a *real* token of an ancestor ``a`` of ``d``: ``a(a) <= kv < a(a) + len(a)``, the ancestor's
  padded start plus its real length (its alignment pad slots are never seen).

So each segment sees the whole of every segment on its path from the root and itself causally, never
a sibling or a cousin::

    segments      prefix P (3) | turn T (2), parent P | member A (1), parent T | member B (1), parent P
    slot          0 1 2        | 3 4                  | 5                      | 6
    row 5 (A0) sees 0 1 2 3 4 5;  row 6 (B0) sees 0 1 2 6

Every layout reads the offsets, real lengths and an ancestor table (:func:`ancestor_table`): a dense
``[1, 1, T, T]`` mask for SDPA / eager (:func:`dense_tree_mask`), and a FlexAttention ``BlockMask``
built from tile arithmetic, no ``[T, T]`` tensor (:func:`tree_block_mask`): equal, table for table, to
``create_block_mask`` over the same mask_mod. Depth is capped at :data:`MAX_TRIE_DEPTH`. Varlen kernels
(flash-attn, TransformerEngine THD) take one causal range per sequence and cannot express the ancestors.
"""

from __future__ import annotations

import torch

from thdpack.attention.block_mask import DEFAULT_BLOCK_SIZE, block_mask_from_tiles, check_block_size
from thdpack.attention.dense_mask import check_mask_dtype
from thdpack.attention.documents import check_offsets, documents_of


MAX_TRIE_DEPTH = 16
"""Deepest trie a mask takes: shared segments on one path from a root (a one-level prefix is depth 1)."""


def check_tree(cu_seqlens_padded, seq_lens, parents, total=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(cu, lens, parents, total)``: int64 ``[S+1]`` offsets, int64 ``[S]`` real lengths and parents, and
    the stream length. ``ValueError`` naming the bad value unless the offsets are valid
    (:func:`thdpack.attention.documents.check_offsets`), every real length fits its padded span,
    every parent is ``-1`` or an earlier segment, and no segment has more than :data:`MAX_TRIE_DEPTH`
    ancestors."""
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
    bad = (par < -1) | (par >= torch.arange(S, device=cu.device))
    if bool(bad.any()):
        d = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"segment {d} has parent {int(par[d])}; a parent must be -1 or an earlier segment")
    ancestor_table(par)  # refuses a trie deeper than MAX_TRIE_DEPTH
    return cu, lens, par, total


def ancestor_table(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anc, depth)``: int64 ``[S, D + 1]`` and ``[S]``: ``anc[s, k]`` is the ancestor of segment ``s`` at
    depth ``k`` (a root has depth 0), ``anc[s, depth[s]] == s``, ``-1`` past it; ``D`` the deepest segment's
    depth. ``parents``: int64 ``[S]``, each ``-1`` or an earlier segment. ``ValueError`` past
    :data:`MAX_TRIE_DEPTH`."""
    chain = [torch.arange(parents.shape[0], device=parents.device)]  # self, parent, grandparent, ...
    while bool((chain[-1] >= 0).any()):
        if len(chain) > MAX_TRIE_DEPTH + 1:
            d = int(torch.nonzero(chain[-1] >= 0)[0, 0])
            raise ValueError(f"segment {d} has more than MAX_TRIE_DEPTH={MAX_TRIE_DEPTH} ancestors; thdpack packs "
                             "tries up to that depth: share fewer levels (a larger min_prefix_len) or split the group")
        up = chain[-1]
        chain.append(torch.where(up >= 0, parents[up.clamp_min(0)], -1))
    levels = torch.stack(chain[:-1], 1)  # [S, D + 1]: column k = k-th ancestor upwards
    depth = (levels >= 0).sum(1) - 1
    k = torch.arange(levels.shape[1], device=parents.device)
    up = (depth[:, None] - k[None, :]).clamp_min(0)
    anc = torch.where(k[None, :] <= depth[:, None], levels.gather(1, up), -1)
    return anc, depth


def slot_segments(cu: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, total: int):
    """``(seg, start, real)`` of every slot: its segment, the segment's first slot, and whether it holds a real
    token (False past ``total``). Validated inputs (:func:`check_tree`) on the device of ``slots``."""
    seg = documents_of(cu, slots)
    start = cu[seg]
    return seg, start, (slots - start < lens[seg]) & (slots < total)


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
    """:func:`dense_tree_mask` on validated inputs (their device is the mask's): own segment causally, or a
    real token of an ancestor (``[S, S]`` ancestor matrix indexed by the slots' segments)."""
    slots = torch.arange(total, device=cu.device)
    seg, start, real = slot_segments(cu, lens, slots, total)
    anc, depth = ancestor_table(parents)
    S = parents.shape[0]
    is_anc = torch.zeros(S, S + 1, dtype=torch.bool, device=cu.device)  # column S: "none" (-1)
    is_anc.scatter_(1, torch.where(anc < 0, S, anc), True)
    is_anc[torch.arange(S, device=cu.device), torch.arange(S, device=cu.device)] = False  # own: causal below
    kv, q = slots[None, :], slots[:, None]
    allowed = ((kv <= q) & (kv >= start[:, None])) | (is_anc[:, :S][seg[:, None], seg[None, :]] & real[None, :])
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
    """:func:`tree_block_mask` on validated inputs (their device is the mask's). The mask_mod reads per-slot
    tables (segment, depth, real) and the ``[S, D + 1]`` ancestor table: ``O(T + S·D)``."""
    partial, full = tree_block_layout(cu, lens, parents, total, q_block, kv_block)
    rows = max(-(-total // q_block) * q_block, -(-total // kv_block) * kv_block)  # kernels may read past T
    seg, start, real = slot_segments(cu, lens, torch.arange(rows, device=cu.device), total)
    anc, depth = ancestor_table(parents)
    slot_depth = depth[seg]

    def tree_causal(b, h, q_idx, kv_idx):
        own = (kv_idx <= q_idx) & (kv_idx >= start[q_idx])
        d = slot_depth[kv_idx]
        above = (d < slot_depth[q_idx]) & (anc[seg[q_idx], d] == seg[kv_idx])
        return own | (above & real[kv_idx])

    return block_mask_from_tiles(partial, full, tree_causal, total, q_block, kv_block)


def tree_block_layout(cu, lens, parents, total: int, q_block: int, kv_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``, bool ``[ceil(T / q_block), ceil(T / kv_block)]``: tiles with some but not all
    visible pairs, and tiles with only visible pairs.

    The query rows are cut into *pieces*, each within one tile and one segment (at most ``R + S``).
    The rows ``r0 .. r1`` of a piece of segment ``d`` see together the keys ``s(d) .. r1`` and the real
    ranges of ``d``'s ancestors; each of them sees ``s(d) .. r0`` and those ranges (merged where one ends
    where the next starts: :func:`_common_ranges`). A key tile is visible from a query tile when some
    piece's ranges touch it, full when it lies inside one of every piece's common ranges and the query tile
    lies inside the stream.
    """
    device = cu.device
    R, C = -(-total // q_block), -(-total // kv_block)
    tile_starts = torch.arange(R, device=device) * q_block
    inner = cu[1:-1][(cu[1:-1] > 0) & (cu[1:-1] < total)]
    r0 = torch.unique(torch.cat([tile_starts, inner]))  # sorted
    r1 = torch.cat([r0[1:], r0.new_tensor([total])]) - 1
    tile = r0 // q_block
    seg = documents_of(cu, r0)
    start = cu[seg]
    anc, depth = ancestor_table(parents)
    lo, hi = _path_ranges(cu, lens, anc, depth, seg, r0)  # [P, D + 1]: ancestors' real ranges, then own
    is_anc = torch.arange(lo.shape[1], device=device)[None, :] < depth[seg][:, None]
    cols = lambda x: x.reshape(-1)  # noqa: E731
    rows_k = tile[:, None].expand_as(lo)
    visible = _mark(R, C, tile, start // kv_block, r1 // kv_block, torch.ones_like(tile, dtype=torch.bool))
    visible |= _mark(R, C, cols(rows_k), cols(lo) // kv_block, cols((hi - 1).clamp_min(0)) // kv_block,
                     cols(is_anc & (hi > lo)))
    run_lo, run_end = _common_ranges(lo, hi, depth[seg])
    count = _count(R, C, cols(rows_k), cols(-(-run_lo // kv_block)), cols(hi // kv_block - 1), cols(run_end))
    pieces = torch.bincount(tile, minlength=R)
    inside = (tile_starts + q_block <= total)[:, None]
    full = inside & (count == pieces[:, None])
    return visible & ~full, full


def _path_ranges(cu, lens, anc, depth, seg, r0) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[P, D + 1]`` half-open ranges of each piece (segment ``seg``, first row ``r0``): column ``k <
    depth`` the real tokens of its ancestor at depth ``k``, column ``depth`` its own ``start .. r0``, empty
    (``r0 + 1 .. r0 + 1``) past it. In stream order (an ancestor precedes its descendants)."""
    path = anc[seg]  # [P, D + 1]
    k = torch.arange(path.shape[1], device=cu.device)[None, :]
    d = depth[seg][:, None]
    a = path.clamp_min(0)
    end = (r0 + 1)[:, None]
    lo = torch.where(k < d, cu[a], torch.where(k == d, cu[seg][:, None], end))
    hi = torch.where(k < d, cu[a] + lens[a], end)
    return lo, hi


def _common_ranges(lo, hi, depth) -> tuple[torch.Tensor, torch.Tensor]:
    """``(run_lo, run_end)`` over ``[P, K]`` ranges in stream order (:func:`_path_ranges`): ``run_lo[p, k]`` the
    first slot of the run of ranges, each starting where the one before it ends, that range ``k`` closes;
    ``run_end[p, k]`` True where range ``k`` closes its run (the next does not continue it) and ``k <= depth``."""
    K = lo.shape[1]
    run_lo = lo.clone()
    for k in range(1, K):
        joined = hi[:, k - 1] == lo[:, k]
        run_lo[:, k] = torch.where(joined, run_lo[:, k - 1], lo[:, k])
    closes = torch.ones_like(lo, dtype=torch.bool)
    closes[:, :-1] = hi[:, :-1] != lo[:, 1:]
    k = torch.arange(K, device=lo.device)[None, :]
    closes |= k == depth[:, None]
    return run_lo, closes & (k <= depth[:, None])


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
