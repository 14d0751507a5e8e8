"""Input files cut into parts that a worker reads on its own, where the data is (``engine: ray``).

A :class:`FilePart` is a piece of one input file, read with the local reader's rules
(:mod:`~thdpack.offline.inputs.sources`), so that its rows are those the local build reads:

- ``lines``: uncompressed JSON Lines, the lines that *start* in bytes ``[start, stop)`` (a cut that falls
  inside a line gives the line to the part it starts in: every line is in exactly one part, whatever the
  cuts), kept as raw bytes (:func:`~thdpack.offline.inputs.jsonl.json_lines`);
- ``row_groups``: Parquet row groups ``[start, stop)``;
- ``file``: the whole file, by the local reader (JSON arrays and ``.gz`` files, Arrow IPC files, memory-mapped,
  Parquet files read whole);

and of those rows ``[skip, skip + take)`` (``max_rows``, an input slice, an Arrow file or a large row group cut
into several parts). :meth:`FilePart.count` reads a part and keeps only its row count (and JSON Lines' line
numbers); :meth:`FilePart.read` gives its rows. :class:`FileParts` holds an input's parts in order, with the
columns of the whole input (the files' schemas unified as the local build concatenates them), and reads
part ``r`` as the ``datasets.Dataset`` the tokenizing map takes.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from thdpack.offline.inputs.jsonl import json_lines
from thdpack.offline.inputs.sources import (JSON_COLUMN, check_utf8_start, concat_rows, map_file, open_arrow,
                                           open_parquet, read_json_file)

MIN_PART_BYTES = 1 << 16  # a JSON Lines part: at least 64 KiB of the file ...
MAX_PART_BYTES = 1 << 26  # ... and at most 64 MiB (what one worker holds of it at a time)


@dataclass(frozen=True)
class PartCount:
    """What counting a part found (:meth:`FilePart.count`)."""

    rows: int
    newlines: int = 0  # ``lines`` parts: newline bytes in the part (the lines before the next part)
    lines: np.ndarray | None = None  # 1-based line of each row within the part (file: within the file); None: 1..rows
    kind: str | None = None  # ``file`` parts of JSON: jsonl or json (an array), as the local reader tells them
    sha256: str | None = None  # ``file`` parts read whole: the file's hash, computed as it was read
    schema: object = None  # ``file`` parts of Arrow: the file's pyarrow.Schema


@dataclass(frozen=True)
class FilePart:
    """A piece of input file ``path`` (named ``given``) that one worker reads (see the module docstring)."""

    path: str
    given: str
    kind: str  # lines | row_groups | file
    reader: str  # json | parquet | arrow: the local reader whose rules apply
    start: int = 0  # lines: first byte; row_groups: first row group
    stop: int = 0  # lines: last byte + 1; row_groups: last row group + 1
    skip: int = 0  # rows of the part left out before the ones kept
    take: int | None = None  # rows of the part kept (None: all after skip)

    def count(self) -> PartCount:
        """Read the part; its :class:`PartCount` (the rows are not kept)."""
        if self.kind == "lines":
            raw = map_file(Path(self.path))  # unmapped when the last view of it goes
            return _count_lines(raw, line_start(raw, self.start), line_start(raw, self.stop))
        if self.reader == "json":  # a JSON array or a .gz file: read whole, as the local reader does
            sf = read_json_file(self.given, Path(self.path), "jsonl", None)[1]
            return PartCount(sf.num_rows, lines=_unless_plain(sf.line_numbers), kind=sf.kind, sha256=sf.sha256)
        if self.reader == "arrow":
            table = open_arrow(self.given, Path(self.path))
            return PartCount(table.num_rows, schema=table.schema)
        raise ValueError(f"a {self.kind} part of a {self.reader} file is not counted (its metadata has its rows)")

    def read(self):
        """The part's rows (``[skip, skip + take)`` of them), a ``pyarrow.Table`` in the file's own columns."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.kind == "lines":
            raw = map_file(Path(self.path))
            a, b = line_start(raw, self.start), line_start(raw, self.stop)
            table = pa.table({JSON_COLUMN: json_lines(memoryview(raw)[a:b] if b > a else b"")[0]})
        elif self.kind == "row_groups":
            table = pq.ParquetFile(self.path).read_row_groups(range(self.start, self.stop))
        elif self.reader == "json":
            table = read_json_file(self.given, Path(self.path), "jsonl", None)[0]
        elif self.reader == "arrow":
            table = open_arrow(self.given, Path(self.path))
        else:
            table = open_parquet(self.given, Path(self.path))
        return table.slice(self.skip, self.take) if self.skip or self.take is not None else table


def line_start(raw, pos: int) -> int:
    """The first line start at or after byte ``pos`` of ``raw`` (a line starts at 0 and after each newline)."""
    if pos <= 0:
        return 0
    if pos >= len(raw):
        return len(raw)
    if raw[pos - 1] == 10:
        return pos
    nl = raw.find(b"\n", pos)
    return len(raw) if nl < 0 else nl + 1


def byte_cuts(size: int, part_bytes: int) -> list[int]:
    """``[0, ..., size]``: cuts of a file of ``size`` bytes into parts of about ``part_bytes``."""
    n = max(1, -(-size // max(1, part_bytes)))
    return [size * k // n for k in range(n + 1)]


def _count_lines(raw, a: int, b: int) -> PartCount:
    """The :class:`PartCount` of the lines of ``raw[a:b]``."""
    if b <= a:
        return PartCount(0)
    part = memoryview(raw)[a:b]
    rows, numbers = json_lines(part)
    return PartCount(len(rows), int(np.count_nonzero(np.frombuffer(part, np.uint8) == 10)), _unless_plain(numbers))


def _unless_plain(numbers) -> np.ndarray | None:
    """``numbers`` (1-based line of each row), or None when they are just 1, 2, ..., n."""
    if numbers is None:
        return None
    numbers = np.asarray(numbers, np.int64)
    return None if np.array_equal(numbers, np.arange(1, numbers.size + 1)) else numbers


def first_json_byte(given: str, path: Path) -> bytes:
    """The first non-blank byte of uncompressed JSON file ``path`` (``[`` for an array; ``b""`` when blank), read
    from its start as the local reader looks at it, its first 64 KiB checked to be UTF-8 the same way."""
    with open(path, "rb") as f:
        start = f.read(1 << 16)
        check_utf8_start(given, start)
        block = start
        while block and not block.strip():
            block = f.read(1 << 20)
    return block.lstrip()[:1]


@dataclass(frozen=True)
class LineNumbers:
    """The 1-based line of each row of a JSON Lines file read in ``lines`` parts, indexed like an array
    (``numbers[row]``): per part, its first row, the lines before it and its rows' lines (None: one row a line)."""

    first_rows: list[int]
    line_offsets: list[int]
    lines: list  # per part: int64 array of lines within the part, or None

    def __getitem__(self, row: int) -> int:
        k = bisect.bisect_right(self.first_rows, int(row)) - 1
        local = int(row) - self.first_rows[k]
        within = local + 1 if self.lines[k] is None else int(self.lines[k][local])
        return self.line_offsets[k] + within


@dataclass(frozen=True)
class FileParts:
    """An input's rows as parts, in order (the rows ``sum(rows)``), read where they run.

    ``schema``: the whole input's columns (None for JSON rows: one raw column); ``columns``: the columns read
    (the tokenizing map's), None for all; ``labels``: each part's rows as messages name them."""

    parts: tuple  # FilePart
    rows: tuple  # int, rows of each part
    labels: tuple  # str, e.g. "data.jsonl rows 0..999 (lines 1..1000)"
    schema: object = None
    columns: tuple | None = None
    starts: np.ndarray = field(init=False, repr=False)  # int64 [parts + 1]: the first row of each part

    def __post_init__(self):
        object.__setattr__(self, "starts", np.concatenate([[0], np.cumsum(self.rows, dtype=np.int64)]))

    @property
    def num_parts(self) -> int:
        return len(self.parts)

    @property
    def num_rows(self) -> int:
        return int(self.starts[-1])

    def part_rows(self, r: int) -> int:
        return int(self.rows[r])

    def describe(self, r: int) -> str:
        return self.labels[r]

    def with_columns(self, columns) -> "FileParts":
        return replace(self, columns=tuple(columns))

    def table(self, r: int):
        """Part ``r``'s rows as a ``pyarrow.Table`` in the whole input's columns."""
        table = self.parts[r].read()
        if self.schema is not None and table.schema != self.schema:
            table = concat_rows([self.schema.empty_table(), table])  # the local build's unification
        return table

    def read(self, r: int):
        """Part ``r``'s rows as a ``datasets.Dataset`` of :attr:`columns` (what the local map reads of them)."""
        import datasets
        from datasets.table import InMemoryTable

        ds = datasets.Dataset(InMemoryTable(self.table(r)))
        return ds if self.columns is None or list(self.columns) == ds.column_names else ds.select_columns(
            list(self.columns))

    def head(self, n: int):
        """The first ``n`` rows (fewer when there are fewer), a ``pyarrow.Table`` in the whole input's columns."""
        tables, left = [], n
        for r in range(self.num_parts):
            if left <= 0:
                break
            if self.rows[r]:
                t = self.table(r).slice(0, left)
                tables.append(t)
                left -= t.num_rows
        return concat_rows(tables) if tables else None

    def between(self, start: int, stop: int) -> "FileParts":
        """The parts of rows ``[start, stop)`` (an input slice), cut where they overlap it."""
        parts, rows, labels = [], [], []
        for r, part in enumerate(self.parts):
            a, b = max(start, int(self.starts[r])), min(stop, int(self.starts[r + 1]))
            if a >= b:
                continue
            skip = a - int(self.starts[r])
            parts.append(replace(part, skip=part.skip + skip, take=b - a))
            rows.append(b - a)
            labels.append(self.labels[r] if b - a == self.rows[r] else f"{self.labels[r]}, its rows {skip}..{skip + b - a - 1}")
        return FileParts(tuple(parts), tuple(rows), tuple(labels), self.schema, self.columns)
