"""The build configuration resolved once into one small, picklable options object per stage.

:meth:`BuildStages.from_config` validates a :class:`~thdpack.offline.config.BuildConfig` once,
resolves its paths against ``base_dir``, reads the files it names (the model config, the chat
template) and splits it into what each stage reads:

==================  ==========================================================================
:class:`InputOptions`     reading the rows (:mod:`thdpack.offline.inputs.sources`)
:class:`TokenizeOptions`  tokenizing them (:mod:`thdpack.offline.tokenizing`)
:class:`VisionOptions`    the VLM set-up and media (:mod:`thdpack.offline.vision`)
:class:`PlanningOptions`  planning the samples into packs (:mod:`thdpack.offline.commands.build_packs`)
:class:`StoreOptions`     writing the packs and the files beside them (:mod:`thdpack.offline.store`,
                          :mod:`thdpack.offline.commands.bridge_export`)
:class:`RayOptions`       ``engine: ray``: the cluster or local instance (:mod:`thdpack.offline.cluster`;
                          the config's ``ray`` section as it is, ``spill_dir`` resolved)
:class:`MixtureStages`    ``input`` as a list of sources: each source's input and tokenizing options, the blend
                          (:mod:`thdpack.offline.commands.mixture_build`)
==================  ==========================================================================

A stage is handed its own options, never the whole config; each options object is a frozen
dataclass of plain values, so it can be shipped (pickled) to a worker process or machine.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from thdpack.batching.shared_prefix import DEFAULT_MIN_PREFIX_LEN
from thdpack.common.align import check_int
from thdpack.offline.config import BuildConfig, RayOptions, read_utf8
from thdpack.offline.errors import ConfigError
from thdpack.planning.options import PlanOptions


def resolve_path(base_dir: Path, value: str) -> Path:
    """``value`` as a path: absolute, or relative to ``base_dir`` (:meth:`BuildConfig.resolve_path`)."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else base_dir / p


@dataclass(frozen=True)
class InputOptions:
    """What reading the input rows needs (:func:`thdpack.offline.inputs.sources.read_source`).

    Attributes:
        input: ``BuildConfig.input`` as given: a path or glob, a list of them, or ``{demo: {...}}``
            (paths are named in messages and metadata as given).
        base_dir: the directory relative input paths are resolved against (:meth:`resolve_path`).
        split: the split to read from a saved DatasetDict, or None (``train`` if present).
        max_rows: read only the first N rows, or None for all.
    """

    input: Any
    base_dir: Path
    split: str | None
    max_rows: int | None

    @classmethod
    def from_config(cls, cfg: BuildConfig) -> "InputOptions":
        """The input options of ``cfg`` (not validated)."""
        return cls(cfg.input, cfg.base_dir, cfg.split, cfg.max_rows)

    def resolve_path(self, value: str) -> Path:
        """``value`` as a path: absolute, or relative to :attr:`base_dir`."""
        return resolve_path(self.base_dir, value)


@dataclass(frozen=True)
class TokenizeOptions:
    """What tokenizing the rows needs (:func:`thdpack.offline.tokenizing.tokenize_step.tokenize_source`,
    :class:`~thdpack.offline.tokenizing.row_tokenizer.RowTokenizer`, the row formats).

    Attributes:
        format: the row format's name, or ``"auto"`` (picked from the rows' fields).
        text_field: the field holding a text row's text.
        messages_field: the field holding a chat row's messages.
        loss: which tokens of a chat / prompt_completion row are trained (``BuildConfig.loss``).
        append_eos: text and string prompt_completion rows end with the tokenizer's EOS token.
        tokenizer: the tokenizer as given (a path or a Hugging Face cache name), or None;
            messages and metadata.json name it so.
        tokenizer_path: :attr:`tokenizer` resolved against the config's directory (it may not
            exist: then :attr:`tokenizer` is looked up in the cache), or None.
        chat_template: the chat template file as given, or None.
        chat_template_text: that file's text, read (and checked to be Jinja) once; or None.
        tokenizer_backend: ``auto``, ``tiktoken`` or ``hf`` (never changes the output).
        targets: the target column written: ``loss_mask`` or ``labels``.
        value_columns: the ``sample_values`` column names, in order (``()`` when not set).
        group_column: the column holding each row's group id, or None.
        num_proc: processes tokenizing the rows.
        map_batch_size: rows per tokenization batch.
        recorded: the options metadata.json records (``BuildConfig.as_dict(recorded=True)``), part
            of the tokenized rows' fingerprint.
    """

    format: str
    text_field: str
    messages_field: str
    loss: str
    append_eos: bool
    tokenizer: str | None
    tokenizer_path: Path | None
    chat_template: str | None
    chat_template_text: str | None
    tokenizer_backend: str
    targets: str
    value_columns: tuple[str, ...]
    group_column: str | None
    num_proc: int
    map_batch_size: int
    recorded: Mapping | None

    @classmethod
    def from_config(cls, cfg: BuildConfig, value_columns: tuple[str, ...] | None = None) -> "TokenizeOptions":
        """The tokenizing options of ``cfg`` (not validated; the chat template is read here);
        ``value_columns``: ``cfg.value_columns()`` when already asked."""
        text = read_chat_template(cfg.base_dir, cfg.chat_template) if cfg.chat_template else None
        return cls(
            format=cfg.format, text_field=cfg.text_field, messages_field=cfg.messages_field, loss=cfg.loss,
            append_eos=cfg.append_eos, tokenizer=cfg.tokenizer,
            tokenizer_path=resolve_path(cfg.base_dir, cfg.tokenizer) if cfg.tokenizer else None,
            chat_template=cfg.chat_template, chat_template_text=text, tokenizer_backend=cfg.tokenizer_backend,
            targets=cfg.targets,
            value_columns=tuple(cfg.value_columns()) if value_columns is None else tuple(value_columns),
            group_column=cfg.group_column, num_proc=cfg.num_proc, map_batch_size=cfg.map_batch_size,
            recorded=cfg.as_dict(recorded=True),
        )

    def extra_columns(self) -> list[str]:
        """The input columns read besides the format's: the ``sample_values`` and the ``group_column``."""
        return list(self.value_columns) + ([self.group_column] if self.group_column else [])


@dataclass(frozen=True)
class VisionOptions:
    """What the VLM set-up and the media stage need (:func:`thdpack.offline.vision.vlm_setup.vlm_build`,
    :func:`thdpack.offline.vision.media.load_image_processor`). A text build ignores them.

    Attributes:
        image_processor: ``BuildConfig.image_processor`` as given: a directory, a mapping of keyword
            arguments, or None.
        image_processor_path: a directory :attr:`image_processor` resolved against ``base_dir``, or None.
        images_field / videos_field: the fields holding a row's image / video references.
        messages_field: the field holding a chat row's messages (their image and video parts).
        image_placeholder / video_placeholder: the markers in the text where each image / video goes.
        image_dir: the directory relative media paths are resolved against (resolved), or None (the
            directory of the row's input file).
        vision_budget: the most vision patches in a pack, or None.
        video: the ``video:`` frame options as given (a mapping, YAML text, or None).
        overflow: the planning overflow policy (``truncate`` cuts videos over the vision budget).
        base_dir: the directory relative input file paths are resolved against (the rows' directories).
    """

    image_processor: Any
    image_processor_path: Path | None
    images_field: str
    videos_field: str
    messages_field: str
    image_placeholder: str
    video_placeholder: str
    image_dir: Path | None
    vision_budget: int | None
    video: Any
    overflow: str
    base_dir: Path

    @classmethod
    def from_config(cls, cfg: BuildConfig) -> "VisionOptions":
        """The vision options of ``cfg`` (not validated)."""
        spec = cfg.image_processor
        return cls(
            image_processor=spec,
            image_processor_path=resolve_path(cfg.base_dir, spec) if isinstance(spec, str) else None,
            images_field=cfg.images_field, videos_field=cfg.videos_field, messages_field=cfg.messages_field,
            image_placeholder=cfg.image_placeholder, video_placeholder=cfg.video_placeholder,
            image_dir=resolve_path(cfg.base_dir, cfg.image_dir) if cfg.image_dir else None,
            vision_budget=cfg.vision_budget, video=cfg.video, overflow=cfg.overflow, base_dir=cfg.base_dir,
        )

    def resolve_path(self, value: str) -> Path:
        """``value`` as a path: absolute, or relative to :attr:`base_dir`."""
        return resolve_path(self.base_dir, value)


@dataclass(frozen=True)
class PlanningOptions:
    """What planning the samples needs: the planner's :class:`~thdpack.planning.options.PlanOptions`
    and the offline build's own settings.

    Attributes:
        plan: pack_size, algorithm, align, overflow, max_samples_per_pack and seed of the plan.
        without_targets: ``drop`` or ``keep`` the samples left with no target token.
        group_column: the column whose groups are planned into one pack, or None.
        skip_bad_rows: skip (and count) bad rows instead of stopping.
        targets: the target column of the tokenized rows (counted per piece).
        share_prefix: each group's common prefix is counted once (:mod:`thdpack.offline.commands.shared_prefixes`).
        min_prefix_len: the shortest prefix shared (``BuildConfig.min_prefix_len``, else
            :data:`~thdpack.batching.shared_prefix.DEFAULT_MIN_PREFIX_LEN`).
        cp_size, tp_size, sequence_parallel, pad_multiple: what ``plan.align`` was derived from
            (:func:`thdpack.common.align.resolve_pad_multiple`), recorded in ``metadata.json``.
    """

    plan: PlanOptions
    without_targets: str
    group_column: str | None
    skip_bad_rows: bool
    targets: str
    share_prefix: bool
    min_prefix_len: int
    cp_size: int
    tp_size: int
    sequence_parallel: bool
    pad_multiple: int | None

    @classmethod
    def from_config(cls, cfg: BuildConfig) -> "PlanningOptions":
        """The planning options of ``cfg`` (validated first: PlanOptions checks its fields); ConfigError for
        ``min_prefix_len`` without ``share_prefix``."""
        if cfg.min_prefix_len is not None and not cfg.share_prefix:
            raise ConfigError(f"min_prefix_len ({cfg.min_prefix_len}) needs share_prefix: true")
        plan = PlanOptions(cfg.pack_size, algorithm=cfg.algorithm, align=cfg.align, overflow=cfg.overflow,
                           max_samples_per_pack=cfg.max_samples_per_pack, seed=cfg.seed)
        return cls(plan, cfg.without_targets, cfg.group_column, cfg.skip_bad_rows, cfg.targets, cfg.share_prefix,
                   DEFAULT_MIN_PREFIX_LEN if cfg.min_prefix_len is None else cfg.min_prefix_len,
                   cfg.cp_size, cfg.tp_size, cfg.sequence_parallel, cfg.pad_multiple)


@dataclass(frozen=True)
class StoreOptions:
    """What writing the packs needs (:func:`thdpack.offline.store.writer.write_packs`,
    :func:`thdpack.offline.commands.bridge_export.write_build`).

    Attributes:
        output_format: ``arrow``, ``parquet`` or ``megatron-bridge``.
        file_size_mb: the approximate size of a data file, in MB.
        save_tokenizer: save a copy of the tokenizer in the output.
        shuffle_packs: write the packs in a seeded random order (the plan's seed; else in plan order).

    The target column, pack size, alignment and seed are the plan's (:class:`PlanningOptions`).
    """

    output_format: str
    file_size_mb: float
    save_tokenizer: bool
    shuffle_packs: bool

    @classmethod
    def from_config(cls, cfg: BuildConfig) -> "StoreOptions":
        """The store options of ``cfg`` (not validated)."""
        return cls(cfg.output_format, cfg.file_size_mb, cfg.save_tokenizer, cfg.shuffle_packs)


@dataclass(frozen=True)
class SourceStages:
    """One source of a mixture: its name, the weight key it gives (``{}``: weight 1; :class:`MixtureSource`'s
    fields), and the options of reading and tokenizing it."""

    name: str
    weights: Mapping
    inputs: InputOptions
    tokenize: TokenizeOptions


@dataclass(frozen=True)
class MixtureStages:
    """A mixture build (``input``: a list of sources; :func:`thdpack.planning.mixture.plan_mixture`).

    Attributes:
        sources: each source's :class:`SourceStages`, in the config's order (its index is its ``source_index``).
        weight_by: ``samples`` or ``tokens``; stopping: ``first_exhausted`` or ``all_exhausted``; size: the weighted
            sources' part of the blend, or None (from ``stopping``).
        packing: ``bfd`` (one plan over the blend) or ``stratified`` (every step of ``step_packs`` packs close to it).
    """

    sources: tuple
    weight_by: str
    stopping: str
    size: int | None
    packing: str
    step_packs: int

    @classmethod
    def from_config(cls, cfg: BuildConfig) -> "MixtureStages | None":
        """The mixture options of ``cfg`` (validated), or None when ``input`` is not a list of sources."""
        from thdpack.offline.config import is_mixture

        if not is_mixture(cfg.input):
            return None
        values = tuple(cfg.value_columns())
        sources = tuple(SourceStages(s.name, dict(s.weights), InputOptions.from_config(s.config),
                                     TokenizeOptions.from_config(s.config, values)) for s in cfg.sources())
        given = cfg.mixture
        return cls(sources, given.weight_by or "samples", given.stopping or "first_exhausted", given.size,
                   given.packing or "bfd", given.step_packs or 1)


@dataclass(frozen=True)
class BuildStages:
    """A build's configuration resolved once: each stage's options, and the model config read.

    Attributes:
        inputs, tokenize, vision, planning, store: the stages' options.
        model_config: the model config, read (a dict), or None.
        model_given: ``BuildConfig.model_config`` as given (metadata.json records it).
        engine: ``local`` or ``ray`` (``BuildConfig.engine``); ray: its options (used with ``engine: ray``).
        mixture: a :class:`MixtureStages` when ``input`` is a list of sources (then ``inputs`` and ``tokenize``
            are its first source's), else None.
        recorded: the config as metadata.json records it (``BuildConfig.as_dict(recorded=True)``).

    A mixture of one source without a weight or ``mixture`` option is the plain build of that source
    (:meth:`BuildConfig.single_source_form`: the same bytes as ``input: PATH``).
    """

    inputs: InputOptions
    tokenize: TokenizeOptions
    vision: VisionOptions
    planning: PlanningOptions
    store: StoreOptions
    model_config: dict | None
    model_given: Any
    engine: str
    ray: RayOptions
    mixture: MixtureStages | None = None
    recorded: Mapping | None = None

    @classmethod
    def from_config(cls, cfg: BuildConfig) -> "BuildStages":
        """Validate ``cfg`` and resolve every stage's options once: ConfigError on an invalid option,
        a model config or chat template that cannot be read."""
        cfg = cfg.single_source_form().validate()
        model_config = load_model_config(cfg.model_config, cfg.base_dir)  # before the long steps: fail fast
        mixture = MixtureStages.from_config(cfg)
        inputs, tokenize = ((InputOptions.from_config(cfg), TokenizeOptions.from_config(cfg)) if mixture is None
                            else (mixture.sources[0].inputs, mixture.sources[0].tokenize))
        return cls(inputs, tokenize, VisionOptions.from_config(cfg), PlanningOptions.from_config(cfg),
                   StoreOptions.from_config(cfg), model_config, cfg.model_config, cfg.engine, _ray(cfg), mixture,
                   cfg.as_dict(recorded=True))

    @property
    def sources(self) -> tuple:
        """The build's sources, each a :class:`SourceStages`: a mixture's, or the one source of a plain build."""
        if self.mixture is not None:
            return self.mixture.sources
        return (SourceStages("input", {}, self.inputs, self.tokenize),)


def _ray(cfg: BuildConfig) -> RayOptions:
    """``cfg.ray`` with ``spill_dir`` resolved against the config's directory."""
    spill = cfg.ray.spill_dir
    return dataclasses.replace(cfg.ray, spill_dir=str(resolve_path(cfg.base_dir, spill))) if spill else cfg.ray


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
