"""Qwen3-VL (``qwen3_vl``, and ``qwen3_vl_moe`` which shares its ``get_rope_index``):
videos carry timestamps as text between frames (``<t> <vision_start> frame <vision_end>``),
so every frame is its own placeholder run and its own mRoPE item with ``t = 1``."""

from __future__ import annotations

from dataclasses import dataclass

from thdpack.vlm.base import QwenVLFamily
from thdpack.vlm.families import register_family


@register_family
@dataclass(frozen=True)
class Qwen3VL(QwenVLFamily):
    MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
    VIDEO_FRAMES_ARE_ITEMS = True
