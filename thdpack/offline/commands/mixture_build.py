"""A mixture build's blend (``input``: a list of sources): the kept rows of the sources, each read, tokenized and
selected by its own options (:mod:`~thdpack.offline.commands.pipeline`), blended by the sources' weights and
planned into packs.

1. **Each source** is read and tokenized as a build of that source alone would (its own ``format``, ``loss``,
   ``chat_template``, fields, ``max_rows``; the build's tokenizer and targets), locally or on Ray, into its own
   work directory; its bad and too long rows are found as a single build finds them (``skip_bad_rows`` counts
   them, per source and cause): the pipeline's steps, the same for one source or several.
2. **The blend**: :func:`thdpack.planning.mixture.plan_mixture` over each source's kept *units*: its rows, or
   with ``group_column`` its groups (a group is drawn, repeated and packed whole); a preference row (chosen +
   rejected) is one unit; ``weight_by: tokens`` counts a unit's tokens. Seeded by the build's ``seed``: which
   units, how many times, in what order is a function of the kept unit counts, their lengths, the weights and
   the seed only, whatever the engine and ``num_proc``.
3. **The plan** over the blend's samples, as a repeated row is a sample of its own: the build's algorithm over
   the whole blend (``mixture_packing: bfd``), or :func:`~thdpack.planning.mixture.plan_stratified`
   (``stratified``: every step of ``mixture_step_packs`` packs close to the blend; not with pairs or groups).
   A preference pair, a group, stays in one pack. ``without_targets`` and ``overflow`` apply as in any build; a
   source in the blend whose every sample they drop stops the build, as a build of that source alone stops.

The sources' tokenized rows are put side by side (their tokens and targets; on Ray their part files, read where
they are), so the pack writer reads them as one build's. Each packed sample records its source
(``source_index``, the source's position in ``input``) and its row within that source (``sample_index``:
a preference source's chosen / rejected rows ``2r`` / ``2r + 1`` as in a single build). ``metadata.json``'s
``mixture`` entry reports per source the rows read, failed, too long, kept, its unit (row, pair, group), the
units kept and in the blend (repeats included) and the most repeats, what the plan dropped (``overflow: drop``, ``without_targets``), the samples, tokens and
target tokens packed, and its share of the blend as requested, as drawn (``realized_share``) and as packed
(``packed_share``, after what the plan dropped), in the ``weight_by`` unit.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass, field

import numpy as np

from thdpack.offline.commands import sample_plan as sp
from thdpack.offline.commands.shared_prefixes import TrieShares, one_level_shares
from thdpack.offline.errors import InputError
from thdpack.offline.inputs.sources import Source
from thdpack.offline.stages import BuildStages
from thdpack.offline.tokenizing.row_formats import row_format
from thdpack.offline.tokenizing.row_tokenizer import ERROR_COLUMN, TAIL_TARGETS_COLUMN
from thdpack.offline.tokenizing.tokenize_step import Tokenized
from thdpack.planning.mixture import MixtureSource, plan_mixture, plan_stratified

logger = logging.getLogger(__name__)



@dataclass
class SourceRows:
    """One source read, tokenized and selected (its rows and sequences numbered within the source;
    :mod:`~thdpack.offline.commands.pipeline`)."""

    name: str
    source: Source
    tokenized: Tokenized
    sequences: object  # sample_plan.Sequences
    sample_rows: np.ndarray  # int64: its usable sequences
    skipped: list  # (input row, reason)
    failed: int  # rows that failed to tokenize (the rest of skipped: too long)
    prefix: np.ndarray | None = None  # share_prefix: int64 [sequences] each one's group prefix (0: unshared)
    patches: np.ndarray | None = None  # rows with images: vision patches per sequence (sample_plan.select_rows)
    vlm: object = None  # rows with images: the source's VlmBuild (a plain build only), else None

    @property
    def per_row(self) -> int:
        """Sequences per row: 2 for preference rows, else 1."""
        return row_format(self.tokenized.fmt).sequences_per_row

    @property
    def unit(self) -> str:
        """What the blend draws of this source: a ``group`` (``group_column``), a ``pair`` (preference rows) or a
        ``row``."""
        return "group" if self.grouped else "pair" if self.per_row > 1 else "row"

    @property
    def grouped(self) -> bool:
        return self.sequences.group is not None and self.per_row == 1

    @functools.cached_property
    def units(self) -> tuple[np.ndarray, np.ndarray]:
        """``(sequences, offsets)``: the source's blend units (:attr:`unit`), each its kept sequences (ascending),
        as int64 CSR arrays: unit ``u``'s are ``sequences[offsets[u]:offsets[u + 1]]``; units in the order of their
        group (a row's, a pair's: its row)."""
        seqs = self.sample_rows
        key = self.sequences.row[seqs] if self.sequences.group is None else self.sequences.group[seqs]
        order = np.argsort(key, kind="stable")
        _, first = np.unique(key[order], return_index=True)
        return seqs[order], np.append(first, seqs.size).astype(np.int64)

    def unit_rows(self, units: np.ndarray) -> np.ndarray:
        """int64 the first input row of each of ``units``."""
        seqs, offsets = self.units
        return self.sequences.row[seqs[offsets[units]]]


@dataclass(frozen=True)
class BlendedInput:
    """The sources of a mixture as the build's one input: rows numbered source after source (``where`` names the
    source), their files, and a fingerprint of the sources' names and fingerprints."""

    names: tuple
    sources: tuple  # Source
    row_offsets: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "row_offsets", np.cumsum([0] + [s.num_rows for s in self.sources]))

    @property
    def num_rows(self) -> int:
        return int(self.row_offsets[-1])

    @property
    def files(self) -> list:
        return [f for s in self.sources for f in s.files]

    @property
    def fingerprint(self) -> str:
        text = json.dumps([[n, s.fingerprint] for n, s in zip(self.names, self.sources)])
        return hashlib.sha256(text.encode()).hexdigest()

    def where(self, row: int) -> str:
        """``source NAME: file:line`` of row ``row`` (numbered source after source)."""
        k = int(np.searchsorted(self.row_offsets, row, side="right") - 1)
        return f"source {self.names[k]!r}: {self.sources[k].where(int(row - self.row_offsets[k]))}"


@dataclass(frozen=True)
class MixtureRecord:
    """What a mixture build adds to its packs and its metadata: per tokenized row (the sources' side by side) its
    source and its row within the source (the ``sample_index`` written), and the per-source report."""

    row_source: np.ndarray  # int64 [tokenized rows]
    row_ids: np.ndarray  # int64 [tokenized rows]
    report: dict  # metadata.json's mixture entry (finished by record_written)


def blend_and_plan(rows: list[SourceRows], stages: BuildStages, ray_session=None) -> "sp.Prepared":
    """Blend the sources' selected ``rows`` (by ``stages.mixture``) and plan the blend (see the module docstring): a
    :class:`~thdpack.offline.commands.sample_plan.Prepared` whose ``sample_rows`` index the sources' tokenized rows
    side by side (a repeated row once per repeat) and whose ``mixture`` is the :class:`MixtureRecord`."""
    mixture, planning = stages.mixture, stages.planning
    blend = _blend(rows, stages.sources, mixture, planning.plan.seed)
    logger.info(str(blend))
    tokenized = _side_by_side(rows, planning.targets, stages.tokenize.value_columns)
    seq_offset = np.cumsum([0] + [r.tokenized.lengths.size for r in rows])[:-1]
    blend_seq, blend_item = _blend_sequences(rows, blend, seq_offset)
    grouped = any(r.unit != "row" for r in rows)
    sequences = sp.Sequences(tokenized.lengths[blend_seq], blend_item, blend_item if grouped else None, False)
    item_source = blend.source
    prefix = None if not planning.share_prefix else _joined_prefixes(rows, planning.plan.align)  # [tokenized rows]
    blend_prefix = None if prefix is None else prefix.take(blend_seq) if isinstance(prefix, TrieShares) else \
        prefix[blend_seq]
    planner = _BlendPlanner(planning, sequences, item_source, mixture, blend_prefix)
    count_tables = sp.target_counter(planning.targets, tokenized, ray_session)
    count = (lambda r, s, n: count_tables(blend_seq[r], s, n))
    where = _ItemWhere(rows, blend)
    plan, vrows, piece_targets, without = sp.plan_samples(planner, count, where,
                                                           np.arange(blend_seq.size, dtype=np.int64))
    blended = BlendedInput(tuple(r.name for r in rows), tuple(r.source for r in rows))
    skipped = sorted((int(blended.row_offsets[k]) + row, why) for k, r in enumerate(rows) for row, why in r.skipped)
    sample_rows = blend_seq[vrows]
    row_source = np.repeat(np.arange(len(rows), dtype=np.int64), [r.tokenized.lengths.size for r in rows])
    row_ids = np.arange(row_source.size, dtype=np.int64) - seq_offset[row_source]
    packed_items = np.unique(blend_item[vrows[np.unique(plan.sample_index)]])
    report = _report(rows, stages.sources, blend, mixture, plan, item_source[blend_item[vrows]], piece_targets, without,
                     item_source[blend_item], item_source[packed_items])
    _refuse_unpacked(report["sources"], planning)
    return sp.Prepared(blended, tokenized, plan, sample_rows, skipped, piece_targets, without, {},
                       stages.model_config, shared_prefix=prefix, groups=_row_units(rows) if grouped else None,
                       mixture=MixtureRecord(row_source, row_ids, report))


def _joined_prefixes(rows: list, align: int):
    """Every source's shared prefixes one after another ([tokenized rows]): int64 one-level prefixes, or
    :class:`TrieShares` where some source lays a group out as a trie (the others' one level as shares)."""
    if not any(isinstance(r.prefix, TrieShares) for r in rows):
        return np.concatenate([r.prefix for r in rows])
    return TrieShares.joined([r.prefix if isinstance(r.prefix, TrieShares) else
                              one_level_shares(r.tokenized.lengths, _groups_of(r), _selected(r), align, r.prefix)
                              for r in rows])


def _selected(r) -> np.ndarray:
    """bool [tokenized rows] of source ``r``: the sequences its selection kept (the others are never planned)."""
    kept = np.zeros(r.tokenized.lengths.size, bool)
    kept[r.sample_rows] = True
    return kept


def _groups_of(r) -> np.ndarray:
    """int64 [tokenized rows] of source ``r``: each sequence's group (its own where it has none)."""
    group = r.sequences.group
    return np.arange(r.tokenized.lengths.size, dtype=np.int64) if group is None else group


def _refuse_unpacked(report: list[dict], planning) -> None:
    """InputError naming the first source that is in the blend but has none of its samples packed (the plan dropped
    them all: ``overflow: drop``, ``without_targets: drop``): it would take its share of the blend and train on
    nothing, so the build stops, as a build of that source alone stops (``report``: the ``mixture`` entry's
    ``sources``)."""
    for r in report:
        if r["blend_units"] and not r["packed_samples"]:
            overflow, targets = r["dropped_overflow"], r["dropped_without_targets"]
            why = [f"{overflow:,} longer than pack_size={planning.plan.pack_size} (overflow: drop)"] if overflow else []
            why += [f"{targets:,} with no target token (without_targets: drop)"] if targets else []
            fix = (["use a larger pack_size or overflow: truncate or split"] if overflow else []) + (
                ["check its loss / labels or set without_targets: keep"] if targets else [])
            raise InputError(f"mixture source {r['name']!r}: the plan dropped every one of its samples in the blend "
                             f"({'; '.join(why)}), so it would take its share of the blend and pack nothing: "
                             f"{'; '.join(fix)}; or drop the source from the mixture")


def _row_units(rows: list[SourceRows]) -> np.ndarray:
    """int64 ``[tokenized rows]`` the unit of each tokenized row (the sources side by side), numbered across the
    sources (0 for rows not kept): a ``share_prefix`` build's ``group_id``. A unit drawn twice keeps its number."""
    out, first = [], 0
    for r in rows:
        seqs, offsets = r.units
        unit = np.zeros(r.tokenized.lengths.size, np.int64)
        unit[seqs] = first + np.repeat(np.arange(offsets.size - 1, dtype=np.int64), np.diff(offsets))
        out.append(unit)
        first += offsets.size - 1
    return np.concatenate(out)


def _blend(rows: list[SourceRows], specs, mixture, seed: int):
    """The :class:`~thdpack.planning.mixture.MixturePlan` over each source's kept units (:attr:`SourceRows.units`;
    its ``row``: a unit's index); ``specs``: each source's :class:`~thdpack.offline.stages.SourceStages`."""
    sources = []
    for r, spec in zip(rows, specs):
        seqs, offsets = r.units
        tokens = np.add.reduceat(r.sequences.lengths[seqs], offsets[:-1]) if seqs.size else np.zeros(0, np.int64)
        try:
            sources.append(MixtureSource(r.name, int(offsets.size - 1), lengths=tokens.astype(np.int64),
                                         **dict(spec.weights)))
        except ValueError as exc:
            raise InputError(str(exc)) from None
    try:
        return plan_mixture(sources, weight_by=mixture.weight_by, size=mixture.size, stopping=mixture.stopping,
                            seed=seed)
    except ValueError as exc:
        raise InputError(f"mixture: {exc}") from None


def _blend_sequences(rows: list[SourceRows], blend, seq_offset: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(blend_seq, blend_item)``: int64 the tokenized row (the sources side by side) of every sequence of the
    blend, in blend order (a unit's sequences ascending: a preference row's chosen then rejected), and the blend
    sample (unit) it belongs to."""
    counts = np.zeros(len(blend), np.int64)
    for k, r in enumerate(rows):
        mine = np.flatnonzero(blend.source == k)
        offsets = r.units[1]
        counts[mine] = offsets[blend.row[mine] + 1] - offsets[blend.row[mine]]
    blend_item = np.repeat(np.arange(len(blend), dtype=np.int64), counts)
    within = np.arange(blend_item.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    blend_seq = np.zeros(blend_item.size, np.int64)
    item_source = blend.source[blend_item]
    for k, r in enumerate(rows):
        sel = np.flatnonzero(item_source == k)
        seqs, offsets = r.units
        blend_seq[sel] = seqs[offsets[blend.row[blend_item[sel]]] + within[sel]] + seq_offset[k]
    return blend_seq, blend_item


def _side_by_side(rows: list[SourceRows], targets: str, value_columns) -> Tokenized:
    """The sources' tokenized rows as one :class:`Tokenized` (rows source after source): the columns the planner
    and the writer read (locally the tokens too; on Ray the small ones, the part files for the tokens)."""
    import datasets
    import pyarrow as pa
    from datasets.table import InMemoryTable

    from thdpack.offline.store.schema import VALUE_COLUMN, VALUE_IS_INT_COLUMN

    values = [c for name in value_columns for c in (VALUE_COLUMN.format(name), VALUE_IS_INT_COLUMN.format(name))]
    small = [TAIL_TARGETS_COLUMN, ERROR_COLUMN, *values]
    on_ray = rows[0].tokenized.files is not None
    columns = small if on_ray else ["input_ids", targets, *small]
    tables = [r.tokenized.dataset.data.table.select(columns) for r in rows]
    table = pa.concat_tables([t.cast(tables[0].schema) for t in tables])
    files = None
    if on_ray:
        from thdpack.offline.cluster.ray_map import PartFiles

        files = PartFiles([p for r in rows for p in r.tokenized.files.paths], columns=["input_ids", targets])
    first = next((r.tokenized for r in rows if r.tokenized.tokenizer is not None), rows[0].tokenized)
    return Tokenized(datasets.Dataset(InMemoryTable(table)), np.concatenate([r.tokenized.lengths for r in rows]),
                     [], "mixture", first.tokenizer, first.tokenizer_info, files)


@dataclass(frozen=True)
class _ItemWhere:
    """``where(item)``: which source and row a blend sample is, for the planner's messages."""

    rows: list
    blend: object

    def where(self, item: int) -> str:
        k = int(self.blend.source[item])
        r = self.rows[k]
        return f"source {r.name!r}: {r.source.where(int(r.unit_rows(np.array([self.blend.row[item]]))[0]))}"


@dataclass(frozen=True)
class _BlendPlanner:
    """The plan of any subset of the blend's sequences: the build's algorithm (``packing: bfd``) or
    :func:`~thdpack.planning.mixture.plan_stratified`; what ``sample_plan.plan_samples`` calls."""

    planning: object
    sequences: object
    item_source: np.ndarray  # int64 [blend samples]
    mixture: object
    prefix: object = None  # share_prefix: int64 [blend sequences] each one's group prefix, or TrieShares

    def plan(self, rows: np.ndarray):
        if self.mixture.packing != "stratified":
            return sp.Planner(self.planning, self.sequences, None, None, self.prefix).plan(rows)
        opts = self.planning.plan
        return plan_stratified(self.sequences.lengths[rows], self.item_source[self.sequences.row[rows]],
                               opts.pack_size, step_packs=self.mixture.step_packs, weight_by=self.mixture.weight_by,
                               align=opts.align, overflow=opts.overflow,
                               max_samples_per_pack=opts.max_samples_per_pack)


def _report(rows, specs, blend, mixture, plan, sample_source, piece_targets, without, seq_source, packed_item_source) -> dict:
    """``metadata.json``'s ``mixture`` entry: the blend's options and per source what was read, kept, blended,
    dropped (by cause) and packed."""
    n = len(rows)
    piece_source = sample_source[plan.sample_index]
    tokens = np.bincount(piece_source, weights=plan.length, minlength=n).astype(np.int64)
    targets = np.bincount(piece_source, weights=piece_targets, minlength=n).astype(np.int64)
    packed = np.bincount(sample_source[np.unique(plan.sample_index)], minlength=n)
    dropped_overflow = np.bincount(sample_source[plan.dropped], minlength=n) if plan.dropped.size else np.zeros(n)
    dropped_targets = (np.bincount(seq_source[without.rows], minlength=n) if without.dropped_samples
                       else np.zeros(n, np.int64))
    packed_units = (tokens.astype(np.float64) if mixture.weight_by == "tokens"
                    else np.bincount(packed_item_source, minlength=n).astype(np.float64))
    report = blend.report()
    sources = []
    for k, (r, b) in enumerate(zip(rows, report)):
        spec = specs[k]
        sources.append({
            "name": r.name, "source_index": k, "format": r.tokenized.fmt,
            "given": {key: value for key, value in spec.weights.items()} or {"weight": 1.0},
            "rows_read": r.source.num_rows, "rows_failed": int(r.failed),
            "rows_too_long": len(r.skipped) - int(r.failed),
            "rows_kept": int(np.unique(r.sequences.row[r.sample_rows]).size), "unit": r.unit,
            "units_kept": b["rows"], "blend_units": b["samples"], "max_repeats": b["max_repeats"],
            "dropped_overflow": int(dropped_overflow[k]), "dropped_without_targets": int(dropped_targets[k]),
            "packed_samples": int(packed[k]), "tokens": int(tokens[k]), "target_tokens": int(targets[k]),
            "requested_share": round(b["requested_share"], 6), "realized_share": round(b["realized_share"], 6),
            "packed_share": round(float(packed_units[k] / max(packed_units.sum(), 1)), 6),
        })
    return {"weight_by": mixture.weight_by, "stopping": mixture.stopping, "size": mixture.size,
            "packing": mixture.packing, "step_packs": mixture.step_packs, "samples": len(blend), "sources": sources}
