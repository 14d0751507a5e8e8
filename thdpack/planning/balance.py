"""Compute-balanced data-parallel planning.

A training step waits for its slowest data-parallel rank, and packs with equal
token counts are not equal work: attention costs ``Σ sᵢ²``. This module plans
packs that respect the token budget (best-fit decreasing, so efficiency is
unchanged) and then deals them to ``R`` ranks × ``M`` micro-batches per step so
the largest per-rank cost of each step is as close as possible to the step mean.

Cost of a pack: ``a·Σ sᵢ + b·Σ sᵢ²`` (FLOPs when ``a``, ``b`` come from
:func:`thdpack.flops.model_flops`; any consistent unit otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from thdpack.common.align import check_number, check_positive_int, round_up
from thdpack.planning.options import PlanOptions, options_from
from thdpack.planning.packing import PackStats, pack_sums
from thdpack.planning.plan import PackPlan, check_groups, number_groups, plan_packs, validate_lengths, vision_overflow
from thdpack.planning.prefix_budget import check_shared_prefix, shared_lengths, shared_sizes
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
            the per-rank cost (1.0 is perfect balance).
        repeated_packs: packs scheduled twice to fill the last step (only when the
            packs could not be split to a multiple of ``R·M``).
    """

    plan: PackPlan
    steps: np.ndarray
    costs: np.ndarray
    step_straggler: np.ndarray
    repeated_packs: int

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


def rank_costs(steps: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """float64 ``[num_steps, R]`` per-rank cost of each step."""
    return costs[steps].sum(axis=2)


def straggler_per_step(steps: np.ndarray, costs: np.ndarray) -> np.ndarray:
    per_rank = rank_costs(steps, costs)
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
    options: PlanOptions | None = None,
    **plan_keywords,
) -> BalancedPlan:
    """Plan packs and deal them to ``num_replicas`` ranks × ``micro_batches`` per step.

    1. Packs are planned by :func:`thdpack.plan_packs` (token budget kept).
    2. If the number of packs is not a multiple of ``R·M``, the cheapest packs are
       re-packed into one full step of ``R·M`` balanced packs (a few packs more;
       nothing repeated; see :func:`_fill_last_step`).
    3. Packs are sorted by cost and cut into steps of ``R·M`` consecutive packs, so a
       step holds packs of similar cost; inside a step, packs are dealt to ranks
       greedily (largest first, to the least-loaded rank with room).
    4. With ``shuffle_steps``, the order of steps is randomised by ``seed``.

    Args:
        lengths, vision_lengths: as in :func:`thdpack.plan_packs`.
        pack_size, options, **plan_keywords: a :class:`thdpack.PlanOptions` or its fields as
            keywords (``pack_size``, ``algorithm``, ``align``, ``overflow``,
            ``max_samples_per_pack``, ``seed``, ``vision_budget``), as in :func:`thdpack.plan_packs`.
        num_replicas: data-parallel ranks ``R``.
        micro_batches: packs per rank per step ``M``.
        cost: a :class:`CostModel` or ``(linear, quadratic)``.
        groups: ``[n]`` group ids (:func:`thdpack.plan_packs`): all of a group's samples run on
            one rank in one step. A group that fits one pack shares a pack with other groups
            (planned as :func:`thdpack.plan_packs` does); a larger one (e.g. 8 GRPO rollouts of
            1,500 tokens at pack 4096) is packed first-fit decreasing into as few packs as
            possible, at most ``micro_batches`` (more is a ``ValueError`` naming the group), and
            its packs are dealt as one bundle (see :func:`_plan_bundles`). Step 2 is skipped (its
            re-packing would part groups), so the last step may repeat packs.
        shared_prefix: with ``groups``, ``[n]`` each sample's prefix shared with its group
            (:func:`thdpack.plan_packs`): a group counts its prefix once against the pack budget and in
            the cost. A group over one pack is planned unshared into its bundle (each pack of the bundle
            then shares the prefix among the members it holds, which only lowers its tokens).
    """
    check_positive_int(num_replicas, "num_replicas")
    check_positive_int(micro_batches, "micro_batches")
    num_replicas, micro_batches = int(num_replicas), int(micro_batches)
    cost = CostModel.of(cost)
    options = options_from("plan_balanced", options, {"pack_size": pack_size, **plan_keywords})
    if groups is not None:
        split = _split_groups(lengths, groups, vision_lengths, options, shared_prefix)
        if split is not None:  # some group needs several packs
            return _plan_bundles(split, options, num_replicas=num_replicas, micro_batches=micro_batches, cost=cost,
                                 shuffle_steps=shuffle_steps)
    plan = plan_packs(lengths, vision_lengths=vision_lengths, groups=groups, shared_prefix=shared_prefix,
                      options=options)
    if groups is None:
        plan = _fill_last_step(plan, num_replicas * micro_batches, cost, options.max_samples_per_pack)
    costs = cost.pack_costs(plan)
    steps, repeated = _cost_sorted_steps(costs, num_replicas, micro_batches)
    steps = _shuffled_steps(steps, options.seed, shuffle_steps)
    return BalancedPlan(plan=plan, steps=steps, costs=costs, step_straggler=straggler_per_step(steps, costs),
                        repeated_packs=repeated)


def _cost_sorted_steps(costs: np.ndarray, num_replicas: int, micro_batches: int) -> tuple[np.ndarray, int]:
    """Steps of packs of similar cost: float64 ``[num_packs]`` ``costs`` sorted decreasing, cut
    into steps of ``R·M`` packs (the costliest packs repeated to fill the last one, when the
    packs are not a multiple), each dealt by :func:`_deal`. Returns (int64 ``[S, R, M]`` pack
    ids, number of repeated packs)."""
    per_step = num_replicas * micro_batches
    num_packs = costs.size
    order = np.argsort(-costs, kind="stable")
    repeated = (-num_packs) % per_step  # only when splitting could not reach a multiple
    if repeated:
        order = np.concatenate([order, order[np.arange(repeated) % num_packs]])
    step_packs = order.reshape(-1, per_step)
    if not step_packs.size:
        return np.zeros((0, num_replicas, micro_batches), np.int64), int(repeated)
    return np.stack([_deal(packs, costs, num_replicas, micro_batches) for packs in step_packs]), int(repeated)


def _shuffled_steps(steps: np.ndarray, seed: int, shuffle_steps: bool) -> np.ndarray:
    """``steps`` (``[S, R, M]``) in an order randomised by ``seed``, or as they are without ``shuffle_steps``."""
    if shuffle_steps and len(steps):
        return steps[np.random.default_rng(seed).permutation(len(steps))]
    return steps


def _deal(group: np.ndarray, costs: np.ndarray, num_replicas: int, micro_batches: int) -> np.ndarray:
    """Deal ``R·M`` packs (sorted by decreasing cost) to ranks, M each, least-loaded first.

    ``group``: int64 ``[R·M]`` pack ids, dealt in this order, each to the rank with the
    least cost so far among those with a free slot (ties: the lowest rank); ``costs``:
    float64 ``[num_packs]``. Returns int64 ``[R, M]`` pack ids, in the order each rank got
    them. Plain reference: ``ref_deal`` in ``tests/test_balance.py``.
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
    load = np.zeros(num_bins)
    free = np.full(num_bins, slots_per_bin, np.int64)
    out = np.full(len(unit_costs), -1, np.int64)
    for u, (c, k) in enumerate(zip(unit_costs.tolist(), unit_slots.tolist())):  # one pass; units are packs
        candidates = np.flatnonzero(free >= k)
        if candidates.size:
            b = candidates[np.argmin(load[candidates])]
            out[u] = b
            free[b] -= k
            load[b] += c
    return out


@dataclass(frozen=True)
class _GroupSplit:
    """Checked inputs of a grouped plan whose groups do not all fit one pack.

    ``lengths`` / ``sizes`` (aligned) / ``gid`` / ``group_of`` (groups numbered 0.. by first
    appearance): int64 ``[n]``; ``vision``: int64 ``[n]`` or None; ``big``: bool ``[G]``; ``prefix``:
    int64 ``[n]`` shared prefixes, or None.
    """

    lengths: np.ndarray
    sizes: np.ndarray
    vision: np.ndarray | None
    gid: np.ndarray
    group_of: np.ndarray
    big: np.ndarray
    prefix: np.ndarray | None = None


def _split_groups(lengths, groups, vision_lengths, options: PlanOptions, shared_prefix=None) -> _GroupSplit | None:
    """Which groups need more than one pack (tokens, their shared prefix once, or vision patches); None when
    none does (then :func:`thdpack.plan_packs` plans them, unchanged)."""
    lengths = validate_lengths(lengths)
    pack_size, vision_budget = options.pack_size, options.vision_budget
    gid = check_groups(groups, lengths.size)
    group_of = number_groups(gid)
    num_groups = int(group_of.max()) + 1 if group_of.size else 0
    sizes = round_up(lengths, options.align)
    prefix = None if shared_prefix is None else check_shared_prefix(shared_prefix, lengths, gid, group_of)
    if prefix is None:
        big = np.bincount(group_of, weights=sizes, minlength=num_groups) > pack_size
    else:
        big = shared_sizes(lengths, prefix, group_of, options.align) > pack_size
    vision = None
    if vision_lengths is not None or vision_budget is not None:
        vision = vision_overflow(lengths, np.zeros(lengths.size, bool), vision_lengths, vision_budget, "drop", pack_size)
        big |= np.bincount(group_of, weights=vision, minlength=num_groups) > vision_budget
    if not big.any():
        return None
    return _GroupSplit(lengths, sizes, vision, gid, group_of, big, prefix)


def _name_group(split: _GroupSplit, members: np.ndarray) -> str:
    shown = ", ".join(map(str, members[:8].tolist())) + (", ..." if members.size > 8 else "")
    return f"group {int(split.gid[members[0]])} (samples {shown})"


def _pack_big_groups(split: _GroupSplit, options: PlanOptions, micro_batches: int):
    """First-fit decreasing packs of every multi-pack group, its samples whole (``options``: the
    pack size, alignment and vision budget of the plan).

    Returns ``(sample_index, pack_counts, bundle_sizes)``: int64 sample ids in pack order, int64
    ``[P]`` samples per pack, int64 ``[num_big_groups]`` packs per group (at most ``micro_batches``).
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
        if len(sub) > micro_batches:
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


def _plan_bundles(split: _GroupSplit, options: PlanOptions, *, num_replicas: int, micro_batches: int,
                  cost: CostModel, shuffle_steps: bool) -> BalancedPlan:
    """:func:`plan_balanced` with groups some of which need several packs.

    Groups that fit one pack are planned by :func:`thdpack.plan_packs` (``groups=``); each larger
    group is packed first-fit decreasing into a bundle of ``k ≤ M`` packs after them. The plan is
    then scheduled by :func:`_bundle_steps`.
    """
    small = np.flatnonzero(~split.big[split.group_of])
    small_plan = plan_packs(split.lengths[small], groups=split.gid[small], options=options,
                            vision_lengths=None if split.vision is None else split.vision[small],
                            shared_prefix=None if split.prefix is None else split.prefix[small])
    big_index, big_counts, bundle_sizes = _pack_big_groups(split, options, micro_batches)
    sample_index = np.concatenate([small[small_plan.sample_index], big_index])
    pack_offsets = np.concatenate([small_plan.pack_offsets, small_plan.pack_offsets[-1] + np.cumsum(big_counts)])
    length = split.lengths[sample_index]
    vision_length = None if split.vision is None else split.vision[sample_index]
    shared = None if split.prefix is None else shared_lengths(sample_index, pack_offsets, split.group_of, split.prefix)
    stats = PackStats.from_packs(length if shared is None else length - shared, pack_offsets, int(options.pack_size),
                                 align=options.align, num_samples=int(split.lengths.size), vision_length=vision_length,
                                 vision_budget=None if split.vision is None else int(options.vision_budget))
    plan = replace(small_plan, sample_index=sample_index, start=np.zeros(sample_index.size, np.int64), length=length,
                   pack_offsets=pack_offsets, stats=stats, vision_length=vision_length, shared_length=shared)
    costs = cost.pack_costs(plan)
    bundle_start = len(small_plan) + np.cumsum(bundle_sizes) - bundle_sizes
    bundles = [np.arange(a, a + k) for a, k in zip(bundle_start.tolist(), bundle_sizes.tolist())]
    steps, repeated = _bundle_steps(np.arange(len(small_plan)), bundles, costs, num_replicas, micro_batches)
    steps = _shuffled_steps(steps, options.seed, shuffle_steps)
    return BalancedPlan(plan=plan, steps=steps, costs=costs, step_straggler=straggler_per_step(steps, costs),
                        repeated_packs=repeated)


def _bundle_steps(singles: np.ndarray, bundles: list[np.ndarray], costs: np.ndarray, num_replicas: int,
                  micro_batches: int) -> tuple[np.ndarray, int]:
    """Schedule single packs and bundles (a group's ``k`` packs, run by one rank in one step).

    Every (step, rank) is a bin of ``M`` slots; there are ``S·R`` of them, ``S`` the fewest steps
    whose bins take every bundle. Bundles (decreasing cost, cost = sum of their packs), then single
    packs (decreasing cost; the ``S·R·M − num_packs`` free slots take copies of the cheapest single
    packs, or of the cheapest packs when there are none) are dealt by :func:`_deal_units` over all
    bins; the bins, sorted by decreasing load, are cut into steps of ``R``, so a step holds bins of
    similar cost. ``singles``: int64 ``[s]``, ``bundles``: int64 arrays of pack ids, ``costs``:
    float64 ``[num_packs]``. Returns (int64 ``[S, R, M]`` pack ids, number of copies). Plain
    reference: ``ref_bundle_steps`` in ``tests/test_plan_groups.py``.
    """
    R, M = num_replicas, micro_batches
    slots = np.array([b.size for b in bundles], np.int64)
    bundle_cost = np.array([costs[b].sum() for b in bundles])
    border = np.argsort(-bundle_cost, kind="stable")
    num_packs = singles.size + int(slots.sum())
    wide = int((2 * slots > M).sum())  # such bundles never share a bin
    num_steps = max(-(-num_packs // (R * M)), -(-wide // R))
    while (_deal_units(bundle_cost[border], slots[border], num_steps * R, M) < 0).any():
        num_steps += 1
    copies = num_steps * R * M - num_packs
    pool = singles if singles.size else np.arange(costs.size)
    pool = pool[np.argsort(costs[pool], kind="stable")]
    fill = np.concatenate([singles, pool[np.arange(copies) % pool.size]])
    fill = fill[np.argsort(-costs[fill], kind="stable")]
    units = [bundles[b] for b in border.tolist()] + [fill[i : i + 1] for i in range(fill.size)]
    unit_costs = np.concatenate([bundle_cost[border], costs[fill]])
    bins = _deal_units(unit_costs, np.concatenate([slots[border], np.ones(fill.size, np.int64)]), num_steps * R, M)
    contents = [[] for _ in range(num_steps * R)]
    for unit, b in zip(units, bins.tolist()):
        contents[b].extend(unit.tolist())
    load = np.bincount(bins, weights=unit_costs, minlength=num_steps * R)
    steps = np.array(contents, np.int64)[np.argsort(-load, kind="stable")].reshape(num_steps, R, M)
    return steps, int(copies)


def _fill_last_step(plan: PackPlan, multiple: int, cost: CostModel, max_items: int | None) -> PackPlan:
    """Re-pack the cheapest packs so that ``len(plan)`` becomes a multiple of ``multiple``.

    The ``len(plan) % multiple`` cheapest packs (more if they hold too few
    samples) are emptied and their pieces dealt largest-cost-first to
    ``multiple`` (or ``2·multiple`` …) fresh packs, each to the least-loaded pack
    with room: the step they form is balanced like the others, and no sample is
    repeated. Returns ``plan`` unchanged when that is impossible (fewer pieces
    than slots).
    """
    num_packs = len(plan)
    missing = (-num_packs) % multiple
    if missing == 0:
        return plan
    counts = np.diff(plan.pack_offsets)
    by_cost = np.argsort(cost.pack_costs(plan), kind="stable")
    taken = multiple - missing  # packs to empty: the rest is then a multiple
    while taken <= num_packs and counts[by_cost[:taken]].sum() < taken + missing:
        taken += multiple
    if taken > num_packs:
        return plan
    new_count = taken + missing
    emptied = np.zeros(num_packs, bool)
    emptied[by_cost[:taken]] = True
    piece_pack = np.repeat(np.arange(num_packs), counts)
    moved = np.flatnonzero(emptied[piece_pack])
    lengths = plan.length[moved].astype(np.float64)
    piece_cost = cost.linear * lengths + cost.quadratic * lengths * lengths
    sizes = round_up(plan.length[moved], plan.align)
    load = np.zeros(new_count)
    room = np.full(new_count, plan.pack_size, np.int64)
    slots = np.full(new_count, max_items or moved.size, np.int64)
    has_vision = plan.vision_length is not None
    patches = plan.vision_length[moved] if has_vision else np.zeros(moved.size, np.int64)
    piece_cost = piece_cost + cost.vision * patches
    vision_room = np.full(new_count, plan.vision_budget if has_vision else 0, np.int64)
    target = np.empty(moved.size, np.int64)
    for rank, j in enumerate(np.argsort(-piece_cost, kind="stable")):  # a few hundred pieces at most
        if rank < new_count:  # the costliest pieces open the fresh packs, one each: none stays empty
            b = rank
        else:
            fits = np.flatnonzero((room >= sizes[j]) & (slots > 0) & (vision_room >= patches[j]))
            if fits.size == 0:
                return plan
            b = fits[np.argmin(load[fits])]
        target[j] = b
        load[b] += piece_cost[j]
        room[b] -= sizes[j]
        slots[b] -= 1
        vision_room[b] -= patches[j]
    # keep the untouched packs in order (renumbered), then the fresh ones
    keep_id = np.cumsum(~emptied) - 1
    pack_of = keep_id[piece_pack]
    pack_of[moved] = (num_packs - taken) + target
    total = num_packs - taken + new_count
    offsets = np.zeros(total + 1, np.int64)
    np.cumsum(np.bincount(pack_of, minlength=total), out=offsets[1:])
    order = np.lexsort((plan.start, plan.sample_index, pack_of))  # within a pack: input order, as plan_packs gives
    sample_index, start, length = plan.sample_index[order], plan.start[order], plan.length[order]
    vision = None if plan.vision_length is None else plan.vision_length[order]
    stats = PackStats.from_packs(length, offsets, plan.pack_size, align=plan.align, num_samples=plan.stats.num_samples,
                                 cuts=plan.stats.cuts, vision_length=vision, vision_budget=plan.vision_budget)
    return replace(
        plan, sample_index=sample_index, start=start, length=length, pack_offsets=offsets,
        stats=stats, vision_length=vision,
    )
