"""The build configuration: one section per stage, read from YAML, flags and keywords, validated once.

:class:`BuildConfig` holds the sections of :mod:`thdpack.offline.stage_options` (``source``, ``mixture``,
``tokenize``, ``planning``, ``store``, ``ray``, ``vision``) and two options of its own (``engine``,
``model_config``). Every option has one flat name, a YAML key and a ``thdpack build`` flag (``pack_size`` ->
``--pack-size``; a ``ray`` / ``mixture`` option's is ``ray_KEY`` / ``mixture_KEY``); YAML may also give a
section whole (``planning: {pack_size: 4096}``), Python the flat names as keywords
(``BuildConfig(input=..., pack_size=4096)``) or a section object. Read a value from its section
(``cfg.planning.pack_size``). Relative paths in a YAML file (``input``, ``tokenizer``) are relative to the
file's directory; relative paths given as flags are relative to the working directory.

:func:`options` reads each option's rule off its field; :meth:`BuildConfig.validate` checks every option by
that rule and ``thdpack.cli.config_flags`` makes every flag from it. Hand-written, not pydantic nor
HfArgumentParser: neither keeps the tested ConfigError messages nor "flag not given = the YAML value stays".
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thdpack.common.align import check_bool, check_int, check_number
from thdpack.demo import generate_rows
from thdpack.offline.errors import ConfigError
from thdpack.offline.stage_options import (MixtureOptions, PlanningOptions, RayOptions, SourceOptions, StoreOptions,
                                     TokenizeOptions, VisionOptions, opt, resolve_path)
from thdpack.planning.mixture import WEIGHT_KEYS

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_uri(spec: str) -> bool:
    """Whether input ``spec`` is a filesystem URI (``PROTOCOL://...``, read with fsspec) rather than a path."""
    return bool(_URI.match(spec))


ENGINES = ("local", "ray")  # where a build tokenizes and writes (docs/distributed.md)
# BuildConfig's sections: the field, and the prefix of its options' flat names ("": the key alone)
SECTIONS = {"source": "", "mixture": "mixture_", "tokenize": "", "planning": "", "store": "", "ray": "ray_",
            "vision": ""}
# a mixture source's own options (input: a list of sources); the other options are the build's, one for all
SOURCE_OPTIONS = ("format", "loss", "chat_template", "text_field", "messages_field", "append_eos", "split", "max_rows")
SOURCE_KEYS = ("path", "demo", "name", *WEIGHT_KEYS, *SOURCE_OPTIONS)
EXECUTION_ONLY = ("num_proc", "map_batch_size", "tokenizer_backend", "engine",
                  *(f"ray_{f.name}" for f in dataclasses.fields(RayOptions)))  # options that never change the output
AUDIO_OPTIONS = ("audio_processor", "audios_field", "audio_placeholder", "max_audio_seconds", "audio_budget")  # omni rows with audio
# recorded in metadata.json only when given (None / false: older builds stay byte-identical)
RECORDED_IF_SET = ("sample_values", "group_column", "share_prefix", "min_prefix_len", *AUDIO_OPTIONS,
                   *(f"mixture_{f.name}" for f in dataclasses.fields(MixtureOptions)))
# metadata.json's "config": the options in the order builds have always written them (byte-identical builds)
RECORD_ORDER = ("input", *(f"mixture_{f.name}" for f in dataclasses.fields(MixtureOptions)), "split", "max_rows",
                "format", "text_field", "messages_field", "loss", "append_eos", "tokenizer", "chat_template",
                "tokenizer_backend", "targets", "pack_size", "algorithm", "overflow", "without_targets",
                "max_samples_per_pack", "sample_values", "group_column", "share_prefix", "min_prefix_len", "seed",
                "shuffle_packs", "cp_size", "tp_size", "sequence_parallel", "pad_multiple", "output_format",
                "file_size_mb", "num_proc", "map_batch_size", "engine",
                *(f"ray_{f.name}" for f in dataclasses.fields(RayOptions)), "skip_bad_rows", "save_tokenizer",
                "model_config", "image_processor", "images_field", "image_placeholder", "image_dir", "vision_budget",
                "videos_field", "video_placeholder", "video", *AUDIO_OPTIONS)


def _section(cls):
    """A :class:`BuildConfig` field holding a section of :mod:`thdpack.offline.stage_options`."""
    return field(default_factory=cls, metadata={"section": cls})


@dataclass(init=False)
class BuildConfig:
    """What ``thdpack build`` reads, how it tokenizes, plans and writes: one section per stage.
    ``BuildConfig(**options)`` takes flat option names (``input=``, ``pack_size=``, ``ray_address=``) and
    sections whole (``ray=RayOptions(...)``)."""

    source: SourceOptions = _section(SourceOptions)
    mixture: MixtureOptions = _section(MixtureOptions)
    tokenize: TokenizeOptions = _section(TokenizeOptions)
    planning: PlanningOptions = _section(PlanningOptions)
    store: StoreOptions = _section(StoreOptions)
    engine: str = opt("local", "where the build tokenizes and writes: local (this machine, num_proc processes) or ray "
                      "(a Ray cluster, or a local Ray instance; the same output byte for byte; docs/distributed.md)",
                      ENGINES)
    ray: RayOptions = _section(RayOptions)
    model_config: Any = opt(
        None, "model config: a config.json or a directory holding one (in YAML also a mapping). Adds the "
        "whole-model FLOPs over-count to the stats; a Qwen-VL family config also builds rows with images",
        accepts=((str, dict), "a path or a mapping"), flag_type=str,
    )
    vision: VisionOptions = _section(VisionOptions)
    # where relative paths in the YAML file are resolved (not a config key)
    base_dir: Path = field(default_factory=Path.cwd, repr=False, compare=False, metadata={"internal": True})

    def __init__(self, **options):
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
        changed = self._with(options, "BuildConfig")
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(changed, f.name))

    # ------------------------------------------------------------------ construction
    @classmethod
    def keys(cls) -> list[str]:
        """The option names (YAML keys and flags)."""
        return [o.name for o in options()]

    @classmethod
    def from_dict(cls, data: dict, *, base_dir: Path | None = None, origin: str = "config") -> "BuildConfig":
        """The config of the YAML mapping ``data``: options by flat name, or sections as mappings (one of the two
        per key)."""
        if not isinstance(data, dict):
            raise ConfigError(f"{origin}: expected a mapping of options, got {type(data).__name__}")
        cfg = cls()._with(data, origin, sections_given=True)
        if base_dir is not None:
            cfg.base_dir = Path(base_dir)
        return cfg
    @classmethod
    def from_yaml(cls, path: str | Path) -> "BuildConfig":
        try:
            import yaml
        except ImportError:
            raise ConfigError("reading a YAML config needs pyyaml: pip install pyyaml (or 'thdpack[hf]')") from None
        path = Path(path)
        if path.is_dir():
            raise ConfigError(f"config file {path} is a directory; give the YAML file in it")
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        text = read_utf8(path, f"{path}", f"cannot read config file {path}", "save the config as UTF-8")
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(yaml_error_line(path, exc)) from None
        return cls.from_dict(data, base_dir=path.resolve().parent, origin=str(path))

    def override(self, **changes) -> "BuildConfig":
        """A copy with ``changes`` applied (``None`` values are ignored): options by flat name, or a section whole (``ray=RayOptions(...)``, or a mapping of some of its keys). Paths given
        here are relative to the working directory."""
        changes = {k: v for k, v in changes.items() if v is not None}
        unknown = [k for k in changes if k not in self.keys() and k not in SECTIONS]
        if unknown:
            raise ConfigError(f"unknown option(s) {unknown}")
        # paths given here are cwd-relative: make them absolute so that base_dir does not apply
        if "input" in changes:
            paths = changes["input"] if isinstance(changes["input"], (list, tuple)) else [changes["input"]]
            if all(isinstance(p, str) for p in paths):
                paths = [p if is_uri(p) else str(Path(p).expanduser().absolute()) for p in paths]
                changes["input"] = paths[0] if len(paths) == 1 else paths
        if "tokenizer" in changes and Path(changes["tokenizer"]).expanduser().exists():
            changes["tokenizer"] = str(Path(changes["tokenizer"]).expanduser().absolute())
        for key in ("model_config", "image_processor", "image_dir"):
            if isinstance(changes.get(key), str) and Path(changes[key]).expanduser().exists():
                changes[key] = str(Path(changes[key]).expanduser().absolute())
        return self._with(changes, "override")

    def _with(self, changes: dict, origin: str, *, sections_given: bool = False) -> "BuildConfig":
        """A copy with ``changes`` (flat option names; sections whole, as an object or a mapping of some of its
        keys) applied: the one place a key finds its field. ``sections_given``: a YAML mapping (a key given
        both ways is refused)."""
        by_name = {o.name: o for o in options()}
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        flat: dict[str, dict] = {}
        for key, value in changes.items():
            if key in SECTIONS:
                setattr(new, key, _section_of(key, getattr(self, key), value, origin))
            elif key == "base_dir":
                new.base_dir = Path(value)
            elif key not in by_name:
                raise ConfigError(f"{origin}: unknown option '{key}'{_close_hint(key, self.keys())}; options: "
                                  f"{', '.join(self.keys())}")
            elif by_name[key].section is None:
                setattr(new, key, value)
            else:
                flat.setdefault(by_name[key].section, {})[by_name[key].key] = value
        for name, given in flat.items():
            both = [k for k in given if isinstance(changes.get(name), dict) and k in changes[name]]
            if both and sections_given:
                raise ConfigError(f"{origin}: {name}.{both[0]} and {SECTIONS[name]}{both[0]} both given; keep one")
            setattr(new, name, dataclasses.replace(getattr(new, name), **given))
        return new

    # ------------------------------------------------------------------ checks
    def validate(self, *, need_tokenizer: bool | None = None) -> "BuildConfig":
        """Raise :class:`ConfigError` on the first invalid option; returns ``self``."""
        check_input(self.source.input)
        for option in options():
            option.check(self.value(option))
            if option.kind == "flag":  # a numpy bool read as the bool it is (metadata.json records it)
                self._set(option, bool(self.value(option)))
        self.tokenize.value_columns
        self._check_mixture()
        if need_tokenizer and not self.tokenize.tokenizer:
            raise ConfigError(f"format '{self.tokenize.format}' needs a tokenizer: give --tokenizer or 'tokenizer:' "
                              "in the config")
        if self.planning.pack_size < self.planning.align:
            raise ConfigError(f"pack_size ({self.planning.pack_size}) is smaller than the alignment multiple "
                              f"({self.planning.align})")
        self._check_share_prefix()
        return self

    def _set(self, option: "Option", value) -> None:
        """Set ``option`` to ``value`` in place."""
        if option.section is None:
            setattr(self, option.name, value)
        else:
            setattr(self, option.section, dataclasses.replace(getattr(self, option.section), **{option.key: value}))

    def _check_mixture(self) -> None:
        """ConfigError for ``mixture_*`` options without a mixture, and for what a mixture does not take."""
        given = [f"mixture_{k}" for k, v in vars(self.mixture).items() if v is not None]
        if not is_mixture(self.source.input):
            if given:
                raise ConfigError(f"{given[0]} needs input as a list of sources (a mixture; docs/build.md, Mixtures)")
            return
        self.sources()
        if self.mixture.step_packs is not None and self.mixture.packing != "stratified":
            raise ConfigError("mixture_step_packs needs mixture_packing: stratified")

    def _check_share_prefix(self) -> None:
        """ConfigError for ``share_prefix`` where a build cannot share prefixes (``min_prefix_len`` without it:
        :meth:`thdpack.offline.stages.BuildStages.from_config`)."""
        plan = self.planning
        if not plan.share_prefix:
            return
        if (self.tokenize.group_column is None and self.tokenize.format not in ("auto", "preference")
                and not is_mixture(self.source.input)):
            raise ConfigError(f"share_prefix needs groups to share within: preference rows (prompt / chosen / "
                              f"rejected) or group_column, not format {self.tokenize.format!r} rows without group_column")
        refused = {"cp_size": plan.cp_size > 1, "output_format": self.store.output_format == "megatron-bridge"}
        for name, bad in refused.items():
            if bad:
                value = plan.cp_size if name == "cp_size" else self.store.output_format
                raise ConfigError(f"share_prefix cannot be used with {name} {value!r}: context-parallel "
                                  "attention and Megatron-Bridge's THD kernels cannot express a shared-prefix tree; "
                                  "remove share_prefix")

    # ------------------------------------------------------------------ paths
    def resolve_path(self, value: str) -> Path:
        """``value`` as a path: absolute, or relative to ``base_dir``."""
        return resolve_path(self.base_dir, value)

    def as_dict(self, *, recorded: bool = False) -> dict:
        """The options by flat name, as written (paths unresolved), in :data:`RECORD_ORDER`. ``recorded=True``
        leaves out the options that cannot change the output (``num_proc``, ...): what metadata.json records,
        so a build is byte-identical however it was parallelised."""
        by_name = {o.name: o for o in options()}
        values = {k: self.value(by_name[k]) for k in RECORD_ORDER}
        return {k: v for k, v in values.items()
                if not (recorded and (k in EXECUTION_ONLY or (k in RECORDED_IF_SET and v in (None, False))))}

    def value(self, option: "Option"):
        """The value of ``option`` (a section's: its field's)."""
        return getattr(getattr(self, option.section), option.key) if option.section else getattr(self, option.name)

    # ------------------------------------------------------------------ mixtures
    def sources(self) -> list[SourceConfig]:
        """The sources of a mixture (``input``: a list of source mappings), checked: one line naming the source for
        an unknown key or a bad option, a weight that is negative or NaN, every weight 0, two sources of one name
        or of the same files. ConfigError when ``input`` is not a mixture."""
        from thdpack.planning.mixture import check_mixture

        if not is_mixture(self.source.input):
            raise ConfigError("input is not a mixture (a list of sources, each a mapping)")
        check_input(self.source.input)
        by_option = {o.name: o for o in options()}
        out: list[SourceConfig] = []
        names: dict[str, int] = {}
        data: dict[str, str] = {}
        for i, entry in enumerate(self.source.input):
            name = _source_name(entry, i)
            own = {k: entry[k] for k in SOURCE_OPTIONS if k in entry}
            for key, value in own.items():
                try:
                    by_option[key].check(value)
                except ConfigError as exc:
                    raise ConfigError(f"input source {name!r}: {exc}") from None
            spec = {"demo": entry["demo"]} if "demo" in entry else entry["path"]
            cfg = self._with({"input": spec, **own, "mixture": MixtureOptions()}, f"input source {name!r}")
            if name in names:
                raise ConfigError(f"input sources {names[name]} and {i} are both named {name!r}: give each source "
                                  "its own name")
            identity = _source_identity(cfg)
            if identity in data:
                raise ConfigError(f"input sources {data[identity]!r} and {name!r} read the same data: give a source "
                                  "once (epochs: 2 repeats it)")
            names[name], data[identity] = i, name
            out.append(SourceConfig(name, {k: entry[k] for k in WEIGHT_KEYS if k in entry}, cfg))
        by_samples = (self.mixture.weight_by or "samples") == "samples"  # a size in tokens: checked on the rows
        try:  # the weights and sizes, before the long steps (each source's rows are counted later)
            check_mixture([{"name": s.name, "num_rows": 1, **s.weights} for s in out],
                          size=self.mixture.size if by_samples else None,
                          stopping=self.mixture.stopping or "first_exhausted", rows_at_least=True)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"input: {exc}") from None
        return out

    def single_source_form(self) -> "BuildConfig":
        """A mixture of one source without a weight or ``mixture_*`` option as the plain build of that source
        (the same bytes as ``input: PATH``); any other config as it is."""
        spec = self.source.input
        if not is_mixture(spec) or len(spec) != 1 or any(k in spec[0] for k in WEIGHT_KEYS):
            return self
        if any(v is not None for v in vars(self.mixture).values()):
            return self
        return self.sources()[0].config


def _section_of(name: str, current, given, origin: str):
    """Section ``name`` as ``given``: a :class:`RayOptions` / :class:`MixtureOptions` as it is, a mapping as some of
    its keys over ``current`` (ConfigError naming ``origin`` for another value or an unknown key)."""
    cls = type(current)
    if isinstance(given, cls):
        return given
    keys = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(given, dict):
        raise ConfigError(f"{origin}: {name} must be a mapping of {', '.join(keys)}, got {given!r}")
    unknown = [k for k in given if k not in keys]
    if unknown:
        raise ConfigError(f"{origin}: unknown key {name}.{unknown[0]}{_close_hint(str(unknown[0]), keys)}; "
                          f"{name} keys: {', '.join(keys)}")
    return dataclasses.replace(current, **given)


def yaml_error_line(path, exc) -> str:
    """``FILE:LINE:COL: invalid YAML: PROBLEM (CONTEXT at LINE:COL)``: PyYAML's error ``exc`` (several
    lines, quoting the text) as one line naming where in ``path`` it is."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None and (mark is None or (start.line, start.column) != (mark.line, mark.column)):
        context = f"{context} at {start.line + 1}:{start.column + 1}"
    return f"{where}: invalid YAML: {problem}" + (f" ({context})" if context else "")


def _close_hint(key: str, keys: list[str]) -> str:
    """`` (did you mean 'NAME'?)`` for the option name of ``keys`` closest to ``key``, if one is close."""
    close = difflib.get_close_matches(key, keys, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


@dataclass(frozen=True)
class Option:
    """One :class:`BuildConfig` option as its field declares it: the rule :meth:`BuildConfig.validate`
    checks and the flag ``thdpack build`` offers (:mod:`thdpack.cli.config_flags`) both come from here.

    ``kind``: ``flag`` (bool), ``int`` (an integer >= ``minimum``), ``number`` (a positive finite
    float), ``text`` (a non-empty string) or ``value`` (anything ``accepts`` allows; ``Any`` fields);
    ``nullable``: None is allowed (``X | None``, or any ``Any`` field)."""

    name: str
    kind: str
    nullable: bool
    default: Any
    help: str | None
    choices: tuple | list | None
    minimum: int
    accepts: tuple | None
    flag_type: type | None
    many: bool
    section: str | None = None  # the BuildConfig section holding it, else None (engine, model_config)
    key: str | None = None  # its field in that section

    def check(self, value) -> None:
        """:class:`ConfigError` naming the option when ``value`` breaks its rule."""
        if value is None and self.nullable:
            return
        if self.choices:
            if value not in self.choices:
                raise ConfigError(f"{self.name} must be one of {', '.join(self.choices)}; got {value!r}")
            return
        if self.kind == "int":
            check_int(value, self.name, self.minimum, error=ConfigError)
        elif self.kind == "flag":
            check_bool(value, self.name, error=ConfigError)
        elif self.kind == "number":
            try:
                check_number(value, self.name, positive=True)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        elif self.kind == "text" and not (isinstance(value, str) and value):
            raise ConfigError(f"{self.name} must be a non-empty string, got {value!r}")
        elif self.kind == "value" and self.accepts and not isinstance(value, self.accepts[0]):
            raise ConfigError(f"{self.name} must be {self.accepts[1]}, got {value!r}")


_KINDS = {bool: "flag", int: "int", float: "number", str: "text"}


@functools.cache
def options() -> tuple[Option, ...]:
    """The options of :class:`BuildConfig`, section by section in field order, each read off its type hint and
    :func:`~thdpack.offline.stage_options.opt` (a section's named ``PREFIX + KEY``, :data:`SECTIONS`)."""
    out = []
    for f in dataclasses.fields(BuildConfig):
        section = f.metadata.get("section")
        if section is not None:
            out += [dataclasses.replace(o, name=SECTIONS[f.name] + o.name, section=f.name, key=o.name)
                    for o in _options_of(section)]
        elif not f.metadata.get("internal"):
            out.append(_options_of(BuildConfig, f.name)[0])
    return tuple(out)


def _options_of(cls, only: str | None = None) -> list[Option]:
    """The :class:`Option` of each option field of ``cls`` (``only``: of that field; derived fields left out)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if (only is not None and f.name != only) or "help" not in f.metadata:
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        base = args[0] if len(args) == 1 else hint
        kind = "value" if base is Any else _KINDS[base]
        out.append(Option(f.name, kind, base is Any or len(args) < len(typing.get_args(hint)), f.default,
                          f.metadata["help"], f.metadata["choices"] or None, f.metadata["minimum"],
                          f.metadata["accepts"], f.metadata["flag_type"], f.metadata["many"]))
    return out


def read_utf8(path: Path, label: str, unreadable: str, fix: str) -> str:
    """The text of the file ``path``; :class:`ConfigError` for bytes that are not UTF-8 (``label``: not UTF-8
    text (byte, offset); ``fix``) or an OS error (``unreadable`` (the reason))."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{label}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}); "
                          f"{fix}") from None
    except OSError as exc:
        raise ConfigError(f"{unreadable} ({exc.strerror or exc})") from None


DEMO_OPTIONS = tuple(inspect.signature(generate_rows).parameters)  # of input {demo: {...}}: the rows' generator's


def check_input(spec) -> None:
    """:class:`ConfigError` naming ``input`` unless ``spec`` is what the build reads
    (:func:`thdpack.offline.inputs.sources.read_source`): a path, glob or URI; a non-empty list of
    them; or ``{demo: {...}}`` (null, or a mapping of :data:`DEMO_OPTIONS`) for the bundled rows."""
    if spec is None:
        raise ConfigError("no input: give --input PATH or 'input:' in the config")
    if isinstance(spec, dict):
        if set(spec) != {"demo"}:
            raise ConfigError(f"input mapping must be {{demo: {{...}}}}, got keys {sorted(map(str, spec))}")
        demo = spec["demo"]
        if demo is not None and (not isinstance(demo, dict) or set(demo) - set(DEMO_OPTIONS)):
            raise ConfigError(f"input: demo options are {sorted(DEMO_OPTIONS)}, got {demo!r}")
        return
    if is_mixture(spec):
        for i, entry in enumerate(spec):
            _check_source_entry(entry, i)
        return
    specs = spec if isinstance(spec, list) else [spec]
    if not specs or not all(isinstance(s, str) for s in specs):
        raise ConfigError(f"input must be a path, a list of paths or {{demo: ...}}, got {spec!r}")


def is_mixture(spec) -> bool:
    """Whether input ``spec`` is a list of sources (mappings: a mixture) rather than of paths."""
    return isinstance(spec, list) and any(isinstance(s, dict) for s in spec)


def _check_source_entry(entry, i: int) -> None:
    """ConfigError naming mixture source ``i`` unless ``entry`` is a mapping of :data:`SOURCE_KEYS` with one of
    ``path`` / ``demo`` (checked as a single input is)."""
    if not isinstance(entry, dict):
        raise ConfigError(f"input source {i}: a mixture's input is a list of sources, each a mapping (path: ..., "
                          f"weight: ...); got {entry!r:.80}")
    try:
        name = _source_name(entry, i)
    except (KeyError, TypeError, IndexError):  # no usable path / demo: told below
        name = entry.get("name", i)
    unknown = [k for k in entry if k not in SOURCE_KEYS]
    if unknown:
        raise ConfigError(f"input source {name!r}: unknown key {unknown[0]!r}{_close_hint(str(unknown[0]), list(SOURCE_KEYS))}"
                          f"; a source takes {', '.join(SOURCE_KEYS)} (the other options are the build's)")
    if ("path" in entry) == ("demo" in entry):
        raise ConfigError(f"input source {name!r}: give one of path or demo")
    if "name" in entry and not (isinstance(entry["name"], str) and entry["name"]):
        raise ConfigError(f"input source {i}: name must be a non-empty string, got {entry['name']!r}")
    given = {"demo": entry["demo"]} if "demo" in entry else entry["path"]
    if isinstance(given, list) and any(isinstance(p, dict) for p in given):
        raise ConfigError(f"input source {name!r}: path must be a path or a list of paths, got {given!r:.80}")
    try:
        check_input(given)
    except ConfigError as exc:
        raise ConfigError(f"input source {name!r}: {exc}") from None


@dataclass(frozen=True)
class SourceConfig:
    """One source of a mixture (:meth:`BuildConfig.sources`): its name, the weight key it gives (``{}``: weight 1)
    and the build's options with its input and its own options (:data:`SOURCE_OPTIONS`) in place and no
    ``mixture_*`` option: the config of a build of this source alone."""

    name: str
    weights: dict
    config: "BuildConfig"


def _source_name(entry: dict, i: int) -> str:
    """A source's ``name``, else its first file's name up to the first dot, ``demo-KIND`` for demo rows."""
    if "name" in entry:
        return entry["name"]
    if "path" in entry:
        first = entry["path"][0] if isinstance(entry["path"], list) else entry["path"]
        return Path(str(first).rstrip("/")).name.split(".")[0] or f"source{i}"
    if not isinstance(entry["demo"], (dict, type(None))):
        raise TypeError("demo is not a mapping")
    return f"demo-{(entry['demo'] or {}).get('kind', 'chat')}"


def _source_identity(cfg: "BuildConfig") -> str:
    """What makes two sources the same data: the demo options, or the resolved paths."""
    spec = cfg.source.input
    if isinstance(spec, dict):
        return repr(sorted((spec["demo"] or {}).items()))
    paths = spec if isinstance(spec, list) else [spec]
    return repr(sorted(p if is_uri(p) else str(cfg.resolve_path(p).resolve()) for p in paths))

