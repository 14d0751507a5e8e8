"""Writing planned packs as Arrow or Parquet data files, a chunk of packs at a time.

For each chunk the pieces of its packs are gathered from the tokenized rows with
one Arrow ``take`` and one numpy fancy index per column: no per-sample Python loop,
and memory bounded by the chunk, not the dataset.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from thdpack.offline.procs import check_signals
from thdpack.offline.store.schema import SAMPLE_VALUE_PREFIX, VALUE_COLUMN, VALUE_IS_INT_COLUMN, data_file_name, file_sha256
from thdpack.offline.store.gather import CHUNK_TOKENS, RowPieces, group_boundaries
from thdpack.planning.plan import PackPlan
from thdpack.common.samples import IGNORE_INDEX


def schema(targets: str):
    import pyarrow as pa

    target_type = pa.bool_() if targets == "loss_mask" else pa.int32()
    return pa.schema(
        [
            ("input_ids", pa.list_(pa.int32())),
            (targets, pa.list_(target_type)),
            ("seq_lens", pa.list_(pa.int32())),
            ("sample_index", pa.list_(pa.int64())),
            ("sample_start", pa.list_(pa.int32())),
        ]
    )


def sample_value_arrays(token_table, names: list[str], rows: np.ndarray) -> dict[str, np.ndarray]:
    """``{name: [tokenized rows]}`` the ``sample_values`` of the tokenized rows (columns
    :data:`~thdpack.offline.store.schema.VALUE_COLUMN`): int64 when every row of ``rows`` (the
    planned ones) gave an integer, else float64."""

    out = {}
    for name in names:
        values = token_table.column(VALUE_COLUMN.format(name)).to_numpy()
        is_int = token_table.column(VALUE_IS_INT_COLUMN.format(name)).to_numpy(zero_copy_only=False)
        out[name] = values.astype(np.int64) if bool(is_int[rows].all()) else values
    return out


def value_fields(values: dict):
    """The Arrow fields of the ``sample_values`` columns (``sample_values.NAME``: list<int64 | double>)."""
    import pyarrow as pa

    return [pa.field(SAMPLE_VALUE_PREFIX + name, pa.list_(pa.from_numpy_dtype(v.dtype))) for name, v in values.items()]


def write_packs(
    out_dir: Path,
    token_table,
    targets: str,
    plan: PackPlan,
    sample_rows: np.ndarray,
    order: np.ndarray,
    *,
    file_format: str = "arrow",
    file_size_mb: float = 512,
    progress: bool = True,
    row_offset: int = 0,
    extra=None,
    values: dict | None = None,
    columns: dict | None = None,
) -> dict:
    """Write the packs of ``plan`` in ``order`` to ``out_dir``.

    Args:
        token_table: ``pyarrow.Table`` with ``input_ids`` and ``targets`` list columns,
            one row per input row.
        sample_rows: ``[num_samples]`` input row of each planned sample
            (``plan.sample_index`` indexes it).
        order: ``[num_packs]`` the plan's pack indices in output order.
        row_offset: added to the ``sample_index`` written (an input slice's first row),
            so that it holds rows of the whole input while ``token_table`` holds the slice's; or int64
            ``[rows of token_table]`` the ``sample_index`` of each row (a mixture's: its row within its source).
        extra: more columns per pack (VLM builds: :class:`thdpack.offline.store.vision_columns.VisionColumns`):
            ``fields()``, ``pack_bytes(plan, sample_rows)`` (their bytes per pack, for sizing
            data files and record batches) and ``columns(rows, counts)`` (rows of ``token_table``).
        values: ``{name: [rows of token_table]}`` per-sample values (:func:`sample_value_arrays`),
            written as ``sample_values.NAME`` columns: one entry per sample like ``seq_lens``.
        columns: ``{column: [rows of token_table]}`` more per-sample columns, written under their own names
            (``share_prefix`` builds: ``group_id`` int64 and ``prefix_len`` int32,
            :data:`thdpack.offline.store.schema.PREFIX_COLUMNS`).

    Returns:
        ``{"files": [{"path", "num_packs", "num_tokens", "num_bytes", "sha256"}], "target_tokens": int}``
    """
    from tqdm.auto import tqdm

    files = pack_files(token_table, targets, plan, sample_rows, order, file_format=file_format,
                       file_size_mb=file_size_mb, row_offset=row_offset, extra=extra, values=values, columns=columns)
    bar = tqdm(total=len(plan), desc="Writing packs", unit="pack", disable=not progress, leave=False)
    written = [files.write(out_dir, s, bar) for s in range(files.num_files)]
    bar.close()
    return files.result(written)


def pack_files(token_rows, targets: str, plan: PackPlan, sample_rows: np.ndarray, order: np.ndarray, *,
               file_format: str = "arrow", file_size_mb: float = 512, row_offset: int = 0, extra=None,
               values: dict | None = None, columns: dict | None = None) -> "PackFiles":
    """The :class:`PackFiles` of :func:`write_packs`'s arguments (``token_rows``: its ``token_table``, or a
    file-backed ``datasets.Dataset`` of the tokenized rows, which pickles as its file paths)."""
    values, columns = values or {}, columns or {}
    sch = _pack_schema(targets, extra, values, columns)
    sizing = _file_sizing(plan, order, targets, file_size_mb, extra, sample_rows)
    writer = _PackWriter(token_rows, targets, plan, sample_rows, sch, file_format, row_offset, extra, values, columns)
    return PackFiles(writer, sizing, order)


@dataclass(frozen=True)
class PackFiles:
    """:func:`write_packs`'s work cut into data files, each written on its own: by this process in
    order, or by any process that unpickles it (``engine: ray``: one Ray task per file)."""

    writer: "_PackWriter"
    sizing: "_FileSizing"
    order: np.ndarray  # int64 [num_packs]: pack indices in output order

    @property
    def num_files(self) -> int:
        return len(self.sizing.file_cuts) - 1

    def write(self, out_dir: Path, s: int, bar=None) -> tuple[dict, int]:
        """Write data file ``s`` into ``out_dir``: its ``files`` entry of :func:`write_packs`'s result
        and its target tokens. Advances the progress ``bar`` (if any) by each record batch's packs."""
        a, b = self.sizing.file_cuts[s], self.sizing.file_cuts[s + 1]
        name = data_file_name(s, self.num_files, self.writer.file_format)
        path = out_dir / name
        target_tokens = self.writer.write_file(path, self.order[a:b], self.sizing.chunk_weight[a:b],
                                               self.sizing.chunk_budget, bar)
        entry = {
            "path": name,
            "num_packs": int(b - a),
            "num_tokens": int(self.sizing.fill[a:b].sum()),
            "num_bytes": path.stat().st_size,
            "sha256": file_sha256(path),
        }
        return entry, target_tokens

    def describe(self, s: int) -> str:
        """``data file NAME (packs A..B of the output order)``, for messages."""
        a, b = self.sizing.file_cuts[s], self.sizing.file_cuts[s + 1]
        return f"data file {data_file_name(s, self.num_files, self.writer.file_format)} (packs {a}..{b - 1})"

    @staticmethod
    def result(written: list[tuple[dict, int]]) -> dict:
        """:func:`write_packs`'s result from every file's :meth:`write`, in file order."""
        return {"files": [entry for entry, _ in written], "target_tokens": int(sum(t for _, t in written))}


def _pack_schema(targets: str, extra, values: dict, columns: dict | None = None):
    """The data files' Arrow schema: the token columns, ``extra``'s fields, the ``values`` columns, the
    per-sample ``columns``."""
    import pyarrow as pa

    sch = schema(targets)
    if extra is not None:
        for f in extra.fields():
            sch = sch.append(f)
    for f in value_fields(values):
        sch = sch.append(f)
    for name, v in (columns or {}).items():
        sch = sch.append(pa.field(name, pa.list_(pa.from_numpy_dtype(v.dtype))))
    return sch


@dataclass(frozen=True)
class _FileSizing:
    """How :func:`write_packs` cuts the packs, in output order, into data files and record batches."""

    fill: np.ndarray  # int64 [num_packs]: real tokens of each pack
    file_cuts: list[int]  # pack boundaries of the data files, [0, ..., num_packs]
    chunk_weight: np.ndarray  # [num_packs]: each pack's tokens, or its bytes when there are extra columns
    chunk_budget: int  # the weight of one record batch


def _file_sizing(plan: PackPlan, order: np.ndarray, targets: str, file_size_mb: float, extra,
                 sample_rows: np.ndarray) -> _FileSizing:
    """Data files of about ``file_size_mb`` and record batches of about :data:`CHUNK_TOKENS` tokens,
    counted in bytes (extra columns included) when there are ``extra`` columns."""
    num_packs = len(plan)
    fill = np.add.reduceat(plan.length, plan.pack_offsets[:-1]) if num_packs else np.zeros(0, np.int64)
    fill = fill[order]
    bytes_per_token = 4 + (0.125 if targets == "loss_mask" else 4)
    if extra is None:
        return _FileSizing(fill, group_boundaries(fill, int(file_size_mb * 1e6 / bytes_per_token)), fill, CHUNK_TOKENS)
    weight = (fill * bytes_per_token).astype(np.int64) + extra.pack_bytes(plan, sample_rows)[order]
    return _FileSizing(fill, group_boundaries(weight, int(file_size_mb * 1e6)), weight,
                       int(CHUNK_TOKENS * bytes_per_token))


@dataclass(frozen=True)
class _PackWriter:
    """Writes packs of ``plan`` as record batches of schema ``sch`` into Arrow or Parquet data files
    (the arguments of :func:`write_packs`; ``token_rows``: as :func:`pack_files` takes them)."""

    token_rows: object
    targets: str
    plan: PackPlan
    sample_rows: np.ndarray
    sch: object  # pyarrow.Schema
    file_format: str
    row_offset: object  # int, or int64 [rows] (write_packs)
    extra: object
    values: dict
    columns: dict = field(default_factory=dict)  # per-sample columns under their own names (pack_files)
    _readers: dict = field(default_factory=dict, repr=False, compare=False)  # made at the first write

    def readers(self) -> dict:
        """A :class:`RowPieces` of the tokenized rows per token column (made once per process)."""
        if not self._readers:
            table = self.token_rows.data.table if hasattr(self.token_rows, "data") else self.token_rows
            self._readers.update({name: RowPieces(table, name) for name in ("input_ids", self.targets)})
        return self._readers

    def __getstate__(self):  # a pickled writer (a Ray task's) makes its own readers
        return {**self.__dict__, "_readers": {}}

    def __setstate__(self, state):
        self.__dict__.update(state)

    def write_file(self, path: Path, packs: np.ndarray, weights: np.ndarray, budget: int, bar) -> int:
        """Write ``packs`` (int64 ``[k]`` pack indices in output order) as one data file at ``path``, in
        record batches of about ``budget`` (``weights``: ``[k]`` each pack's); its target tokens.
        Advances the progress ``bar`` by each batch's packs."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self.file_format == "arrow":
            sink = pa.OSFile(str(path), "wb")
            writer = pa.ipc.new_stream(sink, self.sch)
        else:
            sink = None
            writer = pq.ParquetWriter(str(path), self.sch, compression="zstd")
        readers = self.readers()
        target_tokens = 0
        try:
            chunk_cuts = group_boundaries(weights, budget)
            for c in range(len(chunk_cuts) - 1):
                check_signals()
                ks = packs[chunk_cuts[c] : chunk_cuts[c + 1]]
                batch, n_targets = _chunk(readers, self.targets, self.plan, self.sample_rows, ks, self.sch,
                                          self.row_offset, self.extra, self.values, self.columns)
                target_tokens += n_targets
                if self.file_format == "arrow":
                    writer.write_batch(batch)
                else:
                    writer.write_table(pa.Table.from_batches([batch], self.sch))
                if bar is not None:
                    bar.update(len(ks))
        finally:
            writer.close()
            if sink is not None:
                sink.close()
        return target_tokens


def _chunk(readers: dict, targets: str, plan: PackPlan, sample_rows: np.ndarray, ks: np.ndarray, sch,
           row_offset: int = 0, extra=None, values: dict | None = None, columns: dict | None = None):
    """One record batch holding packs ``ks``; also its number of target tokens. ``readers``:
    a :class:`~thdpack.offline.store.gather.RowPieces` of the tokenized rows per token column."""
    import pyarrow as pa

    starts = plan.pack_offsets[ks]
    counts = plan.pack_offsets[ks + 1] - starts
    n_pieces = int(counts.sum())
    first_piece = np.cumsum(counts) - counts  # first piece of each pack, within the chunk
    piece = np.repeat(starts, counts) + (np.arange(n_pieces) - np.repeat(first_piece, counts))
    rows = sample_rows[plan.sample_index[piece]]
    pstart = plan.start[piece]
    plen = plan.length[piece]

    piece_first = np.cumsum(plen) - plen  # first token of each piece in the output stream
    out = {name: readers[name].gather(rows, pstart, plen) for name in ("input_ids", targets)}
    tgt = out[targets]
    is_target = tgt if targets == "loss_mask" else tgt != IGNORE_INDEX
    n_targets = int(is_target.sum()) - int(is_target[piece_first].sum())  # a sample's first token is never a target

    pack_tokens = np.add.reduceat(plen, first_piece) if len(ks) else np.zeros(0, np.int64)
    tok_offsets = np.zeros(len(ks) + 1, dtype=np.int32)
    np.cumsum(pack_tokens, out=tok_offsets[1:])
    smp_offsets = np.zeros(len(ks) + 1, dtype=np.int32)
    np.cumsum(counts, out=smp_offsets[1:])
    arrays = [
        pa.ListArray.from_arrays(pa.array(tok_offsets), pa.array(out["input_ids"], pa.int32())),
        pa.ListArray.from_arrays(pa.array(tok_offsets), pa.array(tgt, sch.field(targets).type.value_type)),
        pa.ListArray.from_arrays(pa.array(smp_offsets), pa.array(plen.astype(np.int32))),
        pa.ListArray.from_arrays(pa.array(smp_offsets), pa.array(
            row_offset[rows] if isinstance(row_offset, np.ndarray) else rows.astype(np.int64) + row_offset)),
        pa.ListArray.from_arrays(pa.array(smp_offsets), pa.array(pstart.astype(np.int32))),
    ]
    if extra is not None:
        arrays += extra.columns(rows, counts)
    per_sample = [*(values or {}).values(), *(columns or {}).values()]
    arrays += [pa.ListArray.from_arrays(pa.array(smp_offsets), pa.array(v[rows])) for v in per_sample]
    return pa.RecordBatch.from_arrays(arrays, schema=sch), n_targets
