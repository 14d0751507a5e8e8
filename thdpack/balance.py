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

from thdpack.align import check_positive_int
from thdpack.plan import PackPlan, plan_packs


@dataclass(frozen=True)
class CostModel:
    """``cost(pack) = linear · Σ sᵢ + quadratic · Σ sᵢ² + vision · Σ patchesᵢ``.

    ``vision`` is the cost of one ViT patch (e.g. FLOPs per patch of the vision
    tower); it applies to plans made with a vision budget.
    """

    linear: float = 1.0
    quadratic: float = 0.0
    vision: float = 0.0

    @classmethod
    def from_config(cls, config) -> "CostModel":
        """Training FLOPs per token and per unit of ``Σ sᵢ²`` of a model config
        (a transformers config or dict), from :func:`thdpack.flops.model_flops`."""
        from thdpack.flops import model_flops

        linear = float(model_flops(config, num_tokens=1, seqlen_squared_sum=0))
        quadratic = float(model_flops(config, num_tokens=0, seqlen_squared_sum=1))
        return cls(linear, quadratic)

    def pack_costs(self, plan: PackPlan) -> np.ndarray:
        """float64 ``[num_packs]`` cost of every pack of ``plan`` (real lengths)."""
        lengths = plan.length.astype(np.float64)
        if len(plan) == 0:
            return np.zeros(0)
        starts = plan.pack_offsets[:-1]
        cost = self.linear * np.add.reduceat(lengths, starts) + self.quadratic * np.add.reduceat(lengths * lengths, starts)
        if self.vision and plan.vision_length is not None:
            cost += self.vision * np.add.reduceat(plan.vision_length.astype(np.float64), starts)
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
    pack_size: int,
    *,
    num_replicas: int,
    micro_batches: int = 1,
    cost: CostModel | tuple[float, float] = CostModel(),
    algorithm: str = "bfd",
    align: int = 1,
    overflow: str = "error",
    max_samples_per_pack: int | None = None,
    seed: int = 0,
    shuffle_steps: bool = True,
    vision_lengths=None,
    vision_budget: int | None = None,
    groups=None,
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
        lengths, pack_size, algorithm, align, overflow, max_samples_per_pack, seed,
        vision_lengths, vision_budget: as in :func:`thdpack.plan_packs`.
        num_replicas: data-parallel ranks ``R``.
        micro_batches: packs per rank per step ``M``.
        cost: a :class:`CostModel` or ``(linear, quadratic)``.
        groups: ``[n]`` group ids (:func:`thdpack.plan_packs`): a group's samples share a pack,
            hence a rank; step 2 is skipped (its re-packing would part them), so the last step
            may repeat packs.
    """
    check_positive_int(num_replicas, "num_replicas")
    check_positive_int(micro_batches, "micro_batches")
    num_replicas, micro_batches = int(num_replicas), int(micro_batches)
    if not isinstance(cost, CostModel):
        cost = CostModel(*cost)
    plan = plan_packs(
        lengths, pack_size, algorithm=algorithm, align=align, overflow=overflow,
        max_samples_per_pack=max_samples_per_pack, seed=seed,
        vision_lengths=vision_lengths, vision_budget=vision_budget, groups=groups,
    )
    per_step = num_replicas * micro_batches
    if groups is None:
        plan = _fill_last_step(plan, per_step, cost, max_samples_per_pack)
    costs = cost.pack_costs(plan)
    num_packs = len(plan)
    order = np.argsort(-costs, kind="stable")
    repeated = (-num_packs) % per_step  # only when splitting could not reach a multiple
    if repeated:
        order = np.concatenate([order, order[np.arange(repeated) % num_packs]])
    groups = order.reshape(-1, per_step)
    steps = np.stack([_deal(g, costs, num_replicas, micro_batches) for g in groups]) if groups.size else np.zeros(
        (0, num_replicas, micro_batches), np.int64
    )
    if shuffle_steps and len(steps):
        steps = steps[np.random.default_rng(seed).permutation(len(steps))]
    return BalancedPlan(
        plan=plan,
        steps=steps,
        costs=costs,
        step_straggler=straggler_per_step(steps, costs),
        repeated_packs=int(repeated),
    )


def _deal(group: np.ndarray, costs: np.ndarray, num_replicas: int, micro_batches: int) -> np.ndarray:
    """Deal ``R·M`` packs (sorted by decreasing cost) to ranks, M each, least-loaded first.

    ``group``: int64 ``[R·M]`` pack ids, dealt in this order, each to the rank with the
    least cost so far among those with a free slot (ties: the lowest rank); ``costs``:
    float64 ``[num_packs]``. Returns int64 ``[R, M]`` pack ids, in the order each rank got
    them. Plain reference: ``ref_deal`` in ``tests/test_balance.py``.
    """
    out = np.empty((num_replicas, micro_batches), np.int64)
    if micro_batches == 1:
        out[:, 0] = group
        return out
    load = np.zeros(num_replicas)
    filled = np.zeros(num_replicas, np.int64)
    for k in group:  # R·M is small (hundreds at most): a Python loop is fine here
        candidates = np.flatnonzero(filled < micro_batches)
        r = candidates[np.argmin(load[candidates])]
        out[r, filled[r]] = k
        filled[r] += 1
        load[r] += costs[k]
    return out


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
    sizes = -(-plan.length[moved] // plan.align) * plan.align
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
    fill = np.add.reduceat(length, offsets[:-1])
    stats = plan.stats
    new_stats = replace(
        stats,
        num_packs=total,
        efficiency=stats.real_tokens / (total * stats.pack_size),
        packing_factor=stats.num_pieces / total,
        max_samples_per_pack=int(np.diff(offsets).max()),
        min_pack_fill=float(fill.min() / stats.pack_size),
        max_pack_fill=float(fill.max() / stats.pack_size),
    )
    vision = None if plan.vision_length is None else plan.vision_length[order]
    return replace(
        plan, sample_index=sample_index, start=start, length=length, pack_offsets=offsets,
        stats=new_stats, vision_length=vision,
    )
