"""The build's options, one frozen dataclass per stage: what reading, tokenizing, planning, writing, the
VLM set-up, Ray and the blend of a mixture each read.

Each option is one field, stated once: its type hint (``int``, ``bool``, ``float``, ``str``, ``X | None``,
``Any``), default, choices and range (:func:`opt`); its ``help`` is the ``thdpack build`` flag's help.
:class:`~thdpack.offline.config.BuildConfig` holds one of each (its sections) and reads YAML, flags and
keywords into them; :meth:`thdpack.offline.stages.BuildStages.from_config` fills each section's *derived*
fields (:func:`derived`: paths resolved, files read, another section's value a stage also reads) once, and
hands each stage its section. Each is plain values, so it pickles to a worker process or machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thdpack.batching.shared_prefix import DEFAULT_MIN_PREFIX_LEN
from thdpack.offline.errors import ConfigError
from thdpack.planning.mixture import STOPPING, WEIGHT_BY
from thdpack.planning.options import ALGORITHMS, PlanOptions
from thdpack.planning.packing import OVERFLOW_POLICIES

# "auto", then the row formats, one class each in thdpack/offline/tokenizing/row_formats.py (register_format
# refuses a class whose name is not here); docs/build.md, "Row formats"
FORMATS: list[str] = ["auto", "chat", "sharegpt", "prompt_completion", "preference", "text", "tokenized"]
LOSS_MODES = ("assistant", "last_assistant", "all")
TARGETS = ("loss_mask", "labels")  # the target column a build writes; store/schema.py and store/dataset.py read it here
OUTPUT_FORMATS = ("arrow", "parquet", "megatron-bridge")
TOKENIZER_BACKENDS = ("auto", "tiktoken", "hf")
WITHOUT_TARGETS = ("drop", "keep")  # samples left with no target token (docs/build.md, "Samples without targets")
MIXTURE_PACKING = ("bfd", "stratified")


def opt(default, help: str, choices=None, *, minimum: int = 1, accepts: tuple | None = None, flag_type=None,
        many: bool = False):
    """An option field. Its type hint says what it holds (``bool``, ``int``, ``float``, ``str``, ``X | None``:
    may be null, ``Any``: see ``accepts``); ``minimum`` is an ``int`` field's least value, ``accepts`` an
    ``Any`` field's ``((types...), "what it must be")``, ``flag_type`` what an ``Any`` field's flag parses
    as, ``many`` a flag that takes several values."""
    return field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum,
                                            "accepts": accepts, "flag_type": flag_type, "many": many})


def derived(what: str):
    """A field that is not an option: filled once by ``BuildStages.from_config`` (None until then)."""
    return field(default=None, metadata={"derived": what})


def resolve_path(base_dir: Path, value: str) -> Path:
    """``value`` as a path: absolute, or relative to ``base_dir``."""
    p = Path(value).expanduser()
    return p if p.is_absolute() else base_dir / p


@dataclass(frozen=True)
class SourceOptions:
    """Reading the rows (:func:`thdpack.offline.inputs.sources.read_source`); YAML section ``source:``."""

    input: Any = opt(
        None,
        "input file(s): .jsonl/.jsonl.gz/.json, .parquet, .arrow, a directory saved with "
        "datasets' save_to_disk, a directory or glob of such files; in YAML also a list, "
        "or {demo: {num_samples, seed, kind}} for the bundled synthetic rows, or a list of sources (a mixture: "
        "each a mapping of path or demo, name, one of weight / epochs / max_samples, and its own format, loss, "
        "chat_template, ...; docs/build.md, Mixtures)",
        flag_type=str, many=True,
    )
    split: str | None = opt(None, "split to read from a saved DatasetDict (default: 'train' if present)")
    max_rows: int | None = opt(None, "read only the first N rows (quick trials)")
    base_dir: Path | None = derived("the directory relative input paths are resolved against")

    def resolve_path(self, value: str) -> Path:
        """``value`` as a path: absolute, or relative to :attr:`base_dir`."""
        return resolve_path(self.base_dir, value)


@dataclass(frozen=True)
class TokenizeOptions:
    """Tokenizing the rows (:mod:`thdpack.offline.tokenizing`); YAML section ``tokenize:``."""

    format: str = opt("auto", "row format: chat (messages), sharegpt (conversations of from/value turns), "
                       "prompt_completion (prompt + completion, TRL's; the completion is trained), preference (prompt + chosen "
                       "+ rejected, TRL's DPO rows: two sequences kept in one pack), text, tokenized "
                       "(input_ids [+labels|loss_mask]); auto picks from the fields present (docs/build.md, Row formats)",
                       FORMATS)
    text_field: str = opt("text", "field holding the text of a text row")
    messages_field: str = opt("messages", "field holding the messages of a chat row")
    loss: str = opt("assistant", "chat and sharegpt rows: which tokens are trained on; prompt_completion rows: "
                     "the completion's, or every token with all", LOSS_MODES)
    append_eos: bool = opt(True, "text rows and string prompt_completion rows: append the tokenizer's EOS token "
                            "(to every row / completion)")
    tokenizer: str | None = opt(
        None, "tokenizer: a local directory or a name in the local Hugging Face cache (never downloaded)"
    )
    chat_template: str | None = opt(
        None, "chat rows: a Jinja chat template file used instead of the tokenizer's (e.g. one with "
        "{% generation %} markers around the assistant turns); recorded in the tokenizer fingerprint and saved copy"
    )
    tokenizer_backend: str = opt(
        "auto", "how text is encoded: tiktoken (byte-level BPE tokenizers whose merges it runs exactly, several "
        "times faster; every process checks rows against the tokenizer and falls back on any difference), hf "
        "(the tokenizer itself), auto (tiktoken when the tokenizer converts, else hf). Never changes the output",
        TOKENIZER_BACKENDS,
    )
    targets: str = opt("loss_mask", "what the packs store besides token ids: loss_mask (1 bit/token; labels "
                        "are the ids) or labels (int32, for labels that are not the ids)", TARGETS)
    sample_values: Any = opt(
        None, "columns holding a number per row (a reward, a domain id, ...) written with each sample of the packs "
        "and returned as batch.sample_values[name] (docs/build.md, Preference pairs and per-sample values); "
        "as a flag, comma-separated", flag_type=str,
    )
    group_column: str | None = opt(
        None, "column holding a group id per row (e.g. a GRPO prompt id): the rows of a group are planned into one "
        "pack (a group over pack_size is a row error); overflow must be error"
    )
    num_proc: int = opt(1, "processes for parsing and tokenization (datasets.map)")
    map_batch_size: int = opt(1000, "rows per tokenization batch")
    tokenizer_path: Path | None = derived("tokenizer resolved against the config's directory (may not exist: "
                                          "then a cache name)")
    chat_template_text: str | None = derived("the chat_template file's text, read and checked once")
    recorded: Any = derived("the options metadata.json records (part of the tokenized rows' fingerprint)")

    @property
    def value_columns(self) -> tuple[str, ...]:
        """``sample_values`` as column names (a flag's comma-separated string split); () when not set.
        ConfigError for anything but distinct non-empty names."""
        value = self.sample_values
        if value is None:
            return ()
        names = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        if not isinstance(names, list) or not names or not all(isinstance(v, str) and v for v in names):
            raise ConfigError(f"sample_values must be a list of column names (e.g. [reward, domain]), got {value!r}")
        if len(set(names)) != len(names):
            raise ConfigError(f"sample_values names a column twice: {names}")
        return tuple(names)

    def extra_columns(self) -> list[str]:
        """The input columns read besides the format's: the ``sample_values`` and the ``group_column``."""
        return list(self.value_columns) + ([self.group_column] if self.group_column else [])


@dataclass(frozen=True)
class PlanningOptions:
    """Planning the samples into packs (:mod:`thdpack.offline.commands.sample_plan`); YAML section ``planning:``."""

    pack_size: int = opt(4096, "token budget of a pack (after per-sample alignment padding)")
    algorithm: str = opt("bfd", "packing algorithm", ALGORITHMS)
    overflow: str = opt("error", "samples longer than a pack: error, truncate, split or drop", OVERFLOW_POLICIES)
    without_targets: str = opt(
        "drop", "samples with no target token in what overflow keeps of them (e.g. a conversation whose answers "
        "truncation cuts off): drop them before planning and count them, or keep them (their packs train "
        "nothing; a mean loss over such a pack is NaN)", WITHOUT_TARGETS,
    )
    max_samples_per_pack: int | None = opt(None, "cap on samples per pack")
    share_prefix: bool = opt(
        False, "preference rows or group_column: lay each group's common token prefix (a pair's or a group's prompt) "
        "out once; the plan counts it once against pack_size, and the loaded packs are shared-prefix batches "
        "(docs/build.md, Shared prefixes)"
    )
    min_prefix_len: int | None = opt(
        None, f"share_prefix: the shortest prefix shared, in tokens (default {DEFAULT_MIN_PREFIX_LEN})")
    seed: int = opt(0, "seed of first_fit_shuffle and of the pack order", minimum=0)
    cp_size: int = opt(1, "plan for context parallelism of this size (samples padded to 2*cp)")
    tp_size: int = opt(1, "tensor parallel size (matters with sequence_parallel)")
    sequence_parallel: bool = opt(False, "sequence parallelism: pad samples to a multiple of tp*cp too")
    pad_multiple: int | None = opt(None, "extra per-sample multiple, e.g. 16 for FP8 (lcm with the above)")
    skip_bad_rows: bool = opt(False, "skip rows that fail (bad JSON, missing field, too long under "
                               "overflow=error, ...) and report them, instead of stopping")
    targets: str | None = derived("tokenize.targets: the target column counted per piece")
    group_column: str | None = derived("tokenize.group_column: its groups are planned into one pack")

    @property
    def align(self) -> int:
        """The per-sample alignment multiple the plan and the loader use."""
        from thdpack.common.align import resolve_pad_multiple

        try:
            return resolve_pad_multiple(self.cp_size, self.tp_size, self.sequence_parallel, self.pad_multiple)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    @property
    def plan(self) -> PlanOptions:
        """The planner's options: pack_size, algorithm, align, overflow, max_samples_per_pack and seed."""
        return PlanOptions(self.pack_size, algorithm=self.algorithm, align=self.align, overflow=self.overflow,
                           max_samples_per_pack=self.max_samples_per_pack, seed=self.seed)

    @property
    def min_prefix(self) -> int:
        """The shortest prefix shared: ``min_prefix_len``, else :data:`DEFAULT_MIN_PREFIX_LEN`."""
        return DEFAULT_MIN_PREFIX_LEN if self.min_prefix_len is None else self.min_prefix_len


@dataclass(frozen=True)
class StoreOptions:
    """Writing the packs (:mod:`thdpack.offline.store.writer`, :mod:`thdpack.offline.commands.bridge_export`);
    YAML section ``store:``. The target column, pack size, alignment and seed are the plan's."""

    shuffle_packs: bool = opt(True, "write packs in a seeded random order (else in plan order, longest first)")
    output_format: str = opt(
        "arrow", "data file format: arrow (memory-mapped, zero-copy loading), parquet, or megatron-bridge (arrow files "
        "plus Megatron-Bridge's packed Parquet files *.idx.parquet and bridge_metadata.json, pre-padded for "
        "pad_seq_to_mult = the alignment multiple; docs/megatron.md)", OUTPUT_FORMATS)
    file_size_mb: float = opt(512, "approximate size of an output data file in MB")
    save_tokenizer: bool = opt(True, "save a copy of the tokenizer in the output (for inspect and training)")


@dataclass(frozen=True)
class VisionOptions:
    """The VLM set-up and media (:mod:`thdpack.offline.vision`); YAML section ``vision:``. A text build
    ignores them."""

    image_processor: Any = opt(
        None, "VLM rows: a local image processor directory (preprocessor_config.json); in YAML also a mapping of "
        "keyword arguments for the family's image processor (patch/merge sizes default to model_config's)",
        accepts=((str, dict), "a path or a mapping"), flag_type=str,
    )
    images_field: str = opt("images", "VLM rows: field holding each row's list of image paths")
    image_placeholder: str = opt("<image>", "VLM rows: marker in the text where each image goes, in order")
    image_dir: str | None = opt(None, "VLM rows: directory relative image paths are resolved against "
                                 "(default: the directory of the row's input file)")
    vision_budget: int | None = opt(None, "VLM rows: most vision patches in a pack (a second planning budget)")
    videos_field: str = opt("videos", "VLM rows: field holding each row's list of video paths")
    video_placeholder: str = opt("<video>", "VLM rows: marker in the text where each video goes, in order")
    video: Any = opt(
        None, "VLM rows with videos (YAML mapping): frame sampling and size as qwen-vl-utils does it: fps (2.0), "
        "min_frames (4), max_frames (768), min_pixels / max_pixels per frame and total_pixels per video "
        "(default 128 / 768 / 115200 tokens of (patch*merge)^2 pixels); on the command line as YAML: '{fps: 1}'",
        accepts=((dict, str), "a mapping of frame options (fps, min_frames, ...)"), flag_type=str,
    )
    audio_processor: str | None = opt(None, "omni rows with audio: a local processor directory whose "
                                      "preprocessor_config.json is the model's WhisperFeatureExtractor")
    audios_field: str | None = opt(None, "omni rows: field holding each row's list of audio paths (default audios)")
    audio_placeholder: str | None = opt(None, "omni rows: marker in the text where each audio clip goes, in order "
                                        "(default <audio>)")
    max_audio_seconds: float | None = opt(None, "omni rows: longest audio clip (seconds; default and at most the "
                                          "feature extractor's chunk_length, 30); a longer one fails its row")
    audio_budget: int | None = opt(None, "omni rows: most audio feature frames in a pack (a third planning budget; "
                                   "default unbounded)", minimum=1)

    image_processor_path: Path | None = derived("a directory image_processor resolved against the config's directory")
    image_dir_path: Path | None = derived("image_dir resolved against the config's directory")
    messages_field: str | None = derived("tokenize.messages_field: a chat row's messages (their media parts)")
    overflow: str | None = derived("planning.overflow (truncate cuts videos over the vision budget)")
    base_dir: Path | None = derived("the directory relative input file paths are resolved against")

    def resolve_path(self, value: str) -> Path:
        """``value`` as a path: absolute, or relative to :attr:`base_dir`."""
        return resolve_path(self.base_dir, value)


@dataclass(frozen=True)
class RayOptions:
    """The ``ray:`` section: where an ``engine: ray`` build runs (:mod:`thdpack.offline.cluster.ray_session`).
    From Python: ``cfg.override(engine="ray", ray=RayOptions(address="auto"))``; a flag or old flat
    YAML key ``ray_KEY`` sets ``KEY``."""

    address: str | None = opt(None, "engine ray: the cluster to join (auto, HOST:PORT or ray://HOST:PORT; default "
                               "RAY_ADDRESS, else a local Ray instance started and stopped by the build); in YAML "
                               "also ray: {address: ...}")
    num_cpus: int | None = opt(None, "engine ray, local instance: its CPUs (default: every CPU of this machine)")
    cpus_per_actor: float = opt(1.0, "engine ray: CPUs each tokenizing actor and each pack-writing task reserves")
    concurrency: int | None = opt(None, "engine ray: tokenizing actors (default: the cluster's CPUs / "
                                   "ray_cpus_per_actor)")
    object_store_mb: int | None = opt(None, "engine ray, local instance: object store size in MB (default: Ray's)")
    spill_dir: str | None = opt(None, "engine ray, local instance: directory objects spill to when the object "
                                 "store is full (default: Ray's session directory)")
    max_retries: int = opt(2, "engine ray: times a piece of work (a part of the rows tokenized, a data file "
                            "written, ...) is run again when its worker dies; once more stops the build with a "
                            "line naming the input rows or file it was working on", minimum=0)


@dataclass(frozen=True)
class MixtureOptions:
    """The ``mixture:`` section: how the sources of ``input`` (a list of sources) are blended and planned
    (:mod:`thdpack.offline.commands.mixture_build`); None: not given (the default in brackets). A flag or old
    flat YAML key ``mixture_KEY`` sets ``KEY``."""

    weight_by: str | None = opt(None, "mixture (input: a list of sources): what a source's weight is a share "
                                 "of: samples (default) or tokens; in YAML also mixture: {weight_by: ...}",
                                 WEIGHT_BY)
    stopping: str | None = opt(None, "mixture without mixture_size: first_exhausted (default: the weighted "
                                "source that runs out first is used once) or all_exhausted (the last one)",
                                STOPPING)
    size: int | None = opt(None, "mixture: the weighted sources' part of the blend, in samples (or tokens "
                            "with weight_by tokens); default from mixture_stopping")
    packing: str | None = opt(None, "mixture: bfd (default: one best-fit plan over the blend) or stratified "
                               "(every step of mixture_step_packs packs close to the blend)", MIXTURE_PACKING)
    step_packs: int | None = opt(None, "mixture_packing stratified: packs per step (default 1)")

    def filled(self) -> "MixtureOptions":
        """These options with the defaults in place of None (what the blend uses)."""
        return MixtureOptions(self.weight_by or "samples", self.stopping or "first_exhausted", self.size,
                              self.packing or "bfd", self.step_packs or 1)
