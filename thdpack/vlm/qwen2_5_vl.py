"""Qwen2.5-VL (``qwen2_5_vl``): as Qwen2-VL, but a video's temporal positions are
``trunc(k · tokens_per_second · second_per_grid_ts)`` (absolute time), with
``vision_config.tokens_per_second`` from the config and ``second_per_grid_ts``
from the sample (1 when absent, as in the model)."""

from __future__ import annotations

from dataclasses import dataclass

from thdpack.vlm.base import QwenVLFamily
from thdpack.vlm.families import register_family


@register_family
@dataclass(frozen=True)
class Qwen2_5VL(QwenVLFamily):
    MODEL_TYPES = ("qwen2_5_vl",)
    USES_SECOND_PER_GRID_TS = True
    DEFAULT_TOKENS_PER_SECOND = 4  # Qwen2_5_VLVisionConfig's default
