"""The interface a VLM family implements, and the Qwen-VL base the four families share.

A family answers three questions, from its config alone:

1. **Constants**: ``image_token_id``, ``video_token_id`` (``None``: no video),
   ``vision_start_token_id``, ``spatial_merge_size``.
2. **Placeholders**: how the placeholder tokens of a sample split into *items*,
   one contiguous run of placeholder tokens per item. Qwen2-VL / Qwen2.5-VL:
   one item per image and per video. Qwen3-VL / Qwen3.5: one item per image and
   per video *frame* (frames are separated by timestamp text). Each item has
   ``t·h·w / merge²`` tokens.
3. **mRoPE of an item**: its LLM grid ``(t, h/merge, w/merge)`` and the spacing of
   its temporal positions (Qwen2.5-VL: ``tokens_per_second · second_per_grid_ts``
   for videos; 1 otherwise), under the family's ``mrope_convention`` (the rule of a
   transformers version, :mod:`thdpack.vlm.convention`).

Everything else (matching runs to items, the positions themselves) is shared
and vectorised over the whole THD stream in :mod:`thdpack.vlm.mrope`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from thdpack.common.align import check_int
from thdpack.common.samples import SampleError
from thdpack.common.model_config import config_first, config_get
from thdpack.vlm.convention import EXACT, TRANSFORMERS_4, resolve_mrope_convention
from thdpack.vlm.items import MODE_F32, MODE_F64, MODE_INT, RopeItems
from thdpack.vlm.mrope import mrope_for_stream
from thdpack.vlm.tree_vision import attach_tree, prefix_limit
from thdpack.vlm.vision_fields import attach_vision, vision_lengths

@runtime_checkable
class VlmFamily(Protocol):
    """What the shared vision code (:mod:`thdpack.vlm.vision_fields`, :mod:`thdpack.vlm.mrope`) needs from a
    model family (one file per family); :class:`QwenVLFamily` adds what the builder calls
    (:class:`thdpack.batching.vision_family.VisionFamily`)."""

    model_type: str
    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    spatial_merge_size: int
    # values per pixel row (the ViT's patch embedding input), or None: rows unchecked
    pixel_width: int | None
    # which transformers version's get_rope_index the positions follow (thdpack.vlm.convention)
    mrope_convention: str

    @classmethod
    def from_config(cls, config, mrope_convention: str | None = None) -> "VlmFamily":
        """The family's constants from a transformers config or its dict; ``mrope_convention``
        as :func:`thdpack.vlm.convention.resolve_mrope_convention` reads it."""

    def placeholder_tokens(self, grid_thw: np.ndarray) -> np.ndarray:
        """int64 ``[k]`` placeholder tokens of each image / video of ``grid_thw`` ``[k, 3]``."""

    def image_items(self, grid_thw: np.ndarray) -> RopeItems:
        """The items of images ``grid_thw`` ``[k, 3]`` (one per image), in order."""

    def time_intervals(self, second_per_grid_ts, n_videos: int, *, sample: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Per-video temporal spacing and arithmetic mode of one sample's videos."""

    def video_items(self, grid_thw: np.ndarray, interval=None, mode=None) -> RopeItems:
        """The items the placeholders of videos ``grid_thw`` split into, in order."""

    def vit_segments(self, grid_thw: np.ndarray) -> np.ndarray:
        """int64 patch counts of the ViT's attention segments, in patch order."""


@dataclass(frozen=True)
class QwenVLFamily:
    """Shared implementation of the Qwen-VL families; subclasses set the class
    variables below and register themselves (see :mod:`thdpack.vlm.registry`)."""

    MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    # transformers' defaults for the family, used when a config dict lacks a key
    DEFAULT_IMAGE_TOKEN_ID: ClassVar[int] = 151655
    DEFAULT_VIDEO_TOKEN_ID: ClassVar[int] = 151656
    DEFAULT_VISION_START_TOKEN_ID: ClassVar[int] = 151652
    # Qwen3-VL / Qwen3.5: every video frame is its own placeholder run (timestamps separate frames)
    VIDEO_FRAMES_ARE_ITEMS: ClassVar[bool] = False
    # Qwen2.5-VL: video temporal positions spaced by tokens_per_second * second_per_grid_ts
    USES_SECOND_PER_GRID_TS: ClassVar[bool] = False
    DEFAULT_TOKENS_PER_SECOND: ClassVar[float] = 4

    model_type: str
    image_token_id: int
    video_token_id: int | None
    vision_start_token_id: int | None
    spatial_merge_size: int
    tokens_per_second: float | int = 1
    # (in_channels, temporal_patch_size, patch_size) of the ViT's patch embedding; None
    # when the config does not give patch_size (then pixel rows are not checked)
    patch_shape: tuple[int, int, int] | None = None
    # one of thdpack.vlm.convention.CONVENTIONS (from_config resolves the installed transformers')
    mrope_convention: str = EXACT

    # ---- constants ---------------------------------------------------------
    @classmethod
    def from_config(cls, config, mrope_convention: str | None = None) -> "QwenVLFamily":
        model_type = config_get(config, "model_type")
        # the token ids sit at the top level; some exports keep them in text_config
        image = config_first(config, ("image_token_id", "text_config.image_token_id"), cls.DEFAULT_IMAGE_TOKEN_ID)
        if _has_key(config, "video_token_id") and config_get(config, "video_token_id", None) is None:
            video = None  # explicitly no video
        else:
            video = config_first(config, ("video_token_id", "text_config.video_token_id"), cls.DEFAULT_VIDEO_TOKEN_ID)
        start = config_first(
            config, ("vision_start_token_id", "text_config.vision_start_token_id"), cls.DEFAULT_VISION_START_TOKEN_ID
        )
        merge = config_get(config, "vision_config.spatial_merge_size", 2)
        tps = config_get(config, "vision_config.tokens_per_second", cls.DEFAULT_TOKENS_PER_SECOND)
        patch = config_get(config, "vision_config.patch_size", None)
        # older hub configs of Qwen2-VL name the channels in_chans
        channels = config_first(config, ("vision_config.in_channels", "vision_config.in_chans"), 3)
        temporal = config_get(config, "vision_config.temporal_patch_size", 2)
        for key, value, least in (("image_token_id", image, 0), ("video_token_id", video, 0),
                                  ("vision_start_token_id", start, 0), ("vision_config.spatial_merge_size", merge, 1),
                                  ("vision_config.in_channels", channels, 1),
                                  ("vision_config.temporal_patch_size", temporal, 1),
                                  ("vision_config.patch_size", patch, 1)):
            if value is not None:  # token ids and sizes: integers (1.5 or "151655" is not read as one)
                check_int(value, f"the model config's {key}", least, hint=f" ({model_type})")
        family = cls(
            model_type=model_type,
            image_token_id=int(image),
            video_token_id=None if video is None else int(video),
            vision_start_token_id=None if start is None else int(start),
            spatial_merge_size=int(merge),
            tokens_per_second=tps if cls.USES_SECOND_PER_GRID_TS else 1,
            patch_shape=None if patch is None else (int(channels), int(temporal), int(patch)),
            mrope_convention=resolve_mrope_convention(mrope_convention),
        )
        if family.video_token_id is not None and family.video_token_id == family.image_token_id:
            raise ValueError(f"{model_type}: image_token_id and video_token_id are both {family.image_token_id}")
        return family

    @property
    def supports_video(self) -> bool:
        return self.video_token_id is not None

    @property
    def pixel_width(self) -> int | None:
        """Values in one row of ``pixel_values`` (and ``pixel_values_videos``):
        ``in_channels · temporal_patch_size · patch_size²``, or None when unknown."""
        if self.patch_shape is None:
            return None
        channels, temporal, patch = self.patch_shape
        return channels * temporal * patch * patch

    # ---- placeholders -------------------------------------------------------
    def placeholder_tokens(self, grid_thw: np.ndarray) -> np.ndarray:
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        return grid.prod(axis=1) // (self.spatial_merge_size**2)

    def _llm_grid(self, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        m = self.spatial_merge_size
        return grid[:, 0].copy(), grid[:, 1] // m, grid[:, 2] // m

    def image_items(self, grid_thw: np.ndarray) -> RopeItems:
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        t, h, w = self._llm_grid(grid)
        k = grid.shape[0]
        # transformers 4.x's Qwen2.5-VL puts every frame of an image at temporal offset 0
        still = self.USES_SECOND_PER_GRID_TS and self.mrope_convention == TRANSFORMERS_4
        return RopeItems(
            source=np.arange(k, dtype=np.int64),
            grid=grid,
            frame=np.full(k, -1, np.int64),
            t=t,
            h=h,
            w=w,
            interval=np.full(k, 0.0 if still else 1.0, np.float64),
            mode=np.full(k, MODE_INT, np.int8),
        )

    def time_intervals(self, second_per_grid_ts, n_videos: int, *, sample: int = 0) -> tuple[np.ndarray, np.ndarray]:
        if not self.USES_SECOND_PER_GRID_TS:
            return np.ones(n_videos, np.float64), np.full(n_videos, MODE_INT, np.int8)
        truncate = self.mrope_convention != EXACT
        return time_intervals(second_per_grid_ts, n_videos, self.tokens_per_second, sample=sample, truncate=truncate)

    def video_items(self, grid_thw: np.ndarray, interval=None, mode=None) -> RopeItems:
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        t, h, w = self._llm_grid(grid)
        k = grid.shape[0]
        if interval is None:
            interval, mode = self.time_intervals(None, k)
        if not self.VIDEO_FRAMES_ARE_ITEMS:
            return RopeItems(np.arange(k, dtype=np.int64), grid, np.full(k, -1, np.int64), t, h, w, interval, mode)
        # one item per frame: get_rope_index repeats each grid t times with t = 1
        frames = grid[:, 0]
        source = np.repeat(np.arange(k, dtype=np.int64), frames)
        first = np.repeat(np.cumsum(frames) - frames, frames)
        frame = np.arange(source.size, dtype=np.int64) - first
        return RopeItems(
            source=source,
            grid=grid[source],
            frame=frame,
            t=np.ones(source.size, np.int64),
            h=h[source],
            w=w[source],
            interval=interval[source],
            mode=mode[source],
        )

    # ---- vision encoder -----------------------------------------------------
    def vit_segments(self, grid_thw: np.ndarray) -> np.ndarray:
        """Every family here attends each image and each video frame on its own
        (``h·w`` patches per frame; Qwen2.5-VL additionally windows inside a frame
        on its non-full-attention blocks, which it computes itself)."""
        grid = np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)
        return np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0])

    # ---- per-sample reference-style API ---------------------------------------
    def mrope_positions(self, input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None) -> np.ndarray:
        """int64 ``[3, s]`` mRoPE position ids of one sample, as the family's own
        ``get_rope_index`` gives for that sample alone (via the vectorised THD path)."""
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        image_grid = np.zeros((0, 3)) if image_grid_thw is None else np.asarray(image_grid_thw)
        video_grid = np.asarray(video_grid_thw).reshape(-1, 3) if video_grid_thw is not None else np.zeros((0, 3))
        images = self.image_items(image_grid)
        videos = self.video_items(video_grid, *self.time_intervals(second_per_grid_ts, video_grid.shape[0]))
        cu = np.array([0, ids.size], dtype=np.int64)
        one = np.ones(1, np.int64)
        out = mrope_for_stream(self, ids, cu, cu[1:], images, one * len(images), videos, one * len(videos))
        return out.positions

    # ---- a pack's vision fields: what the builder and collators call (thdpack.batching.vision_family) ----
    def attach(self, batch, samples):
        """:func:`thdpack.vlm.vision_fields.attach_vision` of ``samples`` under this family."""
        return attach_vision(batch, samples, self)

    def vision_lengths(self, samples) -> np.ndarray:
        """int64 ``[n]`` ViT patches per sample (:func:`thdpack.vlm.vision_fields.vision_lengths`)."""
        return vision_lengths(samples)

    def prefix_limit(self, flat):
        """:func:`thdpack.vlm.tree_vision.prefix_limit` of the unshared batch ``flat`` under this family."""
        return prefix_limit(flat, self)

    def attach_tree(self, tree, flat):
        """:func:`thdpack.vlm.tree_vision.attach_tree` of the shared-prefix batch ``tree`` under this family."""
        return attach_tree(tree, flat, self)


def _has_key(config, key: str) -> bool:
    if isinstance(config, dict):
        return key in config
    return hasattr(config, key)


def time_intervals(
    second_per_grid_ts, n_videos: int, tokens_per_second, *, sample: int, truncate: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Per-video temporal spacing ``tokens_per_second · second_per_grid_ts[k]`` (float64 ``[n_videos]``)
    and the arithmetic Qwen2.5-VL's ``get_rope_index`` does it in (int8 ``[n_videos]`` modes).

    ``truncate``: transformers <= 5.17's ``tokens_per_second · int(second_per_grid_ts[k])``
    (conventions ``"truncate-spg"`` and ``"transformers-4"``); the product is then integer
    arithmetic for an integer ``tokens_per_second`` (every released config's).

    torch's promotion there: ``arange(t) * (tokens_per_second * s)`` is integer when
    both factors are integers, float64 when ``s`` is a float64 tensor, and float32
    otherwise (Python / numpy floats and float32 tensors). Without
    ``second_per_grid_ts`` the model uses ``s = 1``. Half-precision tensors are
    computed in float32 (not bit-exact to torch's bf16 arithmetic).
    """
    integral_tps = isinstance(tokens_per_second, (int, np.integer)) and not isinstance(tokens_per_second, bool)
    if second_per_grid_ts is None:
        mode = MODE_INT if integral_tps else MODE_F32
        return np.full(n_videos, float(tokens_per_second)), np.full(n_videos, mode, np.int8)
    if isinstance(second_per_grid_ts, torch.Tensor):
        values = second_per_grid_ts.detach().cpu().to(torch.float64).numpy().reshape(-1)
        if second_per_grid_ts.dtype == torch.float64:
            mode = MODE_F64
        elif second_per_grid_ts.is_floating_point():
            mode = MODE_F32
        else:
            mode = MODE_INT if integral_tps else MODE_F32
    else:
        arr = np.asarray(second_per_grid_ts)
        if arr.dtype == object or arr.dtype.kind not in "iuf":
            raise SampleError.at(
                sample, f": 'second_per_grid_ts' must be numbers, got {arr.dtype}",
                field='second_per_grid_ts',
            )
        values = arr.astype(np.float64).reshape(-1)
        mode = MODE_INT if (arr.dtype.kind in "iu" and integral_tps) else MODE_F32
    if values.size != n_videos:
        raise SampleError.at(
            sample, f": 'second_per_grid_ts' has {values.size} values but 'video_grid_thw' has {n_videos} videos",
            field='second_per_grid_ts',
        )
    if not np.all(np.isfinite(values)) or np.any(values < 0):
        raise SampleError.at(
            sample, f": 'second_per_grid_ts' must be finite and >= 0, got {values.tolist()}",
            field='second_per_grid_ts',
        )
    if truncate:
        values = np.trunc(values)
        mode = MODE_INT if integral_tps else MODE_F32
    return float(tokens_per_second) * values, np.full(n_videos, mode, np.int8)
