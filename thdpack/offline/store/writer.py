"""Writing planned packs as Arrow or Parquet data files, a chunk of packs at a time.

For each chunk the pieces of its packs are gathered from the tokenized rows with
one Arrow ``take`` and one numpy fancy index per column: no per-sample Python loop,
and memory bounded by the chunk, not the dataset.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from thdpack.offline.store.format import SAMPLE_VALUE_PREFIX, data_file_name, file_sha256
from thdpack.offline.store.gather import RowPieces
from thdpack.planning.plan import PackPlan
from thdpack.common.samples import IGNORE_INDEX

CHUNK_TOKENS = 1 << 22  # tokens per record batch / row group


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
    :data:`~thdpack.offline.tokenizing.row_formats.VALUE_COLUMN`): int64 when every row of ``rows`` (the
    planned ones) gave an integer, else float64."""
    from thdpack.offline.tokenizing.row_formats import VALUE_COLUMN, VALUE_IS_INT_COLUMN

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


def group_boundaries(tokens: np.ndarray, budget: int) -> list[int]:
    """Boundaries ``[0, ..., n]`` splitting consecutive items into groups of about ``budget`` tokens."""
    if tokens.size == 0:
        return [0, 0]
    group = (np.cumsum(tokens) - 1) // max(1, budget)
    starts = np.flatnonzero(np.diff(group)) + 1
    return [0] + starts.tolist() + [int(tokens.size)]


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
) -> dict:
    """Write the packs of ``plan`` in ``order`` to ``out_dir``.

    Args:
        token_table: ``pyarrow.Table`` with ``input_ids`` and ``targets`` list columns,
            one row per input row.
        sample_rows: ``[num_samples]`` input row of each planned sample
            (``plan.sample_index`` indexes it).
        order: ``[num_packs]`` the plan's pack indices in output order.
        row_offset: added to the ``sample_index`` written (an input slice's first row),
            so that it holds rows of the whole input while ``token_table`` holds the slice's.
        extra: more columns per pack (VLM builds: :class:`thdpack.offline.store.vision_columns.VisionColumns`):
            ``fields()``, ``pack_bytes(plan, sample_rows)`` (their bytes per pack, for sizing
            data files and record batches) and ``columns(rows, counts)`` (rows of ``token_table``).
        values: ``{name: [rows of token_table]}`` per-sample values (:func:`sample_value_arrays`),
            written as ``sample_values.NAME`` columns: one entry per sample like ``seq_lens``.

    Returns:
        ``{"files": [{"path", "num_packs", "num_tokens", "num_bytes", "sha256"}], "target_tokens": int}``
    """
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm.auto import tqdm

    num_packs = len(plan)
    fill = np.add.reduceat(plan.length, plan.pack_offsets[:-1]) if num_packs else np.zeros(0, np.int64)
    fill = fill[order]
    bytes_per_token = 4 + (0.125 if targets == "loss_mask" else 4)
    file_cuts = group_boundaries(fill, int(file_size_mb * 1e6 / bytes_per_token))
    chunk_weight, chunk_budget = fill, CHUNK_TOKENS
    sch = schema(targets)
    if extra is not None:  # size data files and record batches by bytes, extra columns included
        for f in extra.fields():
            sch = sch.append(f)
        chunk_weight = (fill * bytes_per_token).astype(np.int64) + extra.pack_bytes(plan, sample_rows)[order]
        chunk_budget = int(CHUNK_TOKENS * bytes_per_token)
        file_cuts = group_boundaries(chunk_weight, int(file_size_mb * 1e6))
    values = values or {}
    for f in value_fields(values):
        sch = sch.append(f)
    n_files = len(file_cuts) - 1
    readers = {name: RowPieces(token_table, name) for name in ("input_ids", targets)}
    files, target_tokens = [], 0
    bar = tqdm(total=num_packs, desc="Writing packs", unit="pack", disable=not progress, leave=False)
    for s in range(n_files):
        a, b = file_cuts[s], file_cuts[s + 1]
        name = data_file_name(s, n_files, file_format)
        path = out_dir / name
        if file_format == "arrow":
            sink = pa.OSFile(str(path), "wb")
            writer = pa.ipc.new_stream(sink, sch)
        else:
            sink = None
            writer = pq.ParquetWriter(str(path), sch, compression="zstd")
        try:
            chunk_cuts = group_boundaries(chunk_weight[a:b], chunk_budget)
            for c in range(len(chunk_cuts) - 1):
                ks = order[a + chunk_cuts[c] : a + chunk_cuts[c + 1]]
                batch, n_targets = _chunk(readers, targets, plan, sample_rows, ks, sch, row_offset, extra, values)
                target_tokens += n_targets
                if file_format == "arrow":
                    writer.write_batch(batch)
                else:
                    writer.write_table(pa.Table.from_batches([batch], sch))
                bar.update(len(ks))
        finally:
            writer.close()
            if sink is not None:
                sink.close()
        files.append(
            {
                "path": name,
                "num_packs": int(b - a),
                "num_tokens": int(fill[a:b].sum()),
                "num_bytes": path.stat().st_size,
                "sha256": file_sha256(path),
            }
        )
    bar.close()
    return {"files": files, "target_tokens": int(target_tokens)}


def _chunk(readers: dict, targets: str, plan: PackPlan, sample_rows: np.ndarray, ks: np.ndarray, sch,
           row_offset: int = 0, extra=None, values: dict | None = None):
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
        pa.ListArray.from_arrays(pa.array(smp_offsets), pa.array(rows.astype(np.int64) + row_offset)),
        pa.ListArray.from_arrays(pa.array(smp_offsets), pa.array(pstart.astype(np.int32))),
    ]
    if extra is not None:
        arrays += extra.columns(rows, counts)
    arrays += [pa.ListArray.from_arrays(pa.array(smp_offsets), pa.array(v[rows])) for v in (values or {}).values()]
    return pa.RecordBatch.from_arrays(arrays, schema=sch), n_targets
