"""The build configuration: one dataclass, read from YAML and overridden by flags.

Every field is a YAML key and a ``thdpack build`` flag (``pack_size`` ->
``--pack-size``); the field's ``help`` is the flag's help. Relative paths in a
YAML file (``input``, ``tokenizer``) are relative to the file's directory;
relative paths given as flags are relative to the working directory.

Each option is stated once, as a field: its type hint (``int``, ``bool``, ``float``, ``str``,
``X | None``, ``Any``), default, choices and range (:func:`_opt`). :func:`options` reads them off the
fields; :meth:`BuildConfig.validate` checks every option by that rule and ``thdpack.cli.config_flags``
makes every flag from it.

Hand-written, not pydantic (installed) nor HfArgumentParser: both keep none of the tested ConfigError
messages and neither gives "flag not given = the YAML value stays"; each would add code, not remove it.
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

from thdpack.batching.shared_prefix import DEFAULT_MIN_PREFIX_LEN
from thdpack.common.align import check_bool, check_int, check_number
from thdpack.demo import generate_rows
from thdpack.offline.errors import ConfigError
from thdpack.planning.mixture import STOPPING, WEIGHT_BY, WEIGHT_KEYS
from thdpack.planning.packing import OVERFLOW_POLICIES
from thdpack.planning.options import ALGORITHMS

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


def is_uri(spec: str) -> bool:
    """Whether input ``spec`` is a filesystem URI (``PROTOCOL://...``, read with fsspec) rather than a path."""
    return bool(_URI.match(spec))

# "auto", then the row formats, one class each in thdpack/offline/tokenizing/row_formats.py (register_format
# refuses a class whose name is not here); docs/build.md, "Row formats"
FORMATS: list[str] = ["auto", "chat", "sharegpt", "prompt_completion", "preference", "text", "tokenized"]
LOSS_MODES = ("assistant", "last_assistant", "all")
TARGETS = ("loss_mask", "labels")  # the target column a build writes; store/schema.py and store/dataset.py read it here
OUTPUT_FORMATS = ("arrow", "parquet", "megatron-bridge")
TOKENIZER_BACKENDS = ("auto", "tiktoken", "hf")
WITHOUT_TARGETS = ("drop", "keep")  # samples left with no target token (docs/build.md, "Samples without targets")
ENGINES = ("local", "ray")  # where a build tokenizes and writes (docs/distributed.md)
RAY_KEYS = ("address", "num_cpus", "cpus_per_actor", "concurrency", "object_store_mb", "spill_dir",
            "max_retries")  # RayOptions' fields (YAML ray: section)
MIXTURE_KEYS = ("weight_by", "stopping", "size", "packing", "step_packs")  # MixtureOptions' (mixture:; docs/build.md)
_SECTIONS = ("mixture", "ray")  # BuildConfig's section fields
_SECTION_OPTIONS = tuple(f"{n}_{k}" for n, keys in (("mixture", MIXTURE_KEYS), ("ray", RAY_KEYS)) for k in keys)
MIXTURE_PACKING = ("bfd", "stratified")
# a mixture source's own options (input: a list of sources); the other options are the build's, one for all
SOURCE_OPTIONS = ("format", "loss", "chat_template", "text_field", "messages_field", "append_eos", "split", "max_rows")
SOURCE_KEYS = ("path", "demo", "name", *WEIGHT_KEYS, *SOURCE_OPTIONS)
EXECUTION_ONLY = ("num_proc", "map_batch_size", "tokenizer_backend", "engine",
                  *(f"ray_{k}" for k in RAY_KEYS))  # options that never change the output
# recorded in metadata.json only when given (None / false: older builds stay byte-identical)
RECORDED_IF_SET = ("sample_values", "group_column", "share_prefix", "min_prefix_len",
                   *(f"mixture_{k}" for k in MIXTURE_KEYS))


def _opt(default, help: str, choices=None, *, minimum: int = 1, accepts: tuple | None = None, flag_type=None,
         many: bool = False):
    """A :class:`BuildConfig` field. Its type hint says what it holds (``bool``, ``int``, ``float``,
    ``str``, ``X | None``: may be null, ``Any``: see ``accepts``); ``minimum`` is an ``int`` field's
    least value, ``accepts`` an ``Any`` field's ``((types...), "what it must be")``, ``flag_type``
    what an ``Any`` field's flag parses as, ``many`` a flag that takes several values."""
    return field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum,
                                            "accepts": accepts, "flag_type": flag_type, "many": many})


@dataclass(frozen=True)
class RayOptions:
    """The ``ray:`` section: where an ``engine: ray`` build runs (:mod:`thdpack.offline.cluster.ray_session`).
    From Python: ``build_packed(cfg, out, engine="ray", ray=RayOptions(address="auto"))``; a flag or old flat
    YAML key ``ray_KEY`` sets ``KEY``."""

    address: str | None = _opt(None, "engine ray: the cluster to join (auto, HOST:PORT or ray://HOST:PORT; default "
                               "RAY_ADDRESS, else a local Ray instance started and stopped by the build); in YAML "
                               "also ray: {address: ...}")
    num_cpus: int | None = _opt(None, "engine ray, local instance: its CPUs (default: every CPU of this machine)")
    cpus_per_actor: float = _opt(1.0, "engine ray: CPUs each tokenizing actor and each pack-writing task reserves")
    concurrency: int | None = _opt(None, "engine ray: tokenizing actors (default: the cluster's CPUs / "
                                   "ray_cpus_per_actor)")
    object_store_mb: int | None = _opt(None, "engine ray, local instance: object store size in MB (default: Ray's)")
    spill_dir: str | None = _opt(None, "engine ray, local instance: directory objects spill to when the object "
                                 "store is full (default: Ray's session directory)")
    max_retries: int = _opt(2, "engine ray: times a piece of work (a part of the rows tokenized, a data file "
                            "written, ...) is run again when its worker dies; once more stops the build with a "
                            "line naming the input rows or file it was working on", minimum=0)


@dataclass(frozen=True)
class MixtureOptions:
    """The ``mixture:`` section: how the sources of ``input`` (a list of sources) are blended and planned
    (:mod:`thdpack.offline.commands.mixture_build`); None: not given (the default in brackets). A flag or old
    flat YAML key ``mixture_KEY`` sets ``KEY``."""

    weight_by: str | None = _opt(None, "mixture (input: a list of sources): what a source's weight is a share "
                                 "of: samples (default) or tokens; in YAML also mixture: {weight_by: ...}",
                                 WEIGHT_BY)
    stopping: str | None = _opt(None, "mixture without mixture_size: first_exhausted (default: the weighted "
                                "source that runs out first is used once) or all_exhausted (the last one)",
                                STOPPING)
    size: int | None = _opt(None, "mixture: the weighted sources' part of the blend, in samples (or tokens "
                            "with weight_by tokens); default from mixture_stopping")
    packing: str | None = _opt(None, "mixture: bfd (default: one best-fit plan over the blend) or stratified "
                               "(every step of mixture_step_packs packs close to the blend)", MIXTURE_PACKING)
    step_packs: int | None = _opt(None, "mixture_packing stratified: packs per step (default 1)")


def _section(cls, help: str):
    """A :class:`BuildConfig` field holding a section (``ray:``, ``mixture:``): a frozen dataclass of
    :func:`_opt` fields, named ``NAME_KEY`` as options and flags."""
    return field(default_factory=cls, metadata={"help": help, "section": cls})


@dataclass
class BuildConfig:
    """What ``thdpack build`` reads, how it tokenizes, plans and writes."""

    # ---- input
    input: Any = _opt(
        None,
        "input file(s): .jsonl/.jsonl.gz/.json, .parquet, .arrow, a directory saved with "
        "datasets' save_to_disk, a directory or glob of such files; in YAML also a list, "
        "or {demo: {num_samples, seed, kind}} for the bundled synthetic rows, or a list of sources (a mixture: "
        "each a mapping of path or demo, name, one of weight / epochs / max_samples, and its own format, loss, "
        "chat_template, ...; docs/build.md, Mixtures)",
        flag_type=str, many=True,
    )
    mixture: MixtureOptions = _section(MixtureOptions, "input as a list of sources: the blend (docs/build.md, Mixtures)")
    split: str | None = _opt(None, "split to read from a saved DatasetDict (default: 'train' if present)")
    max_rows: int | None = _opt(None, "read only the first N rows (quick trials)")
    format: str = _opt("auto", "row format: chat (messages), sharegpt (conversations of from/value turns), "
                       "prompt_completion (prompt + completion, TRL's; the completion is trained), preference (prompt + chosen "
                       "+ rejected, TRL's DPO rows: two sequences kept in one pack), text, tokenized "
                       "(input_ids [+labels|loss_mask]); auto picks from the fields present (docs/build.md, Row formats)",
                       FORMATS)
    text_field: str = _opt("text", "field holding the text of a text row")
    messages_field: str = _opt("messages", "field holding the messages of a chat row")
    loss: str = _opt("assistant", "chat and sharegpt rows: which tokens are trained on; prompt_completion rows: "
                     "the completion's, or every token with all", LOSS_MODES)
    append_eos: bool = _opt(True, "text rows and string prompt_completion rows: append the tokenizer's EOS token "
                            "(to every row / completion)")
    # ---- tokenizer
    tokenizer: str | None = _opt(
        None, "tokenizer: a local directory or a name in the local Hugging Face cache (never downloaded)"
    )
    chat_template: str | None = _opt(
        None, "chat rows: a Jinja chat template file used instead of the tokenizer's (e.g. one with "
        "{% generation %} markers around the assistant turns); recorded in the tokenizer fingerprint and saved copy"
    )
    tokenizer_backend: str = _opt(
        "auto", "how text is encoded: tiktoken (byte-level BPE tokenizers whose merges it runs exactly, several "
        "times faster; every process checks rows against the tokenizer and falls back on any difference), hf "
        "(the tokenizer itself), auto (tiktoken when the tokenizer converts, else hf). Never changes the output",
        TOKENIZER_BACKENDS,
    )
    targets: str = _opt("loss_mask", "what the packs store besides token ids: loss_mask (1 bit/token; labels "
                        "are the ids) or labels (int32, for labels that are not the ids)", TARGETS)
    # ---- planning
    pack_size: int = _opt(4096, "token budget of a pack (after per-sample alignment padding)")
    algorithm: str = _opt("bfd", "packing algorithm", ALGORITHMS)
    overflow: str = _opt("error", "samples longer than a pack: error, truncate, split or drop", OVERFLOW_POLICIES)
    without_targets: str = _opt(
        "drop", "samples with no target token in what overflow keeps of them (e.g. a conversation whose answers "
        "truncation cuts off): drop them before planning and count them, or keep them (their packs train "
        "nothing; a mean loss over such a pack is NaN)", WITHOUT_TARGETS,
    )
    max_samples_per_pack: int | None = _opt(None, "cap on samples per pack")
    sample_values: Any = _opt(
        None, "columns holding a number per row (a reward, a domain id, ...) written with each sample of the packs "
        "and returned as batch.sample_values[name] (docs/build.md, Preference pairs and per-sample values); "
        "as a flag, comma-separated", flag_type=str,
    )
    group_column: str | None = _opt(
        None, "column holding a group id per row (e.g. a GRPO prompt id): the rows of a group are planned into one "
        "pack (a group over pack_size is a row error); overflow must be error"
    )
    share_prefix: bool = _opt(
        False, "preference rows or group_column: lay each group's common token prefix (a pair's or a group's prompt) "
        "out once; the plan counts it once against pack_size, and the loaded packs are shared-prefix batches "
        "(docs/build.md, Shared prefixes)"
    )
    min_prefix_len: int | None = _opt(
        None, f"share_prefix: the shortest prefix shared, in tokens (default {DEFAULT_MIN_PREFIX_LEN})")
    seed: int = _opt(0, "seed of first_fit_shuffle and of the pack order", minimum=0)
    shuffle_packs: bool = _opt(True, "write packs in a seeded random order (else in plan order, longest first)")
    cp_size: int = _opt(1, "plan for context parallelism of this size (samples padded to 2*cp)")
    tp_size: int = _opt(1, "tensor parallel size (matters with sequence_parallel)")
    sequence_parallel: bool = _opt(False, "sequence parallelism: pad samples to a multiple of tp*cp too")
    pad_multiple: int | None = _opt(None, "extra per-sample multiple, e.g. 16 for FP8 (lcm with the above)")
    # ---- output and execution
    output_format: str = _opt(
        "arrow", "data file format: arrow (memory-mapped, zero-copy loading), parquet, or megatron-bridge (arrow files "
        "plus Megatron-Bridge's packed Parquet files *.idx.parquet and bridge_metadata.json, pre-padded for "
        "pad_seq_to_mult = the alignment multiple; docs/megatron.md)", OUTPUT_FORMATS)
    file_size_mb: float = _opt(512, "approximate size of an output data file in MB")
    num_proc: int = _opt(1, "processes for parsing and tokenization (datasets.map)")
    map_batch_size: int = _opt(1000, "rows per tokenization batch")
    engine: str = _opt("local", "where the build tokenizes and writes: local (this machine, num_proc processes) or ray "
                       "(a Ray cluster, or a local Ray instance; the same output byte for byte; docs/distributed.md)",
                       ENGINES)
    ray: RayOptions = _section(RayOptions, "engine ray: the cluster (docs/distributed.md)")
    skip_bad_rows: bool = _opt(False, "skip rows that fail (bad JSON, missing field, too long under "
                               "overflow=error, ...) and report them, instead of stopping")
    save_tokenizer: bool = _opt(True, "save a copy of the tokenizer in the output (for inspect and training)")
    # ---- model: FLOPs report, VLM rows (thdpack/offline/commands/model_record.py, thdpack/offline/vision/vlm_setup.py)
    model_config: Any = _opt(
        None, "model config: a config.json or a directory holding one (in YAML also a mapping). Adds the "
        "whole-model FLOPs over-count to the stats; a Qwen-VL family config also builds rows with images",
        accepts=((str, dict), "a path or a mapping"), flag_type=str,
    )
    image_processor: Any = _opt(
        None, "VLM rows: a local image processor directory (preprocessor_config.json); in YAML also a mapping of "
        "keyword arguments for the family's image processor (patch/merge sizes default to model_config's)",
        accepts=((str, dict), "a path or a mapping"), flag_type=str,
    )
    images_field: str = _opt("images", "VLM rows: field holding each row's list of image paths")
    image_placeholder: str = _opt("<image>", "VLM rows: marker in the text where each image goes, in order")
    image_dir: str | None = _opt(None, "VLM rows: directory relative image paths are resolved against "
                                 "(default: the directory of the row's input file)")
    vision_budget: int | None = _opt(None, "VLM rows: most vision patches in a pack (a second planning budget)")
    videos_field: str = _opt("videos", "VLM rows: field holding each row's list of video paths")
    video_placeholder: str = _opt("<video>", "VLM rows: marker in the text where each video goes, in order")
    video: Any = _opt(
        None, "VLM rows with videos (YAML mapping): frame sampling and size as qwen-vl-utils does it: fps (2.0), "
        "min_frames (4), max_frames (768), min_pixels / max_pixels per frame and total_pixels per video "
        "(default 128 / 768 / 115200 tokens of (patch*merge)^2 pixels); on the command line as YAML: '{fps: 1}'",
        accepts=((dict, str), "a mapping of frame options (fps, min_frames, ...)"), flag_type=str,
    )

    # where relative paths in the YAML file are resolved (not a config key)
    base_dir: Path = field(default_factory=Path.cwd, repr=False, compare=False, metadata={"internal": True})

    # ------------------------------------------------------------------ construction
    @classmethod
    def keys(cls) -> list[str]:
        """The option names (YAML keys and flags; a section's as ``NAME_KEY``)."""
        return [o.name for o in options()]

    @classmethod
    def from_dict(cls, data: dict, *, base_dir: Path | None = None, origin: str = "config") -> "BuildConfig":
        """The config of the YAML mapping ``data``: options, ``ray:`` / ``mixture:`` sections, or their options
        as flat ``NAME_KEY`` keys (one of the two per key)."""
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
        """A copy with ``changes`` applied (``None`` values are ignored): options by name (a section's as
        ``NAME_KEY``), or a section whole (``ray=RayOptions(...)``, or a mapping of some of its keys). Paths given
        here are relative to the working directory."""
        changes = {k: v for k, v in changes.items() if v is not None}
        unknown = [k for k in changes if k not in self.keys() and k not in _SECTIONS]
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
        """A copy with ``changes`` (option names; sections whole or as ``NAME_KEY`` options) applied: the one
        place a key finds its field. ``sections_given``: a YAML mapping (a key given both ways is refused)."""
        top, parts = {}, {}
        for key, value in changes.items():
            if key in _SECTIONS:
                parts[key] = _section_of(key, getattr(self, key), value, origin)
            elif key in _SECTION_OPTIONS:
                continue
            elif key not in self.keys():
                raise ConfigError(f"{origin}: unknown option '{key}'{_close_hint(key, self.keys())}; options: "
                                  f"{', '.join(self.keys())}")
            else:
                top[key] = value
        for name in _SECTIONS:
            flat = {o.key: changes[o.name] for o in options() if o.section == name and o.name in changes}
            both = [k for k in flat if name in changes and isinstance(changes[name], dict) and k in changes[name]]
            if both and sections_given:
                raise ConfigError(f"{origin}: {name}.{both[0]} and {name}_{both[0]} both given; keep one")
            if flat:
                parts[name] = dataclasses.replace(parts.get(name, getattr(self, name)), **flat)
        return dataclasses.replace(self, **top, **parts)

    # ------------------------------------------------------------------ checks
    def validate(self, *, need_tokenizer: bool | None = None) -> "BuildConfig":
        """Raise :class:`ConfigError` on the first invalid option; returns ``self``."""
        check_input(self.input)
        for option in options():
            option.check(self.value(option))
            if option.kind == "flag":  # a numpy bool read as the bool it is (metadata.json records it)
                setattr(self, option.name, bool(getattr(self, option.name)))
        self.value_columns()
        self._check_mixture()
        if need_tokenizer and not self.tokenizer:
            raise ConfigError(f"format '{self.format}' needs a tokenizer: give --tokenizer or 'tokenizer:' in the config")
        if self.pack_size < self.align:
            raise ConfigError(f"pack_size ({self.pack_size}) is smaller than the alignment multiple ({self.align})")
        self._check_share_prefix()
        return self

    def _check_mixture(self) -> None:
        """ConfigError for ``mixture_*`` options without a mixture, and for what a mixture does not take."""
        given = [f"mixture_{k}" for k, v in vars(self.mixture).items() if v is not None]
        if not is_mixture(self.input):
            if given:
                raise ConfigError(f"{given[0]} needs input as a list of sources (a mixture; docs/build.md, Mixtures)")
            return
        self.sources()
        if self.mixture.step_packs is not None and self.mixture.packing != "stratified":
            raise ConfigError("mixture_step_packs needs mixture_packing: stratified")

    def _check_share_prefix(self) -> None:
        """ConfigError for ``share_prefix`` where a build cannot share prefixes (``min_prefix_len`` without it:
        :meth:`thdpack.offline.stages.PlanningOptions.from_config`)."""
        if not self.share_prefix:
            return
        if self.group_column is None and self.format not in ("auto", "preference") and not is_mixture(self.input):
            raise ConfigError(f"share_prefix needs groups to share within: preference rows (prompt / chosen / "
                              f"rejected) or group_column, not format {self.format!r} rows without group_column")
        refused = {"cp_size": self.cp_size > 1, "output_format": self.output_format == "megatron-bridge"}
        for name, bad in refused.items():
            if bad:
                raise ConfigError(f"share_prefix cannot be used with {name} {getattr(self, name)!r}: context-parallel "
                                  "attention and Megatron-Bridge's THD kernels cannot express a shared-prefix tree; "
                                  "remove share_prefix")

    @property
    def align(self) -> int:
        """The per-sample alignment multiple the plan and the loader use."""
        from thdpack.common.align import resolve_pad_multiple

        try:
            return resolve_pad_multiple(self.cp_size, self.tp_size, self.sequence_parallel, self.pad_multiple)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    # ------------------------------------------------------------------ paths
    def resolve_path(self, value: str) -> Path:
        """``value`` as a path: absolute, or relative to ``base_dir``."""
        p = Path(value).expanduser()
        return p if p.is_absolute() else self.base_dir / p

    def as_dict(self, *, recorded: bool = False) -> dict:
        """The options, as written (paths unresolved). ``recorded=True`` leaves out the
        options that cannot change the output (``num_proc``, ``map_batch_size``, ``tokenizer_backend``): what
        metadata.json records, so a build is byte-identical however it was parallelised."""
        values = {o.name: self.value(o) for o in options()}
        return {k: v for k, v in values.items()
                if not (recorded and (k in EXECUTION_ONLY or (k in RECORDED_IF_SET and v in (None, False))))}

    def value(self, option: "Option"):
        """The value of ``option`` (a section's: its field's)."""
        return getattr(getattr(self, option.section), option.key) if option.section else getattr(self, option.name)

    def value_columns(self) -> list[str]:
        """``sample_values`` as a list of column names (a flag's comma-separated string split);
        [] when not set. ConfigError for anything but distinct non-empty names."""
        value = self.sample_values
        if value is None:
            return []
        names = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(v, str) and v for v in names):
            raise ConfigError(f"sample_values must be a list of column names (e.g. [reward, domain]), got {value!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"sample_values names a column twice: {names}")
        return names

    # ------------------------------------------------------------------ mixtures
    def sources(self) -> list[SourceConfig]:
        """The sources of a mixture (``input``: a list of source mappings), checked: one line naming the source for
        an unknown key or a bad option, a weight that is negative or NaN, every weight 0, two sources of one name
        or of the same files. ConfigError when ``input`` is not a mixture."""
        from thdpack.planning.mixture import check_mixture

        if not is_mixture(self.input):
            raise ConfigError("input is not a mixture (a list of sources, each a mapping)")
        check_input(self.input)
        by_option = {o.name: o for o in options()}
        out: list[SourceConfig] = []
        names: dict[str, int] = {}
        data: dict[str, str] = {}
        for i, entry in enumerate(self.input):
            name = _source_name(entry, i)
            own = {k: entry[k] for k in SOURCE_OPTIONS if k in entry}
            for key, value in own.items():
                try:
                    by_option[key].check(value)
                except ConfigError as exc:
                    raise ConfigError(f"input source {name!r}: {exc}") from None
            spec = {"demo": entry["demo"]} if "demo" in entry else entry["path"]
            cfg = dataclasses.replace(self, input=spec, **own, mixture=MixtureOptions())
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
        if not is_mixture(self.input) or len(self.input) != 1 or any(k in self.input[0] for k in WEIGHT_KEYS):
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
    section: str | None = None  # the section field holding it (ray, mixture), else None
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
    """The options of :class:`BuildConfig`, in field order (a section's in its place, named ``NAME_KEY``), each
    read off its type hint and ``_opt``."""
    out = []
    for f in dataclasses.fields(BuildConfig):
        section = f.metadata.get("section")
        if section is not None:
            out += [dataclasses.replace(o, name=f"{f.name}_{o.name}", section=f.name, key=o.name)
                    for o in _options_of(section)]
        elif not f.metadata.get("internal"):
            out.append(_options_of(BuildConfig, f.name)[0])
    return tuple(out)


def _options_of(cls, only: str | None = None) -> list[Option]:
    """The :class:`Option` of each :func:`_opt` field of ``cls`` (``only``: of that field)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if only is not None and f.name != only:
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
    spec = cfg.input
    if isinstance(spec, dict):
        return repr(sorted((spec["demo"] or {}).items()))
    paths = spec if isinstance(spec, list) else [spec]
    return repr(sorted(p if is_uri(p) else str(cfg.resolve_path(p).resolve()) for p in paths))

