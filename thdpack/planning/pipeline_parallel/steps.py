"""One training step planned for pipeline parallelism: the micro-batch count, the packs dealt, their order.

Under pipeline parallelism (PP, and interleaved PP with ``V`` model chunks per stage) every data-parallel
pipeline runs the same number ``m`` of micro-batches in a step (megatron-core's ``num_microbatches`` is
global), with interleaving ``m`` is a multiple of ``microbatch_group_size_per_vp_stage``, a micro-batch holds
at most a token cap, and the order of a rank's micro-batches sets its pipeline bubble. :func:`plan_steps`::

    lengths of one global batch ─▶ packs of ≤ cap tokens ─▶ m: the fewest per rank that hold them,
                                   (best-fit decreasing)      a multiple of the VPP group
                               ─▶ dealt to the DP ranks by cost (plan_balanced, one step, fillers where
                                  the samples cannot fill every slot) ─▶ each rank's order, simulated

The order: each rank's micro-batches are ordered by simulating megatron-core's schedule on their costs
(:mod:`thdpack.planning.pipeline_parallel.simulate`): the best of a few rules, then pairwise swaps that shorten the
simulated step (at most ``order_budget`` simulations per rank). The first rule, the *hump* (cheapest first,
next cheapest last, the costliest in the middle), is why: warm-up runs the first micro-batch's forward
through ``P − 1`` stages before the last stage has work, and cool-down runs the last one's backward through
``P − 1`` stages after it is done, so cheap micro-batches at both ends shorten both; the middle runs in
steady 1F1B where a costly micro-batch delays no one. On 1F1B it is within 1-3% of the best order found by
trying every one (m ≤ 8); with interleaving the groups of ``vpp_group`` micro-batches change which ones are
exposed, which the simulation sees and a fixed rule does not (``benchmarks/pipeline_steps.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from thdpack.common.align import check_positive_int, round_up
from thdpack.planning.balance import (BalancedPlan, CostModel, filler_pieces, filler_samples, most_group_packs,
                                      plan_balanced)
from thdpack.planning.options import plan_options
from thdpack.planning.packing import pack_sums
from thdpack.planning.pipeline_parallel.simulate import PipelineShape, step_time, step_time_bound
from thdpack.planning.plan import check_groups, number_groups, validate_lengths
from thdpack.planning.prefix_budget import as_layout, group_slots
from thdpack.planning.spread import piece_items

ORDER_RULES = ("hump", "ascending", "descending", "cheapest first, then descending", "as dealt")
DEFAULT_ORDER_BUDGET = 256


@dataclass(frozen=True)
class StepPlan:
    """One step's micro-batches on every data-parallel rank, in run order.

    Attributes:
        balanced: the :class:`thdpack.planning.BalancedPlan` of the step (one step: ``steps`` int64
            ``[1, dp_size, m]`` pack ids in run order, ``filler`` bool ``[1, dp_size, m]``).
        shape: the :class:`thdpack.planning.pipeline_parallel.simulate.PipelineShape` (``pp_size``, ``vpp_size``, ``vpp_group``).
        cost: the :class:`thdpack.CostModel` the packs were dealt and ordered by.
        micro_batch_floor: the count ``m`` starts from: the aligned tokens over ``dp_size`` ranks of caps (no plan
            holds them in fewer), the packs the largest group takes (first-fit decreasing, as ``plan_balanced``
            packs it), rounded up to the VPP multiple; ``num_micro_batches`` is at least it (and at least
            ``min_micro_batches``).
        order_rules: per rank, which rule of :data:`ORDER_RULES` the order started from (module docstring).
    """

    balanced: BalancedPlan
    shape: PipelineShape
    cost: CostModel
    micro_batch_floor: int
    order_rules: tuple

    @property
    def num_micro_batches(self) -> int:
        """``m``: micro-batches per rank in this step, the same on every rank (megatron-core's ``num_microbatches``)."""
        return int(self.balanced.steps.shape[2])

    @property
    def dp_size(self) -> int:
        return int(self.balanced.steps.shape[1])

    @property
    def filler(self) -> np.ndarray:
        """bool ``[dp_size, m]``: the slot runs a filler, one short sample of another micro-batch with no targets
        (the samples could not fill every slot); its sample is scored where its own micro-batch runs."""
        return self.balanced.filler[0]

    @cached_property
    def micro_batches(self) -> list:
        """``micro_batches[rank][j]``: int64 sample indices of rank ``rank``'s ``j``-th micro-batch, in run order
        (a filler slot: the one sample it runs)."""
        plan = self.balanced.plan
        short = filler_samples(plan, self.cost)
        steps, fill = self.balanced.steps[0], self.filler
        return [[np.array([short[k]], np.int64) if f else plan.pack(k).astype(np.int64)
                 for k, f in zip(steps[r].tolist(), fill[r].tolist())] for r in range(self.dp_size)]

    @property
    def micro_batch_costs(self) -> np.ndarray:
        """float64 ``[dp_size, m]`` the cost of what each slot runs, in run order."""
        return self.balanced.slot_costs[0]

    @property
    def rank_costs(self) -> np.ndarray:
        """float64 ``[dp_size]`` each rank's cost of its micro-batches (fillers included: they run)."""
        return self.micro_batch_costs.sum(axis=1)

    @property
    def straggler(self) -> float:
        """``max / mean`` of :attr:`rank_costs` (1.0 is perfect balance)."""
        return self.balanced.straggler

    @property
    def straggler_bound(self) -> float:
        """The least :attr:`straggler` any plan of these samples could reach (never above :attr:`straggler`)."""
        return self.balanced.straggler_bound

    @cached_property
    def rank_step_times(self) -> np.ndarray:
        """float64 ``[dp_size]`` each rank's step under its pipeline schedule, simulated (unit of the costs:
        a stage computing ``c / P`` of every micro-batch of cost ``c``)."""
        return np.array([step_time(c, self.shape) for c in self.micro_batch_costs])

    @property
    def step_time(self) -> float:
        """The step's simulated time: its slowest rank's (the gradient reduction waits for it)."""
        return float(self.rank_step_times.max())

    @property
    def step_time_bound(self) -> float:
        """A step time no plan of these samples on these ranks and stages with ``m`` micro-batches per rank
        beats: the costliest rank costs at least ``balanced.rank_floor`` (``F``), which its last stage computes
        ``F / P`` of, plus the warm-up and cool-down of its cheapest micro-batch
        (:func:`thdpack.planning.pipeline_parallel.simulate.step_time_bound`). That micro-batch costs at least the cheapest
        sample alone, and at least ``F − (m − 1)·c_cap`` (the other ``m − 1`` hold at most ``c_cap``, the cost of
        ``cap`` tokens as one sample: ``Σ sᵢ² ≤ (Σ sᵢ)²``). Never above :attr:`step_time`."""
        plan = self.balanced.plan
        if not len(plan):
            return 0.0
        cheapest = float(piece_items(plan, self.cost).cost.min())
        floor = float(self.balanced.rank_floor)
        if not (self.cost.vision and plan.vision_length is not None):  # a micro-batch's vision cost is unbounded
            cap = float(plan.pack_size)
            full = self.cost.linear * cap + self.cost.quadratic * cap * cap
            cheapest = max(cheapest, floor - (self.num_micro_batches - 1) * full)
        return step_time_bound(floor, cheapest, self.shape)

    @property
    def bubble_fraction(self) -> float:
        """The share of the step the stages of the slowest rank wait: ``1 − (its cost / P) / step_time``."""
        r = int(np.argmax(self.rank_step_times))
        t = self.rank_step_times[r]
        return float(1.0 - self.rank_costs[r] / self.shape.pp_size / t) if t > 0 else 0.0

    @cached_property
    def seqlen_sums(self) -> tuple[np.ndarray, np.ndarray]:
        """The step's FLOPs statistics per rank, what :mod:`thdpack.flops` reads: int64 ``[dp_size]`` ``Σ sᵢ``
        and ``Σ sᵢ²`` of the real lengths each rank runs (a member laid out after its group's shared prefix
        counts ``L − p`` and ``L² − p²``; a filler runs its one piece, and counts)."""
        plan = self.balanced.plan
        lengths = plan.length.astype(np.int64)
        shared = np.zeros_like(lengths) if plan.shared_length is None else plan.shared_length.astype(np.int64)
        tokens = pack_sums(lengths - shared, plan.pack_offsets).astype(np.int64)
        squares = pack_sums(lengths * lengths - shared * shared, plan.pack_offsets).astype(np.int64)
        filler_length = lengths[filler_pieces(plan, self.cost)]
        steps, fill = self.balanced.steps[0], self.filler
        token_sum = np.where(fill, filler_length[steps], tokens[steps]).sum(axis=1)
        square_sum = np.where(fill, filler_length[steps] ** 2, squares[steps]).sum(axis=1)
        return token_sum.astype(np.int64), square_sum.astype(np.int64)

    def __repr__(self) -> str:
        return (f"StepPlan(dp_size={self.dp_size}, num_micro_batches={self.num_micro_batches}, "
                f"pp_size={self.shape.pp_size}, vpp_size={self.shape.vpp_size}, fillers={int(self.filler.sum())}, "
                f"straggler={self.straggler:.4f}, step_time={self.step_time:.4g}, "
                f"step_time_bound={self.step_time_bound:.4g})")


def plan_steps(lengths, *, dp_size: int, max_tokens_per_micro_batch: int, pp_size: int = 1, vpp_size: int = 1,
               vpp_group: int | None = None, cost=None, groups=None, shared_prefix=None, vision_lengths=None,
               min_micro_batches: int = 1, order_budget: int = DEFAULT_ORDER_BUDGET, **plan_keywords) -> StepPlan:
    """Plan one step of a global batch for ``dp_size`` pipelines of ``pp_size`` stages (module docstring).

    Args:
        lengths: int ``[n]`` the global batch's sample lengths (tokens).
        dp_size: data-parallel ranks (pipelines).
        max_tokens_per_micro_batch: a micro-batch's token cap, counted after alignment (memory).
        pp_size, vpp_size, vpp_group: pipeline stages, model chunks per stage (interleaving) and megatron-core's
            ``microbatch_group_size_per_vp_stage`` (None: its default, ``pp_size``); ``m`` is a multiple of
            ``vpp_group`` when ``vpp_size > 1``.
        cost: a :class:`thdpack.CostModel` or ``(linear, quadratic)`` (None: tokens).
        groups, shared_prefix, vision_lengths: as in :func:`thdpack.plan_balanced` (a group runs whole on one
            rank; a group over one micro-batch is packed into the fewest that hold it).
        min_micro_batches: at least this many micro-batches per rank (e.g. ``pp_size``: fewer leave stages idle
            for most of the step); the fewest that hold the batch otherwise.
        order_budget: simulations per rank spent improving its order (0: the best rule, no swaps).
        **plan_keywords: ``align`` (CP alignment, as :func:`thdpack.cp_pad_multiple` gives it), ``algorithm``,
            ``overflow``, ``max_samples_per_pack``, ``seed``, ``vision_budget``, as in :func:`thdpack.plan_packs`.

    Returns a :class:`StepPlan`: ``num_micro_batches``, ``micro_batches[rank][j]``, fillers, costs, the
    simulated step time and its bound, FLOPs statistics.

    Raises ``ValueError`` (a :class:`thdpack.SampleError` naming the sample) for a sample whose aligned length
    alone exceeds the cap (``overflow="error"``), no samples, bad sizes.
    """
    check_positive_int(dp_size, "dp_size")
    check_positive_int(max_tokens_per_micro_batch, "max_tokens_per_micro_batch")
    order_budget = check_order_budget(order_budget)
    check_positive_int(min_micro_batches, "min_micro_batches")
    if "pack_size" in plan_keywords:
        raise TypeError("plan_steps takes the micro-batch's token cap as max_tokens_per_micro_batch, not pack_size")
    shape = PipelineShape(int(pp_size), int(vpp_size), vpp_group)
    cost = CostModel() if cost is None else CostModel.of(cost)
    options = plan_options("plan_steps", {"pack_size": int(max_tokens_per_micro_batch), **plan_keywords})
    arr = validate_lengths(lengths)
    if arr.size == 0:
        raise ValueError("plan_steps: the global batch has no samples; a step needs at least one")
    dp, multiple = int(dp_size), shape.micro_batch_multiple()
    floor = _micro_batch_floor(arr, groups, shared_prefix, vision_lengths, options, dp, multiple)
    start = -(-max(floor, int(min_micro_batches)) // multiple) * multiple
    planned = dict(pack_size=options.pack_size, num_replicas=dp, cost=cost, shuffle_steps=False, groups=groups,
                   shared_prefix=shared_prefix, vision_lengths=vision_lengths, fillers=True,
                   **{k: v for k, v in options.keywords().items() if k != "pack_size"})
    m = start
    while True:
        balanced = plan_balanced(arr, micro_batches=m, **planned)
        if balanced.num_steps <= 1:
            break
        m += multiple  # the packs need more slots than dp·m: the next count megatron-core takes
    balanced, rules = _ordered(balanced, shape, order_budget)
    return StepPlan(balanced=balanced, shape=shape, cost=cost, micro_batch_floor=floor, order_rules=rules)


def check_order_budget(order_budget) -> int:
    """``order_budget`` as an int; ``ValueError`` unless it is an integer >= 0."""
    if not isinstance(order_budget, (int, np.integer)) or isinstance(order_budget, bool) or order_budget < 0:
        raise ValueError(f"order_budget must be an integer >= 0 (simulations per rank), got {order_budget!r}")
    return int(order_budget)


def _micro_batch_floor(lengths, groups, shared_prefix, vision_lengths, options, dp: int, multiple: int) -> int:
    """The fewest micro-batches per rank any plan needs: the aligned tokens (each shared prefix once) over
    ``dp`` caps, and the packs the largest group needs; rounded up to ``multiple``."""
    if groups is None:
        tokens = int(round_up(lengths, options.align).sum())
        need = 1
    else:
        gid = check_groups(groups, lengths.size)
        group_of = number_groups(gid)
        layout = as_layout(shared_prefix, lengths, gid, group_of, options.align)
        tokens = int(round_up(lengths, options.align).sum()) if layout is None else int(group_slots(layout, group_of).sum())
        need = most_group_packs(lengths, groups, vision_lengths, options, shared_prefix)
    by_tokens = -(-tokens // (options.pack_size * dp))
    m = max(1, by_tokens, need)
    return -(-m // multiple) * multiple


def _ordered(balanced: BalancedPlan, shape: PipelineShape, budget: int) -> tuple[BalancedPlan, tuple]:
    """``balanced`` (one step) with each rank's micro-batches in the order :func:`order_micro_batches` picks."""
    costs = balanced.slot_costs[0]
    steps, filler = balanced.steps.copy(), balanced.filler.copy()
    rules = []
    for r in range(steps.shape[1]):
        order, rule = order_micro_batches(costs[r], shape, budget)
        steps[0, r] = steps[0, r, order]
        filler[0, r] = filler[0, r, order]
        rules.append(rule)
    return replace(balanced, steps=steps, filler=filler), tuple(rules)


def order_micro_batches(costs, shape: PipelineShape, budget: int = DEFAULT_ORDER_BUDGET) -> tuple[np.ndarray, str]:
    """``(order, rule)``: int64 ``[m]`` the run order of micro-batches of float ``[m]`` ``costs`` that the
    simulated schedule of ``shape`` runs fastest among :data:`ORDER_RULES`, improved by pairwise swaps (first
    improvement, at most ``budget`` simulations), and the rule it started from. Deterministic: every rank of a
    run-time plan computes the same order."""
    c = np.asarray(costs, np.float64)
    candidates = _rule_orders(c)
    if shape.pp_size == 1 or c.size < 2:  # one stage: every order takes Σ c
        return candidates[0], ORDER_RULES[0]
    times = [step_time(c[o], shape) for o in candidates]
    k = int(np.argmin(times))
    best, best_time = candidates[k].copy(), times[k]
    spent = 0
    improved = True
    while improved and spent < budget:
        improved = False
        for i in range(c.size - 1):
            for j in range(i + 1, c.size):
                if spent >= budget:
                    break
                if c[best[i]] == c[best[j]]:
                    continue
                trial = best.copy()
                trial[i], trial[j] = trial[j], trial[i]
                t = step_time(c[trial], shape)
                spent += 1
                if t < best_time * (1 - 1e-12):
                    best, best_time, improved = trial, t, True
    return best, ORDER_RULES[k]


def _rule_orders(c: np.ndarray) -> list[np.ndarray]:
    """The orders of :data:`ORDER_RULES` for float64 ``[m]`` costs (ties by position)."""
    ascending = np.lexsort((np.arange(c.size), c))
    hump = np.concatenate([ascending[0::2], ascending[1::2][::-1]])
    descending = np.lexsort((np.arange(c.size), -c))
    cheapest_first = np.concatenate([ascending[:1], descending[descending != ascending[0]]])
    return [a.astype(np.int64) for a in (hump, ascending, descending, cheapest_first, np.arange(c.size))]
