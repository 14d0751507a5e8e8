"""Families by ``model_type``: adding a family is adding a file that calls :func:`register_family`."""

from __future__ import annotations

import dataclasses

from thdpack.common.model_config import model_type_of
from thdpack.vlm.convention import resolve_mrope_convention
from thdpack.vlm.families import FAMILIES as _FAMILIES


# model types with audio inputs (refused by name unless a family is registered for them)
_AUDIO_WORDS = ("audio", "omni", "whisper", "voxtral", "speech", "granite_speech", "kyutai", "phi4_multimodal")


def supported_model_types() -> tuple[str, ...]:
    _load_builtin()
    return tuple(sorted(_FAMILIES))


def get_family(model_config, mrope_convention: str | None = None):
    """The :class:`~thdpack.vlm.VlmFamily` of ``model_config`` (a transformers config, its
    dict, or an already-built family); ``ValueError`` for an unknown ``model_type``.

    ``mrope_convention``: which transformers version's ``get_rope_index`` the mRoPE rows
    follow (:mod:`thdpack.vlm.convention`): None or ``"transformers-installed"`` (the
    installed transformers' rule), ``"transformers==5.12.1"``, or ``"exact"``,
    ``"truncate-spg"``, ``"transformers-4"``. An already-built family keeps its own
    convention unless one is given. Pass the result as ``vlm=`` to ``build_thd_batch`` /
    ``ThdCollator`` / ``rebalance`` (it implements :class:`thdpack.batching.vision_family.VisionFamily`).
    """
    if (hasattr(model_config, "image_items") and hasattr(model_config, "mrope_positions")) or (
            hasattr(model_config, "attach") and hasattr(model_config, "vision_lengths")):  # already a family
        if mrope_convention is None:
            return model_config  # already a family
        chosen = resolve_mrope_convention(mrope_convention)
        if not dataclasses.is_dataclass(model_config):
            raise ValueError(
                f"mrope_convention={mrope_convention!r}: the family {type(model_config).__name__} is not a dataclass; "
                "pass its transformers config instead, or build the family with that convention"
            )
        return dataclasses.replace(model_config, mrope_convention=chosen)
    model_type = model_type_of(model_config)
    _load_builtin()
    cls = _FAMILIES.get(model_type)
    if cls is None and any(word in model_type for word in _AUDIO_WORDS):
        omni = ", ".join(t for t in sorted(_FAMILIES) if "omni" in t)
        raise ValueError(f"model_type {model_type!r} has audio inputs, which thdpack packs only for the Qwen-Omni "
                         f"thinkers ({omni}): its audio tower's lengths and positions are not known here, so its "
                         "packs could not be proven exact")
    if cls is None:
        raise ValueError(
            f"unknown VLM model_type {model_type!r}; thdpack.vlm supports {', '.join(sorted(_FAMILIES))}"
        )
    return cls.from_config(model_config, mrope_convention)


def _load_builtin() -> None:
    # importing the family modules registers them
    from thdpack.vlm import qwen2_5_vl, qwen2_vl, qwen3_5, qwen3_vl  # noqa: F401
    from thdpack.vlm.omni import family  # noqa: F401
