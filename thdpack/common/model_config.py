"""Reading a model config that is either a ``transformers`` config object or its dict.

Nothing here imports ``transformers``: a config object is read with ``getattr``,
a dict (``config.to_dict()`` or a hub ``config.json``) with ``[]``, and nested
sub-configs (``vision_config``, ``text_config``) may be either. The one reader of
config values for the FLOPs counts (:mod:`thdpack.flops`), the offline build's model
config (:mod:`thdpack.offline.commands.model_record`) and the VLM families (:mod:`thdpack.vlm`).
"""

from __future__ import annotations

from collections.abc import Mapping

from thdpack.common.align import check_int, check_number

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


def check_config(config, name: str = "config") -> None:
    """``TypeError`` unless ``config`` can be read as a model config: a mapping (a config's
    ``to_dict()``, a hub ``config.json``) or a config object (not None, a number, a string or a list)."""
    if config is None or isinstance(config, (str, bytes, int, float, list, tuple)):
        got = "None" if config is None else type(config).__name__
        raise TypeError(f"{name} must be a transformers config or its dict (config.to_dict()), got {got}")


def config_int(config, path: str, default=_MISSING, *, minimum: int = 1, where: str = "") -> int:
    """``config_get(config, path, default)`` checked by the one integer rule (an integer >= ``minimum``:
    a size is >= 1, a count >= 0): ``ValueError`` naming the key (``where`` + ``path``, e.g.
    ``"text_config."``) when it is missing without a default, or of another type or range."""
    value = config_get(config, path, default if default is not _MISSING else None)
    if value is None:
        raise ValueError(f"the model config has no {where}{path}; pass a complete config of the model")
    check_int(value, f"the model config's {where}{path}", minimum)
    return int(value)


def config_number(config, path: str, default: float, *, where: str = "") -> float:
    """A positive finite real ``config_get(config, path, default)`` (``mlp_ratio``, ...); ``ValueError``
    naming the key otherwise (:func:`thdpack.common.align.check_number`)."""
    value = config_get(config, path, default)
    check_number(value, f"the model config's {where}{path}", positive=True)
    return float(value)


def model_type_of(config) -> str:
    """``config.model_type`` (a class attribute on transformers configs, a key in their dicts)."""
    value = config_get(config, "model_type", None)
    if not isinstance(value, str) or not value:
        kind = "dict" if isinstance(config, Mapping) else type(config).__name__
        raise ValueError(f"model_config ({kind}) has no 'model_type'; pass a transformers config or its to_dict()")
    return value
