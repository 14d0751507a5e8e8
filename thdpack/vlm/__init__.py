"""VLM in-batch packing for the Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5).

``build_thd_batch(samples, model_config=cfg)`` packs processor outputs (placeholders
already expanded, ``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``,
``video_grid_thw``, ``second_per_grid_ts``) into one THD batch with
``mm_token_type_ids`` and ``mrope_position_ids`` per token, computed on the stream
directly from the grids (no model call, no ``[B, S]`` copy). ``cfg`` is a
transformers config or its dict; nothing here imports transformers.

Layout: one file per family (``qwen2_vl.py``, ``qwen2_5_vl.py``, ``qwen3_vl.py``,
``qwen3_5.py``) behind :class:`VlmFamily`, registered by ``model_type``; the shared
vectorised mRoPE in ``mrope.py``, under the rule of a transformers version
(``get_family(cfg, mrope_convention=...)``, ``convention.py``; docs/vlm.md); a pack's
vision fields (each sample's pixels and grids read, checked and concatenated in pack
order, mRoPE rows added) in ``vision_fields.py``; a shared-prefix pack's (a prompt's images
listed once, each member's mRoPE rows continuing from its prefix) in ``tree_vision.py``. CP positions of vision tokens
(:func:`vision_shard_extras`) are defined with the CP split, in :mod:`thdpack.parallel.cp`. The vision
tower split over CP ranks (each rank encodes a FLOPs-balanced share of the pack's frames, the embeddings
all-gathered): :func:`plan_vision_split` (:mod:`thdpack.planning.vision_split`), :func:`vision_rank_inputs`,
:func:`gather_vision_embeddings`, :func:`shard_vision_rows` (:mod:`thdpack.parallel.vision_gather`).
On import it registers :func:`attach_vision` and :func:`vision_lengths` with
:mod:`thdpack.common.extensions`, through which the core calls them.
"""

from thdpack.batching.batch import HF_VISION_KEYS
from thdpack.common.extensions import VisionExtension, register_vision
from thdpack.parallel.cp import vision_shard_extras
from thdpack.parallel.vision_gather import gather_vision_embeddings, shard_vision_rows, vision_rank_inputs
from thdpack.planning.vision_split import VisionSplit, plan_vision_split
from thdpack.vlm.base import QwenVLFamily, RopeItems, VlmFamily
from thdpack.vlm.mrope import mrope_for_stream
from thdpack.vlm.families import register_family
from thdpack.vlm.registry import get_family, supported_model_types
from thdpack.vlm.tree_vision import attach_tree, prefix_limit
from thdpack.vlm.vision_fields import attach_vision, vision_lengths, vision_patch_count

__all__ = [
    "HF_VISION_KEYS",
    "QwenVLFamily",
    "RopeItems",
    "VisionSplit",
    "VlmFamily",
    "attach_vision",
    "gather_vision_embeddings",
    "get_family",
    "mrope_for_stream",
    "plan_vision_split",
    "register_family",
    "shard_vision_rows",
    "supported_model_types",
    "vision_lengths",
    "vision_patch_count",
    "vision_rank_inputs",
    "vision_shard_extras",
]

register_vision(VisionExtension(attach=attach_vision, lengths=vision_lengths,  # the core calls these (build, collate)
                                prefix_limit=prefix_limit, attach_tree=attach_tree,  # shared prompts with images
                                model_types=supported_model_types))
