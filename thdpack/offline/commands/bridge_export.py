"""Megatron-Bridge's packed SFT format: ``thdpack build --output-format megatron-bridge`` and
``thdpack export PATH --to megatron-bridge OUT``.

Bridge's packed-Parquet reader (``GPTSFTPackedParquetDataset`` in
``megatron/bridge/data/packing/parquet.py``, whose ``collate_fn`` is ``GPTSFTPackedDataset``'s in
``packing/gpt_sft.py``, megatron-bridge 0.6.2) reads ``*.parquet`` files with one row per pack:

=================  ============  ==========================================================
column             Arrow type    meaning
=================  ============  ==========================================================
``input_ids``      list<int32>   the pack's stored samples back to back
``loss_mask``      list<int8>    1 = the *next* token of the sample is a target
``seq_start_id``   list<int32>   where each stored sample starts in the pack
=================  ============  ==========================================================

The reader drops each stored sample's last token (it has no next token) and takes labels
from the following token, so a sample of ``s`` tokens is ``s - 1`` tokens in Bridge's
stream, and Bridge's ``cu_seqlens`` are thdpack's minus one per sample. With THD context
parallelism (``pad_seq_to_mult`` = ``m`` > 1) each stored sample is pre-padded with the EOS
id (``loss_mask`` 0) to ``ceil(s - 1, m) + 1`` tokens, as Bridge's own packer does
(``_pre_pad_data_point`` in ``packing/offline.py``): ``cu_seqlens_padded`` are the stored
lengths minus one, and the logical ``cu_seqlens`` end at the last non-EOS token of what the
reader streams of each sample (so a padded sample whose last token is not EOS counts ``s``).

Details: docs/megatron.md, "Bridge export: units, metadata file".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thdpack.offline.errors import ConfigError, InputError
from thdpack.offline.procs import check_signals, signals_deferred
from thdpack.offline.store.schema import file_sha256
from thdpack.offline.store.staging import fsync_dir, fsync_file, move_into_place, staged_output
from thdpack.common.samples import IGNORE_INDEX

FORMAT = "megatron-bridge"
METADATA = "bridge_metadata.json"  # Bridge's packed_metadata_path (a JSON list of dicts)
SUFFIX = ".idx.parquet"  # what Bridge's path resolution recognises as a packed Parquet file
ROW_GROUP = 500  # rows per Parquet row group, as Bridge's own writer (its reader caches one group)
SETTINGS = ("metadata", "pad_seq_to_mult", "pad_id", "pack_size")  # of the metadata.json record: equal across slice builds
PAD_ID_MAX = 2**31 - 1  # Bridge's input_ids are int32
logger = logging.getLogger(__name__)


def bridge_lengths(seq_lens: np.ndarray, multiple: int) -> np.ndarray:
    """int64 ``[n]``: each sample's length in Bridge's stream (its ``cu_seqlens_padded`` steps):
    ``s - 1`` tokens (the last one only serves as a label), rounded up to ``multiple``."""
    run = np.maximum(np.asarray(seq_lens, np.int64) - 1, 0)
    return -(-run // multiple) * multiple


@dataclass
class BridgeRows:
    """The Bridge rows of a batch of packs (numpy, ready for Arrow list arrays).

    ``tok_offsets`` int64 ``[P+1]`` into ``input_ids`` (int32) and ``loss_mask`` (int8);
    ``sample_offsets`` int64 ``[P+1]`` into ``seq_start_id`` (int32, relative to its pack);
    ``pack_runtime`` int64 ``[P]``: each pack's tokens in Bridge's stream;
    ``runtime`` int64 ``[N]``: each sample's (:func:`bridge_lengths`);
    ``eos_tail`` int: samples whose ``cu_seqlens`` Bridge's reader ends early (see :func:`convert`)."""

    tok_offsets: np.ndarray
    input_ids: np.ndarray
    loss_mask: np.ndarray
    sample_offsets: np.ndarray
    seq_start_id: np.ndarray
    pack_runtime: np.ndarray
    runtime: np.ndarray
    eos_tail: int


def convert(ids: np.ndarray, is_target: np.ndarray, sample_offsets: np.ndarray, seq_lens: np.ndarray,
            multiple: int, pad_id: int) -> BridgeRows:
    """thdpack packs -> Bridge rows, all packs of a record batch at once.

    Args:
        ids: int ``[T]`` the packs' tokens back to back; ``is_target``: bool ``[T]``, token t is a
            target (predicted from token t-1 of its sample; a sample's first token never is).
        sample_offsets: int64 ``[P+1]`` offsets of each pack's samples in ``seq_lens`` (from 0).
        seq_lens: int ``[N]`` real length of each sample (they tile ``ids``, pack after pack).
        multiple: Bridge's ``pad_seq_to_mult`` the samples are pre-padded for (1: no padding).
        pad_id: the token the pre-padding uses (Bridge's EOS id).

    ``eos_tail`` counts the samples that Bridge's reader cuts short: with ``multiple`` > 1 it ends a
    sample's logical length at the last non-EOS token it streams, so a sample whose token
    ``s - 2`` is ``pad_id`` (and token ``s - 1`` too, where padding makes it streamed) gets fewer
    than ``s - 1`` tokens in its ``cu_seqlens``; the rest are treated as padding.
    """
    lens = np.asarray(seq_lens, np.int64)
    runtime = bridge_lengths(lens, multiple)
    stored = runtime + 1
    in_start = np.cumsum(lens) - lens
    out_start = np.cumsum(stored) - stored
    dest = np.arange(lens.sum(), dtype=np.int64) + np.repeat(out_start - in_start, lens)

    out_ids = np.full(int(stored.sum()), pad_id, dtype=np.int32)
    out_ids[dest] = ids
    shifted = np.zeros(ids.size, dtype=np.int8)  # Bridge's loss_mask[t]: token t+1 is a target
    shifted[:-1] = is_target[1:]
    shifted[in_start + lens - 1] = 0  # the last token of a sample predicts nothing of it
    out_mask = np.zeros(out_ids.size, dtype=np.int8)
    out_mask[dest] = shifted

    counts = np.diff(sample_offsets)
    pack_first = sample_offsets[:-1]
    pack_stored = np.add.reduceat(stored, pack_first) if counts.size else np.zeros(0, np.int64)
    out_offsets = np.zeros(counts.size + 1, np.int64)
    np.cumsum(pack_stored, out=out_offsets[1:])
    seq_start = (out_start - np.repeat(out_offsets[:-1], counts)).astype(np.int32)
    pack_runtime = np.add.reduceat(runtime, pack_first) if counts.size else np.zeros(0, np.int64)
    eos_tail = _cut_short(ids, in_start, lens, runtime, pad_id) if multiple > 1 else 0
    return BridgeRows(out_offsets, out_ids, out_mask, sample_offsets.astype(np.int64), seq_start, pack_runtime,
                      runtime, eos_tail)


def _cut_short(ids: np.ndarray, in_start: np.ndarray, lens: np.ndarray, runtime: np.ndarray, pad_id: int) -> int:
    """How many samples end, in what Bridge streams of them, with a run of ``pad_id`` reaching
    back over token ``s - 2`` (see :func:`convert`)."""
    two = lens >= 2
    end = in_start[two] + lens[two]
    second_last = ids[end - 2] == pad_id
    streamed_last = runtime[two] >= lens[two]  # padding makes the reader stream token s - 1 too
    return int((second_last & (~streamed_last | (ids[end - 1] == pad_id))).sum())


def _list_values(batch, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets int64 [rows+1] from 0, values)`` of list column ``name`` of a record batch."""
    col = batch.column(name)
    off = np.asarray(col.offsets, dtype=np.int64)
    values = col.values.slice(int(off[0]), int(off[-1] - off[0])).to_numpy(zero_copy_only=False)
    return off - off[0], values


def _targets(batch, targets: str, ids: np.ndarray, tok_off: np.ndarray, where_pack) -> np.ndarray:
    """bool ``[T]``: which tokens of a record batch are targets. Bridge derives labels from the
    next token, so stored ``labels`` must equal the token ids wherever they are not -100."""
    _, values = _list_values(batch, targets)
    if targets == "loss_mask":
        return values.astype(bool)
    is_target = values != IGNORE_INDEX
    bad = np.flatnonzero(is_target & (values != ids))
    if bad.size:
        t = int(bad[0])
        j = int(np.searchsorted(tok_off, t, side="right")) - 1
        raise InputError(f"{where_pack(j)}, token {t - int(tok_off[j])}: label {int(values[t])} differs from the token "
                         f"{int(ids[t])}; Megatron-Bridge's packed format takes labels from the token ids, so it cannot "
                         "hold these packs: train them with thdpack's loader")
    return is_target


def _batch_rows(batch, targets: str, multiple: int, pad_id: int, where_pack) -> BridgeRows:
    tok_off, ids = _list_values(batch, "input_ids")
    smp_off, lens = _list_values(batch, "seq_lens")
    is_target = _targets(batch, targets, ids, tok_off, where_pack)
    return convert(ids, is_target, smp_off, lens, multiple, pad_id)


def _schema():
    import pyarrow as pa

    return pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
                      ("seq_start_id", pa.list_(pa.int32()))])


def _table(rows: BridgeRows):
    import pyarrow as pa

    def lists(offsets, values, kind):
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, kind))

    arrays = [lists(rows.tok_offsets, rows.input_ids, pa.int32()), lists(rows.tok_offsets, rows.loss_mask, pa.int8()),
              lists(rows.sample_offsets, rows.seq_start_id, pa.int32())]
    return pa.Table.from_arrays(arrays, schema=_schema())


@dataclass
class _Totals:
    """What Bridge's metadata list records, accumulated over the packs (Bridge's units)."""

    packs: int = 0
    samples: int = 0
    runtime_tokens: int = 0
    max_seqlen: int = 0
    max_samples: int = 0
    min_pack: int | None = None
    eos_tail: int = 0

    def add(self, rows: BridgeRows) -> None:
        if not rows.pack_runtime.size:
            return
        self.packs += int(rows.pack_runtime.size)
        self.samples += int(rows.runtime.size)
        self.runtime_tokens += int(rows.pack_runtime.sum())
        self.max_seqlen = max(self.max_seqlen, int(rows.runtime.max()))
        self.max_samples = max(self.max_samples, int(np.diff(rows.sample_offsets).max()))
        low = int(rows.pack_runtime.min())
        self.min_pack = low if self.min_pack is None else min(self.min_pack, low)
        self.eos_tail += rows.eos_tail

    def merge(self, other: "_Totals") -> None:
        """Add the totals of the packs of ``other`` (another data file's)."""
        if not other.packs:
            return
        self.packs += other.packs
        self.samples += other.samples
        self.runtime_tokens += other.runtime_tokens
        self.max_seqlen = max(self.max_seqlen, other.max_seqlen)
        self.max_samples = max(self.max_samples, other.max_samples)
        self.min_pack = other.min_pack if self.min_pack is None else min(self.min_pack, other.min_pack)
        self.eos_tail += other.eos_tail

    def bridge_metadata(self, pack_size: int) -> dict:
        """One entry of Bridge's metadata list (the keys of its ``create_packing_strategy``)."""
        return {
            "dataset_max_seqlen": self.max_seqlen,
            "max_samples_per_bin": self.max_samples,
            "packing_factor": round(self.samples / max(self.packs, 1), 2),
            "packing_efficiency": round(self.runtime_tokens / max(self.packs, 1) / pack_size * 100, 2),
            "pack_size": pack_size,
            "min_packed_seqlen": self.min_pack or 0,
        }


def _check_fits(rows: BridgeRows, pack_size: int, multiple: int, align: int, where_pack) -> None:
    over = np.flatnonzero(rows.pack_runtime > pack_size)
    if over.size:
        j = int(over[0])
        raise ConfigError(
            f"{where_pack(j)}: at pad_seq_to_mult={multiple} its samples take {int(rows.pack_runtime[j])} tokens in "
            f"Megatron-Bridge's stream, more than pack_size={pack_size}; export with a pad_seq_to_mult that divides "
            f"the build's alignment multiple ({align}), or rebuild with the cp_size / pad_multiple you train with"
        )


@dataclass(frozen=True)
class _Conversion:
    """How :func:`write_bridge` converts each data file (its arguments)."""

    targets: str
    pack_size: int
    multiple: int
    align: int
    pad: int

    def file(self, out_dir: str, data_file: str) -> tuple[dict, _Totals]:
        """Write Bridge's file of thdpack's ``data_file`` into ``out_dir``: its ``files`` entry and its totals."""
        import pyarrow.parquet as pq

        from thdpack.offline.store.dataset import read_data_file

        data_file = Path(data_file)
        name = data_file.name.rsplit(".", 1)[0] + SUFFIX
        path = Path(out_dir) / name
        totals = _Totals()
        with pq.ParquetWriter(str(path), _schema()) as writer:
            row = 0
            for batch in read_data_file(data_file, damaged="rebuild it").to_batches():
                check_signals()
                where_pack = (lambda j, r=row: f"{data_file}: pack {r + j}")
                rows = _batch_rows(batch, self.targets, self.multiple, self.pad, where_pack)
                _check_fits(rows, self.pack_size, self.multiple, self.align, where_pack)
                writer.write_table(_table(rows), row_group_size=ROW_GROUP)
                totals.add(rows)
                row += batch.num_rows
        fsync_file(path)
        return {"path": name, "num_packs": totals.packs, "num_bytes": path.stat().st_size,
                "sha256": file_sha256(path)}, totals


def convert_file_or_error(conversion: _Conversion, out_dir: str, data_file: str):
    """:meth:`_Conversion.file`, an :class:`~thdpack.offline.errors.OfflineError` returned rather than raised (a
    Ray task's: the build raises the first data file's, as the local loop meets them)."""
    try:
        return conversion.file(out_dir, data_file)
    except (ConfigError, InputError) as exc:
        return exc


def write_bridge(out_dir: Path, data_files: list[Path], *, targets: str, pack_size: int, multiple: int, align: int,
                 pad_id: int | None, run=None) -> dict:
    """Write the packs of thdpack's ``data_files`` (Arrow or Parquet, in order) as Bridge's packed
    Parquet files in ``out_dir`` (one ``<data file stem>.idx.parquet`` each) and its metadata list
    (:data:`METADATA`). Returns the record kept in thdpack's ``metadata.json`` under ``megatron_bridge``.
    ``run(function, shared, items)``: runs ``[function(shared, *item) for item in items]`` elsewhere (an
    ``engine: ray`` build: one Ray task per data file, where the files are); None: here, in order."""
    if multiple > 1 and pad_id is None:
        raise ConfigError(f"pad_seq_to_mult={multiple} pads samples with the tokenizer's EOS id, which this dataset does "
                          "not record: give the EOS id (thdpack export --pad-id ID) or build with a tokenizer")
    pad = 0 if pad_id is None else int(pad_id)
    conversion = _Conversion(targets, pack_size, multiple, align, pad)
    items = [(str(out_dir), str(f)) for f in data_files]
    if run is None:
        converted = [conversion.file(*item) for item in items]
    else:
        converted = run(convert_file_or_error, conversion, items)
    totals, files = _Totals(), []
    for result in converted:
        if isinstance(result, Exception):
            raise result
        entry, file_totals = result
        files.append(entry)
        totals.merge(file_totals)
    entry = totals.bridge_metadata(pack_size)
    (out_dir / METADATA).write_text(json.dumps([entry]) + "\n", encoding="utf-8")
    if totals.eos_tail:
        logger.info(f"note: {totals.eos_tail} sample(s) end with the pad/EOS id {pad} before their last token: "
                    f"Megatron-Bridge's reader (pad_seq_to_mult {multiple} > 1) ends their cu_seqlens before those EOS "
                    "tokens and treats them as padding (docs/megatron.md)")
    return {"files": files, "metadata": METADATA, "pad_seq_to_mult": multiple, "pad_id": pad_id,
            "pack_size": pack_size, "samples_cut_short_by_bridge": totals.eos_tail, **entry}


def bridge_pad_id(meta: dict) -> int | None:
    """The id Bridge pads with (its tokenizer's EOS id), as the build recorded it."""
    tok = meta.get("tokenizer") or {}
    eos = tok.get("eos_token_id")
    return eos if eos is not None else tok.get("pad_token_id")


# ---------------------------------------------------------------------------- thdpack export


def export_bridge(path: str | Path, output: str | Path, *, pad_seq_to_mult: int | None = None,
                  pad_id: int | None = None, overwrite: bool = False) -> dict:
    """Convert the packed dataset at ``path`` to Bridge's packed Parquet format at ``output`` (a
    directory, written atomically like a build). ``pad_seq_to_mult`` defaults to the build's
    alignment multiple, ``pad_id`` to the EOS id its tokenizer recorded. Returns Bridge's record."""
    from thdpack.common.align import check_bool, check_int
    from thdpack.offline.store.dataset import load_packed

    overwrite = check_bool(overwrite, "overwrite")
    ds = load_packed(path)
    meta = ds.metadata
    if meta.get("vision"):
        raise ConfigError(f"{path}: its packs hold images; Megatron-Bridge's packed SFT format is text only")
    multiple = meta["align"] if pad_seq_to_mult is None else pad_seq_to_mult
    check_int(multiple, "pad_seq_to_mult", 1)
    if pad_id is not None:
        _check_pad_id(pad_id, ds)
    output = Path(output)
    with staged_output(output, overwrite, marker=METADATA) as tmp:
        record = write_bridge(tmp, [ds.path / f["path"] for f in meta["files"]], targets=meta["targets"],
                              pack_size=meta["pack_size"], multiple=multiple, align=meta["align"],
                              pad_id=bridge_pad_id(meta) if pad_id is None else pad_id)
        fsync_dir(tmp)
        with signals_deferred(f"the export was complete and is at {output}"):  # never half moved
            move_into_place(tmp, output)
    return record


def _check_pad_id(pad_id, ds) -> None:
    """``pad_id`` is a token id Bridge's int32 ``input_ids`` hold and, where the build recorded its
    tokenizer's vocabulary, one of its ids; ``ValueError`` naming the value (and the metadata file) otherwise."""
    from thdpack.common.align import check_int
    from thdpack.offline.store.schema import METADATA_FILE

    check_int(pad_id, "pad_id", 0, below=PAD_ID_MAX + 1,
              hint=" (the tokenizer's EOS id, which Bridge pads with; Bridge's input_ids are int32)")
    vocab = (ds.metadata.get("tokenizer") or {}).get("vocab_size")
    if vocab is not None and pad_id >= vocab:
        raise ConfigError(f"pad_id {pad_id} is outside the tokenizer's vocabulary of {vocab} ids recorded in "
                          f"{ds.path / METADATA_FILE}: give an id in 0..{vocab - 1}, the tokenizer's EOS id")


# ---------------------------------------------------------------------------- thdpack build --output-format


def data_file_format(output_format: str) -> str:
    """The format of thdpack's own data files for a build's ``output_format``: a Bridge build keeps
    thdpack's packs as Arrow, which Bridge's directory glob (``*.parquet``) does not pick up."""
    return "arrow" if output_format == FORMAT else output_format


def check_text_only(vlm) -> None:
    if vlm is not None:
        raise ConfigError("output_format megatron-bridge: Megatron-Bridge's packed SFT format is text only, and these "
                          "rows have images; use output_format arrow and thdpack's loader")


def write_build(out_dir: Path, planning, files: list[dict], tokenizer_info: dict | None, run=None) -> dict:
    """Bridge's files next to the data files ``files`` a build just wrote into ``out_dir``, pre-padded
    for ``pad_seq_to_mult`` = the build's alignment multiple (``2·cp`` etc.); ``planning``: the build's
    :class:`~thdpack.offline.stage_options.PlanningOptions`; ``run``: as :func:`write_bridge` takes it."""
    plan = planning.plan
    return write_bridge(out_dir, [out_dir / f["path"] for f in files], targets=planning.targets,
                        pack_size=plan.pack_size, multiple=plan.align, align=plan.align,
                        pad_id=bridge_pad_id({"tokenizer": tokenizer_info}), run=run)


def write_merged(out_dir: Path, meta: dict, record: dict) -> dict:
    """Bridge's files for ``thdpack merge`` of slice builds made with ``output_format
    megatron-bridge``: the merged packs (``meta``: the merged ``metadata.json``), at the
    ``pad_seq_to_mult`` and pad id the slices' ``record`` holds."""
    return write_bridge(out_dir, [out_dir / f["path"] for f in meta["files"]], targets=meta["targets"],
                        pack_size=meta["pack_size"], multiple=record["pad_seq_to_mult"], align=meta["align"],
                        pad_id=record["pad_id"])
