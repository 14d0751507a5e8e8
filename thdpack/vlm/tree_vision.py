"""Vision fields of a shared-prefix VLM batch: a group's prompt with images laid out once.

``build_thd_batch(samples, share_prefix="group", vlm=family)`` builds the unshared batch of the
samples first (vision attached: :func:`thdpack.vlm.vision_fields.attach_vision`), finds each group's
prefix on it, and gathers the tree from it (:mod:`thdpack.batching.shared_prefix`). Two methods of a
family (:class:`thdpack.batching.vision_family.VisionFamily`) come from here:

- :func:`prefix_limit`: a prefix may not end inside an image or video (its placeholders would be
  split between the prefix and the members), and every image / video in it must be the same for all
  members (grid, pixels, ``second_per_grid_ts``): equal placeholder tokens do not mean equal images.
  A found prefix is cut before the first that is not; a declared one is a ``ValueError``.
- :func:`attach_tree`: every tree row is a row of the unshared stream (``prefix_tree.unshared_rows``),
  so its ``mrope_position_ids`` and ``mm_token_type_ids`` are gathered from there: the prefix's rows are
  the sample alone's (equal for every member), and each member continues from the prefix's next mRoPE
  position exactly as its unshared sample (the family's ``get_rope_index`` of the sample alone). Images
  and videos are listed in stream order, a shared prompt's once (the vision tower runs once for it), a
  member's own ones (in its suffix) after its prefix's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


_KINDS = (  # (name, token type, pixels, grid, per-item sample index, per-item patch counts)
    ("image", 1, "pixel_values", "image_grid_thw", "image_sample_index", "image_patch_counts"),
    ("video", 2, "pixel_values_videos", "video_grid_thw", "video_sample_index", "video_patch_counts"),
)


@dataclass(frozen=True)
class _Items:
    """The images (or videos) of an unshared batch, int64 ``[k]`` each unless said, in pack order.

    ``sample``: the sample's position; ``start`` / ``end``: its first / one past its last placeholder
    token within the sample; ``row0`` / ``rows``: its pixel rows; ``grid`` ``[k, 3]``.
    """

    kind: str
    sample: np.ndarray
    start: np.ndarray
    end: np.ndarray
    row0: np.ndarray
    rows: np.ndarray
    grid: np.ndarray


def _items(flat, family, spec) -> _Items:
    """The :class:`_Items` of one kind of ``flat`` (an unshared batch with vision attached, no padding)."""
    kind, code, _, grid_key, sample_key, count_key = spec
    grid_t = flat.extras.get(grid_key)
    grid = np.zeros((0, 3), np.int64) if grid_t is None else grid_t.numpy().astype(np.int64)
    counts = family.placeholder_tokens(grid)
    pos = np.flatnonzero(flat.token_extras["mm_token_type_ids"].numpy() == code)
    first = np.cumsum(counts) - counts
    sample = flat.extras[sample_key].numpy().astype(np.int64)
    cu = flat.cu_seqlens.numpy().astype(np.int64)
    start = pos[first] - cu[sample] if grid.shape[0] else np.zeros(0, np.int64)
    end = pos[first + counts - 1] + 1 - cu[sample] if grid.shape[0] else np.zeros(0, np.int64)
    rows = flat.extras[count_key].numpy().astype(np.int64)
    return _Items(kind, sample, start, end, np.cumsum(rows) - rows, rows, grid)


def prefix_limit(flat, family):
    """``limit(members, p, declared, name) -> int`` for the groups of ``flat`` (the unshared batch, vision
    attached): the longest prefix ``<= p`` that ends on no image / video and whose images and videos are
    the same for all ``members``; a ``declared`` prefix that is not is a ``ValueError`` naming ``name``."""
    tables = [(_items(flat, family, spec), flat.extras.get(spec[2])) for spec in _KINDS]
    spg = flat.extras.get("second_per_grid_ts")
    rope, cu = flat.token_extras["mrope_position_ids"].numpy(), flat.cu_seqlens.numpy().astype(np.int64)

    def limit(members: np.ndarray, p: int, declared: bool, name: str) -> int:
        cut, why = _rope_agreement(rope, cu, members, int(p))
        end = cut
        for items, _ in tables:
            inside = np.isin(items.sample, members) & (items.start < end) & (items.end > end)
            for k in np.flatnonzero(inside):
                if items.start[k] < cut:
                    cut, why = int(items.start[k]), _ends_inside(items, k, end)
        for items, pixels in tables:
            for m in members[1:]:
                k, at = _first_difference(items, pixels, spg, int(members[0]), int(m), cut)
                if k is not None and at < cut:
                    cut, why = at, f"sample {int(m)}'s {items.kind} {k} differs from sample {int(members[0])}'s"
        if declared and cut < p:
            raise ValueError(f"{name}: the declared prefix_len={p} is not a shared prompt: {why}; share prompts "
                             "that end after their last image / video and hold the same ones (pixels, grids)")
        return cut

    return limit


def _rope_agreement(rope: np.ndarray, cu: np.ndarray, members: np.ndarray, p: int) -> tuple[int, str]:
    """``(cut, why)``: the first of the ``p`` prefix tokens where a member's mRoPE rows (int64 ``[3, U]`` of the
    unshared stream, offsets ``cu``) differ from the first member's (a video's spacing given in another
    dtype), or ``(p, "")``."""
    cols = cu[members][:, None] + np.arange(p)[None, :]
    differs = (rope[:, cols] != rope[:, cols[:1]]).any(axis=(0, 1))
    if not differs.any():
        return p, ""
    d = int(np.argmax(differs))
    return d, f"the members' mRoPE positions differ from token {d} on"


def _ends_inside(items: _Items, k: int, p: int) -> str:
    return (f"it ends inside sample {int(items.sample[k])}'s {items.kind} at tokens "
            f"{int(items.start[k])}..{int(items.end[k]) - 1} (prefix {p})")


def _first_difference(items: _Items, pixels, spg, a: int, b: int, cut: int) -> tuple[int | None, int]:
    """``(k, token)``: the first of sample ``b``'s items starting before ``cut`` (numbered within the sample)
    that is not sample ``a``'s ``k``-th (place, grid, pixels, video spacing), and where it starts; ``(None, cut)``."""
    ia = np.flatnonzero((items.sample == a) & (items.start < cut))
    ib = np.flatnonzero((items.sample == b) & (items.start < cut))
    for k in range(max(ia.size, ib.size)):
        if k >= ia.size or k >= ib.size:
            return k, int(items.start[ib[k]] if k < ib.size else items.start[ia[k]])
        x, y = int(ia[k]), int(ib[k])
        same = (items.start[x] == items.start[y] and items.end[x] == items.end[y]
                and np.array_equal(items.grid[x], items.grid[y])
                and torch.equal(pixels[items.row0[x]: items.row0[x] + items.rows[x]],
                                pixels[items.row0[y]: items.row0[y] + items.rows[y]]))
        if same and items.kind == "video" and spg is not None:
            same = bool(spg[x] == spg[y])
        if not same:
            return k, int(min(items.start[x], items.start[y]))
    return None, cut


def attach_tree(tree, flat, family):
    """Add the vision fields to the shared-prefix batch ``tree`` gathered from the unshared ``flat``
    (in place; returns it).

    ``tree.token_extras``: ``mrope_position_ids`` int64 ``[3, T]`` and ``mm_token_type_ids`` int32 ``[T]``,
    every real row the unshared stream's row it was gathered from; a pad slot continues the row before
    it by one per slot on all three rows (type 0, no loss, attended by nothing real).
    ``tree.extras``: as :func:`thdpack.vlm.vision_fields.attach_vision`, with the images and videos in
    stream order, a shared prompt's once: ``pixel_values(_videos)``, ``image_grid_thw`` /
    ``video_grid_thw``, ``second_per_grid_ts``, ``image_sample_index`` / ``video_sample_index`` (a shared
    one's: its group's first member), ``image_patch_counts`` / ``video_patch_counts``,
    ``vision_cu_seqlens``, ``num_image_segments``, ``vision_max_seqlen``. ``sample_vision_patches`` and
    ``rope_deltas`` stay per sample, as unshared.
    """
    pt = tree.prefix_tree
    rows = pt.unshared_rows.numpy()
    total = int(tree.input_ids.numel())
    src = np.zeros(total, np.int64)
    src[rows] = np.arange(rows.size)  # a prefix row: any member's (all equal, prefix_limit checked)
    real = np.zeros(total, bool)
    real[rows] = True
    anchor = np.maximum(np.maximum.accumulate(np.where(real, np.arange(total), -1)), 0)
    mrope = flat.token_extras["mrope_position_ids"].numpy()[:, src[anchor]] + (np.arange(total) - anchor)
    types = np.where(real, flat.token_extras["mm_token_type_ids"].numpy()[src], 0)
    tree.token_extras["mrope_position_ids"] = torch.from_numpy(np.ascontiguousarray(mrope, dtype=np.int64))
    tree.token_extras["mm_token_type_ids"] = torch.from_numpy(types.astype(np.int32))
    cu = flat.cu_seqlens.numpy().astype(np.int64)
    keeper = _group_keeper(pt)
    segments = []
    for spec in _KINDS:
        items = _items(flat, family, spec)
        segments.append(_list_once(tree, flat, items, spec, keeper, rows[cu[items.sample] + items.start], family))
    vision_cu = np.zeros(sum(s.size for s in segments) + 1, np.int64)
    np.cumsum(np.concatenate(segments), out=vision_cu[1:])
    tree.extras.update(vision_cu_seqlens=torch.from_numpy(vision_cu.astype(np.int32)),
                       num_image_segments=int(segments[0].size),
                       vision_max_seqlen=int(np.diff(vision_cu).max()) if vision_cu.size > 1 else 0)
    return tree


def _group_keeper(pt) -> np.ndarray:
    """int64 ``[n]``: the sample that lists the prefix images of each sample's group (its first member;
    the sample itself when laid out alone)."""
    n = pt.prefix_lens.numel()
    parents = pt.parents.numpy()
    prefix_seg = np.where(pt.prefix_lens.numpy() > 0, parents[pt.sample_segment.numpy()], -1)
    keeper = np.arange(n, dtype=np.int64)
    first = np.full(parents.size, n, np.int64)
    shared = prefix_seg >= 0
    np.minimum.at(first, prefix_seg[shared], np.flatnonzero(shared))
    keeper[shared] = first[prefix_seg[shared]]
    return keeper


def _list_once(tree, flat, items: _Items, spec, keeper: np.ndarray, stream_row: np.ndarray, family) -> np.ndarray:
    """Put one kind's items of the tree in ``tree.extras`` (stream order, a shared one once); returns
    int64 the ViT attention segments of the kept items."""
    _, _, pix_key, grid_key, sample_key, count_key = spec
    in_prefix = items.start < tree.prefix_tree.prefix_lens.numpy()[items.sample]
    keep = np.flatnonzero(~in_prefix | (keeper[items.sample] == items.sample))
    keep = keep[np.argsort(stream_row[keep], kind="stable")]
    grid = items.grid[keep]
    if flat.extras.get(pix_key) is not None:
        lens = items.rows[keep]
        idx = np.repeat(items.row0[keep] - (np.cumsum(lens) - lens), lens) + np.arange(int(lens.sum()))
        tree.extras[pix_key] = flat.extras[pix_key][torch.from_numpy(idx)] if keep.size else None
    tree.extras[grid_key] = torch.from_numpy(grid) if keep.size else None
    tree.extras[sample_key] = torch.from_numpy(items.sample[keep])
    tree.extras[count_key] = torch.from_numpy(items.rows[keep])
    if items.kind == "video" and flat.extras.get("second_per_grid_ts") is not None:
        tree.extras["second_per_grid_ts"] = flat.extras["second_per_grid_ts"][torch.from_numpy(keep)]
    return family.vit_segments(grid)
