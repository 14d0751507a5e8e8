"""Where every sample of a run-time rebalance goes: integers only, the same on every rank.

Every rank computes :func:`plan_route` from the same gathered :class:`RankRecord` list, so
every rank knows, without a second round, which samples each rank runs, which samples each
rank sends to each other one, and the way back. Global sample ids number the ranks' local
samples rank by rank: rank ``r``'s local sample ``i`` is global sample ``offsets[r] + i``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from thdpack.common.align import round_up
from thdpack.planning.balance import BalancedPlan, CostModel, filler_samples, plan_balanced
from thdpack.planning.options import PlanOptions
from thdpack.planning.plan import number_groups
from thdpack.planning.prefix_budget import SharedLayout, as_layout, group_slots
from thdpack.planning.pipeline_parallel.simulate import PipelineShape
from thdpack.planning.pipeline_parallel.steps import StepPlan, plan_steps


@dataclass(frozen=True)
class StepsRequest:
    """What :func:`thdpack.loaders.rebalance.rebalance_steps` asks :func:`plan_route` for: the pipeline's
    ``shape``, the fewest micro-batches per rank it takes and the simulations per rank its order search may spend."""

    shape: PipelineShape
    min_micro_batches: int
    order_budget: int


@dataclass(frozen=True)
class RankRecord:
    """What one rank tells the others before planning (``n`` its local samples).

    Attributes:
        lengths: int64 ``[n]`` tokens each sample is planned with (cut to the layout's ``max_length``).
        groups: int64 ``[n]`` the group id of each sample (ids are per rank: the same id on two
            ranks is two groups), or None without groups.
        sizes: int64 ``[n]`` bytes of each encoded sample (what the all-to-all moves).
        error: None, or why this rank's input is refused (every rank raises it).
        prefix: int64 ``[n]`` the prefix each sample shares with its group (``share_prefix``; 0: laid
            out alone; VLM samples), or a :class:`thdpack.planning.prefix_budget.SharedLayout` (text: each
            group as its build lays it out, a trie's segments once), or None without shared prefixes.
    """

    lengths: np.ndarray
    groups: np.ndarray | None
    sizes: np.ndarray
    error: str | None = None
    prefix: np.ndarray | SharedLayout | None = None


@dataclass(frozen=True)
class Route:
    """Which rank runs which samples (``R`` ranks, ``N`` samples over all of them).

    Attributes:
        offsets: int64 ``[R+1]``: rank ``r``'s local sample ``i`` is global sample ``offsets[r] + i``.
        plan: the :class:`thdpack.planning.BalancedPlan` of the ``N`` lengths (global ids).
        batch_ids: per rank, int64 ``[m_r]``: the global ids of its micro-batches' samples, in order.
        batch_bounds: per rank, int64 ``[b_r + 1]``: where each of its ``b_r`` micro-batches starts
            in ``batch_ids`` (``b_r`` the same on every rank).
        filler: per rank, bool ``[b_r]``: the micro-batch only fills a slot no pack was left for (one
            short sample, run with no targets).
        runner: int64 ``[N]`` the rank whose non-filler micro-batch holds each sample (each exactly once).
        lengths, sizes: int64 ``[N]`` every sample's planned length and encoded bytes.
        held: per rank, int64 sorted unique global ids of the samples its micro-batches hold.
        groups, prefix: int64 ``[N]`` every sample's global group number, and the prefix it shares
            with its group (or the text samples' ``SharedLayout``: :class:`RankRecord`), with shared
            prefixes; else None.
        credit: per rank, int64 ``[m_r]`` (aligned with ``batch_ids``) tokens of each slot laid out
            by an earlier member of its pack (its group's prefix; 0 for the first and for fillers).
        steps: the :class:`thdpack.planning.pipeline_parallel.steps.StepPlan` of a pipeline-parallel step (its ``balanced`` is
            ``plan``), or None.
    """

    offsets: np.ndarray
    plan: BalancedPlan
    batch_ids: list
    batch_bounds: list
    filler: list
    runner: np.ndarray
    lengths: np.ndarray
    sizes: np.ndarray
    held: list
    groups: np.ndarray | None = None
    prefix: np.ndarray | SharedLayout | None = None
    credit: list | None = None
    steps: StepPlan | None = None

    @property
    def world_size(self) -> int:
        return int(self.offsets.size - 1)

    def owner(self, ids: np.ndarray) -> np.ndarray:
        """int64 ``[k]`` the rank whose local sample each global id in ``ids`` is."""
        return np.searchsorted(self.offsets, ids, side="right") - 1

    def sends(self, source: int, dest: int) -> np.ndarray:
        """int64 sorted global ids of ``source``'s samples that ``dest`` holds (what goes from one to the other)."""
        need = self.held[dest]
        lo, hi = np.searchsorted(need, self.offsets[source : source + 2])
        return need[lo:hi]

    def real_ids(self, rank: int) -> np.ndarray:
        """int64 ``[k]`` global ids of the samples of ``rank``'s non-filler micro-batches, in batch order."""
        counts = np.diff(self.batch_bounds[rank])
        return self.batch_ids[rank][np.repeat(~self.filler[rank], counts)]

    def rank_costs(self, lengths: np.ndarray, cost: CostModel) -> np.ndarray:
        """float64 ``[R]`` each rank's cost (``lengths``: int64 ``[N]``; fillers included: they run). A
        member whose prefix an earlier one laid out costs ``L − p`` and ``L² − p²`` (``CostModel.pack_costs``)."""
        out = np.zeros(self.world_size)
        for r, ids in enumerate(self.batch_ids):
            s = lengths[ids].astype(np.float64)
            c = 0.0 if self.credit is None else self.credit[r].astype(np.float64)
            out[r] = cost.linear * (s - c).sum() + cost.quadratic * (s * s - c * c).sum()
        return out


def plan_route(records: list[RankRecord], options: PlanOptions, *, micro_batches: int | None, cost: CostModel,
               pipeline: StepsRequest | None = None) -> Route:
    """The :class:`Route` of every rank's ``records`` (one per rank, in rank order), planned by
    :func:`thdpack.plan_balanced` with ``options`` (pack size, the layout's ``align``), ``R`` =
    ``len(records)`` replicas, ``micro_batches`` and ``cost``, steps unshuffled.

    Rank ``r`` runs ``plan.steps[:, r, :]`` (its ``S·M`` micro-batches, step by step). The plan is made
    with ``fillers=True``: the samples are spread over as many packs as the slots hold, and a slot no
    pack is left for (``plan.filler``) becomes a filler micro-batch holding one short sample (the
    cheapest of the pack it copies, fetched if another rank made it), so every rank still runs ``S·M``
    micro-batches. ``ValueError`` (the same on every rank)
    for a record's error, groups given on some ranks only, a sample longer than a pack, or a
    group longer than ``micro_batches`` packs, naming the rank and its local sample or group.

    With ``pipeline`` (``micro_batches`` None) the plan is :func:`thdpack.planning.pipeline_parallel.steps.plan_steps`'s of the
    gathered lengths instead: one step, ``m`` its own, each rank's micro-batches in the order it simulated
    (:attr:`Route.steps`).
    """
    check_records(records, options, micro_batches, cap_name="pack_size" if pipeline is None else
                  "max_tokens_per_micro_batch")
    counts = np.array([r.lengths.size for r in records], np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    lengths = np.concatenate([r.lengths for r in records]).astype(np.int64)
    groups = _global_groups(records)
    prefix = _gathered_prefix([r.prefix for r in records])
    steps = None
    try:
        if pipeline is None:
            plan = plan_balanced(lengths, num_replicas=len(records), micro_batches=micro_batches, cost=cost,
                                 shuffle_steps=False, groups=groups, shared_prefix=prefix, fillers=True,
                                 **options.keywords())
        else:
            steps = plan_steps(lengths, dp_size=len(records), max_tokens_per_micro_batch=options.pack_size,
                               pp_size=pipeline.shape.pp_size, vpp_size=pipeline.shape.vpp_size,
                               vpp_group=pipeline.shape.vpp_group, min_micro_batches=pipeline.min_micro_batches,
                               order_budget=pipeline.order_budget, cost=cost,
                               groups=groups, shared_prefix=prefix,
                               **{k: v for k, v in options.keywords().items() if k != "pack_size"})
            plan = steps.balanced
    except ValueError as exc:
        raise ValueError(f"rebalance: {exc} (samples are numbered rank by rank: rank r's first local sample is "
                         f"global sample offsets[r], offsets {offsets[:-1].tolist()[:16]})") from None
    sizes = np.concatenate([r.sizes for r in records]).astype(np.int64)
    route = replace(_route_of(plan, offsets, lengths, sizes, cost), steps=steps)
    return route if prefix is None else _with_credit(route, groups, prefix)


def check_records(records: list[RankRecord], options: PlanOptions, micro_batches: int | None, *,
                  cap_name: str = "pack_size") -> None:
    """``ValueError`` naming the rank (and its local sample or group) for what no plan can take (``cap_name``: what
    the caller called the pack's token budget)."""
    failed = [(r, rec.error) for r, rec in enumerate(records) if rec.error is not None]
    if failed:
        r, message = failed[0]
        more = f" ({len(failed)} ranks failed)" if len(failed) > 1 else ""
        raise ValueError(f"rebalance: rank {r}: {message}{more}")
    for name, given in (("groups=", [rec.groups is not None for rec in records]),
                        ("share_prefix=", [rec.prefix is not None for rec in records])):
        if any(given) and not all(given):
            raise ValueError(f"rebalance: {name} was given on ranks {np.flatnonzero(given).tolist()} but not on "
                             f"ranks {np.flatnonzero(~np.array(given)).tolist()}; give it on every rank or none")
    pack_size, align = options.pack_size, options.align
    for r, rec in enumerate(records):
        sizes = round_up(rec.lengths, align)
        over = np.flatnonzero(sizes > pack_size)
        if over.size:
            i = int(over[0])
            raise ValueError(f"rebalance: sample {i} of rank {r} has {int(rec.lengths[i])} tokens ({int(sizes[i])} "
                             f"aligned to {align}), more than {cap_name}={pack_size}; a rollout is never cut here: "
                             f"raise {cap_name} or drop it ({over.size} such sample(s) on rank {r})")
        if rec.groups is not None and rec.groups.size and micro_batches is not None:  # plan_steps sizes m to them
            _check_group_sizes(r, rec, align, pack_size * micro_batches, micro_batches)


def _check_group_sizes(rank: int, rec: RankRecord, align: int, budget: int, micro_batches: int) -> None:
    """A group over ``micro_batches`` packs (its prefix counted once where it shares one) is refused."""
    gid = rec.groups
    group_of = number_groups(gid)
    prefix = np.zeros(gid.size, np.int64) if rec.prefix is None else rec.prefix
    totals = group_slots(as_layout(prefix, rec.lengths, gid, group_of, align), group_of)  # a layout: as given
    over = np.flatnonzero(totals > budget)
    if over.size:
        g = int(over[0])
        raise ValueError(f"rebalance: group {int(gid[np.argmax(group_of == g)])} of rank {rank} has {int(totals[g])} "
                         f"tokens (aligned), more than micro_batches={micro_batches} packs hold ({budget}); a group "
                         "runs on one rank in one step: raise micro_batches or pack_size")


def _global_groups(records: list[RankRecord]) -> np.ndarray | None:
    """int64 ``[N]`` group numbers unique over ranks (each rank's ids numbered, then offset), or None."""
    if records[0].groups is None:
        return None
    out, base = [], 0
    for rec in records:
        local = number_groups(rec.groups) if rec.groups.size else np.zeros(0, np.int64)
        out.append(local + base)
        base += int(local.max()) + 1 if local.size else 0
    return np.concatenate(out).astype(np.int64)


def _gathered_prefix(prefixes: list):
    """Every rank's shared prefixes in rank order: None, int64 ``[N]`` one-level prefixes, or one
    :class:`thdpack.planning.prefix_budget.SharedLayout` (text: tries; groups are per rank, so each keeps its
    members' shares)."""
    if prefixes[0] is None:
        return None
    if isinstance(prefixes[0], SharedLayout):
        return SharedLayout.joined(prefixes)
    return np.concatenate(prefixes).astype(np.int64)


def _with_credit(route: Route, groups: np.ndarray, prefix: np.ndarray) -> Route:
    """``route`` with its shared prefixes: per rank, the prefix tokens each slot's pack laid out before it
    (the plan's ``shared_length``; fillers run alone and get 0)."""
    shared = np.zeros(route.lengths.size, np.int64)
    inner = route.plan.plan
    if inner.shared_length is not None:
        shared[inner.sample_index] = inner.shared_length
    credit = [np.where(np.repeat(f, np.diff(b)), 0, shared[ids])
              for ids, b, f in zip(route.batch_ids, route.batch_bounds, route.filler)]
    return replace(route, groups=groups, prefix=prefix, credit=credit)


def _route_of(plan: BalancedPlan, offsets: np.ndarray, lengths: np.ndarray, sizes: np.ndarray,
              cost: CostModel) -> Route:
    """Rank ``r``'s micro-batches: ``plan.steps[:, r, :]`` in order, the plan's filler slots (``plan.filler``)
    holding the cheapest sample of the pack they copy (fetched if another rank made it)."""
    steps, fill_all = plan.steps, plan.filler
    num_ranks = offsets.size - 1
    pack_offsets, sample_index = plan.plan.pack_offsets, plan.plan.sample_index
    short = filler_samples(plan.plan, cost)
    batch_ids, batch_bounds, filler, reals = [], [], [], []
    runner = np.full(lengths.size, -1, np.int64)
    for r in range(num_ranks):
        packs, fill = steps[:, r, :].reshape(-1), fill_all[:, r, :].reshape(-1)
        parts = [np.array([short[k]]) if f else sample_index[pack_offsets[k] : pack_offsets[k + 1]]
                 for k, f in zip(packs.tolist(), fill.tolist())]
        real = np.concatenate([p for p, f in zip(parts, fill.tolist()) if not f] or [np.zeros(0, np.int64)])
        runner[real] = r
        reals.append(real)
        counts = np.array([p.size for p in parts], np.int64)
        batch_ids.append(np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64))
        batch_bounds.append(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
        filler.append(fill.astype(bool))
    scored = np.bincount(np.concatenate(reals or [np.zeros(0, np.int64)]).astype(np.int64),
                         minlength=lengths.size)
    if lengths.size and not (scored == 1).all():  # the plan's guarantee, checked: cheap, and loud if ever broken
        raise RuntimeError(f"rebalance: the plan scores sample {int(np.flatnonzero(scored != 1)[0])} "
                           f"{int(scored[scored != 1][0])} times; this is a bug in thdpack")
    return Route(offsets=offsets, plan=plan, batch_ids=batch_ids, batch_bounds=batch_bounds, filler=filler,
                 runner=runner, lengths=lengths, sizes=sizes, held=[np.unique(ids) for ids in batch_ids])
