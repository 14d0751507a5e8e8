"""Vision fields of a VLM pack: read and check each sample's pixels and grids,
concatenate them in pack order, and add mRoPE rows and token types to the batch.

Called by :func:`thdpack.build_thd_batch` (as ``vlm.attach``, :meth:`thdpack.vlm.QwenVLFamily.attach`) when
``vlm`` is given, after the text stream is built; it reads the stream (so
``max_length`` truncation and alignment padding are already applied) and never
builds a ``[B, S]`` copy.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from thdpack.common.samples import SampleError, get_field
from thdpack.vlm.items import RopeItems
from thdpack.vlm.convention import EXACT
from thdpack.vlm.mrope import mrope_for_stream

IMAGE_FIELDS = ("pixel_values", "image_grid_thw")
VIDEO_FIELDS = ("pixel_values_videos", "video_grid_thw")


@dataclasses.dataclass(frozen=True)
class _SampleVision:
    """What the samples of a pack give, checked, one entry per sample unless said.

    ``images`` / ``videos``: ``(pixels [patches, D] or None, grid int64 [k, 3])``.
    ``intervals``: the family's ``(interval, mode)`` per sample *with videos*.
    ``second_per_grid_ts``: float32 ``[k]`` per sample with videos (1.0 where it gave
    none), or ``None`` when the family takes no ``second_per_grid_ts``.
    """

    images: list
    videos: list
    intervals: list
    second_per_grid_ts: list | None


@dataclasses.dataclass(frozen=True)
class _PackGrids:
    """The pack's grids in pack order, int64 ``[N_img, 3]`` / ``[N_vid, 3]``, and the number
    of images / videos of each sample, int64 ``[n]``."""

    image_grid: np.ndarray
    video_grid: np.ndarray
    image_counts: np.ndarray
    video_counts: np.ndarray


def attach_vision(batch, samples, family):
    """Add the VLM fields of ``samples`` under ``family`` (a :class:`~thdpack.vlm.VlmFamily`) to ``batch``
    (in place; returns it).

    ``batch.token_extras`` (per token, sharded by CP like ``input_ids``):
        ``mm_token_type_ids``: int32 ``[T]``, 0 text (and pad slots), 1 image, 2 video.
        ``mrope_position_ids``: int64 ``[3, T]``, sample by sample what the family's
        ``get_rope_index`` gives for that sample alone (pad slots: see
        :mod:`thdpack.vlm.mrope`).

    ``batch.extras`` (per batch; ``None`` where the pack has no image / video):
        ``pixel_values`` ``[P_img, D]`` and ``pixel_values_videos`` ``[P_vid, D]``:
        the samples' rows concatenated in pack order (dtype as given).
        ``image_grid_thw`` / ``video_grid_thw``: int64 ``[N_img, 3]`` / ``[N_vid, 3]``.
        ``second_per_grid_ts``: float32 ``[N_vid]`` (Qwen2.5-VL only; 1.0 where a sample gave none).
        ``image_sample_index`` / ``video_sample_index``: int64 position in the pack of
        each image / video's sample.
        ``image_patch_counts`` / ``video_patch_counts``: int64 ``t·h·w`` patches per image / video.
        ``sample_vision_patches``: int64 ``[n]`` ViT patches per sample (images + videos).
        ``vision_cu_seqlens``: int32, one segment per image and per video frame (``h·w``
        patches), images first then videos: the ViT's attention segments when it runs
        once on ``cat([pixel_values, pixel_values_videos])``; the first
        ``num_image_segments + 1`` entries are the image call's own cu_seqlens.
        ``num_image_segments``: int. ``vision_max_seqlen``: int (0 without vision).
        ``rope_deltas``: int64 ``[n]``, ``get_rope_index``'s second output per sample.
        ``vlm_model_type``: the family's ``model_type``.
        ``mrope_convention``: the transformers rule the mRoPE rows follow
        (:mod:`thdpack.vlm.convention`).
    """
    vision = _read_vision(list(samples), family)
    grids = _pack_grids(vision, batch.num_samples)
    rope = _stream_mrope(batch, family, vision, grids)
    batch.token_extras["mm_token_type_ids"] = torch.from_numpy(rope.token_type.astype(np.int32))
    batch.token_extras["mrope_position_ids"] = torch.from_numpy(rope.positions)
    batch.extras.update(_vision_extras(family, vision, grids, rope.rope_deltas))
    return batch


def _read_vision(samples: list, family) -> _SampleVision:
    """Read and check every sample's images, videos and video time spacing, in sample
    order, then check that the pixel rows of all samples have one width."""
    uses_spg = bool(getattr(family, "USES_SECOND_PER_GRID_TS", False))
    images, videos, intervals, spg_parts = [], [], [], []
    for i, sample in enumerate(samples):
        images.append(_read_kind(sample, i, "image", family))
        vid = _read_kind(sample, i, "video", family)
        videos.append(vid)
        n_vid = vid[1].shape[0]
        if n_vid:  # per-video temporal spacing (Qwen2.5-VL: from second_per_grid_ts)
            spg = get_field(sample, "second_per_grid_ts", i) if uses_spg else None
            intervals.append(family.time_intervals(spg, n_vid, sample=i))
            if uses_spg:
                spg_parts.append(np.ones(n_vid, np.float32) if spg is None else _to_numpy(spg).astype(np.float32).reshape(-1))
    _check_columns(images, "pixel_values")
    _check_columns(videos, "pixel_values_videos")
    return _SampleVision(images, videos, intervals, spg_parts if uses_spg else None)


def _pack_grids(vision: _SampleVision, n: int) -> _PackGrids:
    """The samples' grids concatenated in pack order, with the count per sample."""
    return _PackGrids(
        image_grid=_cat_grids([g for _, g in vision.images]),
        video_grid=_cat_grids([g for _, g in vision.videos]),
        image_counts=np.fromiter((g.shape[0] for _, g in vision.images), np.int64, count=n),
        video_counts=np.fromiter((g.shape[0] for _, g in vision.videos), np.int64, count=n),
    )


def _stream_mrope(batch, family, vision: _SampleVision, grids: _PackGrids):
    """:func:`~thdpack.vlm.mrope.mrope_for_stream` of the batch's stream: the pack's image and
    video items (each numbered within its sample, for error messages) placed on its tokens."""
    if vision.intervals:
        interval = np.concatenate([iv for iv, _ in vision.intervals])
        mode = np.concatenate([md for _, md in vision.intervals])
    else:
        interval, mode = family.time_intervals(None, 0)
    image_items, image_items_per_sample = _localize(family.image_items(grids.image_grid), grids.image_counts)
    video_items, video_items_per_sample = _localize(
        family.video_items(grids.video_grid, interval, mode), grids.video_counts)
    hint = ""
    if batch.tokens_truncated:
        hint = f" (note: max_length truncation cut {batch.tokens_truncated} tokens from this batch's samples)"
    return mrope_for_stream(
        family,
        batch.input_ids.numpy(),
        batch.cu_seqlens_padded.numpy().astype(np.int64),
        batch.seq_lens.numpy().astype(np.int64),
        image_items,
        image_items_per_sample,
        video_items,
        video_items_per_sample,
        hint=hint,
    )


def _vit_cu_seqlens(family, grids: _PackGrids) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(image segments, all segments, cu_seqlens int64 [segments + 1])`` of the ViT's
    attention segments, images first then videos; raises when the patches overflow int32."""
    image_segments = family.vit_segments(grids.image_grid)
    segments = np.concatenate([image_segments, family.vit_segments(grids.video_grid)])
    vision_cu = np.zeros(segments.size + 1, np.int64)
    np.cumsum(segments, out=vision_cu[1:])
    if vision_cu[-1] > np.iinfo(np.int32).max:
        raise ValueError(f"pack has {int(vision_cu[-1])} vision patches; does not fit int32 vision_cu_seqlens")
    return image_segments, segments, vision_cu


def _vision_extras(family, vision: _SampleVision, grids: _PackGrids, rope_deltas: np.ndarray) -> dict:
    """The per-batch ``batch.extras`` of :func:`attach_vision` (see there)."""
    n = grids.image_counts.size
    image_patches = grids.image_grid.prod(axis=1)
    video_patches = grids.video_grid.prod(axis=1)
    image_segments, segments, vision_cu = _vit_cu_seqlens(family, grids)
    image_sample = np.repeat(np.arange(n, dtype=np.int64), grids.image_counts)
    video_sample = np.repeat(np.arange(n, dtype=np.int64), grids.video_counts)
    sample_patches = np.bincount(image_sample, weights=image_patches, minlength=n).astype(np.int64)
    sample_patches += np.bincount(video_sample, weights=video_patches, minlength=n).astype(np.int64)
    extras = {
        "vlm_model_type": family.model_type,
        "mrope_convention": getattr(family, "mrope_convention", EXACT),
        "pixel_values": _cat_pixels([p for p, _ in vision.images]),
        "pixel_values_videos": _cat_pixels([p for p, _ in vision.videos]),
        "image_grid_thw": torch.from_numpy(grids.image_grid) if grids.image_grid.shape[0] else None,
        "video_grid_thw": torch.from_numpy(grids.video_grid) if grids.video_grid.shape[0] else None,
        "image_sample_index": torch.from_numpy(image_sample),
        "video_sample_index": torch.from_numpy(video_sample),
        "image_patch_counts": torch.from_numpy(image_patches),
        "video_patch_counts": torch.from_numpy(video_patches),
        "sample_vision_patches": torch.from_numpy(sample_patches),
        "vision_cu_seqlens": torch.from_numpy(vision_cu.astype(np.int32)),
        "num_image_segments": int(image_segments.size),
        "vision_max_seqlen": int(segments.max()) if segments.size else 0,
        "rope_deltas": torch.from_numpy(rope_deltas),
    }
    if vision.second_per_grid_ts is not None:
        parts = vision.second_per_grid_ts
        extras["second_per_grid_ts"] = torch.from_numpy(np.concatenate(parts)) if parts else None
    return extras


def vision_patch_count(sample, index: int = 0) -> int:
    """ViT patches of one sample (``Σ t·h·w`` over its image and video grids), the
    quantity ``plan_packs(vision_lengths=...)`` budgets."""
    total = 0
    for field in ("image_grid_thw", "video_grid_thw"):
        value = get_field(sample, field, index)
        if value is not None:
            total += int(_grid(value, index, field).prod(axis=1).sum())
    return total


def vision_lengths(samples) -> np.ndarray:
    """int64 ``[n]`` :func:`vision_patch_count` of every sample."""
    return np.fromiter((vision_patch_count(s, i) for i, s in enumerate(samples)), dtype=np.int64)


# --------------------------------------------------------------------------- reading


def _cat_grids(grids: list[np.ndarray]) -> np.ndarray:
    present = [g for g in grids if g.shape[0]]
    if not present:
        return np.zeros((0, 3), np.int64)
    return present[0] if len(present) == 1 else np.concatenate(present)


def _localize(items: RopeItems, counts: np.ndarray) -> tuple[RopeItems, np.ndarray]:
    """``items`` with ``source`` renumbered from pack-wide to within its sample (for
    error messages), and the number of items of each sample (int64 ``[n]``)."""
    sample_of_row = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    if not len(items):
        return items, np.zeros(counts.size, np.int64)
    per_sample = np.bincount(sample_of_row[items.source], minlength=counts.size)
    first = np.cumsum(counts) - counts
    local = items.source - first[sample_of_row[items.source]]
    return dataclasses.replace(items, source=local), per_sample


def _read_kind(sample, i: int, kind: str, family):
    """``(pixels or None, grid int64 [k, 3])`` of one sample's images or videos, checked."""
    pix_field, grid_field = IMAGE_FIELDS if kind == "image" else VIDEO_FIELDS
    pixels = get_field(sample, pix_field, i)
    grid_value = get_field(sample, grid_field, i)
    grid = np.zeros((0, 3), np.int64) if grid_value is None else _grid(grid_value, i, grid_field)
    n_rows = None if pixels is None else _rows(pixels, i, pix_field, family)
    if kind == "video" and not family.supports_video and (grid.shape[0] or n_rows):
        raise SampleError.at(
            i, f": has video inputs ('{grid_field}' with {grid.shape[0]} videos, "
            f"'{pix_field}' with {n_rows or 0} rows) but the model config ({family.model_type}) has no video token",
            field=grid_field,
        )
    if grid.shape[0] == 0:
        if n_rows:
            raise SampleError.at(
                i, f": '{pix_field}' has {n_rows} rows of patches but no '{grid_field}' "
                f"(every {kind} needs its (t, h, w) grid)",
                field=pix_field,
            )
        return None, grid
    if pixels is None:
        raise SampleError.at(
            i, f": '{grid_field}' describes {grid.shape[0]} {kind}(s) "
            f"({int(grid.prod(axis=1).sum())} patches) but the sample has no '{pix_field}'",
            field=grid_field,
        )
    m = family.spatial_merge_size
    bad = np.flatnonzero((grid < 1).any(axis=1) | (grid[:, 1] % m != 0) | (grid[:, 2] % m != 0))
    if bad.size:
        j = int(bad[0])
        raise SampleError.at(
            i, f": {kind} {j} has {grid_field} row {grid[j].tolist()}; t, h, w must be >= 1 "
            f"and h, w multiples of spatial_merge_size={m}",
            field=grid_field,
        )
    patches = grid.prod(axis=1)
    if n_rows != int(patches.sum()):
        per = " + ".join(f"{'·'.join(map(str, g))}" for g in grid.tolist())
        raise SampleError.at(
            i, f": '{pix_field}' has {n_rows} rows but '{grid_field}' gives {int(patches.sum())} patches "
            f"({per}, {kind}s 0..{grid.shape[0] - 1})",
            field=pix_field,
        )
    return _as_tensor(pixels), grid


def _grid(value, i: int, field: str) -> np.ndarray:
    arr = _to_numpy(value)
    if arr.dtype == object or (arr.size and arr.dtype.kind not in "iu"):
        if arr.size and arr.dtype.kind == "f" and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        else:
            raise SampleError.at(i, f": '{field}' must hold integers, got {arr.dtype}", field=field)
    if arr.size == 0:
        return np.zeros((0, 3), np.int64)
    if arr.ndim == 1 and arr.size == 3:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise SampleError.at(
            i, f": '{field}' must have shape [k, 3] (t, h, w per item), got {tuple(arr.shape)}",
            field=field,
        )
    return arr.astype(np.int64)


def _to_numpy(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def _rows(pixels, i: int, field: str, family) -> int:
    """Rows of a sample's ``[patches, dim]`` pixels, checked to be 2-D and, when the
    config gives the patch embedding, ``dim`` values wide."""
    shape = tuple(pixels.shape) if hasattr(pixels, "shape") else np.shape(pixels)
    if len(shape) != 2:
        raise SampleError.at(i, f": '{field}' must be 2-D [patches, dim], got shape {shape}", field=field)
    width = getattr(family, "pixel_width", None)
    if width is not None and shape[1] != width:
        parts = getattr(family, "patch_shape", None)
        why = "" if parts is None else " (in_channels {} · temporal_patch_size {} · patch_size {}²)".format(*parts)
        raise SampleError.at(
            i, f": '{field}' rows have {shape[1]} values but the model config expects {width}{why}; "
            "use the image processor that matches this model",
            field=field,
        )
    return int(shape[0])


def _as_tensor(pixels) -> torch.Tensor:
    if isinstance(pixels, torch.Tensor):
        return pixels
    arr = np.asarray(pixels)
    if arr.dtype == np.float64 and not isinstance(pixels, np.ndarray):
        arr = arr.astype(np.float32)  # Python lists: float32, like a processor's tensors
    return torch.from_numpy(np.ascontiguousarray(arr))


def _check_columns(parts, field: str) -> None:
    first = None
    for i, (pix, _) in enumerate(parts):
        if pix is None:
            continue
        if first is None:
            first = (i, pix.shape[1])
        elif pix.shape[1] != first[1]:
            raise SampleError.at(
                i, f": '{field}' rows have {pix.shape[1]} values but sample {first[0]}'s have {first[1]}",
                field=field,
            )


def _cat_pixels(parts) -> torch.Tensor | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    return torch.cat(present, dim=0)
