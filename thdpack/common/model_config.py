"""Reading a model config that is either a ``transformers`` config object or its dict.

Nothing here imports ``transformers``: a config object is read with ``getattr``,
a dict (``config.to_dict()`` or a hub ``config.json``) with ``[]``, and nested
sub-configs (``vision_config``, ``text_config``) may be either. The one reader of
config values for the FLOPs counts (:mod:`thdpack.flops`), the offline build's model
config (:mod:`thdpack.offline.build_model`) and the VLM families (:mod:`thdpack.vlm`).
"""

from __future__ import annotations

from collections.abc import Mapping

_MISSING = object()


def _child(node, key: str):
    if node is None:
        return _MISSING
    if isinstance(node, Mapping):
        return node.get(key, _MISSING)
    return getattr(node, key, _MISSING)


def config_get(config, path: str, default=_MISSING):
    """``config.a.b`` for ``path="a.b"``, on objects and dicts alike.

    Returns ``default`` when a key is missing or ``None`` (hub configs write
    ``null`` for unset values); raises ``KeyError`` when there is no default.
    """
    node = config
    for key in path.split("."):
        node = _child(node, key)
        if node is _MISSING or node is None:
            if default is _MISSING:
                raise KeyError(path)
            return default
    return node


def config_first(config, paths: tuple[str, ...], default=_MISSING):
    """The first of ``paths`` that is set in ``config`` (e.g. a key that older hub
    configs keep at the top level and newer ones in ``text_config``)."""
    for path in paths:
        value = config_get(config, path, None)
        if value is not None:
            return value
    if default is _MISSING:
        raise KeyError(paths[0])
    return default


def model_type_of(config) -> str:
    """``config.model_type`` (a class attribute on transformers configs, a key in their dicts)."""
    value = config_get(config, "model_type", None)
    if not isinstance(value, str) or not value:
        kind = "dict" if isinstance(config, Mapping) else type(config).__name__
        raise ValueError(f"model_config ({kind}) has no 'model_type'; pass a transformers config or its to_dict()")
    return value
