"""The build configuration resolved once: each stage's section, its derived fields filled.

:meth:`BuildStages.from_config` validates a :class:`~thdpack.offline.config.BuildConfig` once and fills the
derived fields of its sections (:mod:`thdpack.offline.stage_options`): paths resolved against ``base_dir``, the
files it names read (the model config, the chat template), the values a stage reads of another section.
Each stage is handed its section, never the whole config:

==========================  ==========================================================================
``sources``                 each source's :class:`SourceOptions` and :class:`TokenizeOptions` (a plain build:
                            one source; a mixture: each of ``input``'s, their own options in place)
``planning``                :mod:`thdpack.offline.commands.sample_plan`, ``mixture`` the blend
                            (:mod:`thdpack.offline.commands.mixture_build`)
``store``                   :mod:`thdpack.offline.store`, :mod:`thdpack.offline.commands.bridge_export`
``vision``                  :mod:`thdpack.offline.vision`
``ray``                     ``engine: ray`` (:mod:`thdpack.offline.cluster`; ``spill_dir`` resolved)
==========================  ==========================================================================
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thdpack.common.align import check_int
from thdpack.offline.config import BuildConfig, is_mixture, read_utf8
from thdpack.offline.errors import ConfigError
from thdpack.offline.stage_options import (MixtureOptions, PlanningOptions, RayOptions, SourceOptions, StoreOptions,
                                     TokenizeOptions, VisionOptions, resolve_path)


@dataclass(frozen=True)
class SourceStages:
    """One source of the build: its name, the weight key it gives (``{}``: weight 1; :class:`MixtureSource`'s
    fields), and the options of reading and tokenizing it."""

    name: str
    weights: Mapping
    inputs: SourceOptions
    tokenize: TokenizeOptions


@dataclass(frozen=True)
class BuildStages:
    """A build's configuration resolved once: each stage's section, and the model config read.

    Attributes:
        sources: each source's :class:`SourceStages` (a plain build: one, named ``input``), in the config's order
            (its index is its ``source_index``); inputs, tokenize: the first source's.
        vision, planning, store, ray: the sections, derived fields filled.
        mixture: the blend's options, defaults filled (:meth:`MixtureOptions.filled`), when ``input`` is a list
            of sources; else None.
        model_config: the model config, read (a dict), or None; model_given: ``model_config`` as given.
        engine: ``local`` or ``ray``.
        recorded: the config as metadata.json records it (``BuildConfig.as_dict(recorded=True)``).

    A mixture of one source without a weight or ``mixture`` option is the plain build of that source
    (:meth:`BuildConfig.single_source_form`: the same bytes as ``input: PATH``).
    """

    sources: tuple
    vision: VisionOptions
    planning: PlanningOptions
    store: StoreOptions
    model_config: dict | None
    model_given: Any
    engine: str
    ray: RayOptions
    mixture: MixtureOptions | None
    recorded: Mapping

    @classmethod
    def from_config(cls, cfg: BuildConfig) -> "BuildStages":
        """Validate ``cfg`` and fill every section's derived fields once: ConfigError on an invalid option,
        a model config or chat template that cannot be read."""
        cfg = cfg.single_source_form().validate()
        if cfg.planning.min_prefix_len is not None and not cfg.planning.share_prefix:
            raise ConfigError(f"min_prefix_len ({cfg.planning.min_prefix_len}) needs share_prefix: true")
        model_config = load_model_config(cfg.model_config, cfg.base_dir)  # before the long steps: fail fast
        mixed = is_mixture(cfg.source.input)
        sources = (tuple(_source(s.name, dict(s.weights), s.config) for s in cfg.sources()) if mixed
                   else (_source("input", {}, cfg),))
        tok, base, vision = cfg.tokenize, cfg.base_dir, cfg.vision
        spec = vision.image_processor
        vision = dataclasses.replace(
            vision, image_processor_path=resolve_path(base, spec) if isinstance(spec, str) else None,
            image_dir_path=resolve_path(base, vision.image_dir) if vision.image_dir else None,
            messages_field=tok.messages_field, overflow=cfg.planning.overflow, base_dir=base)
        planning = dataclasses.replace(cfg.planning, targets=tok.targets, group_column=tok.group_column)
        spill = cfg.ray.spill_dir
        ray = dataclasses.replace(cfg.ray, spill_dir=str(resolve_path(base, spill))) if spill else cfg.ray
        return cls(sources, vision, planning, cfg.store, model_config, cfg.model_config, cfg.engine, ray,
                   cfg.mixture.filled() if mixed else None, cfg.as_dict(recorded=True))

    @property
    def inputs(self) -> SourceOptions:
        """The first source's reading options."""
        return self.sources[0].inputs

    @property
    def tokenize(self) -> TokenizeOptions:
        """The first source's tokenizing options (``sample_values`` and ``group_column`` are the build's)."""
        return self.sources[0].tokenize


def _source(name: str, weights: dict, cfg: BuildConfig) -> SourceStages:
    """Source ``name`` of the config ``cfg`` of a build of it alone: its sections with paths resolved, the chat
    template read."""
    tok, base = cfg.tokenize, cfg.base_dir
    text = read_chat_template(base, tok.chat_template) if tok.chat_template else None
    tokenize = dataclasses.replace(tok, tokenizer_path=resolve_path(base, tok.tokenizer) if tok.tokenizer else None,
                                   chat_template_text=text, recorded=cfg.as_dict(recorded=True))
    return SourceStages(name, weights, dataclasses.replace(cfg.source, base_dir=base), tokenize)


# ---------------------------------------------------------------------------- the files the config names


def read_chat_template(base_dir: Path, given: str) -> str:
    """The text of the chat template file ``given`` (relative to ``base_dir``), checked to be Jinja."""
    path = resolve_path(base_dir, given)
    if path.is_dir():
        raise ConfigError(f"chat_template {given!r}: {path} is a directory; give the template file")
    if not path.is_file():
        raise ConfigError(f"chat_template {given!r}: no such file ({path})")
    text = read_utf8(path, f"chat_template {path}", f"chat_template {given!r}: cannot read {path}",
                     "save the template as UTF-8")
    if not text.strip():
        raise ConfigError(f"chat_template {path} is empty; give a Jinja chat template file (or remove "
                          "chat_template to use the tokenizer's own)")
    try:
        from jinja2 import TemplateSyntaxError
        from transformers.utils.chat_template_utils import _compile_jinja_template

        _compile_jinja_template(text)
    except ImportError:
        pass
    except TemplateSyntaxError as exc:
        raise ConfigError(f"chat_template {path}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    return text


def read_model_config(path: str | Path) -> dict:
    """The config dict of ``path``: a ``config.json`` file or a directory holding one."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"model_config {path}: no such file (give a config.json or a directory holding one)")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model_config {p}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model_config {p}: expected a JSON object, got {type(data).__name__}")
    return data


def load_model_config(spec, base_dir: Path) -> dict | None:
    """The model config ``spec`` (``BuildConfig.model_config``) as a dict (None when not given). A
    relative path is relative to ``base_dir`` (the YAML file's directory; flags are made absolute)."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        return check_model_config(dict(spec), "model_config (inline mapping)")
    if not isinstance(spec, str):
        raise ConfigError(f"model_config must be a path or a mapping, got {type(spec).__name__}")
    return read_checked_model_config(resolve_path(base_dir, spec))


def read_checked_model_config(path: Path) -> dict:
    """:func:`read_model_config` of ``path``, checked by :func:`check_model_config` (the message names the file)."""
    return check_model_config(read_model_config(path), f"model_config {path / 'config.json' if path.is_dir() else path}")


# what the build's FLOPs report reads of a model config (thdpack/flops/coefficients.py): a positive integer each
MODEL_CONFIG_NEEDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
MODEL_CONFIG_COUNTS = ("num_key_value_heads", "head_dim", "intermediate_size")  # checked the same when set


def check_model_config(config: dict, what: str) -> dict:
    """``config`` when it holds what the build reads of a model config: :data:`MODEL_CONFIG_NEEDS` as
    positive integers (at the top or in ``text_config``, as the FLOPs module reads them), the counts of
    :data:`MODEL_CONFIG_COUNTS` likewise when set, a string ``model_type``. ConfigError naming the key
    (``what``: the option and file, for the message) otherwise."""
    if not config:
        raise ConfigError(f"{what} is empty; give the model's config.json (the build reads "
                          f"{', '.join(MODEL_CONFIG_NEEDS)} from it)")
    text = config.get("text_config")
    if text is not None and not isinstance(text, Mapping):
        raise ConfigError(f"{what}: 'text_config' must be a mapping, got {text!r:.60}")
    model_type = config.get("model_type")
    if model_type is not None and not isinstance(model_type, str):
        raise ConfigError(f"{what}: 'model_type' must be a string, got {model_type!r:.60}")
    for key in MODEL_CONFIG_NEEDS + MODEL_CONFIG_COUNTS:
        value = (text or {}).get(key)
        value = config.get(key) if value is None else value
        if value is None:
            if key in MODEL_CONFIG_COUNTS:
                continue
            raise ConfigError(f"{what} has no '{key}'; the build needs {', '.join(MODEL_CONFIG_NEEDS)} "
                              "(give the model's config.json)")
        check_int(value, f"{what}: '{key}'", 1, error=ConfigError)
    return config
