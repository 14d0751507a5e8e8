"""The build's tokenizing step: :func:`tokenize_source` runs the row tokenizer over every row of a source.

It resolves the row format (:func:`resolve_format`), checks the columns the format and the
options need, loads the tokenizer (:mod:`thdpack.offline.tokenizing.tokenizer_loading`), and maps
:class:`~thdpack.offline.tokenizing.row_tokenizer.RowTokenizer` (or the VLM build's row tokenizer) over
the rows with ``datasets.map`` (batched, ``num_proc`` processes, results memory-mapped in a
work directory). With the tiktoken fast path, a row where it disagrees with the tokenizer
makes the whole step run again without it. The result (:class:`Tokenized`) holds the
tokenized rows, their lengths and the failed rows' errors.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import numpy as np

from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.stage_options import TokenizeOptions
from thdpack.offline.store.schema import GROUP_COLUMN, VALUE_COLUMN, VALUE_IS_INT_COLUMN, bytes_sha256
from thdpack.offline.inputs.mmap_input import memory_mapped
from thdpack.offline.procs import map_in_processes
from thdpack.offline.tokenizing.row_formats import DETECTION_ORDER, detect_format, row_format
from thdpack.offline.tokenizing.row_tokenizer import ERROR_COLUMN, TAIL_TARGETS_COLUMN, TOOLS_FIELD, RowTokenizer
from thdpack.offline.inputs.sources import JSON_COLUMN, Source, first_json_problem, json_fields
from thdpack.offline.tokenizing.tiktoken_bpe import FastTokenizerMismatch
from thdpack.offline.tokenizing.tokenizer_loading import fast_bpe, load_tokenizer, tokenizer_info

logger = logging.getLogger(__name__)


@dataclass
class Tokenized:
    """Tokenized rows (one per input row; two per row, chosen then rejected, for preference rows) and what
    went wrong (indexed like the tokenized rows).

    Under ``engine: ray`` the rows stay in the part files the workers wrote (``files``, opened where they are
    read: the tasks that count targets, find shared prefixes, write packs), and ``dataset`` holds only their
    small columns (:data:`TOKEN_COLUMNS` and the pixel columns left out): what the driver plans with."""

    dataset: object  # datasets.Dataset: input_ids, loss_mask|labels, __error__, ...
    lengths: np.ndarray  # int64 [rows]; 0 for failed rows
    errors: list[tuple[int, str]]  # (row, message) of failed rows
    fmt: str
    tokenizer: object | None
    tokenizer_info: dict | None
    files: object = None  # engine: ray: every column, where the workers read them (ray_map.PartFiles)

    @property
    def rows(self):
        """Every column of the rows, as a worker reads them: ``files`` (engine: ray), else ``dataset``."""
        return self.dataset if self.files is None else self.files


TOKEN_COLUMNS = ("input_ids", "loss_mask", "labels")  # the tokens, left in the part files under engine: ray
PIXEL_COLUMNS = ("pixel_values", "pixel_values_videos")  # VLM rows' pixels, likewise


def resolve_format(opts: TokenizeOptions, source: Source) -> str:
    """The name of the row format: ``opts.format`` or, for ``auto``, the first format of
    :data:`~thdpack.offline.tokenizing.row_formats.DETECTION_ORDER` whose fields the rows have
    (:func:`~thdpack.offline.tokenizing.row_formats.row_format` gives the format object)."""
    if opts.format != "auto":
        return opts.format
    fmt = detect_format(source.columns, opts)
    problem = first_json_problem(source) if fmt is None and source.is_json and not source.columns else None
    if problem:
        raise InputError(f"cannot tell the row format: none of the first rows is a JSON object ({problem}); "
                         "each line of a JSON Lines file is one object, e.g. {\"messages\": [...]}")
    if fmt is None:
        expected = "; ".join(f"{' + '.join(repr(f) for f in row_format(name).fields(opts))} ({name})"
                             for name in DETECTION_ORDER)
        raise InputError(
            f"{source.files[0].path}: cannot tell the row format from the fields {sorted(source.columns)}; "
            f"expected {expected}. Set --format and --messages-field / --text-field."
        )
    return fmt


def tokenize_source(opts: TokenizeOptions, source: Source, work_dir, *, progress: bool = True,
                    vlm=None, mapper=None) -> Tokenized:
    """Tokenize every row of ``source`` by the options ``opts`` with ``datasets.map`` into ``work_dir``; with ``vlm``
    (a :class:`thdpack.offline.vision.vlm_setup.VlmBuild`) also process the rows' images. ``mapper``: runs the
    map elsewhere, with :func:`~thdpack.offline.procs.map_in_processes`'s arguments and ``summarize`` (``engine:
    ray``: :func:`thdpack.offline.cluster.ray_map.map_on_ray`, whose part files stay where they are: see
    :class:`Tokenized`); None: in ``opts.num_proc`` local processes."""
    fmt = resolve_format(opts, source)
    _check_source_columns(opts, source, fmt, vlm)
    tok = _tokenizer_for_format(opts, fmt)
    ds = _columns_to_tokenize(opts, source, fmt, vlm)
    bpe, note = fast_bpe(opts, tok, fmt)
    if note:
        logger.info(note)
    features = _tokenized_features(opts, vlm)
    fingerprint = bytes_sha256(
        json.dumps([source.fingerprint, fmt, opts.recorded, tokenizer_info(tok, "") if tok else None],
                   sort_keys=True, default=str)
    )[:16]
    batch_size = opts.map_batch_size if vlm is None else vlm.map_batch_size(opts.map_batch_size)
    num_proc = min(opts.num_proc, max(1, len(ds) // max(1, batch_size))) if opts.num_proc > 1 else None
    parts = None
    if source.parts is not None:  # engine: ray read the rows where they are: the map reads them part by part there
        parts = source.parts.with_columns(ds.column_names)
    elif num_proc or mapper:  # workers map the rows from a file instead of each getting a pickled copy (mmap_input.py)
        ds = memory_mapped(ds, work_dir / "rows.arrow")
    tokenizers = _RowTokenizers(fmt, opts, tok, ds.column_names, source, vlm)
    rows = _RowMap(parts or ds, num_proc, mapper, dict(
        batched=True,
        batch_size=batch_size,
        remove_columns=ds.column_names,
        with_indices=vlm is not None,
        features=features,
        cache_file_name=str(work_dir / "tokenized.arrow"),
        load_from_cache_file=False,
        new_fingerprint=fingerprint,
        desc=f"Tokenizing ({fmt})",
    ))
    out = _tokenize_rows(rows, tokenizers, bpe, progress)
    info = tokenizer_info(tok, opts.tokenizer) if tok else None
    if mapper is not None:  # engine: ray: the driver keeps the lengths and the small columns, not the tokens
        return _tokenized_parts(out, fmt, tok, info)
    col = out.data.table.column("input_ids")
    lengths = np.concatenate(
        [np.diff(np.asarray(c.offsets)).astype(np.int64) for c in col.chunks] or [np.zeros(0, np.int64)]
    )
    err_col = out.data.table.column(ERROR_COLUMN)
    bad = np.flatnonzero(np.asarray(err_col.is_valid()))
    errors = [(int(i), err_col[int(i)].as_py()) for i in bad]
    return Tokenized(out, lengths, errors, fmt, tok, info)


def _tokenized_parts(mapped, fmt: str, tok, info) -> Tokenized:
    """The :class:`Tokenized` of a map on Ray (``mapped``: a ``ray_map.MappedParts`` whose summaries are
    :class:`_PartSummary` results): the lengths and small columns of every part, the part files."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    lengths = np.concatenate([np.asarray(n, np.int64) for n, _ in mapped.summaries])
    table = pa.concat_tables([t for _, t in mapped.summaries])
    err_col = table.column(ERROR_COLUMN)
    errors = [(int(i), err_col[int(i)].as_py()) for i in np.flatnonzero(np.asarray(err_col.is_valid()))]
    return Tokenized(datasets.Dataset(InMemoryTable(table)), lengths, errors, fmt, tok, info, mapped.files)


@dataclass(frozen=True)
class _PartSummary:
    """What the driver keeps of a part file of tokenized rows (computed where it was written): the rows' lengths
    (int32) and their columns but the tokens and pixels, in one chunk."""

    def __call__(self, path: str):
        import datasets

        table = datasets.Dataset.from_file(path).data.table
        col = table.column("input_ids")
        lengths = np.concatenate([np.diff(np.asarray(c.offsets)) for c in col.chunks] or [np.zeros(0, np.int32)])
        small = table.drop_columns([c for c in TOKEN_COLUMNS + PIXEL_COLUMNS if c in table.column_names])
        return lengths.astype(np.int32), small.combine_chunks()


def _check_source_columns(opts: TokenizeOptions, source: Source, fmt: str, vlm) -> None:
    """Refuse a row format that cannot carry images (VLM builds), a missing column of the format (inputs
    with columns), and a column of ``sample_values`` or ``group_column`` the input lacks (JSON rows: a field
    none of the first rows has, named once rather than as an error of every row)."""
    row_fmt = row_format(fmt)
    if vlm is not None and row_fmt.images_refused:
        raise ConfigError(row_fmt.images_refused)
    fields = source.columns
    if source.is_json:
        if any(c not in fields for c in opts.extra_columns()):
            fields = json_fields(source)
    else:
        missing = [c for c in row_fmt.fields(opts) if c not in fields]
        if missing:
            raise InputError(
                f"{source.files[0].path}: no '{missing[0]}' column for format '{fmt}' (columns: {source.columns})"
            )
    missing = [c for c in opts.extra_columns() if c not in fields]
    if missing:
        what = "field in its rows" if source.is_json else "column"
        raise InputError(f"{source.files[0].path}: no '{missing[0]}' {what}, which "
                         f"{'group_column' if missing[0] == opts.group_column else 'sample_values'} names "
                         f"({'fields' if source.is_json else 'columns'}: {fields})")


def _tokenizer_for_format(opts: TokenizeOptions, fmt: str):
    """The build's tokenizer, or None for pre-tokenized rows without one; ConfigError when ``fmt`` needs one."""
    tok = None
    if opts.tokenizer:
        tok = load_tokenizer(opts)
    elif row_format(fmt).needs_tokenizer:
        raise ConfigError(f"format '{fmt}' needs a tokenizer: give --tokenizer or 'tokenizer:' in the config")
    return tok


def _columns_to_tokenize(opts: TokenizeOptions, source: Source, fmt: str, vlm):
    """``source.dataset`` with only the columns the row tokenizer reads (JSON inputs: the raw row)."""
    ds = source.dataset
    row_fmt = row_format(fmt)
    keep = [JSON_COLUMN] if source.is_json else [c for c in ds.column_names if c in (
        row_fmt.fields(opts) + list(row_fmt.optional_fields)
        + ([TOOLS_FIELD] if row_fmt.tools else []) + (vlm.input_columns() if vlm is not None else [])
        + opts.extra_columns())]
    if keep != ds.column_names:
        ds = ds.select_columns(keep)
    return ds


def _tokenized_features(opts: TokenizeOptions, vlm):
    """The ``datasets.Features`` of the tokenized rows: ids, targets, the error, the VLM build's
    columns, the ``sample_values`` and the ``group_column`` key."""
    import datasets

    target_type = datasets.Value("bool") if opts.targets == "loss_mask" else datasets.Value("int32")
    return datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            opts.targets: datasets.List(target_type),
            ERROR_COLUMN: datasets.Value("string"),
            TAIL_TARGETS_COLUMN: datasets.Value("int64"),
            **(vlm.features() if vlm is not None else {}),
            **{col.format(c): datasets.Value(kind) for c in opts.value_columns
               for col, kind in ((VALUE_COLUMN, "float64"), (VALUE_IS_INT_COLUMN, "bool"))},
            **({GROUP_COLUMN: datasets.Value("string")} if opts.group_column else {}),
        }
    )


@dataclass(frozen=True)
class _RowTokenizers:
    """Makes the build's row tokenizer (the VLM build's with ``vlm``), with or without a fast BPE."""

    fmt: str
    opts: TokenizeOptions
    tok: object
    columns: list[str]  # the columns of the rows mapped
    source: Source
    vlm: object

    def make(self, bpe):
        """The row tokenizer, using the fast path ``bpe`` (None: the tokenizer itself)."""
        if self.vlm is None:
            return RowTokenizer(self.fmt, self.opts, self.tok, self.columns, bpe)
        return self.vlm.row_tokenizer(self.fmt, self.opts, self.tok, self.columns, self.source, bpe)


@dataclass(frozen=True)
class _RowMap:
    """One ``datasets.map`` over the rows ``ds``: by ``mapper``, in ``num_proc`` processes of our own, or in this one."""

    ds: object  # datasets.Dataset, or the input's parts where they are (Source.parts: mapper only)
    num_proc: int | None
    mapper: object  # None, or map_on_ray (tokenize_source)
    kwargs: dict  # datasets.map's keyword arguments

    def run(self, fn):
        """The rows mapped by ``fn`` (a batched row tokenizer)."""
        if self.mapper is not None:  # the rows stay where they were mapped: what comes back is _tokenized_parts'
            rows = self.ds.with_format("arrow") if hasattr(self.ds, "with_format") else self.ds
            return self.mapper(rows, fn, summarize=_PartSummary(), **self.kwargs)
        if self.num_proc:  # in processes of our own, which signals and errors stop for sure (procs.py)
            return map_in_processes(self.ds.with_format("arrow"), fn, self.num_proc, **self.kwargs).with_format(None)
        return self.ds.with_format("arrow").map(fn, **self.kwargs).with_format(None)


def _tokenize_rows(rows: _RowMap, tokenizers: _RowTokenizers, bpe, progress: bool):
    """Map the row tokenizer over ``rows``; when the fast path ``bpe`` disagrees with the tokenizer on
    a row, map again without it. ``progress=False`` silences ``datasets``' bars meanwhile."""
    import datasets

    if not progress:
        datasets.disable_progress_bars()
    try:
        try:
            return rows.run(tokenizers.make(bpe))
        except FastTokenizerMismatch as exc:
            if bpe is None:
                raise
            logger.info(f"tiktoken  {exc}; tokenizing again with the tokenizer itself")
            return rows.run(tokenizers.make(None))
    finally:
        if not progress:
            datasets.enable_progress_bars()
