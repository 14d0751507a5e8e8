"""Qwen3.5 (``qwen3_5``, and ``qwen3_5_moe``): Qwen3-VL's placeholder and mRoPE
layout (one item per video frame) with its own token ids.

Its Gated DeltaNet (linear attention) layers see sample boundaries only through
``cu_seq_lens_q`` with flash-linear-attention's varlen kernels; the torch fallback
ignores them, so on the CPU only ``full_attention`` layers keep packed samples apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from thdpack.vlm.base import QwenVLFamily
from thdpack.vlm.families import register_family


@register_family
@dataclass(frozen=True)
class Qwen3_5(QwenVLFamily):
    MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
    VIDEO_FRAMES_ARE_ITEMS = True
    DEFAULT_IMAGE_TOKEN_ID = 248056
    DEFAULT_VIDEO_TOKEN_ID = 248057
    DEFAULT_VISION_START_TOKEN_ID = 248053
