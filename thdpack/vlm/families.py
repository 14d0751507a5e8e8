"""The table of VLM families by ``model_type`` and the decorator a family file fills it with.

Kept apart from the lookup (:mod:`thdpack.vlm.registry`, which imports the built-in
family files) so that a family file importing :func:`register_family` makes no cycle.
"""

from __future__ import annotations

FAMILIES: dict[str, type] = {}


def register_family(cls: type) -> type:
    """Class decorator: register ``cls`` under each of its ``MODEL_TYPES``."""
    for model_type in cls.MODEL_TYPES:
        FAMILIES[model_type] = cls
    return cls
