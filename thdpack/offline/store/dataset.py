"""Loading a packed dataset and turning its rows (packs) into :class:`thdpack.ThdBatch` es.

::

    ds = thdpack.offline.load_packed("out/demo")        # one row per pack
    loader = DataLoader(ds, batch_size=None, shuffle=True, num_workers=2,
                        collate_fn=ds.collator(cp_rank=rank))   # CP/TP/pad id from metadata
    for batch in loader:                                  # ThdBatch, one pack
        ...

Arrow data files are memory-mapped: opening is instant, rows are numpy views of the
mapped file, and DataLoader workers share the pages. Parquet data files are decoded
into memory when opened. Needs ``pyarrow`` only (not ``datasets``).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.utils.data

from thdpack.common.align import check_bool, check_int, resolve_pad_multiple
from thdpack.batching.batch import ThdBatch, warn_if_no_targets
from thdpack.loaders.collate import ThdCollator
from thdpack.batching.layout import layout_of
from thdpack.offline.stage_options import TARGETS
from thdpack.offline.errors import NotPackedError, read_error, require_pyarrow
from thdpack.offline.store.row_batch import rows_batch, rows_shared_batch
from thdpack.offline.store.schema import (METADATA_FILE, PREFIX_COLUMNS, SAMPLE_COLUMNS, SOURCE_COLUMN, SAMPLE_VALUE_PREFIX, TOKENIZER_DIR,
                                          PackedMetadata, check_metadata, file_sha256, row_list, value_columns)
from thdpack.batching.shared_prefix import DEFAULT_MIN_PREFIX_LEN, PREFIX_FIELD
from thdpack.common.samples import IGNORE_INDEX
from thdpack.common.values import PREFIX
from thdpack.vlm.registry import get_family


# ---------------------------------------------------------------------------- rows -> samples


def unpack_row(row: Mapping) -> list[dict]:
    """The samples of one packed row: ``[{"input_ids": [s_i], "loss_mask" | "labels": [s_i]}, ...]``
    (VLM packs: also ``pixel_values`` and ``image_grid_thw`` of the samples with images).

    ``row`` needs ``input_ids`` and ``seq_lens`` (and carries ``loss_mask`` or
    ``labels``); values may be numpy arrays, lists, tensors or Arrow values. The
    returned arrays are views of the row's arrays (pixels: tensors of one writable copy of the pack's).
    """
    ids, lens, targets = _row_tokens(row)
    cuts = np.cumsum(lens)[:-1]
    fields = {"input_ids": np.split(ids, cuts), **{name: np.split(arr, cuts) for name, arr in targets.items()}}
    samples = [{k: v[i] for k, v in fields.items()} for i in range(lens.size)]
    if "image_counts" in row:  # a VLM pack: each sample's pixel_values / image_grid_thw
        from thdpack.offline.store.vision_readback import add_vision

        add_vision(samples, row)
    return samples


def _row_tokens(row: Mapping) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(ids [S], seq_lens int64 [n], {"loss_mask" | "labels": [S]})`` of a packed row, as numpy
    arrays (views of the row's), checked to agree: ``ValueError`` otherwise."""
    check_pack_row(row, ("input_ids", "seq_lens"))
    ids = row_list(row["input_ids"], "input_ids")
    lens = row_list(row["seq_lens"], "seq_lens").astype(np.int64)
    if int(lens.sum()) != ids.size or (lens.size and lens.min() < 1):
        raise ValueError(f"packed row: seq_lens {lens.tolist()[:8]}... sum to {int(lens.sum())} but input_ids has {ids.size} tokens")
    targets = {}
    for name in TARGETS:
        if name in row and row[name] is not None:
            targets[name] = row_list(row[name], name)
            if targets[name].size != ids.size:
                raise ValueError(f"packed row: '{name}' has {targets[name].size} values but input_ids has {ids.size}")
    return ids, lens, targets


PACK_ROW = "input_ids, seq_lens, sample_index, sample_start and loss_mask or labels"  # what a pack row holds


def check_pack_row(row, fields: Sequence[str], where: str = "packed row") -> None:
    """``row`` is a pack (a row of :func:`load_packed`) holding ``fields``; ``TypeError`` /
    ``ValueError`` naming ``where``, the missing field and what a pack row holds otherwise."""
    if not isinstance(row, Mapping):
        raise TypeError(f"{where} must be a mapping (a row of load_packed), got {type(row).__name__}")
    missing = [name for name in fields if name not in row]
    if missing:
        raise ValueError(
            f"{where} has no {', '.join(map(repr, missing))}: it is not a pack. A pack (a row of load_packed) holds "
            f"{PACK_ROW}; collate plain samples with thdpack.ThdCollator"
        )


class PackedRowCollator:
    """``collate_fn`` for rows of :func:`load_packed`: each row is a pack of several samples.

    A row (``DataLoader(batch_size=None)``) gives the :class:`ThdBatch` of that pack;
    a list of rows (``batch_size=k``) gives one :class:`ThdBatch` holding all their
    samples (a stream of up to ``k · pack_size`` tokens). The batch's ``sample_index``
    holds the input rows of the samples; of a mixture's packs (a ``source_index`` column), ``source_index``
    holds each sample's source and ``sample_index`` its row within that source. The layout keywords (the
    :class:`thdpack.batching.BatchLayout` fields) and ``cp_group`` are those of :class:`thdpack.ThdCollator`
    (the packs are planned already, so there are no planning arguments), and ``model_config`` (a VLM's
    config or family) gives its ``vlm=``.
    Packs go straight from their stored streams into the builder's kernels
    (:mod:`thdpack.offline.store.row_batch`; a VLM pack's vision fields from views of the row), never
    split into samples: the batch ``ThdCollator`` builds of the same samples. ``sample_values``: the
    per-sample value columns to return as ``batch.sample_values[name]`` (``[n]``, int64 or
    float64; :meth:`PackedDataset.collator` passes those the build wrote).

    ``share_prefix=True`` (what :meth:`PackedDataset.collator` passes for a ``share_prefix: true`` build):
    each group's prefix (the rows' ``group_id`` / ``prefix_len`` columns) is laid out once,
    ``build_thd_batch(share_prefix=..., min_prefix_len=...)``, so a pack's tree fits ``pack_size``
    (``False`` on such a build: every sample whole, as unshared, which may exceed it).
    """

    def __init__(
        self,
        *,
        cp_group=None,
        model_config=None,
        sample_values: Sequence[str] = (),
        share_prefix: bool = False,
        min_prefix_len: int = DEFAULT_MIN_PREFIX_LEN,
        **layout_keywords,
    ):
        share_prefix = check_bool(share_prefix, "share_prefix", hint=" (the rows' group_id / prefix_len columns)")
        self.sample_values = tuple(sample_values)
        self.share_prefix = share_prefix
        layout = layout_of("PackedRowCollator", layout_keywords)
        share = dict(share_prefix=_GROUP_FIELD, min_prefix_len=min_prefix_len) if share_prefix else {}
        vlm = None if model_config is None else get_family(model_config)  # a config (dict) or a family
        self.collator = ThdCollator(**layout.keywords(), cp_group=cp_group, vlm=vlm, **share)  # its layout, args checked
        self._vlm, self._share = vlm, share

    def __call__(self, rows) -> ThdBatch:
        if isinstance(rows, Mapping):
            rows = [rows]
        batch = self._straight(rows)
        for name in self.sample_values:  # in stream order, like the samples (a CP shard keeps them all)
            batch.extras[PREFIX + name] = torch.from_numpy(_row_values(rows, name))
        return batch

    def _straight(self, rows) -> ThdBatch:
        """The batch of ``rows``, built from their stored streams (:mod:`.row_batch`)."""
        parts, index, vision = [], [], []
        for i, row in enumerate(rows):
            check_pack_row(row, ("input_ids", "seq_lens", "sample_index"), f"packed row {i}")
            parts.append(_row_tokens(row))
            index.append(row_list(row["sample_index"], "sample_index").astype(np.int64))
            if self._vlm is not None or self.share_prefix or "image_counts" in row:  # text packs need none
                views = _row_vision(row, parts[-1][1].size)  # (a VLM row's columns checked even without vlm)
                vision.extend(_with_prefixes(views, row, i) if self.share_prefix else views)
        build = rows_shared_batch if self.share_prefix else rows_batch
        batch = build(parts, self.collator.layout, **self._share, vlm=self._vlm, vision=vision,
                      sample_index=np.concatenate(index) if index else np.zeros(0, np.int64),
                      sources=(lambda: _row_sources(rows)) if all(SOURCE_COLUMN in row for row in rows) else None)
        warn_if_no_targets(batch, 4)  # the frame that called the collator
        return _own_pixels(batch, vision)


def _row_vision(row: Mapping, n: int) -> list[dict]:
    """The ``n`` samples of packed ``row`` holding their vision fields only (pixels: views of the row's);
    ``{}`` each for a text pack."""
    if "image_counts" not in row:
        return [{} for _ in range(n)]
    from thdpack.offline.store.vision_readback import add_vision

    return add_vision([{} for _ in range(n)], row, copy=False)


def _row_sources(rows) -> np.ndarray:
    """int64 ``[n]`` the source of every sample of a mixture's packs ``rows``."""
    return np.concatenate([row_list(row[SOURCE_COLUMN], SOURCE_COLUMN).astype(np.int64) for row in rows])


_GROUP_FIELD = "group"  # the sample field share_prefix reads each sample's group from


def _with_prefixes(samples: list[dict], row, i: int) -> list[dict]:
    """``samples`` of packed row ``i`` with their group and declared prefix (:data:`PREFIX_COLUMNS`)."""
    missing = [c for c in PREFIX_COLUMNS if c not in row]
    if missing:
        raise KeyError(f"packed row {i} has no '{missing[0]}' column; the dataset was built without share_prefix: "
                       "true (rebuild with it, or collate with share_prefix=False)")
    group, prefix = (row_list(row[c], c).astype(np.int64) for c in PREFIX_COLUMNS)
    # a group stored with one prefix is declared (one level); a trie's members hold what earlier members lay out
    # (they differ), and the build finds the trie itself (thdpack/offline/commands/shared_prefixes.py: TrieShares)
    low, high = {}, {}
    for g, p in zip(group.tolist(), prefix.tolist()):
        low[g], high[g] = min(low.get(g, p), p), max(high.get(g, p), p)
    return [{**s, _GROUP_FIELD: g, PREFIX_FIELD: p} if low[g] == high[g] else {**s, _GROUP_FIELD: g}
            for s, g, p in zip(samples, group.tolist(), prefix.tolist())]


def _own_pixels(batch: ThdBatch, samples: list[dict]) -> ThdBatch:
    """``batch`` with its own copy of a pixel tensor (``[P, pixel_dim]``) that it took from a
    sample as it is (a batch whose pixels are one sample's): the samples' are views of the rows."""
    for name in ("pixel_values", "pixel_values_videos"):
        pixels = batch.extras.get(name)
        if pixels is not None and any(s.get(name) is pixels for s in samples):
            batch.extras[name] = pixels.clone()
    return batch


def _row_values(rows, name: str) -> np.ndarray:
    """``[n]`` value ``name`` of every sample of ``rows`` (their ``sample_values.NAME`` lists, joined)."""
    column = SAMPLE_VALUE_PREFIX + name
    parts = []
    for row in rows:
        if column not in row:
            raise KeyError(f"packed row has no '{column}' column; the dataset was built without sample_values: "
                           f"[{name}, ...] (rebuild with it, or collate without sample_values)")
        value = row[column]
        parts.append(np.asarray(value.to_pylist() if type(value).__module__.startswith("pyarrow") else value))
    return np.concatenate(parts)


# ---------------------------------------------------------------------------- data file checks


def read_data_file(path: Path, damaged: str):
    """The ``pyarrow.Table`` of one data file (Arrow: memory-mapped); :class:`NotPackedError` naming
    ``path`` if it is not a valid data file, :class:`~thdpack.offline.errors.ReadError` if this
    process may not read it (``damaged``: what to do about a damaged one)."""
    pa = require_pyarrow("load_packed")
    import pyarrow.parquet as pq

    parquet = path.suffix == ".parquet"
    try:
        if parquet:
            return pq.read_table(path, memory_map=True)
        return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
    except OSError as exc:
        if exc.errno in _UNREADABLE:  # not damaged: this process may not read it
            raise read_error(exc, path) from None
        raise _not_valid(path, parquet, exc, damaged) from None
    except pa.ArrowException as exc:
        raise _not_valid(path, parquet, exc, damaged) from None


_UNREADABLE = (errno.EACCES, errno.EPERM, errno.EIO)


def _not_valid(path: Path, parquet: bool, exc: Exception, damaged: str) -> NotPackedError:
    """The error of a data file Arrow cannot read as one."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    kind = "Parquet file" if parquet else "Arrow stream"
    return NotPackedError(f"{path}: not a valid {kind} ({reason}); {damaged}")


def _pack_where(path: Path, pack: int, k: int) -> str:
    return f"{path}: pack {pack} (pack {k} of the dataset)"


def _offsets(batch, name: str) -> tuple[np.ndarray, int]:
    """int64 ``[rows + 1]`` offsets of list column ``name`` into its values, and the number of values."""
    col = batch.column(name)
    return np.asarray(col.offsets, dtype=np.int64), len(col.values)


def _first_bad(bad: np.ndarray) -> int | None:
    hits = np.flatnonzero(bad)
    return int(hits[0]) if hits.size else None


def _check_data_file(table, entry: dict, path: Path, meta: dict, first_k: int, damaged: str) -> int:
    """Check a data file's rows against ``metadata.json`` without reading its tokens: the token
    and sample columns' offsets, every ``seq_lens`` entry >= 1, each pack's ``seq_lens``
    summing to its tokens and no pack longer than ``pack_size``, the data file's token count.
    ``first_k``: the dataset's index of the data file's first pack. Returns the data file's number
    of samples (``seq_lens`` entries)."""
    missing = [c for c in meta["columns"] if c not in table.schema.names]
    if missing:
        raise NotPackedError(f"{path}: has no column {', '.join(map(repr, missing))} listed in 'columns' of "
                             f"{METADATA_FILE}; {damaged}")
    pack_tokens, pieces, row = [], 0, 0
    for batch in table.to_batches():
        tokens, n = _check_batch(batch, meta, lambda j: _pack_where(path, row + j, first_k + row + j), damaged)
        pack_tokens.append(tokens)
        pieces += n
        row += batch.num_rows
    total = int(sum(int(t.sum()) for t in pack_tokens))
    if total != entry["num_tokens"]:
        raise NotPackedError(f"{path}: holds {total} tokens, but its 'num_tokens' in {METADATA_FILE} is "
                             f"{entry['num_tokens']}; {damaged}")
    return pieces


def _checked_offsets(batch, targets: str, where, damaged: str, values: Sequence[str] = ()) -> dict:
    """``{"input_ids": tok, "seq_lens": smp}``: int64 ``[rows + 1]`` list offsets of the token
    columns and of the sample columns (``values``: the per-sample value columns too) of a record
    batch, after checking that they are in range, non-decreasing and shared by the columns of each group."""
    groups = {"input_ids": ("input_ids", targets), "seq_lens": (*SAMPLE_COLUMNS, *values)}
    offsets = {}
    for lead, names in groups.items():
        off, n_values = _offsets(batch, lead)
        j = _first_bad((np.diff(off) < 0) | (off[1:] > n_values) | (off[:-1] < 0))
        if j is not None:
            raise NotPackedError(f"{where(j)}: '{lead}' has broken list offsets; {damaged}")
        for name in names[1:]:
            j = _first_bad(_offsets(batch, name)[0] != off)
            if j is not None:
                j = max(j - 1, 0)
                raise NotPackedError(f"{where(j)}: '{name}' and '{lead}' have different lengths; {damaged}")
        offsets[lead] = off
    return offsets


def _check_batch(batch, meta: dict, where, damaged: str) -> tuple[np.ndarray, int]:
    """One record batch of :func:`_check_data_file`; ``where(j)`` names its pack ``j``. Returns
    int64 ``[rows]`` tokens of each pack and the batch's number of samples."""
    shared = "share_prefix" in meta
    offsets = _checked_offsets(batch, meta["targets"], where, damaged,
                               [*value_columns(meta), *(PREFIX_COLUMNS if shared else ()),
                                *((SOURCE_COLUMN,) if "mixture" in meta else ())])
    tokens = np.diff(offsets["input_ids"])
    sample_off = offsets["seq_lens"]
    lens = np.asarray(batch.column("seq_lens").values.to_numpy(), dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(lens)])
    per_pack = cum[sample_off[1:]] - cum[sample_off[:-1]]
    j = _first_bad(np.diff(sample_off) < 1)
    if j is not None:
        raise NotPackedError(f"{where(j)}: has no samples ('seq_lens' is empty); {damaged}")
    s = _first_bad(lens[sample_off[0] : sample_off[-1]] < 1)
    if s is not None:
        j = int(np.searchsorted(sample_off, sample_off[0] + s, side="right")) - 1
        raise NotPackedError(f"{where(j)}: 'seq_lens' has {int(lens[sample_off[0] + s])}, not a length >= 1; {damaged}")
    j = _first_bad(per_pack != tokens)
    if j is not None:
        raise NotPackedError(f"{where(j)}: 'seq_lens' sum to {int(per_pack[j])} but 'input_ids' has "
                             f"{int(tokens[j])} tokens; {damaged}")
    if "mixture" in meta:
        _check_source_index(batch, sample_off, len(meta["mixture"]["sources"]), where, damaged)
    stream = tokens - _shared_tokens(batch, sample_off) if shared else tokens
    j = _first_bad(stream > meta["pack_size"])
    if j is not None:
        what = " with each group's prefix once" if shared else ""
        raise NotPackedError(f"{where(j)}: has {int(stream[j])} tokens{what}, more than 'pack_size' ({meta['pack_size']}) "
                             f"in {METADATA_FILE}; {damaged}")
    return tokens, int(sample_off[-1] - sample_off[0])


def _check_source_index(batch, sample_off: np.ndarray, num_sources: int, where, damaged: str) -> None:
    """A mixture's record batch: every sample's ``source_index`` names one of the ``num_sources`` sources of
    ``mixture.sources`` in ``metadata.json`` (its offsets are the samples': :func:`_checked_offsets`)."""
    values = np.asarray(batch.column(SOURCE_COLUMN).values.to_numpy(), dtype=np.int64)[sample_off[0]:sample_off[-1]]
    s = _first_bad((values < 0) | (values >= num_sources))
    if s is not None:
        j = int(np.searchsorted(sample_off, sample_off[0] + s, side="right")) - 1
        raise NotPackedError(f"{where(j)}: '{SOURCE_COLUMN}' has {int(values[s])}, but 'mixture.sources' in "
                             f"{METADATA_FILE} lists {num_sources} sources; {damaged}")


def _shared_tokens(batch, sample_off: np.ndarray) -> np.ndarray:
    """int64 ``[rows]`` the tokens each pack of a ``share_prefix`` record batch lays out once instead of per
    member: its groups' ``prefix_len`` for every member but one."""
    pack = np.repeat(np.arange(sample_off.size - 1), np.diff(sample_off))
    return np.bincount(pack, weights=_shared_per_sample(batch, sample_off), minlength=sample_off.size - 1).astype(np.int64)


def _shared_per_sample(batch, sample_off: np.ndarray) -> np.ndarray:
    """int64 ``[samples]`` of the record batch's packs (``sample_off``: their samples' offsets), pack after
    pack: the tokens of each sample that its pack's stream does not hold again (its group's ``prefix_len``
    for every member but the first of its group in the pack; 0 for the first and for unshared samples)."""
    a, b = int(sample_off[0]), int(sample_off[-1])
    group, prefix = (np.asarray(batch.column(c).values.to_numpy(), dtype=np.int64)[a:b] for c in PREFIX_COLUMNS)
    pack = np.repeat(np.arange(sample_off.size - 1), np.diff(sample_off))
    order = np.lexsort((group, pack))
    repeat = np.zeros(b - a, bool)
    repeat[order[1:]] = (pack[order][1:] == pack[order][:-1]) & (group[order][1:] == group[order][:-1])
    return np.where(repeat, prefix, 0).astype(np.int64)


def _bad_tokens(row: Mapping, vocab_size: int | None) -> str | None:
    """What is wrong with a pack's token ids and labels (negative, or outside the vocabulary
    of ``vocab_size``), or None. Costs a min and a max per column of the pack."""
    limit = vocab_size if vocab_size is not None else np.iinfo(np.int64).max
    vocab = f"the tokenizer's vocabulary of {vocab_size}" if vocab_size is not None else "token ids (>= 0)"
    ids = row["input_ids"]
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        t = _first_bad((ids < 0) | (ids >= limit))
        return f"'input_ids' token {t} has id {int(ids[t])}, outside {vocab}"
    labels = row.get("labels")
    if labels is not None and labels.size and (labels.min() < 0 or labels.max() >= limit):
        bad = ((labels < 0) & (labels != IGNORE_INDEX)) | (labels >= limit)
        t = _first_bad(bad)
        if t is not None:
            return f"'labels' token {t} has {int(labels[t])}, outside {vocab} and not {IGNORE_INDEX} (no loss)"
    return None


# ---------------------------------------------------------------------------- the dataset


def _is_bool(arrow_type) -> bool:
    import pyarrow as pa

    return pa.types.is_boolean(arrow_type)


def read_metadata(path: str | Path) -> PackedMetadata:
    """``metadata.json`` of a packed dataset, checked against its schema
    (:func:`thdpack.offline.store.schema.check_metadata`); :class:`NotPackedError` if ``path`` is
    not a complete packed dataset or its metadata is damaged."""
    path = Path(path)
    meta_path = path / METADATA_FILE
    if not path.is_dir():
        raise NotPackedError(f"{path} is not a directory (a packed dataset is a directory with {METADATA_FILE})")
    try:
        text = meta_path.read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):
        raise NotPackedError(
            f"{path} has no {METADATA_FILE}: it is not a thdpack packed dataset, or its build did not complete "
            "(metadata.json is written last)"
        ) from None
    except UnicodeDecodeError as exc:
        raise NotPackedError(f"{meta_path} is not valid JSON ({exc})") from None
    except OSError as exc:  # there, but this process may not read it (or the directory)
        raise read_error(exc, meta_path) from None
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotPackedError(f"{meta_path} is not valid JSON ({exc})") from None
    return check_metadata(meta, path)


class PackedDataset(torch.utils.data.Dataset):
    """A packed dataset on disk: ``ds[k]`` is pack ``k`` as a dict of numpy arrays.

    Row fields: ``input_ids`` (int32 ``[T_k]``), ``loss_mask`` (bool ``[T_k]``) or
    ``labels`` (int32 ``[T_k]``), ``seq_lens`` (int32 ``[n_k]``), ``sample_index``
    (int64 ``[n_k]``), ``sample_start`` (int32 ``[n_k]``). Arrays of Arrow data files are
    read-only views of the memory-mapped files.

    Picklable (workers reopen the files). Use :meth:`collator` for the ``collate_fn``.
    """

    def __init__(self, path: str | Path, *, verify: bool = False):
        self.path = Path(path)
        self.verify = check_bool(verify, "verify")
        self.metadata = read_metadata(self.path)
        self._open()

    # ---- opening
    def _open(self) -> None:
        batches, where = [], []  # where: (data file path, its pack at the batch's first row) of each record batch
        pieces = first = 0  # first: the dataset's index of the data file's first pack
        for f in self.metadata["files"]:
            p = self.path / f["path"]  # inside self.path (check_metadata)
            table = self._open_data_file(p, f)
            pieces += _check_data_file(table, f, p, self.metadata, first, self._damaged)
            row = 0
            for b in table.to_batches():
                if b.num_rows:
                    batches.append(b)
                    where.append((p, row))
                    row += b.num_rows
            first += row
        expected = self.metadata["counts"].get("pieces", pieces)
        if pieces != expected:
            raise NotPackedError(f"{self.path / METADATA_FILE}: 'counts.pieces' is {expected} but the data files hold "
                                 f"{pieces} samples (seq_lens entries); {self._damaged}")
        self._batches = batches
        self._where = where
        self._starts = np.cumsum([0] + [b.num_rows for b in batches])
        self.columns = list(batches[0].schema.names) if batches else []
        self._views: dict = {}
        tok = self.metadata.get("tokenizer") or {}
        self._vocab_size = tok.get("vocab_size")

    def _open_data_file(self, p: Path, f: dict):
        """The table of data file ``p`` (its ``files`` entry ``f``), checked for presence, size, sha256
        (``verify``) and number of packs."""
        if not p.is_file():
            raise NotPackedError(f"{self.path}: data file {f['path']} listed in {METADATA_FILE} is missing; {self._damaged}")
        if p.stat().st_size != f["num_bytes"]:
            raise NotPackedError(
                f"{self.path}: data file {f['path']} has {p.stat().st_size} bytes, metadata says {f['num_bytes']} "
                f"(modified or truncated); {self._damaged}"
            )
        if self.verify:
            if file_sha256(p) != f["sha256"]:
                raise NotPackedError(f"{self.path}: data file {f['path']} does not match its sha256 in {METADATA_FILE}")
        table = read_data_file(p, self._damaged)
        if table.num_rows != f["num_packs"]:
            raise NotPackedError(f"{self.path}: data file {f['path']} has {table.num_rows} packs, metadata says {f['num_packs']}")
        return table

    @property
    def _damaged(self) -> str:
        """What to do about a damaged data file (the end of its error message)."""
        return f"the dataset is damaged: check its checksums with `thdpack stats {self.path} --verify`, and rebuild it"

    def __getstate__(self):
        return {"path": self.path, "verify": False, "metadata": self.metadata}

    def __setstate__(self, state):
        self.path, self.verify, self.metadata = state["path"], state["verify"], state["metadata"]
        self._open()

    # ---- access
    def __len__(self) -> int:
        return int(self._starts[-1])

    def _column(self, b: int, name: str):
        key = (b, name)
        view = self._views.get(key)
        if view is None:
            col = self._batches[b].column(name)
            offsets = np.asarray(col.offsets)
            values = col.values
            if not _is_bool(values.type):  # a zero-copy numpy view
                values = values.to_numpy()
            view = self._views[key] = (offsets, values)
        return view

    def __getitem__(self, k: int) -> dict:
        n = len(self)
        if isinstance(k, (np.integer,)):
            k = int(k)
        if not isinstance(k, int):
            raise TypeError(f"pack index must be an integer, got {type(k).__name__}")
        check_int(k, "pack", -n, below=n, hint=f" (the dataset has {n} packs; a negative pack counts from the end)",
                  error=IndexError)
        if k < 0:
            k += n
        b = int(np.searchsorted(self._starts, k, side="right") - 1)
        i = k - int(self._starts[b])
        row = {}
        for name in self.columns:
            offsets, values = self._column(b, name)
            a, e = int(offsets[i]), int(offsets[i + 1])
            if isinstance(values, np.ndarray):
                row[name] = values[a:e]
            else:  # Arrow booleans are bit-packed: unpack this row only
                row[name] = values.slice(a, e - a).to_numpy(zero_copy_only=False)
        path, first = self._where[b]
        problem = _bad_tokens(row, self._vocab_size)
        if problem:
            raise NotPackedError(f"{_pack_where(path, first + i, k)}: {problem}; {self._damaged}")
        return row

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]

    def samples(self, k: int) -> list[dict]:
        """The samples of pack ``k`` (see :func:`unpack_row`)."""
        return unpack_row(self[k])

    # ---- whole-dataset views
    def pack_num_tokens(self) -> np.ndarray:
        """int64 ``[num_packs]`` real tokens of every pack."""
        parts = [np.diff(self._column(b, "input_ids")[0]) for b in range(len(self._batches))]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def all_seq_lens(self, *, stream: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``(seq_lens, pack_offsets)``: every sample's length, pack after pack, and the
        ``[num_packs + 1]`` offsets of each pack's samples in it. ``stream=True``: of a ``share_prefix``
        build, the tokens each sample adds to its pack's stream (a group's prefix counted for its first
        member only), as the build's own statistics count them; the stored lengths otherwise."""
        shared = check_bool(stream, "stream") and bool(self.metadata.get("share_prefix"))
        lens, counts = [], []
        for b in range(len(self._batches)):
            offsets, values = self._column(b, "seq_lens")
            these = np.asarray(values[offsets[0] : offsets[-1]], dtype=np.int64)
            lens.append(these - _shared_per_sample(self._batches[b], offsets) if shared else these)
            counts.append(np.diff(offsets))
        lens_all = np.concatenate(lens) if lens else np.zeros(0, np.int64)
        off = np.zeros(len(self) + 1, dtype=np.int64)
        if counts:
            np.cumsum(np.concatenate(counts), out=off[1:])
        return lens_all, off

    @property
    def pack_size(self) -> int:
        return int(self.metadata["pack_size"])

    @property
    def tokenizer_path(self) -> Path | None:
        """The tokenizer copy saved with the dataset, if any."""
        p = self.path / TOKENIZER_DIR
        return p if p.is_dir() else None

    def collator(self, **overrides) -> PackedRowCollator:
        """A :class:`PackedRowCollator` set up from the metadata: the pad token id and the
        CP/TP/SP/pad multiple the packs were planned for, and for VLM packs the saved model
        config (``model_config=``). Override any argument (e.g. ``cp_rank=rank``). A larger alignment multiple than the plan's may push a pack past
        ``pack_size`` (a warning says so)."""
        meta = self.metadata
        tok = meta.get("tokenizer") or {}
        kwargs = dict(
            pad_token_id=tok.get("pad_token_id") or 0,
            cp_size=meta.get("cp_size", 1),
            tp_size=meta.get("tp_size", 1),
            sequence_parallel=meta.get("sequence_parallel", False),
            pad_multiple=meta.get("pad_multiple"),
        )
        if meta.get("sample_values"):  # the per-sample value columns the build wrote
            kwargs["sample_values"] = list(meta["sample_values"])
        if "share_prefix" in meta:  # each group's prefix once, as the plan counted it
            kwargs.update(share_prefix=True, min_prefix_len=meta["share_prefix"]["min_prefix_len"])
        if meta.get("vision") and (self.path / "model_config.json").is_file():  # VLM packs: mRoPE, vision inputs
            kwargs["model_config"] = json.loads((self.path / "model_config.json").read_text(encoding="utf-8"))
        kwargs.update(overrides)
        multiple = resolve_pad_multiple(
            kwargs["cp_size"], kwargs["tp_size"], kwargs["sequence_parallel"], kwargs["pad_multiple"]
        )
        if meta["align"] % multiple:
            warnings.warn(
                f"collating with pad multiple {multiple}, but the packs were planned for multiple {meta['align']}: "
                f"packs may exceed pack_size={meta['pack_size']} after padding. Rebuild with the CP/TP settings you train with.",
                stacklevel=2,
            )
        return PackedRowCollator(**kwargs)

    def to_hf(self):
        """The packs as a ``datasets.Dataset`` (memory-mapped for Arrow data files)."""
        import datasets

        files = [str(self.path / f["path"]) for f in self.metadata["files"]]
        if self.metadata["file_format"] == "parquet":
            import pyarrow.parquet as pq
            from datasets.table import InMemoryTable

            return datasets.Dataset(InMemoryTable(pq.read_table(files)))  # a list of files reads as one table
        return datasets.concatenate_datasets([datasets.Dataset.from_file(f) for f in files])

    def __repr__(self) -> str:
        m = self.metadata
        return (
            f"PackedDataset({str(self.path)!r}: {len(self)} packs of {m['pack_size']} tokens, "
            f"{m['counts']['samples']} samples, {m['file_format']}, targets={m['targets']})"
        )


def load_packed(path: str | Path, *, verify: bool = False) -> PackedDataset:
    """Open a packed dataset written by ``thdpack build``.

    Checks that the build completed (``metadata.json`` is written last), ``metadata.json``
    against its schema (:func:`thdpack.offline.store.schema.check_metadata`), and every data file:
    present with the recorded size, readable, its packs, tokens and ``seq_lens`` consistent
    with the metadata and no pack longer than ``pack_size`` (list offsets only: the tokens
    are not read). ``verify=True`` also checks the data files' sha256. Reading a pack checks
    its token ids (and labels) against the tokenizer's vocabulary. Every failure is a
    :class:`NotPackedError` naming the key, or the data file and pack.
    Returns a :class:`PackedDataset` (one row per pack).
    """
    return PackedDataset(path, verify=verify)
