"""Reading inputs into one ``datasets.Dataset`` of raw rows, remembering where each row came from.

Supported inputs:

- JSON Lines (``.jsonl``, ``.jsonl.gz``, ``.json`` with one object per line) and JSON
  arrays (``.json`` starting with ``[``). Lines are kept as raw bytes here and parsed
  in the (parallel) tokenization step, so a malformed line becomes a row error that
  names its file and line.
- Parquet (``.parquet``) and Arrow (``.arrow``, IPC stream or file format; streams are
  memory-mapped).
- A directory written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` needs ``split``).
- A directory or glob: every supported file in it, in sorted order.
- A filesystem URI (``s3://``, ``gs://``, ``hf://``, ...) of any of these, fetched with fsspec
  (:mod:`thdpack.offline.inputs.remote`).
- ``{"demo": {...}}``: the bundled synthetic rows (:mod:`thdpack.demo`).

Every row gets a location (``file:line`` or ``file row N``) for error messages, and
the whole input a content fingerprint (sha256 of the files' bytes).
"""

from __future__ import annotations

import glob
import gzip
import os
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from thdpack.offline.config import check_input
from thdpack.offline.stage_options import SourceOptions
from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.store.schema import bytes_sha256, file_sha256
from thdpack.offline.inputs.jsonl import json_lines
from thdpack.offline.config import is_uri
from thdpack.offline.inputs.remote import fetch, filesystem, is_local

JSON_COLUMN = "__json__"  # raw JSON text of a row, parsed during tokenization
JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".ndjson")
TABLE_SUFFIXES = (".parquet", ".arrow")


@dataclass
class SourceFile:
    path: str  # as given (for messages and metadata)
    kind: str  # jsonl | json | parquet | arrow | saved | demo
    num_rows: int
    sha256: str
    # JSON Lines: 1-based line of each row (an int64 array, or what indexes like one: file_parts.LineNumbers)
    line_numbers: np.ndarray | None = field(default=None, repr=False)

    def describe(self) -> dict:
        return {"path": self.path, "kind": self.kind, "rows": self.num_rows, "sha256": self.sha256}


def files_fingerprint(files) -> str:
    """Hex sha256 naming the rows of ``files`` (:class:`SourceFile`: kind, rows and content hash)."""
    return bytes_sha256("".join(f"{f.kind}:{f.num_rows}:{f.sha256}\n" for f in files))


@dataclass
class Source:
    """Raw rows and where they came from.

    ``dataset`` has either one column ``__json__`` (raw JSON bytes of each row) or
    the typed columns of Parquet / Arrow / saved datasets.
    """

    dataset: object  # datasets.Dataset
    files: list[SourceFile]
    columns: list[str]  # fields available in the rows (for JSON: the first object's keys)
    row_offsets: np.ndarray = field(init=False, repr=False)
    fetched: object = field(default=None, repr=False)  # the temporary directory of fetched URI inputs, kept alive
    # engine: ray reads the rows where they are (thdpack.offline.inputs.cluster_source): their parts
    # (thdpack.offline.inputs.file_parts.FileParts), and ``dataset`` holds only the first rows; None: ``dataset``
    # holds every row
    parts: object = field(default=None, repr=False)

    def __post_init__(self):
        self.row_offsets = np.cumsum([0] + [f.num_rows for f in self.files])

    @property
    def is_json(self) -> bool:
        return JSON_COLUMN in self.dataset.column_names

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets[-1])

    @property
    def fingerprint(self) -> str:
        return files_fingerprint(self.files)

    def where(self, row: int) -> str:
        """``file:line`` (JSON Lines) or ``file row N`` for global row ``row``."""
        k = int(np.searchsorted(self.row_offsets, row, side="right") - 1)
        f = self.files[k]
        local = row - int(self.row_offsets[k])
        if f.line_numbers is not None:
            return f"{f.path}:{int(f.line_numbers[local])}"
        return f"{f.path} row {local}"


def read_source(opts: SourceOptions, *, progress: bool = True, fetch_dir: Path | None = None) -> Source:
    """Read ``opts.input`` into a :class:`Source` (rows not yet parsed or tokenized). Inputs named by a
    URI are fetched into ``fetch_dir`` (a build's work directory), else into a temporary directory that
    lives as long as the Source."""
    import datasets

    spec = opts.input
    check_input(spec)
    if isinstance(spec, dict):
        return _read_demo(spec["demo"] or {}, opts)
    paths, fetched = input_paths(opts, fetch_dir)
    files: list[SourceFile] = []
    tables = []
    limit = opts.max_rows
    from tqdm.auto import tqdm

    bar = tqdm(paths, desc="Reading", unit="file", disable=not progress or len(paths) < 2, leave=False)
    for given, path in bar:
        kind = input_kind(path)
        if kind in ("jsonl", "json"):
            table, sf = read_json_file(given, path, kind, limit)
        elif kind in ("parquet", "arrow"):
            table, sf = read_table_file(given, path, kind, limit)
        else:
            saved = _read_saved(given, path, opts)
            saved.fetched = fetched
            return saved
        tables.append(table)
        files.append(sf)
        if limit is not None:
            limit -= sf.num_rows
            if limit <= 0:
                break
    from datasets.table import InMemoryTable

    table = concat_rows(tables)
    # the files' hashes name the rows: without a fingerprint, datasets hashes a pickled copy of the table
    ds = datasets.Dataset(InMemoryTable(table), fingerprint=files_fingerprint(files)[:16])
    columns = json_columns(files, ds) if JSON_COLUMN in table.column_names else list(table.column_names)
    return Source(ds, files, columns, fetched)


def concat_rows(tables: list):
    """The input files' rows (``pyarrow.Table`` s, in order) as one table, their columns unified (a column
    missing from a file is null there, types promoted); InputError when they cannot be."""
    import pyarrow as pa

    if len(tables) == 1:
        return tables[0]
    try:
        return pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise InputError(f"input files have incompatible columns: {exc}") from None


# ---------------------------------------------------------------------------- paths


def input_paths(opts: SourceOptions, fetch_dir: Path | None = None) -> tuple[list[tuple[str, Path]], object]:
    """``(paths, fetched)``: the input files of ``opts.input`` (not a demo) in order, each as ``(name as given,
    path)``, and the temporary directory URI inputs were fetched into (None when ``fetch_dir`` is given or none
    was fetched). ConfigError for inputs that cannot be built together."""
    spec = opts.input
    specs = spec if isinstance(spec, list) else [spec]

    paths: list[tuple[str, Path]] = []
    fetched = None
    for k, s in enumerate(specs):
        if is_uri(s):
            if fetch_dir is None and fetched is None:
                fetched = tempfile.TemporaryDirectory(prefix="thdpack-input-")
            paths.extend(_expand_uri(s, opts, Path(fetch_dir or fetched.name) / f"input-{k}"))
        else:
            paths.extend(_expand(s, opts))
    kinds = {input_kind(p) for _, p in paths}
    if "saved" in kinds and len(paths) > 1:
        raise ConfigError("a save_to_disk directory must be the only input")
    if kinds & {"jsonl", "json"} and kinds - {"jsonl", "json"}:
        raise ConfigError(
            f"inputs mix JSON with {sorted(kinds - {'jsonl', 'json'})} files; build them separately"
        )

    return paths, fetched


def _expand_uri(spec: str, opts: SourceOptions, into: Path) -> list[tuple[str, Path]]:
    """:func:`_expand` of a URI: ``file://`` read in place, any other protocol fetched under ``into``."""
    fs, path = filesystem(spec)
    if is_local(fs):
        found = _expand(path, opts)
        return [(spec, p) for _, p in found] if len(found) == 1 and not glob.has_magic(path) else found
    return fetch(spec, into, lambda name: _supported(Path(name)))


def _expand(spec: str, opts: SourceOptions) -> list[tuple[str, Path]]:
    path = opts.resolve_path(spec)
    if any(ch in spec for ch in "*?["):  # a pattern, under the config's directory taken as named
        given = Path(spec).expanduser()
        pattern = str(given) if given.is_absolute() else os.path.join(glob.escape(str(opts.base_dir)), str(given))
        found = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
        found = [p for p in found if p.is_file() and _supported(p)]
        if found:
            _refuse_packed(spec, found, _glob_root(given, opts), opts, pattern=True)
            return [(_display(spec, p, opts), p) for p in found]
        if not path.exists():  # else a file or directory whose name holds * ? [
            raise InputError(f"input pattern {spec!r} matches no .jsonl/.json/.parquet/.arrow file")
    if not path.exists():
        raise InputError(f"input {spec!r} does not exist (looked at {path})")
    if path.is_dir():
        if _is_saved_dataset(path):
            return [(spec, path)]
        found = sorted(p for p in path.rglob("*") if p.is_file() and _supported(p))
        _refuse_packed(spec, found, path, opts)
        if not found:
            raise InputError(f"input directory {spec!r} has no .jsonl/.json/.parquet/.arrow file and is not a save_to_disk dataset")
        return [(_display(spec, p, opts), p) for p in found]
    if not _supported(path):
        raise InputError(f"input {spec!r}: unsupported file type; expected {', '.join(JSON_SUFFIXES + TABLE_SUFFIXES)}")
    return [(spec, path)]


def _glob_root(given: Path, opts: SourceOptions) -> Path:
    """The directory a pattern's matches are under: its leading components without ``*?[``."""
    parts = []
    for part in given.parts[:-1]:
        if glob.has_magic(part):
            break
        parts.append(part)
    return opts.resolve_path(str(Path(*parts))) if parts else opts.base_dir


def _refuse_packed(spec: str, found: list[Path], root: Path, opts: SourceOptions, pattern: bool = False) -> None:
    """InputError when a file of ``found`` (under directory ``root``) lies in a packed dataset (a
    directory with a thdpack ``metadata.json``, e.g. an earlier build's output inside the input
    directory): its data files, tokenizer and metadata are not rows."""
    from thdpack.offline.store.schema import FORMAT_NAME, METADATA_FILE

    seen: dict[Path, bool] = {}

    def packed(d: Path) -> bool:
        if d not in seen:
            try:
                seen[d] = json.loads((d / METADATA_FILE).read_bytes()).get("format") == FORMAT_NAME
            except (OSError, ValueError, AttributeError, RecursionError):
                seen[d] = False
        return seen[d]

    for p in found:
        for d in p.parents:
            if packed(d):
                _packed_found(spec, d, root, [f for f in found if d not in f.parents], opts, pattern)
            if d == root or root not in d.parents:
                break


def _packed_found(spec: str, d: Path, root: Path, rows: list[Path], opts: SourceOptions, pattern: bool):
    """Raise the InputError of :func:`_refuse_packed` for packed dataset ``d`` (``rows``: the files found outside it)."""
    name = _display(spec, d, opts)
    example = f" (e.g. {str(Path(spec) / ('*' + _suffix(rows[0])))!r})" if rows and not pattern else ""
    if d == root and not pattern:
        raise InputError(f"input {spec!r} is a packed dataset (thdpack build's output), not rows: give the files it "
                         "was built from (thdpack stats and inspect read packed datasets)")
    raise InputError(
        f"input {'pattern' if pattern else 'directory'} {spec!r} {'matches the files of' if pattern else 'holds'} a "
        f"packed dataset, {name} (an earlier thdpack build's output), whose files are not rows: "
        f"{'narrow the pattern to' if pattern else 'point the input at'} the row files{example} or move the "
        "packed output out of the input directory")


def _suffix(p: Path) -> str:
    """The supported suffix of input file ``p`` (``.jsonl``, ``.jsonl.gz``, ``.parquet``, ...)."""
    name = p.name.lower()
    return next(s for s in sorted(JSON_SUFFIXES + TABLE_SUFFIXES, key=len, reverse=True) if name.endswith(s))


def _display(spec: str, p: Path, opts: SourceOptions) -> str:
    """How a file found through a directory or glob is named in messages and metadata."""
    return str(p) if Path(spec).is_absolute() else os.path.relpath(p, opts.base_dir)


def _supported(p: Path) -> bool:
    name = p.name.lower()
    return name.endswith(JSON_SUFFIXES + TABLE_SUFFIXES)


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def input_kind(path: Path) -> str:
    if path.is_dir():
        return "saved"
    name = path.name.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    return "jsonl"  # JSON arrays are detected when reading


# ---------------------------------------------------------------------------- readers


def map_file(path: Path):
    """The file's bytes, memory-mapped read-only (``b""`` for an empty file)."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_json_file(given: str, path: Path, kind: str, limit: int | None):
    import pyarrow as pa

    gz = path.name.lower().endswith(".gz")
    # uncompressed: memory-mapped, the lines are views of the file's pages (page cache, shared
    # with the tokenization workers' reads), not a private copy of a file that may exceed RAM
    raw = path.read_bytes() if gz else map_file(path)
    sha = bytes_sha256(raw)  # of the file as stored
    if gz:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise InputError(f"{given}: not a valid gzip file ({exc})") from None
    start = raw[: 1 << 16]  # the first non-blank byte, without copying the whole file
    check_utf8_start(given, start)
    head = start.lstrip()[:1] if start.strip() else bytes(raw).lstrip()[:1]
    if head == b"[":  # a JSON array of objects
        try:
            rows = json.loads(bytes(raw))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"{given}: invalid JSON ({exc})") from None
        except RecursionError:
            raise InputError(f"{given}: invalid JSON ({NESTED_TOO_DEEP})") from None
        if limit is not None:
            rows = rows[:limit]
        lines = [json.dumps(r, ensure_ascii=False).encode() for r in rows]
        table = pa.table({JSON_COLUMN: pa.array(lines, pa.large_binary())})
        return table, SourceFile(given, "json", len(lines), sha)
    lines, line_numbers = json_lines(raw, limit)  # zero-copy where it can (thdpack/offline/inputs/jsonl.py)
    return pa.table({JSON_COLUMN: lines}), SourceFile(given, "jsonl", len(lines), sha, line_numbers)


NESTED_TOO_DEEP = "nested deeper than the JSON parser's recursion limit"
# byte order marks, longest first (UTF-32 LE starts with UTF-16 LE's)
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"),
         (b"\xfe\xff", "UTF-16"))


def check_utf8_start(given: str, start: bytes) -> None:
    """InputError naming the encoding when ``start`` (the first 64 KiB of JSON file ``given``) is not
    UTF-8: a UTF-16 / UTF-32 byte order mark, NUL bytes among the first four (JSON text starts with an
    ASCII character, so they give the code unit's width, as RFC 4627 detects it), or a byte that is not
    UTF-8 (Latin-1, cp1252, ...: the first one's offset and line). Only the first bytes are looked at;
    a later bad byte is a row error (its line's)."""
    start = bytes(start)
    head = start[:4]
    name = next((n for bom, n in _BOMS if head.startswith(bom)), None)
    why = "it starts with a byte order mark"
    if name is None and len(head) >= 2 and b"\x00" in head:
        name = ("UTF-32" if b"\x00\x00\x00" in head else "UTF-16") + ("LE" if head[0] else "BE")
        why = "NUL bytes between its first characters"
    if name is not None:
        raise InputError(f"{given} is {name} ({why}): convert it to UTF-8, e.g. iconv -f {name} -t UTF-8")
    try:
        start.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data" and exc.start >= len(start) - 3 and len(start) == 1 << 16:
            return  # a character cut by the 64 KiB boundary
        line = start.count(b"\n", 0, exc.start) + 1
        raise InputError(f"{given}:{line}: not UTF-8: byte {start[exc.start]:#04x} at offset {exc.start} (Latin-1 or "
                         "another 8-bit encoding?); convert the file to UTF-8, e.g. iconv -f LATIN1 -t UTF-8") from None


def read_table_file(given: str, path: Path, kind: str, limit: int | None):
    """``(table, SourceFile)`` of a Parquet or Arrow (``kind``) input file: its rows (the first ``limit``) and hash."""
    table = open_parquet(given, path) if kind == "parquet" else open_arrow(given, path)
    if limit is not None:
        table = table.slice(0, limit)
    return table, SourceFile(given, kind, table.num_rows, file_sha256(path))


def open_parquet(given: str, path: Path):
    """The rows of Parquet file ``path`` (named ``given`` in messages), read whole."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{given}: cannot read Parquet ({exc})") from None


def open_arrow(given: str, path: Path):
    """The rows of Arrow IPC file ``path`` (stream or file format; named ``given`` in messages), memory-mapped."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        try:
            return pa.ipc.open_file(pa.memory_map(str(path))).read_all()
        except pa.ArrowInvalid as exc:
            raise InputError(f"{given}: not an Arrow IPC stream or file ({exc})") from None


def _read_saved(given: str, path: Path, opts: SourceOptions) -> Source:
    ds, files_dir = load_saved(given, path, opts)
    return Source(ds, [SourceFile(given, "saved", len(ds), saved_sha256(files_dir))], list(ds.column_names))


def load_saved(given: str, path: Path, opts: SourceOptions):
    """``(dataset, files_dir)``: the ``save_to_disk`` dataset at ``path`` (its split ``opts.split``; memory-mapped,
    its first ``opts.max_rows`` rows) and the directory of its Arrow files."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several types here
        raise InputError(f"{given}: cannot load the saved dataset ({exc})") from None
    if isinstance(ds, datasets.DatasetDict):
        split = opts.split or ("train" if "train" in ds else None)
        if split not in ds:
            raise ConfigError(f"{given} is a DatasetDict with splits {list(ds)}; choose one with --split")
        ds = ds[split]
        files_dir = path / split
    else:
        if opts.split:
            raise ConfigError(f"{given} is a single Dataset; --split {opts.split!r} does not apply")
        files_dir = path
    if opts.max_rows is not None:
        ds = row_range(ds, 0, min(opts.max_rows, len(ds)))
    return ds, files_dir


def row_range(ds, start: int, stop: int):
    """Rows ``[start, stop)`` of the ``datasets.Dataset`` ``ds``: a zero-copy slice, with a fingerprint of our own.

    ``datasets`` would otherwise hash the arguments of ``select``, inside a bare ``except`` that swallows a signal
    arriving meanwhile (it then warns that the hash failed); the slice's fingerprint follows from ``ds``'s."""
    fingerprint = bytes_sha256(f"{ds._fingerprint}:rows:{int(start)}:{int(stop)}")[:32]
    return ds.select(range(int(start), int(stop)), new_fingerprint=fingerprint)


def saved_sha256(files_dir: Path) -> str:
    """The content hash of a ``save_to_disk`` dataset: of its Arrow files' hashes, in name order."""
    return bytes_sha256("".join(file_sha256(p) for p in sorted(Path(files_dir).glob("*.arrow"))))


def _read_demo(demo: dict, opts: SourceOptions) -> Source:
    import datasets

    from thdpack.demo import generate_rows

    try:
        rows = generate_rows(**demo)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"input: demo: {exc}") from None
    if opts.max_rows is not None:
        rows = rows[: opts.max_rows]
    ds = datasets.Dataset.from_list(rows)
    desc = ",".join(f"{k}={demo[k]}" for k in sorted(demo))
    sha = bytes_sha256(json.dumps(rows, sort_keys=True))
    return Source(ds, [SourceFile(f"demo({desc})", "demo", len(rows), sha)], list(ds.column_names))


def json_fields(source: Source, rows: int = 100) -> list[str]:
    """The keys of the first ``rows`` JSON objects of ``source`` together, in the order first seen
    (a field absent from all of them is taken as missing from the input, not from each row)."""
    col = source.dataset.data.column(JSON_COLUMN)
    seen: dict[str, None] = {}
    for i in range(min(len(source.dataset), rows)):
        try:
            obj = json.loads(col[i].as_py())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(obj, dict):
            seen.update(dict.fromkeys(obj))
    return list(seen)


def first_json_problem(source: Source, rows: int = 100) -> str | None:
    """``FILE:LINE: why`` of the first of the first ``rows`` JSON rows of ``source`` that is not a JSON
    object (invalid JSON, or a list, string, ...); None when there is none."""
    col = source.dataset.data.column(JSON_COLUMN)
    for i in range(min(len(source.dataset), rows)):
        try:
            obj = json.loads(col[i].as_py())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return f"{source.where(i)}: invalid JSON ({exc})"
        except RecursionError:
            return f"{source.where(i)}: invalid JSON ({NESTED_TOO_DEEP})"
        if not isinstance(obj, dict):
            return f"{source.where(i)}: a JSON {type(obj).__name__}, not an object"
    return None


def json_columns(files: list[SourceFile], ds) -> list[str]:
    """Keys of the first parseable JSON object (to pick a format); [] if none parse."""
    col = ds.data.column(JSON_COLUMN)
    for i in range(min(len(ds), 100)):
        try:
            obj = json.loads(col[i].as_py())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            continue
        if isinstance(obj, dict):
            return list(obj)
    return []
