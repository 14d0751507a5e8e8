"""The tokenized rows of a build selected and planned: which rows go in (failed, too long, over the vision
budget left out and counted), their groups and target counts, the plan, and what planning leaves without
targets (:class:`Prepared`: everything before writing). :mod:`~thdpack.offline.commands.build_packs` runs it
for one input, :mod:`~thdpack.offline.commands.mixture_build` for each source of a mixture and their blend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from thdpack.common.align import round_up
from thdpack.offline.commands.pack_stats import BUILD_COUNTS, summarize
from thdpack.offline.commands.shared_prefixes import (TrieShares, common_prefixes, common_prefixes_of_dataset,
                                                      trie_shares, trie_shares_of_dataset)
from thdpack.offline.errors import ConfigError, InputError, MAX_ERRORS_INLINE, MAX_ERRORS_RECORDED
from thdpack.offline.inputs.sources import Source
from thdpack.offline.stage_options import PlanningOptions
from thdpack.offline.store.schema import GROUP_COLUMN
from thdpack.offline.tokenizing.row_formats import row_format
from thdpack.offline.tokenizing.row_tokenizer import TAIL_TARGETS_COLUMN
from thdpack.offline.tokenizing.tokenize_step import Tokenized
from thdpack.planning.plan import PackPlan, plan_packs

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """Everything before writing: rows read, tokenized, planned."""

    source: Source
    tokenized: Tokenized
    plan: PackPlan
    sample_rows: np.ndarray  # int64 [num_samples]: tokenized row of each planned sample (the input row, or
    #                          for preference rows 2 * input row + 0 chosen / 1 rejected)
    skipped: list[tuple[int, str]]  # (input row, reason)
    piece_targets: np.ndarray  # int64 [pieces]: target tokens of each piece of plan
    without_targets: "WithoutTargets"  # samples with no target in what the plan keeps (dropped or kept)
    timings: dict = field(default_factory=dict)
    model_config: dict | None = None  # the build's model config, loaded (BuildStages.model_config)
    vlm: object = None  # a thdpack.offline.vision.vlm_setup.VlmBuild for rows with images, else None
    shared_prefix: object = None  # share_prefix builds: int64 [sequences] each one's group prefix, or TrieShares
    groups: np.ndarray | None = None  # int64 [sequences]: group of each sequence (pairs, group_column), else None
    mixture: object = None  # a mixture build's commands.mixture_build.MixtureRecord, else None

    def counts(self) -> dict:
        st = self.plan.stats
        w = self.without_targets
        pack_targets = (np.add.reduceat(self.piece_targets, self.plan.pack_offsets[:-1]) if len(self.plan)
                        else np.zeros(0, np.int64))
        return {
            "input_rows": self.source.num_rows,
            "skipped_rows": len(self.skipped),
            "samples": int(self.sample_rows.size),
            "pieces": st.num_pieces,
            "samples_without_targets": int(w.rows.size),  # after truncation, before the policy
            "truncated": {"samples": st.samples_truncated, "tokens": st.tokens_truncated},
            "dropped": {"samples": st.samples_dropped, "tokens": st.tokens_dropped},
            "split": {"samples": st.samples_split},
            "without_targets": {
                "policy": w.policy,
                "dropped_samples": w.dropped_samples,
                "dropped_tokens": w.dropped_tokens,
                "pieces": int((self.piece_targets == 0).sum()),  # in the packs: kept samples, split pieces
                "packs": int((pack_targets == 0).sum()),
            },
        }

    def summary(self, eval_multiple: int | None = None) -> dict:
        counts = self.counts()
        extra = {k: counts[k] for k in BUILD_COUNTS if k in counts}  # target_tokens: added once written
        plan = self.plan
        return summarize(
            plan.length if plan.shared_length is None else plan.length - plan.shared_length,  # the stream's tokens
            self.plan.pack_offsets,
            self.plan.pack_size,
            self.plan.align,
            eval_multiple=eval_multiple,
            input_lengths=self.tokenized.lengths[self.sample_rows],
            counts=extra,
            model_config=self.model_config,
            vision_grid_thw=None if self.vlm is None else self.vlm.packed_grids(
                self.tokenized.dataset.data.table, self.sample_rows[self.plan.sample_index]),
        )

    def skipped_examples(self) -> list[dict]:
        return [{"where": self.source.where(r), "error": m} for r, m in self.skipped[:MAX_ERRORS_RECORDED]]



@dataclass(frozen=True)
class Sequences:
    """The tokenized sequences of a build (one per input row; two for preference rows)."""

    lengths: np.ndarray  # int64 [sequences]: tokens of each
    row: np.ndarray  # int64 [sequences]: input row of each
    group: np.ndarray | None  # int64 [sequences]: group of each (planned into one pack), or None
    pairs: bool  # preference rows: a chosen and a rejected sequence per row


def sequences_of(tokenized: Tokenized, planning: PlanningOptions, pairs: bool) -> Sequences:
    """The :class:`Sequences` of ``tokenized``."""
    lengths = tokenized.lengths  # per tokenized sequence
    seq_row = row_format(tokenized.fmt).sequence_rows(lengths.size)  # input row of each sequence
    return Sequences(lengths, seq_row, _sequence_groups(tokenized, seq_row, planning), pairs)


def select_rows(planning: PlanningOptions, source: Source, tokenized: Tokenized, sequences: Sequences, vlm,
                ray_session=None, *, tries: bool = True):
    """``(sample_rows, skipped, patches, prefix)``: the tokenized sequences to plan (int64, ascending), the
    ``(input row, reason)`` of the rows left out (failed, too long, over the vision budget), sorted,
    the VLM builds' per-sequence patches (None without ``vlm``) and, with ``share_prefix``, int64
    ``[sequences]`` each sequence's group prefix (else None; on the ``ray_session``'s cluster, by a Ray task
    that reads the tokens where they are), a :class:`TrieShares` where ``tries`` and some ``group_column`` group is
    laid out as a trie. Raises InputError listing the bad rows unless
    ``planning.skip_bad_rows``, and when no row is left."""
    grouped = sequences.group is not None
    skipped = _row_errors(tokenized.errors, sequences.row, sequences.pairs)  # from here on, per input row
    usable = np.ones(int(sequences.row[-1]) + 1 if sequences.row.size else 0, dtype=bool)
    usable[[r for r, _ in skipped]] = False
    prefix = None
    if planning.share_prefix:  # found on the rows that did not fail; too long groups go whole, the rest keep theirs
        args = (sequences.lengths, sequences.group, usable[sequences.row], planning.plan.align, planning.min_prefix)
        if ray_session is None:
            prefix = common_prefixes(tokenized.dataset.data.table, planning.targets, *args)
        else:
            from thdpack.offline.cluster.ray_tasks import run_tasks

            prefix = run_tasks(ray_session, common_prefixes_of_dataset, (tokenized.rows, planning.targets), [args],
                               describe=lambda k: "finding the groups' shared prefixes")[0]
        if tries and sequences.group is not None and not sequences.pairs and vlm is None:  # groups laid out as tries
            if ray_session is None:
                shares = trie_shares(tokenized.dataset.data.table, planning.targets, *args, prefix)
            else:
                shares = run_tasks(ray_session, trie_shares_of_dataset, (tokenized.rows, planning.targets),
                                   [(*args, prefix)], describe=lambda k: "finding the groups' tries")[0]
            prefix = prefix if shares is None else shares
    row_tokens = (_row_tokens(sequences.lengths, sequences.row, sequences.group, planning.plan.align, prefix)
                  if grouped else sequences.lengths)
    too_long = _too_long_rows(planning, source, row_tokens, usable, grouped, sequences.pairs)
    skipped.extend(too_long)
    usable[np.array([r for r, _ in too_long], np.int64)] = False
    patches = None
    if vlm is not None:  # vision budget, and rows with images that cannot be cut
        patches, bad = vlm.plan_checks(planning.plan, tokenized, usable)
        skipped.extend(bad)
        usable[[r for r, _ in bad]] = False
    skipped.sort()
    if skipped and not planning.skip_bad_rows:
        shown = "; ".join(f"{source.where(r)}: {m}" for r, m in skipped[:MAX_ERRORS_INLINE])
        more = f" (and {len(skipped) - MAX_ERRORS_INLINE} more)" if len(skipped) > MAX_ERRORS_INLINE else ""
        raise InputError(
            f"{len(skipped)} bad row(s): {shown}{more}. Fix them, or pass --skip-bad-rows to skip and count them."
        )
    sample_rows = np.flatnonzero(usable[sequences.row]).astype(np.int64)
    if sample_rows.size == 0:
        raise InputError(f"no usable rows in {source.num_rows} (all {len(skipped)} were skipped)")
    return sample_rows, skipped, patches, prefix


def _too_long_rows(planning: PlanningOptions, source: Source, row_tokens: np.ndarray, usable: np.ndarray, grouped: bool,
                   pairs: bool) -> list[tuple[int, str]]:
    """``(input row, reason)`` of the usable rows whose tokens (``row_tokens``, int64 ``[rows]``: a
    group's together) exceed what pack_size allows under ``overflow: error`` (other policies cut them in
    :func:`plan_packs`). Raises InputError listing them unless ``planning.skip_bad_rows``."""
    opts = planning.plan
    limit = opts.usable_length  # the rest is plan_packs' overflow policy (thdpack/planning/packing.py)
    too_long = np.flatnonzero(usable & (row_tokens > limit)) if opts.overflow == "error" else np.zeros(0, np.int64)
    what = (f" in its group (group_column: {planning.group_column})" if planning.group_column else
            " for chosen + rejected" if pairs else "") + (", the shared prefix once" if planning.share_prefix else "")
    if too_long.size and not planning.skip_bad_rows:
        shown = ", ".join(f"{source.where(r)} ({int(row_tokens[r])} tokens{what})"
                          for r in too_long[:MAX_ERRORS_INLINE].tolist())
        more = f" and {too_long.size - MAX_ERRORS_INLINE} more" if too_long.size > MAX_ERRORS_INLINE else ""
        raise InputError(
            f"{too_long.size} row(s) have more tokens than pack_size={opts.pack_size}"
            + (f" allows at align {opts.align} ({limit})" if limit != opts.pack_size else "")
            + f": {shown}{more}. "
            + ("A group (a preference pair, a group_column group) shares one pack: use a larger pack_size, or "
               "--skip-bad-rows." if grouped else
               "Use overflow: truncate, split or drop, a larger pack_size, or --skip-bad-rows.")
        )
    return [(r, f"{int(row_tokens[r])} tokens{what}, more than pack_size={opts.pack_size} allows (overflow=error)")
            for r in too_long.tolist()]


@dataclass(frozen=True)
class Planner:
    """:func:`plan_packs` with the build's options, for any subset of its tokenized sequences."""

    planning: PlanningOptions
    sequences: Sequences
    vlm: object  # a VlmBuild, or None
    patches: object  # the VlmBuild's per-sequence patches (vlm.plan_checks), or None
    prefix: np.ndarray | None = None  # share_prefix: int64 [sequences] each one's group prefix (common_prefixes)

    def plan(self, rows: np.ndarray) -> PackPlan:
        """The plan of the sequences ``rows`` (int64, ascending)."""
        opts, group = self.planning.plan, self.sequences.group
        return plan_packs(
            self.sequences.lengths[rows],
            opts.pack_size,
            algorithm=opts.algorithm,
            align=opts.align,
            overflow=opts.overflow,
            max_samples_per_pack=opts.max_samples_per_pack,
            seed=opts.seed,
            **(self.vlm.plan_kwargs(self.patches, rows) if self.vlm is not None else {}),
            **({"groups": group[rows]} if group is not None else {}),  # a pair's / group's sequences in one pack
            **({"shared_prefix": _planned_prefix(self.prefix, rows)} if self.prefix is not None else {}),  # once
        )


def _planned_prefix(prefix, rows: np.ndarray):
    """The ``shared_prefix`` of the sequences ``rows`` (whole groups): their one-level prefixes, or their groups'
    layouts where some group is a trie (:class:`TrieShares`)."""
    return prefix.layout.subset(rows) if isinstance(prefix, TrieShares) else prefix[rows]


def plan_samples(planner: Planner, count, source: Source, sample_rows: np.ndarray, *, whole_input: bool = True):
    """``(plan, sample_rows, piece_targets, without)``: the plan of ``sample_rows``, the target tokens of
    each of its pieces (int64 ``[pieces]``) and the :class:`WithoutTargets`; under ``without_targets:
    drop`` planned again without those samples (their whole groups), whose rows ``sample_rows`` no
    longer holds. ``count``: the target counter of the tokenized rows (:func:`target_counter`). ``overflow: drop`` of every row stops the build of a
    ``whole_input``; an input slice whose rows are all dropped is written empty with a warning (the
    other slices may hold packs; merge adds up the counts)."""
    planning, sequences = planner.planning, planner.sequences
    plan = planner.plan(sample_rows)
    if plan.stats.samples_dropped and plan.stats.samples_dropped == sample_rows.size:
        if whole_input:
            _all_dropped(planning, source, sequences, sample_rows)
        logger.warning(f"warning: every row of this input slice is longer than pack_size={planning.plan.pack_size}: "
                       f"overflow=drop dropped all {sample_rows.size} (counted in metadata.json); the slice has no packs")
    piece_targets = _piece_targets(count, sample_rows, plan)
    without = _without_targets(sample_rows, plan, piece_targets, planning.without_targets)
    if without.dropped_samples:  # the plan's cuts are per sample: the other samples keep theirs
        seq_group = sequences.group
        drop = (np.flatnonzero(np.isin(seq_group, seq_group[without.rows])) if seq_group is not None
                else without.rows)  # whole groups
        sample_rows = np.setdiff1d(sample_rows, drop, assume_unique=True)
        del plan, piece_targets  # planned again below: not both plans held at once
        if sample_rows.size == 0:
            raise InputError(
                f"no row has a target token in what overflow={planning.plan.overflow} keeps of it ({without.rows.size} rows, "
                f"e.g. {source.where(int(sequences.row[without.rows[0]]))}): nothing to train on. Check the loss / "
                "labels of the rows, raise pack_size, or set without_targets: keep to pack them anyway"
            )
        plan = planner.plan(sample_rows)
        piece_targets = _piece_targets(count, sample_rows, plan)
    return plan, sample_rows, piece_targets, without


def _all_dropped(planning: PlanningOptions, source: Source, sequences: Sequences, sample_rows: np.ndarray) -> None:
    """InputError for a plan that ``overflow: drop`` left empty: every sample is longer than a pack
    (as a build whose samples all lack targets stops, rather than writing a dataset of no packs)."""
    opts = planning.plan
    longest = int(sample_rows[np.argmax(sequences.lengths[sample_rows])])
    raise InputError(
        f"every row is longer than pack_size={opts.pack_size}"
        + (f" allows at align {opts.align} ({opts.usable_length})" if opts.usable_length != opts.pack_size else "")
        + f", so overflow=drop dropped all {sample_rows.size} (the longest: {source.where(int(sequences.row[longest]))}, "
        f"{int(sequences.lengths[longest])} tokens): use a larger pack_size, or overflow: truncate or split"
    )


def log_plan(planning: PlanningOptions, plan: PackPlan, without: "WithoutTargets", seconds: float) -> None:
    """The ``planned`` log line, and the ``without targets`` one when some samples have none."""
    opts = planning.plan
    logger.info(f"planned   {len(plan):,} packs of {opts.pack_size} ({opts.algorithm}, align {opts.align}): "
                f"efficiency {plan.stats.efficiency:.4f}, lower bound {plan.stats.lower_bound:,} in {seconds:.2f}s")
    if without.rows.size:
        logger.info(f"without targets: {without.rows.size:,} samples have no target token in what overflow="
                    f"{opts.overflow} keeps of them; {'dropped' if without.dropped_samples else 'kept'} "
                    f"(without_targets: {planning.without_targets})")


def check_group_options(planning: PlanningOptions, input_slice, what: str) -> None:
    """Preference rows and ``group_column`` builds (``what``): the options that would part a pair or a
    group are refused (ConfigError saying what to use); so are slice builds (a group may span slices,
    and ``thdpack merge`` does not know two samples per row)."""
    if input_slice is not None:
        raise ConfigError(f"--slice is not available with {what} yet; build in one process "
                          "(num_proc: N parallelises the tokenization)")
    if planning.plan.overflow != "error":
        raise ConfigError(
            f"overflow: {planning.plan.overflow} cannot be used with {what}: a pair or group shares one pack, and cutting or "
            "dropping one of its sequences would part it. Use overflow: error with a larger pack_size, or "
            "--skip-bad-rows to skip (and count) the rows of groups that do not fit"
        )
    if planning.plan.max_samples_per_pack is not None:
        raise ConfigError(f"max_samples_per_pack cannot be used with {what} (a group is planned as one item); "
                          "remove it")


def _row_errors(errors: list[tuple[int, str]], seq_row: np.ndarray, pairs: bool) -> list[tuple[int, str]]:
    """``(input row, message)`` of the tokenized sequences' errors: as they are, or for preference rows
    one per row, naming the sequence (chosen / rejected) when only one of the two failed."""
    if not pairs:
        return list(errors)
    by_row: dict[int, list[tuple[int, str]]] = {}
    for seq, msg in errors:
        by_row.setdefault(int(seq_row[seq]), []).append((seq, msg))
    out = []
    for row, errs in by_row.items():
        if len(errs) == 2 and errs[0][1] == errs[1][1]:  # the row's own error (bad JSON, a missing field)
            out.append((row, errs[0][1]))
        else:
            out.append((row, "; ".join(f"{'chosen' if seq % 2 == 0 else 'rejected'}: {msg}" for seq, msg in errs)))
    return out


def _sequence_groups(tokenized: Tokenized, seq_row: np.ndarray, planning: PlanningOptions) -> np.ndarray | None:
    """int64 ``[sequences]`` the group of each tokenized sequence, planned into one pack: the
    ``group_column`` value's (numbered), else for preference rows the row's (its pair); None otherwise."""
    if planning.group_column:
        keys = tokenized.dataset.data.table.column(GROUP_COLUMN).to_pylist()  # None on failed rows (0 tokens)
        return np.unique(np.array([k or "" for k in keys], dtype=object), return_inverse=True)[1].astype(np.int64)
    return seq_row if row_format(tokenized.fmt).sequences_per_row > 1 else None


def _row_tokens(lengths: np.ndarray, seq_row: np.ndarray, seq_group: np.ndarray, align: int,
                prefix: np.ndarray | None = None) -> np.ndarray:
    """int64 ``[rows]`` the aligned tokens of each input row's group together (what the group takes in a pack;
    with ``prefix``, int64 ``[sequences]`` each sequence's group prefix, that prefix once)."""
    if isinstance(prefix, TrieShares):
        group_tokens = np.bincount(seq_group, weights=prefix.layout.slots).astype(np.int64)
    elif prefix is None:
        group_tokens = np.bincount(seq_group, weights=round_up(lengths, align)).astype(np.int64)
    else:
        group_tokens = np.bincount(seq_group, weights=round_up(np.maximum(lengths - prefix, 0), align))
        group_prefix = np.zeros(group_tokens.size, np.int64)
        np.maximum.at(group_prefix, seq_group, prefix)
        group_tokens = group_tokens.astype(np.int64) + round_up(group_prefix, align)
    row_group = np.zeros(int(seq_row[-1]) + 1 if seq_row.size else 0, np.int64)
    row_group[seq_row] = seq_group
    return group_tokens[row_group]


@dataclass(frozen=True)
class WithoutTargets:
    """The samples left with no target token once cut to what the plan keeps of them."""

    rows: np.ndarray  # int64 [k]: their input rows, ascending
    policy: str  # BuildConfig.without_targets: "drop" or "keep"
    dropped_samples: int  # k under "drop", else 0
    dropped_tokens: int  # the tokens they would have taken in packs, under "drop"; else 0


def _without_targets(sample_rows: np.ndarray, plan: PackPlan, piece_targets: np.ndarray, policy: str) -> WithoutTargets:
    """Which planned samples hold no target token in any of their pieces. Samples that the
    plan itself dropped (``overflow: drop``) have no pieces and are not counted here."""
    n = sample_rows.size
    pieces = np.bincount(plan.sample_index, minlength=n)
    targets = np.bincount(plan.sample_index, weights=piece_targets, minlength=n)
    empty = (pieces > 0) & (targets == 0)
    drop = policy == "drop"
    kept_tokens = np.bincount(plan.sample_index, weights=plan.length, minlength=n)
    return WithoutTargets(
        rows=sample_rows[empty],
        policy=policy,
        dropped_samples=int(empty.sum()) if drop else 0,
        dropped_tokens=int(kept_tokens[empty].sum()) if drop else 0,
    )


def _piece_targets(count, sample_rows: np.ndarray, plan: PackPlan) -> np.ndarray:
    """int64 ``[pieces]``: target tokens of each piece of ``plan`` (as the writer stores it: the
    tokenized row's targets from the piece's start; a piece's first token starts a sample in its pack,
    so it is never a target), by ``count(rows, starts, lengths)`` (:func:`target_counter`)."""
    return count(sample_rows[plan.sample_index], plan.start + 1, plan.length - 1)


def target_counter(targets: str, tokenized: Tokenized, ray_session=None):
    """``count(rows, starts, lengths)`` -> int64 target tokens of each piece ``rows[k][starts[k]:][:lengths[k]]``
    of the tokenized rows. A piece that is its whole row after the first token (no cut by ``overflow``: most
    pieces) has its row's :data:`TAIL_TARGETS_COLUMN` count, one integer per row that tokenizing wrote; the
    other pieces' targets are read: here, or under ``engine: ray`` by Ray tasks over runs of
    :data:`RAY_COUNT_TOKENS` tokens, which read the rows where they run (only the piece arrays and the counts
    cross the network, never the targets; the driver holds no tokens)."""
    from thdpack.offline.store.gather import count_targets, count_targets_of_dataset, group_boundaries

    table = tokenized.dataset.data.table
    tail = table.column(TAIL_TARGETS_COLUMN).to_numpy()
    row_length = tokenized.lengths

    def read(rows, starts, lengths):
        if ray_session is None:
            return count_targets(table, targets, rows, starts, lengths)
        from thdpack.offline.cluster.ray_tasks import run_tasks

        cuts = group_boundaries(lengths, RAY_COUNT_TOKENS)
        items = [(rows[a:b], starts[a:b], lengths[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        return np.concatenate(run_tasks(ray_session, count_targets_of_dataset, (tokenized.rows, targets), items,
                                        describe=lambda k: f"counting the targets of pieces (run {k + 1} of "
                                                           f"{len(items)})"))

    def count(rows, starts, lengths):
        whole = (starts == 1) & (lengths == row_length[rows] - 1)
        out = np.zeros(rows.size, np.int64)
        out[whole] = tail[rows[whole]]
        cut = np.flatnonzero(~whole)
        if cut.size:
            out[cut] = read(rows[cut], starts[cut], lengths[cut])
        return out

    return count


RAY_COUNT_TOKENS = 1 << 25  # tokens of cut pieces per Ray task counting targets (~32M: a second or two of work)
