"""Vision-tower sequence counts of the Qwen-VL families: ViT patches, ``Σ (patches
per frame)²`` and Qwen2.5-VL's attention-window sum, from ``grid_thw``.

A vision config is read with :func:`thdpack.common.model_config.config_get` (a
``transformers`` config, its ``vision_config`` or a dict); only the window sums need one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from thdpack.common.align import check_int
from thdpack.common.model_config import config_get, config_int

__all__ = ["VisionStats", "as_pair", "grid_rows", "vision_config_of", "vision_seqlen_stats", "window_patches"]


@dataclass(frozen=True)
class VisionStats:
    """Attention work of a Qwen-VL style vision tower over some images / videos.

    Attributes:
        patches: ViT patches ``Σ t·h·w`` over the ``grid_thw`` rows.
        seqlen_squared_sum: ``Σ t·(h·w)²``: every frame (temporal patch) is its own
            attention segment of ``h·w`` patches (Qwen2-VL / 2.5-VL / 3-VL / 3.5).
        window_seqlen_squared_sum: ``Σ`` over Qwen2.5-VL attention windows of
            (patches in the window)², 0 for towers without window attention.
    """

    patches: int = 0
    seqlen_squared_sum: int = 0
    window_seqlen_squared_sum: int = 0

    def __add__(self, other: "VisionStats") -> "VisionStats":
        return VisionStats(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def as_pair(v, name: str = "vision_config.patch_size") -> tuple[int, int]:
    """``(a, b)`` of a size given as one int or a pair (``patch_size: 14`` or ``[14, 14]``), each an
    integer >= 1; ``ValueError`` naming the config key ``name`` otherwise."""
    if v is None:
        raise ValueError(f"the model config has no {name}; pass a complete config of the model")
    pair = (v[0], v[-1]) if isinstance(v, (list, tuple)) and v else (v, v)
    for x in pair:
        check_int(x, f"the model config's {name}", 1)
    return int(pair[0]), int(pair[1])


def vision_config_of(config):
    """``config.vision_config`` (Qwen-Omni: ``config.thinker_config.vision_config``), ``config`` itself
    when it is a vision config (has ``depth``), else None."""
    vision = config_get(config_get(config, "thinker_config", config), "vision_config", None)
    if vision is None and config_get(config, "depth", None) is not None:
        vision = config
    return vision


def window_patches(vision_config) -> int | None:
    """Side of a Qwen2.5-VL attention window in merge units (``window_size // merge // patch``),
    or None for a tower without window attention."""
    window = config_get(vision_config, "window_size", None)
    if window is None or config_get(vision_config, "fullatt_block_indexes", None) is None:
        return None
    merge = config_int(vision_config, "spatial_merge_size", 1, where="vision_config.")
    window = config_int(vision_config, "window_size", where="vision_config.")
    return window // merge // as_pair(config_get(vision_config, "patch_size", None))[0]


def grid_rows(grid_thw) -> np.ndarray:
    """int64 ``[k, 3]`` rows of ``grid_thw`` (torch, numpy or nested lists). Every entry is
    a count of patches: an integer >= 0, checked by :func:`thdpack.common.align.check_int`,
    whose ``ValueError`` names the first entry that is not (``grid_thw[i, j]``)."""
    if isinstance(grid_thw, torch.Tensor):
        grid_thw = grid_thw.detach().cpu().numpy()
    grid = np.asarray(grid_thw)
    if grid.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if grid.size % 3:
        raise ValueError(f"grid_thw must hold rows of 3 (t, h, w), got shape {grid.shape}")
    rows = grid.reshape(-1, 3)
    hint = " (patches along t, h, w of an image or video)"
    if isinstance(grid_thw, (list, tuple)) and rows.dtype.kind in "iu":  # bools in a list read as 0 / 1
        for (i, j), value in np.ndenumerate(np.asarray(grid_thw, dtype=object).reshape(-1, 3)):
            if isinstance(value, bool):
                check_int(value, f"grid_thw[{i}, {j}]", 0, hint=hint)
    if rows.dtype.kind not in "iu":  # floats, bools, objects: each entry by the rule
        for (i, j), value in np.ndenumerate(rows):
            check_int(value.item() if isinstance(value, np.generic) else value, f"grid_thw[{i}, {j}]", 0, hint=hint)
    elif (rows < 0).any():
        i, j = np.argwhere(rows < 0)[0].tolist()
        check_int(rows[i, j].item(), f"grid_thw[{i}, {j}]", 0, hint=hint)
    return rows.astype(np.int64)


def vision_seqlen_stats(grid_thw, vision_config=None) -> VisionStats:
    """:class:`VisionStats` of ``grid_thw`` (int ``[k, 3]``: temporal, height, width in
    patches, per image or video; torch, numpy or nested lists).

    Window sums follow Qwen2.5-VL's ``get_window_index``: each frame's
    ``(h/m) × (w/m)`` grid of merge units (``m = spatial_merge_size``) is tiled by
    ``W × W`` windows, ``W = window_size // m // patch_size``, the last row / column of
    windows partial. A window of ``r × c`` merge units holds ``r·c·m²`` patches, so a
    frame contributes ``m⁴ · (Σ_rows rᵢ²) · (Σ_cols cⱼ²)`` with ``Σ rᵢ² = ⌊H/W⌋·W² + (H mod W)²``.
    ``vision_config`` (a config, its ``vision_config`` or a dict) is needed only for windows.
    Every entry of ``grid_thw`` must be an integer >= 0 (:func:`grid_rows`).
    """
    vision_config = vision_config_of(vision_config)
    grid = grid_rows(grid_thw)
    patches = full = window = 0
    side = window_patches(vision_config) if vision_config is not None else None
    merge = config_int(vision_config, "spatial_merge_size", 1, where="vision_config.") if vision_config is not None else 1
    for t, h, w in grid.tolist():
        patches += t * h * w
        full += t * (h * w) ** 2
        if side:
            gh, gw = h // merge, w // merge
            rows = (gh // side) * side**2 + (gh % side) ** 2
            cols = (gw // side) * side**2 + (gw % side) ** 2
            window += t * merge**4 * rows * cols
    return VisionStats(patches, full, window)

