"""Extension points: behaviour a domain package provides and the core calls without
importing it, so the core (``build``, ``collate``) stays free of imports back into
:mod:`thdpack.vlm`.

One today, the vision extension: :mod:`thdpack.vlm` registers it on import, and
``thdpack/__init__`` imports :mod:`thdpack.vlm`, so ``import thdpack`` is enough for
``build_thd_batch(samples, model_config=cfg)`` to attach vision inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from thdpack.common.model_config import config_get


@dataclass(frozen=True)
class VisionExtension:
    """What the core needs from VLM support.

    Attributes:
        attach: ``attach(batch, samples, model_config)`` adds the vision inputs,
            ``mm_token_type_ids`` (int32 ``[T]``) and ``mrope_position_ids`` (int64
            ``[3, T]``) to a built whole (not sharded) batch, in place.
        lengths: ``lengths(samples)``, int64 ``[n]`` ViT patches per sample (planning
            with ``vision_budget``).
        prefix_limit: shared prefixes (``build_thd_batch(share_prefix=..., model_config=...)``):
            ``prefix_limit(flat, model_config)`` of the unshared batch ``flat`` (vision attached, no
            padding) returns ``limit(members, p, declared, name) -> int``: the longest prefix ``<= p``
            of a group's ``members`` (int64 sample positions) that ends on no image / video and
            whose images and videos are the same for every member (``ValueError`` naming ``name``
            where a ``declared`` prefix is not). None: no shared prefixes with vision.
        attach_tree: ``attach_tree(tree, flat, model_config)`` adds the vision inputs, token types
            and mRoPE rows of the shared-prefix batch ``tree`` gathered from ``flat``, in place
            (a shared prompt's images listed once).
        model_types: ``model_types()``, the ``model_type`` s of the VLM families supported.
    """

    attach: Callable[[object, Sequence, object], object]
    lengths: Callable[[Sequence], np.ndarray]
    prefix_limit: Callable[[object, object], Callable] | None = None
    attach_tree: Callable[[object, object, object], object] | None = None
    model_types: Callable[[], Sequence[str]] = tuple


_vision: VisionExtension | None = None


def register_vision(extension: VisionExtension) -> None:
    """Install ``extension`` as the vision extension (the last registration wins)."""
    global _vision
    _vision = extension


def vision() -> VisionExtension:
    """The registered vision extension; ``RuntimeError`` if none is."""
    if _vision is None:
        raise RuntimeError("no vision extension is registered: import thdpack.vlm (import thdpack does)")
    return _vision


def vlm_config_problem(options: str, model_config) -> str | None:
    """The one message for VLM-only ``options`` (``"vision_budget"``, ``"vision_budget / image_processor"``)
    given with ``model_config`` (a transformers config, its dict, a built VLM family, or None) that is not a
    VLM's: None when it is one. ``thdpack build`` and :class:`~thdpack.ThdCollator` say the same words."""
    if model_config is not None and hasattr(model_config, "image_items"):
        return None  # an already-built VLM family
    types = tuple(vision().model_types())
    model_type = None if model_config is None else config_get(model_config, "model_type", None)
    if model_type in types:
        return None
    verb = "need" if "/" in options else "needs"
    return (f"{options} {verb} a VLM model_config (model_type one of {', '.join(types)}), got "
            + ("none" if model_config is None else repr(model_type)))
