"""What the builder and the collators call on a VLM family, handed in as ``vlm=``.

The core never imports :mod:`thdpack.vlm`: the caller that has the model config resolves its
family once (``thdpack.vlm.get_family(model_config)``) and passes it to ``build_thd_batch``,
``ThdCollator`` or ``rebalance``; each Qwen-VL family implements this interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class VisionFamily(Protocol):
    """A VLM family as the core sees it (:class:`thdpack.vlm.QwenVLFamily` implements it)."""

    def attach(self, batch, samples: Sequence) -> object:
        """Add the vision inputs, ``mm_token_type_ids`` (int32 ``[T]``) and ``mrope_position_ids``
        (int64 ``[3, T]``) of ``samples`` to their built whole (not sharded) ``batch``, in place."""

    def vision_lengths(self, samples: Sequence) -> np.ndarray:
        """int64 ``[n]`` ViT patches per sample (planning with ``vision_budget``)."""

    def prefix_limit(self, flat) -> Callable:
        """For shared prefixes: ``limit(members, p, declared, name) -> int`` over the unshared batch ``flat``
        (vision attached, no padding): the longest prefix ``<= p`` of a group's ``members`` (int64 sample
        positions) that ends on no image / video and holds the same ones for every member (``ValueError``
        naming ``name`` where a ``declared`` prefix is not)."""

    def attach_tree(self, tree, flat) -> object:
        """Add the vision inputs, token types and mRoPE rows of the shared-prefix batch ``tree`` gathered
        from ``flat``, in place (a shared prompt's images listed once)."""


def check_vlm(vlm, where: str) -> None:
    """``TypeError`` unless ``vlm`` is None or a :class:`VisionFamily` (a model config is not: resolve it)."""
    if vlm is not None and not isinstance(vlm, VisionFamily):
        raise TypeError(f"{where}: vlm must be a VLM family, thdpack.vlm.get_family(model_config), or None; "
                        f"got {type(vlm).__name__}")
