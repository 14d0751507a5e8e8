"""The packed dataset on disk.

A directory of data files, one row per pack (docs/build.md, "On-disk format: the directory"); a row holds
its samples (or sample pieces) back to back:

=================  =================  =====================================================
column             Arrow type         meaning
=================  =================  =====================================================
``input_ids``      list<int32>        the pack's real tokens (no alignment padding)
``loss_mask``      list<bool>         1 = the token is a target (is predicted from the
                                      token before it, within its sample); or instead:
``labels``         list<int32>        HF-style unshifted labels, -100 = no loss
``seq_lens``       list<int32>        real length of each sample, in stream order
``sample_index``   list<int64>        input row of each sample
``sample_start``   list<int32>        first token of each piece within its input row
                                      (non-zero only for ``overflow="split"`` pieces)
``sample_values.   list<int64 |       with ``sample_values: [NAME, ...]`` only: the value of
NAME``             double>            column NAME of each sample's input row (its pieces too)
``group_id``       list<int64>        with ``share_prefix: true`` only: each sample's group (its pair's,
                                      its ``group_column`` value's), numbered within the build
``prefix_len``     list<int32>        with ``share_prefix: true`` only: the tokens the sample shares
                                      with its group (0: alone; a trie: docs/build.md); stored whole
``source_index``   list<int64>        mixture builds only (``input``: a list of sources): each sample's
                                      source, its position in ``input``; ``sample_index`` is then its
                                      row within that source
=================  =================  =====================================================

More (preference rows, padding, ``metadata.json``): docs/build.md, "On-disk format: details".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, TypedDict, get_origin, get_type_hints

import numpy as np

from thdpack.common.align import check_int, is_int
from thdpack.offline.stage_options import TARGETS  # the target columns a build writes: one of them
from thdpack.offline.errors import NotPackedError

FORMAT_NAME = "thdpack.packed"
FORMAT_VERSION = 1  # what text builds write
VLM_FORMAT_VERSION = 2  # VLM builds: + pixel_values, image_grid_thw, image_counts (thdpack/offline/vision/vlm_setup.py)
MAX_FORMAT_VERSION = 2  # what load_packed reads
METADATA_FILE = "metadata.json"
TOKENIZER_DIR = "tokenizer"
LIST_COLUMNS = ("input_ids", "loss_mask", "labels", "seq_lens", "sample_index", "sample_start")
SAMPLE_COLUMNS = ("seq_lens", "sample_index", "sample_start")  # one entry per sample of the pack
SAMPLE_VALUE_PREFIX = "sample_values."  # + NAME: a per-sample value column (``sample_values:``), one entry per sample
# the tokenized (not yet packed) columns of sample value ``name`` (``sample_values:``): its number (float64) and whether
# the row gave an integer (a value column is written as int64 when every kept row did)
VALUE_COLUMN = "__value__.{}"
VALUE_IS_INT_COLUMN = "__value_int__.{}"
GROUP_COLUMN = "__group__"  # the tokenized column of a row's ``group_column`` value, as JSON text
# share_prefix builds: each sample's group number (int64) and its group's shared prefix (int32, 0: unshared)
PREFIX_COLUMNS = ("group_id", "prefix_len")
SOURCE_COLUMN = "source_index"  # mixture builds: each sample's source (int64; its position in the config's input)
SUFFIX = {"arrow": ".arrow", "parquet": ".parquet"}
REBUILD = "rebuild the dataset, or restore the metadata.json its build wrote"


def data_file_name(i: int, n: int, file_format: str) -> str:
    """``data-00003-of-00008.arrow``: the name of data file ``i`` of ``n``."""
    return f"data-{i:05d}-of-{n:05d}{SUFFIX[file_format]}"


_DATA_FILE_NAME = re.compile(r"data-\d{5}-of-\d{5}\.(arrow|parquet)")


def looks_packed(path: Path) -> bool:
    """``path`` is a directory holding data files named as a build names them (:func:`data_file_name`)
    and no ``state.json`` (``datasets``' ``save_to_disk`` names its files alike and writes one): a packed
    dataset, or one whose ``metadata.json`` is missing."""
    try:
        names = {p.name for p in path.iterdir()} if path.is_dir() else set()
    except OSError:
        return False
    return "state.json" not in names and any(_DATA_FILE_NAME.fullmatch(n) for n in names)


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read 4 MiB at a time (the checksums ``metadata.json`` records)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def bytes_sha256(data) -> str:
    """Hex sha256 of ``data`` (bytes, a memory map, or text, hashed as UTF-8): the fingerprints of
    inputs, tokenizers and small files (:func:`file_sha256` for files of any size)."""
    return hashlib.sha256(data.encode() if isinstance(data, str) else data).hexdigest()


# ---------------------------------------------------------------------------- metadata.json rules


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one ``metadata.json`` value must be: ``what`` names it in the error, ``ok`` tests it;
    a key that is not ``required`` may be absent (readers then use their default)."""

    what: str
    ok: Callable[[object], bool]
    required: bool = True

    def or_null(self) -> Rule:
        return Rule(f"{self.what} or null", lambda v: v is None or self.ok(v), self.required)

    def optional(self) -> Rule:
        return dataclasses.replace(self, required=False)


def _one_of(*choices: str) -> Rule:
    return Rule(f"one of {', '.join(map(repr, choices))}", lambda v: isinstance(v, str) and v in choices)


def _value_types(v) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and k and t in ("int64", "float64") for k, t in v.items())


COUNT = Rule("an integer >= 0", lambda v: is_int(v, 0))  # the one integer rule: JSON true is not a count
POSITIVE = Rule("an integer >= 1", lambda v: is_int(v, 1))
FLAG = Rule("true or false", lambda v: isinstance(v, bool))
TEXT = Rule("a string", lambda v: isinstance(v, str))
OBJECT = Rule("an object", lambda v: isinstance(v, dict))
LIST = Rule("a list", lambda v: isinstance(v, list))
NAMES = Rule("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))
SHA256 = Rule("a sha256 (64 hex digits)", lambda v: isinstance(v, str) and re.fullmatch("[0-9a-f]{64}", v) is not None)
VALUE_TYPES = Rule('an object {name: "int64" or "float64"}', _value_types)
SHARE_PREFIX = Rule("an object with an integer 'min_prefix_len' >= 1",
                    lambda v: isinstance(v, dict) and is_int(v.get("min_prefix_len"), 1))
SHARE = Rule("a number in [0, 1]", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1)
SOME = Rule("a non-empty list", lambda v: isinstance(v, list) and len(v) > 0)


# ---------------------------------------------------------------------------- metadata.json types
# Each key's type says what build and merge write; an ``Annotated[..., Rule]`` key is one a reader
# uses (load_packed, its collator, thdpack stats / inspect), and its rule is what check_metadata
# enforces. The schemas below are derived from these types: a key is described once.


class Counts(TypedDict, total=False):
    """``counts``: what the build read, kept and cut (offline/commands/pack_stats.py)."""

    samples: Annotated[int, COUNT]
    pieces: Annotated[int, COUNT.optional()]
    tokens: Annotated[int, COUNT.optional()]
    target_tokens: Annotated[int, COUNT.optional()]


class SourceFile(TypedDict, total=False):
    """One input file of ``source.files``."""

    path: Annotated[str, TEXT]


class SourceInfo(TypedDict, total=False):
    """``source``: the input and its row format."""

    format: Annotated[str, TEXT]
    fingerprint: str  # of the input files and the options that read them (offline/inputs/sources.py)
    files: Annotated[list[SourceFile], LIST]


class TokenizerInfo(TypedDict, total=False):
    """``tokenizer``: what the collator and inspect need of the tokenizer (offline/tokenizing/tokenizer_loading.py)."""

    vocab_size: Annotated[int, POSITIVE.optional()]
    pad_token_id: Annotated[int | None, COUNT.or_null().optional()]
    name_or_path: Annotated[str | None, TEXT.or_null().optional()]


class DataFile(TypedDict, total=False):
    """One data file of ``files``."""

    path: Annotated[str, TEXT]
    num_packs: Annotated[int, COUNT]
    num_tokens: Annotated[int, COUNT]
    num_bytes: Annotated[int, COUNT]
    sha256: Annotated[str, SHA256]


class MixtureSourceInfo(TypedDict, total=False):
    """One source of ``mixture.sources``, in the config's order (offline/commands/mixture_build.py's report)."""

    name: Annotated[str, TEXT]
    source_index: int
    format: str
    given: dict
    rows_read: Annotated[int, COUNT]
    rows_failed: Annotated[int, COUNT]
    rows_too_long: Annotated[int, COUNT]
    rows_kept: Annotated[int, COUNT]
    unit: str
    units_kept: int
    blend_units: Annotated[int, COUNT]
    max_repeats: Annotated[int, COUNT]
    dropped_overflow: Annotated[int, COUNT]
    dropped_without_targets: Annotated[int, COUNT]
    packed_samples: Annotated[int, COUNT]
    tokens: Annotated[int, COUNT]
    target_tokens: int
    requested_share: Annotated[float, SHARE]
    realized_share: Annotated[float, SHARE]
    packed_share: Annotated[float, SHARE]


class MixtureInfo(TypedDict, total=False):
    """``mixture``: the blend's options and its sources (mixture builds only; ``source_index`` names them)."""

    weight_by: Annotated[str, TEXT]
    stopping: str
    size: int | None
    packing: Annotated[str, TEXT]
    step_packs: int
    samples: Annotated[int, COUNT]
    sources: Annotated[list[MixtureSourceInfo], SOME]


class PackedMetadata(TypedDict, total=False):
    """``metadata.json`` of a packed dataset, keys in the order build writes them (merge keeps it).
    What a reader may rely on are the ``Annotated`` keys: :data:`METADATA_SCHEMA`, checked by
    :func:`check_metadata`."""

    format: str  # FORMAT_NAME (checked first, with complete)
    format_version: Annotated[int, POSITIVE]
    complete: bool
    thdpack_version: str
    file_format: Annotated[str, _one_of(*SUFFIX)]  # arrow | parquet
    targets: Annotated[str, _one_of(*TARGETS)]  # loss_mask | labels
    columns: Annotated[list[str], NAMES]
    num_packs: Annotated[int, COUNT]
    pack_size: Annotated[int, POSITIVE]
    align: Annotated[int, POSITIVE]
    cp_size: Annotated[int, POSITIVE.optional()]
    tp_size: Annotated[int, POSITIVE.optional()]
    sequence_parallel: Annotated[bool, FLAG.optional()]
    pad_multiple: Annotated[int | None, POSITIVE.or_null().optional()]
    algorithm: str
    overflow: str
    without_targets: str
    max_samples_per_pack: int | None
    seed: int
    shuffle_packs: bool
    dataset_max_seqlen: int  # the NeMo / Megatron-Bridge fields (offline/summary.nemo_fields)
    max_samples_per_bin: int
    packing_factor: float
    packing_efficiency: float
    min_packed_seqlen: int
    counts: Annotated[Counts, OBJECT]
    source: Annotated[SourceInfo, OBJECT]
    tokenizer: Annotated[TokenizerInfo | None, OBJECT.or_null().optional()]
    model: dict | None
    files: Annotated[list[DataFile], LIST]
    stats: Annotated[dict, OBJECT.optional()]
    skipped_examples: list[dict]
    config: dict  # BuildConfig.as_dict(recorded=True)
    # sample_values builds only: {NAME: "int64" | "float64"}, each with a sample_values.NAME column
    sample_values: Annotated[dict[str, str], VALUE_TYPES.optional()]
    megatron_bridge: dict  # output_format megatron-bridge only (offline/commands/bridge_export.py)
    vision: Annotated[dict | None, OBJECT.or_null().optional()]  # VLM builds only (offline/store/vision_columns.py)
    # share_prefix builds only: {min_prefix_len, groups, samples, prefix_tokens, tokens_saved} (offline/commands/build_packs.py)
    share_prefix: Annotated[dict, SHARE_PREFIX.optional()]
    # mixture builds only: the blend and per-source counts (offline/commands/mixture_build.py), with a source_index column
    mixture: Annotated[MixtureInfo, OBJECT.optional()]
    input_slice: dict  # slice builds only (offline/inputs/input_slice.py)
    input_slices: dict  # merged builds only


def metadata_text(meta: PackedMetadata) -> str:
    """The text of ``metadata.json``: indented JSON, non-ASCII kept, one final newline."""
    return json.dumps(meta, indent=2, ensure_ascii=False) + "\n"


def schema_of(kind: type) -> dict[str, Rule]:
    """The rules of a metadata TypedDict: ``{key: Rule}`` for each ``Annotated[..., Rule]`` key, in order."""
    hints = get_type_hints(kind, include_extras=True)
    return {key: rule for key, hint in hints.items() if get_origin(hint) is Annotated
            for rule in hint.__metadata__ if isinstance(rule, Rule)}


METADATA_SCHEMA = schema_of(PackedMetadata)
COUNTS_SCHEMA = schema_of(Counts)
FILE_SCHEMA = schema_of(DataFile)
SOURCE_SCHEMA = schema_of(SourceInfo)
SOURCE_FILE_SCHEMA = schema_of(SourceFile)
TOKENIZER_SCHEMA = schema_of(TokenizerInfo)
MIXTURE_SCHEMA = schema_of(MixtureInfo)
MIXTURE_SOURCE_SCHEMA = schema_of(MixtureSourceInfo)


def _check_keys(obj, schema: dict, where: str, prefix: str = "") -> None:
    """:class:`NotPackedError` naming the first key of ``obj`` (a JSON object) that breaks ``schema``."""
    for key, rule in schema.items():
        name = f"{prefix}{key}"
        if key not in obj:
            if rule.required:
                raise NotPackedError(f"{where}: '{name}' is missing; {REBUILD}")
            continue
        value = obj[key]
        if not rule.ok(value):
            raise NotPackedError(f"{where}: '{name}' must be {rule.what}, got {value!r:.60} ({type(value).__name__}); "
                                 f"{REBUILD}")


def _check_items(items: list, schema: dict, where: str, name: str) -> None:
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise NotPackedError(f"{where}: '{name}[{i}]' must be an object, got {item!r:.60}; {REBUILD}")
        _check_keys(item, schema, where, f"{name}[{i}].")


def check_metadata(meta, root: Path) -> PackedMetadata:
    """Check the ``metadata.json`` of the packed dataset at ``root`` against the schema above:
    every key present with its type and range, the counts consistent with each other, and
    every data file a file inside ``root``. Raises :class:`NotPackedError` naming the key."""
    where = str(root / METADATA_FILE)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME or meta.get("complete") is not True:
        raise NotPackedError(f"{where} does not describe a complete {FORMAT_NAME} dataset")
    _check_keys(meta, METADATA_SCHEMA, where)
    if meta["format_version"] > MAX_FORMAT_VERSION:
        raise NotPackedError(f"{root} has format version {meta['format_version']}; this thdpack reads up to "
                             f"{MAX_FORMAT_VERSION}: upgrade thdpack")
    _check_keys(meta["counts"], COUNTS_SCHEMA, where, "counts.")
    _check_keys(meta["source"], SOURCE_SCHEMA, where, "source.")
    _check_items(meta["source"]["files"], SOURCE_FILE_SCHEMA, where, "source.files")
    if meta.get("tokenizer") is not None:
        _check_keys(meta["tokenizer"], TOKENIZER_SCHEMA, where, "tokenizer.")
        _check_token_ids(meta["tokenizer"], where)
    _check_items(meta["files"], FILE_SCHEMA, where, "files")
    missing = [c for c in ("input_ids", meta["targets"], *SAMPLE_COLUMNS) if c not in meta["columns"]]
    if missing:
        raise NotPackedError(f"{where}: 'columns' lacks {', '.join(map(repr, missing))}; {REBUILD}")
    missing = [c for c in value_columns(meta) if c not in meta["columns"]]
    if missing:
        raise NotPackedError(f"{where}: 'columns' lacks {missing[0]!r} of 'sample_values'; {REBUILD}")
    missing = [c for c in PREFIX_COLUMNS if "share_prefix" in meta and c not in meta["columns"]]
    if missing:
        raise NotPackedError(f"{where}: 'columns' lacks {missing[0]!r} of 'share_prefix'; {REBUILD}")
    if "mixture" in meta:
        _check_mixture(meta, where)
    _check_totals(meta, where)
    _check_data_file_paths(meta, root, where)
    return meta


def _check_mixture(meta: dict, where: str) -> None:
    """``mixture``: its keys, every source's (what ``thdpack stats`` and ``inspect`` read), and the column that
    names each sample's source; the data files' ``source_index`` values are checked against ``mixture.sources``
    where they are read (:func:`thdpack.offline.store.dataset.load_packed`)."""
    _check_keys(meta["mixture"], MIXTURE_SCHEMA, where, "mixture.")
    _check_items(meta["mixture"]["sources"], MIXTURE_SOURCE_SCHEMA, where, "mixture.sources")
    if SOURCE_COLUMN not in meta["columns"]:
        raise NotPackedError(f"{where}: 'columns' lacks {SOURCE_COLUMN!r} of 'mixture'; {REBUILD}")


TOKEN_ID_KEYS = ("pad_token_id", "eos_token_id", "bos_token_id")  # of ``tokenizer``: what pads, ends, begins


def _check_token_ids(tok: dict, where: str) -> None:
    """The tokenizer's special ids are token ids (an integer >= 0, or null) and, where ``vocab_size`` is
    recorded, within its vocabulary: the collator pads with one, the Bridge export with another."""
    vocab = tok.get("vocab_size")
    hint = f" (a token id{'' if vocab is None else ' of the tokenizer.vocab_size ids'}, or null); {REBUILD}"
    for key in TOKEN_ID_KEYS:
        value = tok.get(key)
        if value is not None:
            check_int(value, f"{where}: 'tokenizer.{key}'", 0, below=vocab, hint=hint, error=NotPackedError)


def value_columns(meta: dict) -> list[str]:
    """The per-sample value columns of a dataset (``sample_values.NAME``); [] for builds without them."""
    return [SAMPLE_VALUE_PREFIX + name for name in meta.get("sample_values") or {}]


def _check_totals(meta: dict, where: str) -> None:
    """The data files' packs and tokens add up to the dataset's."""
    packs = sum(f["num_packs"] for f in meta["files"])
    if packs != meta["num_packs"]:
        raise NotPackedError(f"{where}: 'num_packs' is {meta['num_packs']} but 'files' hold {packs} packs; {REBUILD}")
    tokens = sum(f["num_tokens"] for f in meta["files"])
    if meta["counts"].get("tokens", tokens) != tokens:
        raise NotPackedError(f"{where}: 'counts.tokens' is {meta['counts']['tokens']} but 'files' hold {tokens} tokens; "
                             f"{REBUILD}")


def _check_data_file_paths(meta: dict, root: Path, where: str) -> None:
    """Every data file is named once, with the suffix of ``file_format``, and lies inside ``root``."""
    suffix = SUFFIX[meta["file_format"]]
    seen = set()
    for i, f in enumerate(meta["files"]):
        key, rel = f"files[{i}].path", f["path"]
        if rel in seen:
            raise NotPackedError(f"{where}: '{key}' ({rel!r}) is listed twice; {REBUILD}")
        seen.add(rel)
        if not rel.endswith(suffix):
            raise NotPackedError(f"{where}: '{key}' ({rel!r}) does not end in {suffix!r} "
                                 f"(file_format {meta['file_format']!r}); {REBUILD}")
        data_file_path(root, rel, where=f"{where}: '{key}'")


def data_file_path(root: Path, rel: str, *, where: str) -> Path:
    """``root / rel`` for a data file named in ``metadata.json``; :class:`NotPackedError` if it is
    absolute or resolves (``..``, symbolic links) outside ``root``."""
    path = root / rel
    if Path(rel).is_absolute() or not path.resolve().is_relative_to(root.resolve()):
        raise NotPackedError(f"{where} ({rel!r}) points outside the dataset directory {root}: data files must be "
                             f"files inside it, named relative to it; {REBUILD}")
    return path


def row_list(value, name: str) -> np.ndarray:
    """A packed row's list field as a 1-D numpy array (numpy, list, tensor or Arrow value)."""
    if not isinstance(value, np.ndarray):
        module = type(value).__module__
        if module.startswith("torch"):
            value = value.detach().cpu().numpy()
        elif module.startswith("pyarrow"):
            value = getattr(value, "values", value)  # a ListScalar's child array
            value = value.to_numpy(zero_copy_only=False)
        else:
            value = np.asarray(value)
    if value.ndim != 1 or (value.size and value.dtype.kind not in "iub"):
        raise ValueError(f"packed row: '{name}' must be a flat list of integers, got {value.dtype} {value.shape}")
    return value
