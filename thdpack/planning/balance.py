"""Compute-balanced data-parallel planning.

A training step waits for its slowest data-parallel rank, and packs with equal
token counts are not equal work: attention costs ``Σ sᵢ²``. This module plans
packs that respect the token budget (best-fit decreasing, so efficiency is
unchanged) and then deals them to ``R`` ranks × ``M`` micro-batches per step so
the largest per-rank cost of each step is as close as possible to the step mean.
With ``S·M`` micro-batches per rank fixed, the slack a nearly full budget leaves is
spread over a step of even packs (:mod:`thdpack.planning.spread`), a plan whose ranks
are still off the bound no plan can beat (:mod:`thdpack.planning.rank_fill`) gets its
last step filled rank by rank (:mod:`thdpack.planning.rank_fill`).

Cost of a pack: ``a·Σ sᵢ + b·Σ sᵢ²`` (FLOPs when ``a``, ``b`` come from
:func:`thdpack.flops.model_flops`; any consistent unit otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from thdpack.common.align import check_bool, check_number, check_positive_int, round_up
from thdpack.common.jit import njit
from thdpack.planning.options import PlanOptions, plan_options
from thdpack.planning.packing import PackStats, pack_sums
from thdpack.planning.plan import PackPlan, check_groups, number_groups, plan_packs, validate_lengths, vision_overflow
from thdpack.planning.prefix_budget import SharedLayout, as_layout, group_slots, piece_shared
from thdpack.planning.rank_fill import (rank_floor, refill_around_bundles, refill_last_step, relabel, straggler,
                                        straggler_bound)
from thdpack.planning.spread import Items, group_items, piece_items, recut, spread_slack
from thdpack.common.samples import SampleError


@dataclass(frozen=True)
class CostModel:
    """``cost(pack) = linear · Σ sᵢ + quadratic · Σ sᵢ² + vision · Σ patchesᵢ``.

    ``vision`` is the cost of one ViT patch (e.g. FLOPs per patch of the vision
    tower); it applies to plans made with a vision budget. Each is a finite number >= 0
    (``ValueError`` naming it otherwise: a negative or NaN cost would deal packs by nonsense).
    """

    linear: float = 1.0
    quadratic: float = 0.0
    vision: float = 0.0

    def __post_init__(self):
        for name in ("linear", "quadratic", "vision"):
            check_number(getattr(self, name), f"CostModel.{name}", positive=False,
                         what=" (the cost of a token, of a unit of Σ sᵢ², of a vision patch)")

    @classmethod
    def of(cls, cost) -> "CostModel":
        """``cost`` as a :class:`CostModel`: one already, or ``(linear, quadratic[, vision])``;
        ``TypeError`` naming ``cost`` otherwise."""
        if isinstance(cost, CostModel):
            return cost
        if isinstance(cost, (tuple, list)) and 1 <= len(cost) <= 3:
            return cls(*cost)
        raise TypeError(f"cost must be a CostModel or (linear, quadratic), got {cost!r}")

    @classmethod
    def from_config(cls, config) -> "CostModel":
        """Training FLOPs per token and per unit of ``Σ sᵢ²`` of a model config
        (a transformers config or dict), from :func:`thdpack.flops.model_flops`."""
        from thdpack.flops import model_flops

        linear = float(model_flops(config, num_tokens=1, seqlen_squared_sum=0))
        quadratic = float(model_flops(config, num_tokens=0, seqlen_squared_sum=1))
        return cls(linear, quadratic)

    def pack_costs(self, plan: PackPlan) -> np.ndarray:
        """float64 ``[num_packs]`` cost of every pack of ``plan`` (real lengths). With shared prefixes
        (``plan.shared_length``), each prefix once: a member after the first costs ``L − p`` tokens and
        ``L² − p²`` of ``Σ sᵢ²`` (its ``c·(2p + c)`` attention), so a group costs ``Σ Lⱼ − (k − 1)·p`` and
        ``Σ Lⱼ² − (k − 1)·p²``."""
        lengths = plan.length.astype(np.float64)
        offsets = plan.pack_offsets
        shared = 0.0 if plan.shared_length is None else plan.shared_length.astype(np.float64)
        cost = (self.linear * pack_sums(lengths - shared, offsets)
                + self.quadratic * pack_sums(lengths * lengths - shared * shared, offsets))
        if self.vision and plan.vision_length is not None:
            cost += self.vision * pack_sums(plan.vision_length.astype(np.float64), offsets)
        return cost


@dataclass(frozen=True)
class BalancedPlan:
    """Packs and which rank runs which, step by step.

    Attributes:
        plan: the underlying :class:`PackPlan` (every pack within ``pack_size``).
        steps: int64 ``[num_steps, num_replicas, micro_batches]`` pack ids; rank r
            runs ``plan.pack(steps[s, r, m])`` as micro-batch m of step s.
        costs: float64 ``[num_packs]`` pack costs.
        step_straggler: float64 ``[num_steps]`` max over ranks / mean over ranks of
            the per-rank cost (1.0 is perfect balance; fillers at their cost).
        repeated_packs: packs scheduled twice to fill the last step (only when the
            packs could not be split to a multiple of ``R·M``).
        rank_floor: a cost the costliest rank of any plan of the same pieces and groups reaches over
            ``num_steps`` steps (:func:`thdpack.planning.rank_fill.rank_floor`); 0.0 without packs.
        filler: with ``plan_balanced(fillers=True)``, bool ``[num_steps, num_replicas, micro_batches]``:
            the slot runs a filler (one short sample of its pack, no targets) rather than the pack,
            which runs in another slot; None otherwise (a repeated pack runs again).
        filler_costs: with ``fillers=True``, float64 ``[num_packs]`` the cost of a filler of each pack
            (its shortest piece alone); None otherwise.
    """

    plan: PackPlan
    steps: np.ndarray
    costs: np.ndarray
    step_straggler: np.ndarray
    repeated_packs: int
    rank_floor: float = 0.0
    filler: np.ndarray | None = None
    filler_costs: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        return int(self.steps.shape[0])

    @property
    def straggler_ratio(self) -> float:
        """Mean over steps of max/mean per-rank cost."""
        return float(self.step_straggler.mean()) if self.step_straggler.size else 1.0

    def rank_packs(self, rank: int) -> np.ndarray:
        """int64 ``[num_steps, micro_batches]`` pack ids of ``rank``."""
        return self.steps[:, rank, :]

    @property
    def slot_costs(self) -> np.ndarray:
        """float64 ``[num_steps, num_replicas, micro_batches]`` the cost of what every slot runs (a
        repeated pack its cost again, a filler the filler's)."""
        return slot_costs(self.steps, self.costs, self.filler, self.filler_costs)

    @property
    def rank_totals(self) -> np.ndarray:
        """float64 ``[num_replicas]`` every rank's cost summed over the steps."""
        return self.slot_costs.sum(axis=(0, 2))

    @property
    def straggler(self) -> float:
        """``max / mean`` of :attr:`rank_totals`: the plan's ranks over all its steps (1.0 is perfect balance)."""
        return straggler(self.rank_totals)

    @property
    def straggler_bound(self) -> float:
        """The least :attr:`straggler` a plan whose ranks cost as much in all could have: ``max(1, rank_floor /
        mean)`` (:func:`thdpack.planning.rank_fill.straggler_bound`); never above :attr:`straggler`."""
        return straggler_bound(self.rank_floor, self.rank_totals)


def slot_costs(steps: np.ndarray, costs: np.ndarray, filler: np.ndarray | None = None,
               filler_costs: np.ndarray | None = None) -> np.ndarray:
    """float64 ``[S, R, M]`` the cost of every slot of int64 ``[S, R, M]`` ``steps``: ``costs[pack]``, or
    ``filler_costs[pack]`` where bool ``filler`` is set."""
    out = costs[steps]
    if filler is not None:
        out = np.where(filler, filler_costs[steps], out)
    return out


def rank_costs(steps: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """float64 ``[num_steps, R]`` per-rank cost of each step."""
    return costs[steps].sum(axis=2)


def straggler_per_step(steps: np.ndarray, costs: np.ndarray, filler: np.ndarray | None = None,
                       filler_costs: np.ndarray | None = None) -> np.ndarray:
    """float64 ``[S]`` max / mean of the per-rank cost of each step (1.0 where the mean is 0)."""
    per_rank = slot_costs(steps, costs, filler, filler_costs).sum(axis=2)
    mean = per_rank.mean(axis=1)
    return np.divide(per_rank.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)


def plan_balanced(
    lengths,
    pack_size: int | None = None,
    *,
    num_replicas: int,
    micro_batches: int = 1,
    cost: CostModel | tuple[float, float] = CostModel(),
    shuffle_steps: bool = True,
    vision_lengths=None,
    groups=None,
    shared_prefix=None,
    fillers: bool = False,
    **plan_keywords,
) -> BalancedPlan:
    """Plan packs and deal them to ``num_replicas`` ranks × ``micro_batches`` per step.

    Packs are planned, their slack spread, sorted by cost into steps, dealt, and the last step filled rank by
    rank: docs/rl.md, "plan_balanced: the steps of a plan".

    Args:
        lengths, vision_lengths: as in :func:`thdpack.plan_packs`.
        pack_size, **plan_keywords: the planning keywords (``pack_size``, ``algorithm``, ``align``, ``overflow``,
            ``max_samples_per_pack``, ``seed``, ``vision_budget``), as in :func:`thdpack.plan_packs`.
        num_replicas, micro_batches: data-parallel ranks ``R``; packs per rank per step ``M``.
        cost: a :class:`CostModel` or ``(linear, quadratic)``.
        groups: ``[n]`` group ids (:func:`thdpack.plan_packs`): all of a group's samples run on
            one rank in one step. A group that fits one pack shares a pack with other groups; a larger
            one (e.g. 8 GRPO rollouts of 1,500 tokens at pack 4096) is packed first-fit decreasing into as
            few packs as possible, at most ``micro_batches`` (more is a ``ValueError`` naming the group),
            dealt as one bundle (:func:`_plan_bundles`), the other groups' packs re-cut, whole groups, to
            fill the other slots. Without ``fillers`` and without such a group, the packs are
            :func:`thdpack.plan_packs`'s (steps 2 and 4 only deal them), and the last step may repeat packs.
        shared_prefix: with ``groups``, ``[n]`` each sample's prefix shared with its group
            (:func:`thdpack.plan_packs`): a group counts its prefix once against the pack budget and in
            the cost. A group over one pack is planned unshared into its bundle (each pack of the bundle
            then shares the prefix among the members it holds, which only lowers its tokens).
        fillers: the caller runs a slot the plan cannot fill as a *filler* (the cheapest sample of a pack,
            no targets, as :func:`thdpack.rebalance` does), not the pack again: every item then gets a pack
            of its own before a slot is left over, fillers are dealt at their cost and marked in
            :attr:`BalancedPlan.filler`, and steps 2 and 4 re-cut groups too (and every step, not only the
            last).
    """
    check_positive_int(num_replicas, "num_replicas")
    check_positive_int(micro_batches, "micro_batches")
    num_replicas, micro_batches = int(num_replicas), int(micro_batches)
    cost = CostModel.of(cost)
    options = plan_options("plan_balanced", {"pack_size": pack_size, **plan_keywords})
    shape = dict(num_replicas=num_replicas, micro_batches=micro_batches, cost=cost,
                 shuffle_steps=check_bool(shuffle_steps, "shuffle_steps"), fillers=check_bool(fillers, "fillers"))
    split = None if groups is None else _split_groups(lengths, groups, vision_lengths, options, shared_prefix)
    if split is not None and split.big.any():  # some group needs several packs
        return _plan_bundles(split, options, **shape)
    plan = plan_packs(lengths, vision_lengths=vision_lengths, groups=groups, shared_prefix=shared_prefix,
                      **options.keywords())
    return _plan_whole_groups(plan, split, options, **shape)


def _plan_whole_groups(plan: PackPlan, split: _GroupSplit | None, options: PlanOptions, *, num_replicas: int,
                       micro_batches: int, cost: CostModel, shuffle_steps: bool, fillers: bool) -> BalancedPlan:
    """Steps 2–5 of :func:`plan_balanced` for ``plan`` (:func:`thdpack.plan_packs`'s), whose pieces (or groups,
    ``split``) each fit one pack."""
    items_of = (lambda p: piece_items(p, cost)) if split is None else \
        (lambda p: group_items(p, split.group_of, cost, split.layout))
    planned, fresh = len(plan), 0
    if split is None or fillers:  # a grouped plan without fillers keeps plan_packs' packs
        plan, fresh = spread_slack(plan, items_of(plan), cost.pack_costs(plan), num_replicas * micro_batches,
                                   fillers=fillers, max_pieces=options.max_samples_per_pack or 0,
                                   recut_full=num_replicas > 1)
    dealt = _deal_steps(plan, cost, num_replicas, micro_batches, fillers)
    recut_last = _last_step_recut(dealt, split is None, planned, fresh, fillers)
    even = recut_last and not fillers and len(dealt.plan) == planned  # every pack may be re-cut, at the same count
    dealt = _rank_repair(dealt, items_of, cost, options, micro_batches=micro_batches, recut_last=recut_last,
                         fillers=fillers, even=even)
    return _balanced(dealt, items_of(dealt.plan), options, num_replicas=num_replicas, micro_batches=micro_batches,
                     cost=cost, shuffle_steps=shuffle_steps, fillers=fillers)


@dataclass(frozen=True)
class _Dealt:
    """A plan and its steps (``[S, R, M]`` pack ids), before the steps are shuffled: the pack costs, the
    number of repeated slots, and with fillers which slots run one and what each pack's costs."""

    plan: PackPlan
    steps: np.ndarray
    costs: np.ndarray
    repeated: int
    filler: np.ndarray | None = None
    filler_costs: np.ndarray | None = None

    @property
    def slot_costs(self) -> np.ndarray:
        return slot_costs(self.steps, self.costs, self.filler, self.filler_costs)


def _deal_steps(plan: PackPlan, cost: CostModel, num_replicas: int, micro_batches: int, fillers: bool) -> _Dealt:
    """``plan``'s packs in steps of similar cost (:func:`_cost_sorted_steps`)."""
    costs = cost.pack_costs(plan)
    filler_costs = _filler_costs(plan, cost) if fillers else None
    steps, repeated, filler = _cost_sorted_steps(costs, num_replicas, micro_batches, filler_costs)
    return _Dealt(plan, steps, costs, repeated, filler, filler_costs)


def _last_step_recut(dealt: _Dealt, ungrouped: bool, planned: int, fresh: int, fillers: bool) -> bool:
    """Whether the last step's packs may be re-cut rank by rank: always with fillers; without, only for a
    plan without groups (one with groups keeps :func:`thdpack.plan_packs`' packs) whose last step repeats
    nothing and holds only packs :func:`spread_slack` made, or a plan with as many packs as
    ``plan_packs`` gave (its cheapest packs, what may be re-cut without more packs)."""
    if fillers:
        return True
    if not ungrouped or dealt.repeated or not dealt.steps.size:
        return False
    return len(dealt.plan) == planned or bool((dealt.steps[-1] >= len(dealt.plan) - fresh).all())


# a plan whose straggler is over REPAIR_AT x its bound gets its last step filled rank by rank
REPAIR_AT = 1.005


def _rank_repair(dealt: _Dealt, items_of, cost: CostModel, options: PlanOptions, *, micro_batches: int,
                 recut_last: bool, fillers: bool, even: bool = False) -> _Dealt:
    """``dealt``, or, when its ranks' totals are off their bound by more than :data:`REPAIR_AT`, the plan
    with the lowest straggler of: its last step filled rank by rank
    (:func:`thdpack.planning.rank_fill.refill_last_step`: the items of its packs with ``recut``, else its
    packs whole), and with fillers every step so filled; with ``even`` (no fillers, as many packs as
    :func:`thdpack.plan_packs` gave) also every pack re-cut evenly and dealt again. Without fillers a re-cut
    keeps steps of decreasing cost (no fresh pack dearer than an earlier step's) and fills every slot."""
    steps = dealt.steps
    if not steps.size or steps.shape[1] == 1:
        return dealt
    totals = dealt.slot_costs.sum(axis=(0, 2))
    floor = _floor(dealt.plan, items_of(dealt.plan), cost, options, steps.shape[1], micro_batches, len(steps))
    if straggler(totals) <= REPAIR_AT * straggler_bound(floor, totals):
        return dealt
    best, best_straggler = dealt, straggler(totals)
    for candidate in _refills(dealt, items_of, cost, options, recut_last=recut_last, fillers=fillers, even=even):
        value = straggler(candidate.slot_costs.sum(axis=(0, 2)))
        if value < best_straggler:
            best, best_straggler = candidate, value
        if best_straggler <= REPAIR_AT * straggler_bound(floor, best.slot_costs.sum(axis=(0, 2))):
            break
    return best


def _refills(dealt: _Dealt, items_of, cost: CostModel, options: PlanOptions, *, recut_last: bool, fillers: bool,
             even: bool):
    """The plans :func:`_rank_repair` tries, best first: the last step re-cut (or its packs moved whole),
    then with fillers every step re-cut (while the fill's work stays small), with ``even`` every pack re-cut
    into as many of even cost (:func:`thdpack.planning.spread.recut`), dealt as :func:`_deal_steps` deals."""
    steps, slot = dealt.steps, dealt.slot_costs
    filler = np.zeros(steps.shape, bool) if dealt.filler is None else dealt.filler
    max_pieces = options.max_samples_per_pack or 0
    cap = np.inf if fillers or len(steps) == 1 else float(dealt.costs[steps[:-1]].min())
    spans = [1] + ([len(steps)] if fillers and len(steps) > 1 and dealt.plan.length.size * steps.size <= _FILL_WORK
                   else [])
    for span, current in ((span, current) for span in (spans if recut_last else []) for current in (False, True)):
        out = refill_last_step(dealt.plan, items_of(dealt.plan), steps, slot, filler, recut=True, num_last=span,
                               max_pieces=max_pieces, cost_cap=cap, fill_all=not fillers, from_current=current)
        if out is not None and (fillers or not out[2].any()):  # without fillers every slot must hold a pack
            yield _refilled(dealt, out, cost, fillers)
    if even:
        plan = recut(dealt.plan, items_of(dealt.plan), len(dealt.plan), max_pieces)
        if plan is not None:
            yield _deal_steps(plan, cost, steps.shape[1], steps.shape[2], False)
    plan, new_steps, flags = refill_last_step(dealt.plan, None, steps, slot, filler, recut=False)
    yield replace(dealt, steps=new_steps, filler=None if dealt.filler is None else flags)


# the most (pieces × slots) a refill of every step may visit: beyond it, the last step only
_FILL_WORK = 1 << 24


def _refilled(dealt: _Dealt, out: tuple, cost: CostModel, fillers: bool) -> _Dealt:
    """The :class:`_Dealt` of a re-cut :func:`refill_last_step` result: its costs recounted, and with fillers
    its empty slots running a filler of the pack whose filler is cheapest."""
    plan, steps, empty = out
    costs = cost.pack_costs(plan)
    if not fillers:
        return _Dealt(plan, steps, costs, 0)
    filler_costs = _filler_costs(plan, cost)
    steps = np.where(empty, int(np.argmin(filler_costs)), steps)
    return _Dealt(plan, steps, costs, int(empty.sum()), empty, filler_costs)


def _floor(plan: PackPlan, items: Items, cost: CostModel, options: PlanOptions, num_replicas: int,
           micro_batches: int, num_steps: int) -> float:
    """:func:`thdpack.planning.rank_fill.rank_floor` of ``plan``'s items on ``num_replicas`` ranks of
    ``num_steps·micro_batches`` micro-batches (an item over one pack, a group's bundle, fills at most
    ``micro_batches``)."""
    fits = items.size <= options.pack_size
    if options.vision_budget is not None:
        fits &= items.vision <= options.vision_budget
    piece_min = float(piece_items(plan, cost).cost.min()) if plan.length.size else 0.0
    item_cost = items.cost
    if items.layout is not None and items.layout.prefix is not None and not fits.all():  # a group over one pack
        first = np.unique(items.of_piece, return_index=True)[1]  # lays its prefix out in each of its packs: at
        p = np.zeros(items.size.size)  # least size / pack_size of them
        p[items.of_piece[first]] = items.layout.prefix[plan.sample_index[first]]
        extra = np.maximum(0, -(-items.size // options.pack_size) - 1)
        item_cost = item_cost + extra * (cost.linear * p + cost.quadratic * p * p)
    return rank_floor(item_cost, np.where(fits, 1, np.minimum(micro_batches, items.pieces)).astype(np.int64),
                      piece_min, num_replicas, num_steps * micro_batches)


def _balanced(dealt: _Dealt, items: Items, options: PlanOptions, *, num_replicas: int, micro_batches: int,
              cost: CostModel, shuffle_steps: bool, fillers: bool) -> BalancedPlan:
    """The :class:`BalancedPlan` of ``dealt``: its floor computed, its steps shuffled with ``shuffle_steps``
    (its fillers alike)."""
    steps, filler = dealt.steps, dealt.filler
    floor = _floor(dealt.plan, items, cost, options, num_replicas, micro_batches, len(steps))
    if shuffle_steps and len(steps):
        order = np.random.default_rng(options.seed).permutation(len(steps))
        steps = steps[order]
        filler = None if filler is None else filler[order]
    return BalancedPlan(plan=dealt.plan, steps=steps, costs=dealt.costs,
                        step_straggler=straggler_per_step(steps, dealt.costs, filler, dealt.filler_costs),
                        repeated_packs=dealt.repeated, rank_floor=floor, filler=filler,
                        filler_costs=dealt.filler_costs)


def _filler_costs(plan: PackPlan, cost: CostModel) -> np.ndarray:
    """float64 ``[num_packs]`` the cost of a filler of every pack: its cheapest piece alone."""
    if len(plan) == 0:
        return np.zeros(0)
    return np.minimum.reduceat(piece_items(plan, cost).cost, plan.pack_offsets[:-1])


def filler_pieces(plan: PackPlan, cost: CostModel) -> np.ndarray:
    """int64 ``[num_packs]`` the piece (position in ``plan.sample_index``) a filler of every pack runs: its
    cheapest (the first such), the one :func:`_filler_costs` counts."""
    if len(plan) == 0:
        return np.zeros(0, np.int64)
    pack_of = np.repeat(np.arange(len(plan)), np.diff(plan.pack_offsets))
    order = np.lexsort((np.arange(pack_of.size), piece_items(plan, cost).cost, pack_of))
    return order[plan.pack_offsets[:-1]].astype(np.int64)


def filler_samples(plan: PackPlan, cost: CostModel) -> np.ndarray:
    """int64 ``[num_packs]`` the input sample a filler of every pack runs (:func:`filler_pieces`)."""
    return plan.sample_index[filler_pieces(plan, cost)]


def _cost_sorted_steps(costs: np.ndarray, num_replicas: int, micro_batches: int,
                       filler_costs: np.ndarray | None = None) -> tuple[np.ndarray, int, np.ndarray | None]:
    """Steps of packs of similar cost: float64 ``[num_packs]`` ``costs`` sorted decreasing, cut
    into steps of ``R·M`` packs (copies of the cheapest packs of the earlier steps fill the last one,
    when the packs are not a multiple), each dealt as :func:`_deal` deals (its slots by decreasing cost).
    A copy is dealt at its pack's cost, or at
    ``filler_costs`` (float64 ``[num_packs]``) when given (it then runs a filler). Returns (int64
    ``[S, R, M]`` pack ids, number of copies, bool ``[S, R, M]`` the copies' slots with
    ``filler_costs``, else None)."""
    per_step = num_replicas * micro_batches
    num_packs = costs.size
    order = np.argsort(-costs, kind="stable")
    repeated = (-num_packs) % per_step  # only when splitting could not reach a multiple
    copy = np.zeros(order.size + repeated, bool)
    if repeated:  # copies of the cheapest packs the last step does not hold (a group runs on one rank in a
        earlier = num_packs - (per_step - repeated)  # step), or with fillers those whose filler is cheapest
        pool = np.concatenate([order[:earlier][::-1], order[earlier:][::-1]])
        if filler_costs is not None:
            pool = np.argsort(filler_costs, kind="stable")
        order = np.concatenate([order, pool[np.arange(repeated) % num_packs]])
        copy[num_packs:] = True
    slot_cost = costs[order] if filler_costs is None else np.where(copy, filler_costs[order], costs[order])
    if not order.size:
        empty = np.zeros((0, num_replicas, micro_batches), np.int64)
        return empty, int(repeated), None if filler_costs is None else empty.astype(bool)
    shape = (-1, num_replicas, micro_batches)
    slot_cost, order, copy = slot_cost.reshape(-1, per_step), order.reshape(-1, per_step), copy.reshape(-1, per_step)
    by_cost = np.argsort(-slot_cost, axis=1, kind="stable")  # each step's slots by decreasing cost, as _deal deals
    slot_cost, order, copy = (np.take_along_axis(a, by_cost, axis=1) for a in (slot_cost, order, copy))
    ones = np.ones(per_step, np.int64)
    ranks = np.stack([_deal_kernel(np.ascontiguousarray(c), ones, num_replicas, micro_batches) for c in slot_cost])
    by_rank = np.argsort(ranks, axis=1, kind="stable")
    steps = np.take_along_axis(order, by_rank, axis=1).reshape(shape)
    return steps, int(repeated), None if filler_costs is None else np.take_along_axis(copy, by_rank, 1).reshape(shape)


def _deal(group: np.ndarray, costs: np.ndarray, num_replicas: int, micro_batches: int) -> np.ndarray:
    """Deal ``R·M`` packs (sorted by decreasing cost) to ranks, M each, least-loaded first.

    ``group``: int64 ``[R·M]`` pack ids, dealt in this order, each to the rank with the
    least cost so far among those with a free slot (ties: the lowest rank); ``costs``:
    float64 ``[num_packs]``. Returns int64 ``[R, M]`` pack ids, in the order each rank got
    them. Plain reference: ``ref_deal`` in ``tests/test_balance.py``. (:func:`_cost_sorted_steps`
    deals every step so, all at once.)
    """
    ranks = _deal_units(costs[group], np.ones(group.size, np.int64), num_replicas, micro_batches)
    return group[np.argsort(ranks, kind="stable")].reshape(num_replicas, micro_batches)


def _deal_units(unit_costs: np.ndarray, unit_slots: np.ndarray, num_bins: int, slots_per_bin: int) -> np.ndarray:
    """The dealing rule: units in the given order, each to the least-loaded bin with enough free slots.

    ``unit_costs``: float64 ``[U]``; ``unit_slots``: int64 ``[U]`` slots a unit occupies (1 for
    a pack, ``k`` for a group's bundle of ``k`` packs); bins: ``num_bins`` of ``slots_per_bin``
    slots (a rank's micro-batches). Ties go to the lowest bin. Returns int64 ``[U]`` the bin of
    each unit, -1 where no bin had room. Plain reference: ``ref_deal_units`` in
    ``tests/test_plan_groups.py``.
    """
    return _deal_kernel(np.ascontiguousarray(unit_costs, np.float64), np.ascontiguousarray(unit_slots, np.int64),
                        int(num_bins), int(slots_per_bin))


@njit
def _deal_kernel(unit_costs, unit_slots, num_bins, slots_per_bin):
    """:func:`_deal_units`, compiled."""
    load = np.zeros(num_bins)
    free = np.full(num_bins, slots_per_bin, np.int64)
    out = np.full(unit_costs.shape[0], -1, np.int64)
    for u in range(unit_costs.shape[0]):
        b = -1
        for q in range(num_bins):
            if free[q] >= unit_slots[u] and (b < 0 or load[q] < load[b]):
                b = q
        if b >= 0:
            out[u] = b
            free[b] -= unit_slots[u]
            load[b] += unit_costs[u]
    return out


@dataclass(frozen=True)
class _GroupSplit:
    """Checked inputs of a grouped plan whose groups do not all fit one pack.

    ``lengths`` / ``sizes`` (aligned) / ``gid`` / ``group_of`` (groups numbered 0.. by first
    appearance): int64 ``[n]``; ``vision``: int64 ``[n]`` or None; ``big``: bool ``[G]``; ``layout``:
    the shared segments (:class:`thdpack.planning.prefix_budget.SharedLayout`), or None.
    """

    lengths: np.ndarray
    sizes: np.ndarray
    vision: np.ndarray | None
    gid: np.ndarray
    group_of: np.ndarray
    big: np.ndarray
    layout: SharedLayout | None = None


def _split_groups(lengths, groups, vision_lengths, options: PlanOptions, shared_prefix=None) -> _GroupSplit:
    """The checked groups, and which need more than one pack (tokens, their shared prefix once, or vision
    patches); when none does, :func:`thdpack.plan_packs` plans them."""
    lengths = validate_lengths(lengths)
    pack_size, vision_budget = options.pack_size, options.vision_budget
    gid = check_groups(groups, lengths.size)
    group_of = number_groups(gid)
    num_groups = int(group_of.max()) + 1 if group_of.size else 0
    sizes = round_up(lengths, options.align)
    layout = as_layout(shared_prefix, lengths, gid, group_of, options.align)
    if layout is None:
        big = np.bincount(group_of, weights=sizes, minlength=num_groups) > pack_size
    else:
        big = group_slots(layout, group_of) > pack_size
    vision = None
    if vision_lengths is not None or vision_budget is not None:
        vision = vision_overflow(lengths, np.zeros(lengths.size, bool), vision_lengths, vision_budget, "drop", pack_size)
        big |= np.bincount(group_of, weights=vision, minlength=num_groups) > vision_budget
    return _GroupSplit(lengths, sizes, vision, gid, group_of, big, layout)


def _name_group(split: _GroupSplit, members: np.ndarray) -> str:
    shown = ", ".join(map(str, members[:8].tolist())) + (", ..." if members.size > 8 else "")
    return f"group {int(split.gid[members[0]])} (samples {shown})"


def _pack_big_groups(split: _GroupSplit, options: PlanOptions, micro_batches: int | None):
    """First-fit decreasing packs of every multi-pack group, its samples whole (``options``: the
    pack size, alignment and vision budget of the plan).

    Returns ``(sample_index, pack_counts, bundle_sizes)``: int64 sample ids in pack order, int64
    ``[P]`` samples per pack, int64 ``[num_big_groups]`` packs per group (at most ``micro_batches``;
    None: any number, as :func:`group_pack_counts` asks).
    """
    by_group = np.argsort(split.group_of, kind="stable")
    bounds = np.cumsum(np.bincount(split.group_of, minlength=split.big.size))[:-1]
    members_of = np.split(by_group, bounds)
    pack_size, vision_budget = options.pack_size, options.vision_budget
    checks = [(split.sizes, pack_size, "tokens (aligned)", "pack_size")]
    if split.vision is not None:
        checks.append((split.vision, vision_budget, "vision patches", "vision_budget"))
    for per_sample, budget, what, name in checks:
        too_long = np.flatnonzero(split.big[split.group_of] & (per_sample > budget))
        if too_long.size:
            i = int(too_long[0])
            raise SampleError.at(
                i, f" of {_name_group(split, members_of[split.group_of[i]])} has {int(per_sample[i])} {what}, "
                f"more than {name}={budget}; a group's samples are never cut: raise {name} or drop the sample "
                f"({too_long.size} such sample(s))"
            )
    sample_index, pack_counts, bundle_sizes, over = [], [], [], []
    for g in np.flatnonzero(split.big).tolist():
        members = members_of[g]
        sub = plan_packs(
            split.lengths[members], pack_size, algorithm="ffd", align=options.align,
            vision_lengths=None if split.vision is None else split.vision[members], vision_budget=vision_budget,
        )
        if micro_batches is not None and len(sub) > micro_batches:
            over.append((g, len(sub)))
        sample_index.append(members[sub.sample_index])
        pack_counts.append(np.diff(sub.pack_offsets))
        bundle_sizes.append(len(sub))
    if over:
        g, k = over[0]
        members = members_of[g]
        raise ValueError(
            f"{_name_group(split, members)} has {int(split.sizes[members].sum())} tokens (aligned) and needs {k} packs "
            f"of pack_size={pack_size}, more than micro_batches={micro_batches}; a group's packs run on one rank in "
            f"one step: raise micro_batches or pack_size ({len(over)} group(s) too large)"
        )
    return np.concatenate(sample_index), np.concatenate(pack_counts), np.asarray(bundle_sizes, np.int64)


def most_group_packs(lengths, groups, vision_lengths, options: PlanOptions, shared_prefix=None) -> int:
    """The most packs of ``options.pack_size`` one group needs (1 when each fits one pack; 0 without samples):
    the first-fit decreasing count :func:`plan_balanced` packs a multi-pack group with, so ``micro_batches`` at
    least this is never refused for a group's size."""
    split = _split_groups(lengths, groups, vision_lengths, options, shared_prefix)
    if not split.big.any():
        return int(split.lengths.size > 0)
    return int(_pack_big_groups(split, options, None)[2].max())


def _plan_bundles(split: _GroupSplit, options: PlanOptions, *, num_replicas: int, micro_batches: int,
                  cost: CostModel, shuffle_steps: bool, fillers: bool) -> BalancedPlan:
    """:func:`plan_balanced` with groups some of which need several packs.

    Groups that fit one pack are planned by :func:`thdpack.plan_packs` (``groups=``); each larger
    group is packed first-fit decreasing into a bundle of ``k ≤ M`` packs after them. When the steps
    the bundles need leave more slots than those single packs fill, the single packs are re-cut,
    whole groups, into as many packs as there are slots (or groups, if fewer):
    :func:`thdpack.planning.spread.recut`. The plan is then scheduled by :func:`_bundle_steps`.
    """
    small = np.flatnonzero(~split.big[split.group_of])
    small_plan = plan_packs(split.lengths[small], groups=split.gid[small], **options.keywords(),
                            vision_lengths=None if split.vision is None else split.vision[small],
                            shared_prefix=None if split.layout is None else split.layout.subset(small))
    big = _pack_big_groups(split, options, micro_batches)
    plan, bundles = _with_bundles(split, small, small_plan, big, options)
    costs = cost.pack_costs(plan)
    slots = num_replicas * micro_batches * _bundle_num_steps(len(plan), bundles, costs, num_replicas, micro_batches)
    small_groups = number_groups(split.gid[small])
    free = min(slots - int(big[1].size), int(small_groups.max()) + 1 if small.size else 0)
    if free > len(small_plan):  # spread the single packs over every slot the bundles leave
        small_layout = None if split.layout is None else split.layout.subset(small)
        spread = recut(small_plan, group_items(small_plan, small_groups, cost, small_layout), free)
        if spread is not None:
            plan, bundles = _with_bundles(split, small, spread, big, options)
            costs = cost.pack_costs(plan)
    filler_costs = _filler_costs(plan, cost) if fillers else None
    singles = np.arange(len(plan) - int(big[1].size))
    steps, repeated, filler = _bundle_steps(singles, bundles, costs, num_replicas, micro_batches, filler_costs)
    dealt = _Dealt(plan, steps, costs, repeated, filler, filler_costs)
    if fillers:
        dealt = _bundle_repair(dealt, bundles, lambda p: group_items(p, split.group_of, cost, split.layout), cost,
                               options, micro_batches)
    return _balanced(dealt, group_items(dealt.plan, split.group_of, cost, split.layout), options,
                     num_replicas=num_replicas, micro_batches=micro_batches, cost=cost, shuffle_steps=shuffle_steps,
                     fillers=fillers)


def _bundle_repair(dealt: _Dealt, bundles: list[np.ndarray], items_of, cost: CostModel, options: PlanOptions,
                   micro_batches: int) -> _Dealt:
    """A plan with bundles and fillers: its step-rank bins relabelled so that the ranks' totals even out
    (:func:`thdpack.planning.rank_fill.relabel`), and when that is off the bound by more than
    :data:`REPAIR_AT`, every step filled rank by rank around the bundles
    (:func:`thdpack.planning.rank_fill.refill_around_bundles`) if that is better."""
    if not dealt.steps.size:
        return dealt
    perm = relabel(dealt.slot_costs.sum(axis=2))
    dealt = replace(dealt, steps=np.take_along_axis(dealt.steps, perm[:, :, None], axis=1),
                    filler=np.take_along_axis(dealt.filler, perm[:, :, None], axis=1))
    totals = dealt.slot_costs.sum(axis=(0, 2))
    floor = _floor(dealt.plan, items_of(dealt.plan), cost, options, dealt.steps.shape[1], micro_batches,
                   len(dealt.steps))
    if straggler(totals) <= REPAIR_AT * straggler_bound(floor, totals):
        return dealt
    out = refill_around_bundles(dealt.plan, items_of(dealt.plan), bundles, dealt.costs, dealt.steps.shape,
                                max_pieces=options.max_samples_per_pack or 0)
    if out is None:
        return dealt
    other = _refilled(dealt, out, cost, True)
    return other if straggler(other.slot_costs.sum(axis=(0, 2))) < straggler(totals) else dealt


def _with_bundles(split: _GroupSplit, small: np.ndarray, small_plan: PackPlan, big: tuple, options: PlanOptions):
    """``(plan, bundles)``: the packs of ``small_plan`` (over the samples ``small``, int64), then the big
    groups' packs (``big``: :func:`_pack_big_groups`'s result); ``bundles`` the pack ids of each big group."""
    big_index, big_counts, bundle_sizes = big
    sample_index = np.concatenate([small[small_plan.sample_index], big_index])
    pack_offsets = np.concatenate([small_plan.pack_offsets, small_plan.pack_offsets[-1] + np.cumsum(big_counts)])
    length = split.lengths[sample_index]
    vision_length = None if split.vision is None else split.vision[sample_index]
    shared = None if split.layout is None else piece_shared(sample_index, pack_offsets, split.group_of, split.layout)
    stats = PackStats.from_packs(length if shared is None else length - shared, pack_offsets, int(options.pack_size),
                                 align=options.align, num_samples=int(split.lengths.size), vision_length=vision_length,
                                 vision_budget=None if split.vision is None else int(options.vision_budget))
    plan = replace(small_plan, sample_index=sample_index, start=np.zeros(sample_index.size, np.int64), length=length,
                   pack_offsets=pack_offsets, stats=stats, vision_length=vision_length, shared_length=shared)
    bundle_start = len(small_plan) + np.cumsum(bundle_sizes) - bundle_sizes
    return plan, [np.arange(a, a + k) for a, k in zip(bundle_start.tolist(), bundle_sizes.tolist())]


def _bundle_num_steps(num_packs: int, bundles: list[np.ndarray], costs: np.ndarray, num_replicas: int,
                      micro_batches: int) -> int:
    """The fewest steps whose ``R`` bins of ``M`` slots take ``num_packs`` packs and every bundle (int64
    pack ids; ``costs``: float64 ``[num_packs]``), dealt as :func:`_bundle_steps` deals them."""
    R, M = num_replicas, micro_batches
    slots = np.array([b.size for b in bundles], np.int64)
    bundle_cost = np.array([costs[b].sum() for b in bundles])
    border = np.argsort(-bundle_cost, kind="stable")
    wide = int((2 * slots > M).sum())  # such bundles never share a bin
    num_steps = max(-(-num_packs // (R * M)), -(-wide // R))
    while (_deal_units(bundle_cost[border], slots[border], num_steps * R, M) < 0).any():
        num_steps += 1
    return num_steps


def _bundle_steps(singles: np.ndarray, bundles: list[np.ndarray], costs: np.ndarray, num_replicas: int,
                  micro_batches: int, filler_costs: np.ndarray | None = None):
    """Schedule single packs and bundles (a group's ``k`` packs, run by one rank in one step).

    Every (step, rank) is a bin of ``M`` slots; there are ``S·R`` of them, ``S`` the fewest steps
    whose bins take every bundle. Bundles (decreasing cost, cost = sum of their packs), then single
    packs (decreasing cost; the ``S·R·M − num_packs`` free slots take copies of the cheapest single
    packs, or of the cheapest packs when there are none) are dealt by :func:`_deal_units` over all
    bins; the bins, sorted by decreasing load, are cut into steps of ``R``, so a step holds bins of
    similar cost. ``singles``: int64 ``[s]``, ``bundles``: int64 arrays of pack ids, ``costs``:
    float64 ``[num_packs]``. With ``filler_costs`` (float64 ``[num_packs]``) a copy is dealt at that
    cost (it runs a filler). Returns (int64 ``[S, R, M]`` pack ids, number of copies, bool ``[S, R,
    M]`` the copies' slots with ``filler_costs``, else None). Plain reference: ``ref_bundle_steps`` in
    ``tests/test_plan_groups.py``.
    """
    R, M = num_replicas, micro_batches
    slots = np.array([b.size for b in bundles], np.int64)
    bundle_cost = np.array([costs[b].sum() for b in bundles])
    border = np.argsort(-bundle_cost, kind="stable")
    num_packs = singles.size + int(slots.sum())
    num_steps = _bundle_num_steps(num_packs, bundles, costs, R, M)
    copies = num_steps * R * M - num_packs
    pool = singles if singles.size else np.arange(costs.size)
    pool = pool[np.argsort(costs[pool], kind="stable")]
    fill = np.concatenate([singles, pool[np.arange(copies) % pool.size]])
    copy = np.arange(fill.size) >= singles.size
    fill_cost = costs[fill] if filler_costs is None else np.where(copy, filler_costs[fill], costs[fill])
    by_cost = np.argsort(-fill_cost, kind="stable")
    fill, copy, fill_cost = fill[by_cost], copy[by_cost], fill_cost[by_cost]
    units = [bundles[b] for b in border.tolist()] + [fill[i : i + 1] for i in range(fill.size)]
    marks = [np.zeros(bundles[b].size, bool) for b in border.tolist()] + [copy[i : i + 1] for i in range(fill.size)]
    unit_costs = np.concatenate([bundle_cost[border], fill_cost])
    bins = _deal_units(unit_costs, np.concatenate([slots[border], np.ones(fill.size, np.int64)]), num_steps * R, M)
    contents, flags = [[] for _ in range(num_steps * R)], [[] for _ in range(num_steps * R)]
    for unit, mark, b in zip(units, marks, bins.tolist()):
        contents[b].extend(unit.tolist())
        flags[b].extend(mark.tolist())
    by_load = np.argsort(-np.bincount(bins, weights=unit_costs, minlength=num_steps * R), kind="stable")
    steps = np.array(contents, np.int64)[by_load].reshape(num_steps, R, M)
    filler = None if filler_costs is None else np.array(flags, bool)[by_load].reshape(num_steps, R, M)
    return steps, int(copies), filler


