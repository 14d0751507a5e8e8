"""``engine: ray``: an input read where the data is; the driver learns only what it needs to plan.

:func:`read_on_cluster` gives the build a :class:`~thdpack.offline.inputs.sources.Source` as
:func:`~thdpack.offline.inputs.sources.read_source` does (the same files, row counts, hashes, row
locations and columns, so ``metadata.json`` is the local build's), without reading the rows here:

1. **Discovery** (the driver): the file list, each file's size, the first bytes of a JSON file (an array
   or JSON Lines; its encoding), a Parquet file's row groups and schema from its footer.
2. **Counting and hashing** (Ray tasks, all at once): each JSON Lines file is cut into byte ranges
   (:mod:`~thdpack.offline.inputs.file_parts`), each range's lines counted where it is read; JSON arrays,
   ``.gz`` and Arrow files are read whole by a task; every file's SHA-256 is computed by the task that reads it
   whole. The driver combines the counts and the hashes in file order: rows numbered, ``max_rows`` applied,
   the source fingerprint as the local build's.
3. **The first rows** (a Ray task): at most :data:`HEAD_ROWS` rows, what format detection and the VLM set-up
   look at. They are the source's ``dataset``; its ``parts`` (:class:`~thdpack.offline.inputs.file_parts.FileParts`)
   are the rows the tokenizing map reads, on the workers, part by part.

The bundled demo rows are generated on the driver (a few thousand rows) and a ``save_to_disk`` dataset is
memory-mapped there (its Arrow files hashed by a task): both are mapped as file-backed datasets.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from thdpack.offline.cluster.ray_session import RaySession
from thdpack.offline.cluster.ray_tasks import run_tasks
from thdpack.offline.config import check_input
from thdpack.offline.errors import InputError, OfflineError
from thdpack.offline.inputs.file_parts import (MAX_PART_BYTES, MIN_PART_BYTES, FilePart, FileParts, LineNumbers,
                                               PartCount, byte_cuts, first_json_byte)
from thdpack.offline.inputs.sources import (JSON_COLUMN, Source, SourceFile, concat_rows, files_fingerprint,
                                            input_kind, input_paths, json_columns, load_saved, read_source,
                                            saved_sha256)
from thdpack.offline.stage_options import SourceOptions
from thdpack.offline.store.schema import file_sha256

HEAD_ROWS = 1000  # rows of the input the driver holds: what format detection (100) and the VLM set-up (1000) read
PARTS_PER_CPU = 4  # tokenizing parts per actor of the cluster, as the map cuts a dataset (ray_map.PARTS_PER_ACTOR)
SPLIT_ROW_GROUP = 8  # at most this many parts of one Parquet row group (each part decodes the whole group)


@dataclass
class ClusterSource(Source):
    """A :class:`~thdpack.offline.inputs.sources.Source` whose rows stay where they are (see the module
    docstring): ``dataset`` holds its first rows, ``parts`` all of them."""

    session: RaySession | None = field(default=None, repr=False)

    def rows_between(self, start: int, stop: int):
        """``(parts, first rows)`` of rows ``[start, stop)`` (an input slice): the parts cut to them and their
        first :data:`HEAD_ROWS` rows as a ``datasets.Dataset``."""
        parts = self.parts.between(start, stop)
        return parts, _head(self.session, parts, self.files)


def read_on_cluster(session: RaySession, opts: SourceOptions, *, progress: bool = True,
                    fetch_dir: Path | None = None) -> Source:
    """The :class:`~thdpack.offline.inputs.sources.Source` of ``opts.input`` on the cluster of ``session`` (see
    the module docstring): the local reader's files, rows and errors, its rows read by Ray tasks."""
    spec = opts.input
    check_input(spec)
    if isinstance(spec, dict):  # the bundled demo rows: generated here
        return read_source(opts, progress=progress, fetch_dir=fetch_dir)
    paths, fetched = input_paths(opts, fetch_dir)
    if input_kind(paths[0][1]) == "saved":  # the only input (input_paths checks)
        return _read_saved(session, *paths[0], opts, fetched)
    found = [_discover(given, path) for given, path in paths]
    work = _scan_work(found, session.actors * PARTS_PER_CPU)
    results = run_tasks(session, _scan, None, [(w,) for w in work],
                        describe=lambda k: f"{work[k][0]} {work[k][2].given}" + _bytes(work[k][2]))
    files, parts = _assemble(found, work, results, opts.max_rows, session.actors * PARTS_PER_CPU)
    schema = None
    if found and found[0].reader != "json":
        kept = [f.schema for f in found[: len(files)]]
        schema = kept[0] if len(kept) == 1 else concat_rows([s.empty_table() for s in kept]).schema
    rows = FileParts(tuple(p for p, _, _ in parts), tuple(n for _, n, _ in parts), tuple(x for _, _, x in parts),
                     schema)
    head = _head(session, rows, files)
    columns = json_columns(files, head) if JSON_COLUMN in head.column_names else list(head.column_names)
    return ClusterSource(head, files, columns, fetched, rows, session)


def _bytes(part: FilePart) -> str:
    return f" bytes {part.start}..{part.stop}" if part.kind == "lines" else ""


@dataclass
class _Found:
    """An input file as the driver finds it (discovery): how it is read, and what its footer says."""

    given: str
    path: Path
    reader: str  # json | parquet | arrow
    kind: str  # the SourceFile kind: jsonl, json (an array, or a .gz file until read), parquet, arrow
    size: int
    error: OfflineError | None = None  # raised when the build reaches this file (in file order)
    group_rows: list = field(default_factory=list)  # Parquet: rows of each row group
    schema: object = None  # Parquet: from the footer; Arrow: from the task that reads it


def _discover(given: str, path: Path) -> _Found:
    """What the driver reads of input file ``path``: its size, a JSON file's first bytes, a Parquet footer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = input_kind(path)
    reader = "json" if kind in ("jsonl", "json") else kind
    f = _Found(given, path, reader, kind, path.stat().st_size)
    try:
        if reader == "json" and not path.name.lower().endswith(".gz"):
            f.kind = "json" if first_json_byte(given, path) == b"[" else "jsonl"
        elif reader == "json":
            f.kind = "json"  # read whole by a task, which tells jsonl from an array
        elif reader == "parquet":
            try:
                with pq.ParquetFile(path) as meta:  # its footer
                    f.group_rows = [meta.metadata.row_group(g).num_rows for g in range(meta.num_row_groups)]
                    f.schema = meta.schema_arrow
            except (pa.ArrowInvalid, OSError) as exc:
                raise InputError(f"{given}: cannot read Parquet ({exc})") from None
    except OfflineError as exc:
        f.error = exc
    return f


def _scan_work(found: list[_Found], want: int) -> list[tuple[str, int, FilePart]]:
    """The counting and hashing tasks of the files ``found``: ``(what, file index, part)``; JSON Lines cut into
    byte ranges of about ``1/want`` of the JSON Lines bytes (within :data:`MIN_PART_BYTES` ..
    :data:`MAX_PART_BYTES`)."""
    lines_bytes = sum(f.size for f in found if f.kind == "jsonl" and f.error is None)
    part_bytes = min(max(lines_bytes // max(1, want), MIN_PART_BYTES), MAX_PART_BYTES)
    work = []
    for i, f in enumerate(found):
        if f.error is not None:
            continue
        whole = FilePart(str(f.path), f.given, "file", f.reader)
        if f.kind == "jsonl":
            cuts = byte_cuts(f.size, part_bytes)
            work += [("counting", i, FilePart(str(f.path), f.given, "lines", "json", a, b))
                     for a, b in zip(cuts[:-1], cuts[1:])]
        elif f.reader in ("json", "arrow"):
            work.append(("counting", i, whole))  # read whole: hashed there too (json), or counted (arrow)
        if f.kind == "jsonl" or f.reader in ("parquet", "arrow"):
            work.append(("hashing", i, whole))
    return work


def _scan(shared, item: tuple[str, int, FilePart]):
    """A Ray task: count a part or hash a file; an error of the input is returned (the driver raises the
    first one in file order, as the local build meets them)."""
    what, _, part = item
    try:
        return part.count() if what == "counting" else file_sha256(Path(part.path))
    except OfflineError as exc:
        return exc


def _assemble(found: list[_Found], work: list, results: list, limit: int | None, want: int):
    """``(files, parts)``: the :class:`SourceFile` of each file read (up to ``max_rows``, ``limit``) and the
    tokenizing parts ``(FilePart, rows, label)`` in order, from the scan's ``results`` (of ``work``)."""
    by_file: dict[int, list] = {}
    for (what, i, part), result in zip(work, results):
        by_file.setdefault(i, []).append((what, part, result))
    files, counted = [], []
    for i, f in enumerate(found):
        if f.error is not None:
            raise f.error
        done = by_file.get(i, [])
        for _, _, result in done:
            if isinstance(result, OfflineError):
                raise result
        sf, pieces = _file_rows(f, done, limit)
        files.append(sf)
        counted.append(pieces)
        if limit is not None:
            limit -= sf.num_rows
            if limit <= 0:
                break
    per_part = max(1, sum(n for pieces in counted for _, n in pieces) // max(1, want))
    parts = []
    for sf, pieces in zip(files, counted):
        parts += _tokenizing_parts(sf, pieces, per_part)
    return files, parts


def _file_rows(f: _Found, done: list, limit: int | None):
    """``(SourceFile, pieces)`` of file ``f`` from its scan results ``done`` (``(what, part, result)``): its rows
    up to ``limit`` and the pieces they come in (``(FilePart, rows)``, before cutting for tokenizing)."""
    sha = next((r for w, _, r in done if w == "hashing"), None)
    counts = [(p, r) for w, p, r in done if w == "counting"]
    lines = None
    if f.kind == "jsonl":
        pieces = [(p, c.rows) for p, c in counts]
        firsts = np.concatenate([[0], np.cumsum([c.rows for _, c in counts], dtype=np.int64)])[:-1].tolist()
        offsets = np.concatenate([[0], np.cumsum([c.newlines for _, c in counts], dtype=np.int64)])[:-1].tolist()
        lines = LineNumbers(firsts, offsets, [c.lines for _, c in counts])
    elif f.reader == "json":  # read whole: an array (kind json) or a .gz file of lines (kind jsonl)
        c: PartCount = counts[0][1]
        f.kind, sha = c.kind, c.sha256
        pieces = [(counts[0][0], c.rows)]
        if c.kind == "jsonl":
            lines = LineNumbers([0], [0], [c.lines])
    elif f.reader == "arrow":
        c = counts[0][1]
        f.schema = c.schema
        pieces = [(counts[0][0], c.rows)]
    else:
        pieces = [(FilePart(str(f.path), f.given, "row_groups", "parquet", g, g + 1), n)
                  for g, n in enumerate(f.group_rows)]
    total = sum(n for _, n in pieces)
    keep = total if limit is None else min(total, limit)
    return SourceFile(f.given, f.kind, keep, sha, lines), _first_rows(pieces, keep)


def _first_rows(pieces: list, keep: int) -> list:
    """``pieces`` (``(FilePart, rows)``) cut to their first ``keep`` rows."""
    out = []
    for part, n in pieces:
        if keep <= 0:
            break
        if n > keep:
            part, n = replace(part, take=keep), keep
        out.append((part, n))
        keep -= n
    return out


def _tokenizing_parts(sf: SourceFile, pieces: list, per_part: int) -> list:
    """The tokenizing parts ``(FilePart, rows, label)`` of a file's ``pieces`` (``(FilePart, rows)``): JSON Lines
    ranges and files read whole as they are; Parquet row groups joined up to about ``per_part`` rows, a larger
    group cut into at most :data:`SPLIT_ROW_GROUP` parts; an Arrow file (memory-mapped) cut into parts of about
    ``per_part`` rows."""
    out, run = [], []
    first = 0  # the file's row where the next part starts

    def add(part: FilePart, n: int):
        nonlocal first
        where = f"{sf.path} rows {first}..{first + n - 1}"
        if sf.line_numbers is not None:
            where += f" (lines {sf.line_numbers[first]}..{sf.line_numbers[first + n - 1]})"
        out.append((part, n, where))
        first += n

    def flush():
        if run:
            last = run[-1][0]
            add(replace(run[0][0], stop=last.stop, take=None if last.take is None else sum(n for _, n in run)),
                sum(n for _, n in run))
            run.clear()

    for part, n in pieces:
        if n == 0:
            continue
        if part.kind == "row_groups" and n <= 2 * per_part:
            run.append((part, n))
            if sum(k for _, k in run) >= per_part:
                flush()
            continue
        flush()
        cuts = 1 if part.kind == "lines" or part.reader == "json" else -(-n // per_part)
        cuts = min(cuts, SPLIT_ROW_GROUP) if part.kind == "row_groups" else cuts
        for j in range(cuts):
            a, b = n * j // cuts, n * (j + 1) // cuts
            add(part if cuts == 1 else replace(part, skip=part.skip + a, take=b - a), b - a)
    flush()
    return out


def _head(session: RaySession, parts: FileParts, files: list[SourceFile]):
    """The first :data:`HEAD_ROWS` rows of ``parts``, read by a Ray task, as a ``datasets.Dataset``."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    table = run_tasks(session, _head_rows, parts, [(HEAD_ROWS,)], describe=lambda k: "reading the first rows")[0]
    if table is None:  # no rows: an empty table of the input's columns
        table = (parts.schema.empty_table() if parts.schema is not None
                 else pa.table({JSON_COLUMN: pa.array([], pa.large_binary())}))
    return datasets.Dataset(InMemoryTable(table), fingerprint=files_fingerprint(files)[:16])


def _head_rows(parts: FileParts, n: int):
    """A Ray task: :meth:`FileParts.head`."""
    return parts.head(n)


def _read_saved(session: RaySession, given: str, path: Path, opts: SourceOptions, fetched) -> Source:
    """A ``save_to_disk`` dataset: memory-mapped here (its rows are read by the map's workers), its Arrow files
    hashed by a Ray task."""
    ds, files_dir = load_saved(given, path, opts)
    sha = run_tasks(session, _saved_hash, None, [(str(files_dir),)], describe=lambda k: f"hashing {given}")[0]
    return Source(ds, [SourceFile(given, "saved", len(ds), sha)], list(ds.column_names), fetched)


def _saved_hash(shared, files_dir: str) -> str:
    return saved_sha256(Path(files_dir))
