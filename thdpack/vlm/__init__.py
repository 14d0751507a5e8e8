"""VLM in-batch packing for the Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5).

``build_thd_batch(samples, vlm=get_family(cfg))`` packs processor outputs (placeholders
already expanded, ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
``video_grid_thw``, ``second_per_grid_ts``) into one THD batch with
``mm_token_type_ids`` and ``mrope_position_ids`` per token, computed on the stream
directly from the grids (no model call, no ``[B, S]`` copy). ``cfg`` is a
transformers config or its dict; nothing here imports transformers. The family is resolved
once and handed in (``vlm=``): the core never imports this package.

Layout: one file per family (``qwen2_vl.py``, ``qwen2_5_vl.py``, ``qwen3_vl.py``,
``qwen3_5.py``) behind :class:`VlmFamily`, in a table by ``model_type`` (:func:`get_family`); the shared
vectorised mRoPE in ``mrope.py``, under the rule of a transformers version
(``get_family(cfg, mrope_convention=...)``, ``convention.py``; docs/vlm.md); a pack's
vision fields (each sample's pixels and grids read, checked and concatenated in pack
order, mRoPE rows added) in ``vision_fields.py``; a shared-prefix pack's (a prompt's images
listed once, each member's mRoPE rows continuing from its prefix) in ``tree_vision.py``. CP positions of vision tokens
(:func:`vision_shard_extras`) are defined with the CP split, in :mod:`thdpack.parallel.cp`. The vision
tower split over CP ranks (each rank encodes a FLOPs-balanced share of the pack's frames, the embeddings
all-gathered): :func:`plan_vision_split` (:mod:`thdpack.planning.vision_split`), :func:`vision_rank_inputs`,
:func:`gather_vision_embeddings`, :func:`shard_vision_rows` (:mod:`thdpack.parallel.vision_gather`).
"""

from thdpack.parallel.cp import vision_shard_extras
from thdpack.parallel.vision_gather import gather_vision_embeddings, shard_vision_rows, vision_rank_inputs
from thdpack.planning.vision_split import VisionSplit, plan_vision_split
from thdpack.vlm.base import QwenVLFamily, VlmFamily
from thdpack.vlm.mrope import mrope_for_stream
from thdpack.vlm.families import register_family
from thdpack.vlm.registry import get_family, supported_model_types
from thdpack.vlm.vision_fields import vision_lengths

__all__ = [
    "QwenVLFamily",
    "VisionSplit",
    "VlmFamily",
    "gather_vision_embeddings",
    "get_family",
    "mrope_for_stream",
    "plan_vision_split",
    "register_family",
    "shard_vision_rows",
    "supported_model_types",
    "vision_lengths",
    "vision_rank_inputs",
    "vision_shard_extras",
]
