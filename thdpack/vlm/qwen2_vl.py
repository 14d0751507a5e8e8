"""Qwen2-VL (``qwen2_vl``): one placeholder run per image and per video; video
temporal positions are the frame (temporal patch) index."""

from __future__ import annotations

from dataclasses import dataclass

from thdpack.vlm.base import QwenVLFamily
from thdpack.vlm.families import register_family


@register_family
@dataclass(frozen=True)
class Qwen2VL(QwenVLFamily):
    MODEL_TYPES = ("qwen2_vl",)
