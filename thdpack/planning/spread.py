"""Spreading the slack: the cheapest packs of a plan re-cut into packs of even cost.

A balanced plan gives every data-parallel rank ``S·M`` micro-batches (``S`` steps of ``M``), so it has
``S·R·M`` slots to fill. Best-fit decreasing fills packs to the budget and leaves what is left over in
the last, nearly empty one; dealt to ranks, that runt makes its rank the light one (2 ranks × 6
micro-batches, 50 rollouts of 22,635 tokens in packs of 2,048: straggler 1.073 before, 1.002 after)::

    BFD      rank 0: 2048 2044 2033 2019 2013  329     rank 1: 2048 2037 2029 2028 2007 2000
    spread   rank 0: 2048 2044 2033 2019 1606 1548     rank 1: 2048 2037 2029 2028 1603 1592
                                         └──────── the cheapest step, re-cut ────────┘

:func:`spread_slack` re-cuts the cheapest packs (``T`` of them, at least one step's worth) into ``T +
missing`` packs, ``missing`` the slots the plan leaves empty: its *items* (pieces, or whole groups
with their shared prefix once) largest cost first, the first ``T + missing`` opening one pack each,
every later one to the least-loaded pack with room (tokens, vision patches, pieces). The step those
packs form is even, and the slack is spread over every rank instead of left in one pack.

The choice of ``T`` keeps what :func:`thdpack.plan_balanced` has always promised: a plan with as many
packs as best-fit decreasing re-cuts its cheapest step; a plan that needs more packs to fill its last
step re-cuts the fewest cheapest packs whose items give every fresh pack one (``_fill_last_step`` until
0.2.0), and those that cost as much as the dearest of them (full packs, often) with them. With
``fillers`` (:func:`thdpack.rebalance`, where a slot the plan cannot fill runs one short sample with no
targets) a plan with fewer items than slots puts every item in a pack of its own; without (a repeated
slot runs its pack again) it keeps its packs and repeats some.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from thdpack.common.align import round_up
from thdpack.common.jit import njit
from thdpack.planning.packing import PackStats
from thdpack.planning.plan import PackPlan
from thdpack.planning.prefix_budget import SharedLayout, piece_shared


@dataclass(frozen=True)
class Items:
    """What a re-cut moves: a plan's pieces (``I = m``), or its groups (every piece of a group in one pack).

    Attributes:
        of_piece: int64 ``[m]`` the item of every piece of the plan.
        size: int64 ``[I]`` aligned tokens of every item (a group's shared prefix once).
        vision: int64 ``[I]`` vision patches of every item (zeros without a vision budget).
        pieces: int64 ``[I]`` pieces in every item (what ``max_samples_per_pack`` counts).
        cost: float64 ``[I]`` cost of every item laid out in one pack (:meth:`CostModel.pack_costs`'s rule).
        group_of: int64 ``[n]`` every input sample's group number, or None; layout: their shared segments'
            :class:`thdpack.planning.prefix_budget.SharedLayout` (to recount ``shared_length`` in fresh packs),
            or None for a plan without shared prefixes.
    """

    of_piece: np.ndarray
    size: np.ndarray
    vision: np.ndarray
    pieces: np.ndarray
    cost: np.ndarray
    group_of: np.ndarray | None = None
    layout: SharedLayout | None = None


def piece_items(plan: PackPlan, cost) -> Items:
    """Every piece of ``plan`` an item of its own (plans without groups)."""
    length = plan.length.astype(np.float64)
    item_cost = cost.linear * length + cost.quadratic * length * length
    vision = np.zeros(plan.length.size, np.int64)
    if plan.vision_length is not None:
        vision = plan.vision_length
        item_cost = item_cost + cost.vision * vision
    return Items(np.arange(plan.length.size, dtype=np.int64), round_up(plan.length, plan.align), vision,
                 np.ones(plan.length.size, np.int64), item_cost)


def group_items(plan: PackPlan, group_of: np.ndarray, cost, layout: SharedLayout | None = None) -> Items:
    """Every group of ``plan`` one item (``group_of``: int64 ``[n]`` group number of every input sample,
    ``0..G-1``; ``layout``: their shared segments, or None). The plan's pieces are whole samples, a group's all
    in one pack: an item's size is its members' slots, its cost :meth:`CostModel.pack_costs`'s over the tokens
    each member adds."""
    of_piece = group_of[plan.sample_index]
    num = int(group_of.max()) + 1 if group_of.size else 0
    length = plan.length.astype(np.int64)
    members = np.bincount(of_piece, minlength=num)
    if layout is None:
        shared = np.zeros(length.size, np.int64)
        slots = round_up(length, plan.align)
    else:
        shared, slots = layout.shared[plan.sample_index], layout.slots[plan.sample_index]
    size = np.bincount(of_piece, weights=slots, minlength=num).astype(np.int64)
    size[members == 0] = 0
    vision = np.zeros(num, np.int64)
    if plan.vision_length is not None:
        vision = np.bincount(of_piece, weights=plan.vision_length, minlength=num).astype(np.int64)
    lf, sf = length.astype(np.float64), shared.astype(np.float64)
    item_cost = (cost.linear * np.bincount(of_piece, weights=lf - sf, minlength=num)
                 + cost.quadratic * np.bincount(of_piece, weights=lf * lf - sf * sf, minlength=num))
    if plan.vision_length is not None:
        item_cost = item_cost + cost.vision * vision
    return Items(of_piece, size, vision, members.astype(np.int64), item_cost, group_of, layout)


@njit
def _place_items(order, cost, size, vision, pieces, count, capacity, vision_capacity, max_pieces):
    """The re-cut's rule, compiled: items in ``order`` (int64 ``[k]`` item ids, decreasing cost), the first
    ``count`` opening one pack each, every later one to the least-loaded pack (float64 ``cost`` summed;
    ties: the lowest) with room for its ``size`` tokens, ``vision`` patches and ``pieces`` (``max_pieces
    <= 0``: no limit). Returns (int64 ``[k]`` the pack of each item in ``order``, float64 ``[count]``
    loads, True), or (partial, loads, False) as soon as an item fits no pack."""
    k = order.shape[0]
    load = np.zeros(count)
    room = np.full(count, capacity, np.int64)
    vroom = np.full(count, vision_capacity, np.int64)
    slots = np.full(count, max_pieces if max_pieces > 0 else 1 << 62, np.int64)
    out = np.full(k, -1, np.int64)
    for r in range(k):
        j = order[r]
        b = r
        if r >= count:
            b = -1
            for q in range(count):
                if room[q] >= size[j] and vroom[q] >= vision[j] and slots[q] >= pieces[j]:
                    if b < 0 or load[q] < load[b]:
                        b = q
            if b < 0:
                return out, load, False
        out[r] = b
        load[b] += cost[j]
        room[b] -= size[j]
        vroom[b] -= vision[j]
        slots[b] -= pieces[j]
    return out, load, True


def spread_slack(plan: PackPlan, items: Items, pack_costs: np.ndarray, per_step: int, *, fillers: bool = False,
                 max_pieces: int = 0, recut_full: bool = True) -> tuple[PackPlan, int]:
    """``plan`` with its cheapest packs re-cut so that the slack is spread over a step of even packs.

    Args:
        plan: a :class:`PackPlan` (``P`` packs) to be dealt in steps of ``per_step`` (``R·M``) slots.
        items: its :class:`Items` (pieces, or groups).
        pack_costs: float64 ``[P]`` cost of every pack (:meth:`CostModel.pack_costs`).
        fillers: a slot the plan cannot fill runs a filler (one short sample), not its pack again: with
            fewer items than slots, every item of the re-cut packs gets a pack of its own.
        max_pieces: the most pieces a pack holds (0: no limit).
        recut_full: re-cut the cheapest step of a plan whose packs already fill whole steps (False with
            one rank, whose balance nothing changes).

    Returns ``(plan', fresh)``: ``(plan, 0)`` when nothing is re-cut (no packs, one slot per step, a re-cut
    that would not fit: an item no fresh pack has room for, or at the same number of packs one no evener
    than before); else a plan whose untouched packs keep their order, then its ``fresh`` new ones; pieces
    within a pack in input order.
    """
    num_packs = len(plan)
    if num_packs == 0 or per_step == 1:
        return plan, 0
    missing = (-num_packs) % per_step
    if missing == 0 and not recut_full:
        return plan, 0
    item_pack = item_packs(plan, items)
    by_cost = np.argsort(pack_costs, kind="stable")
    held = np.cumsum(np.bincount(item_pack[item_pack >= 0], minlength=num_packs)[by_cost])
    taken = per_step - missing if missing else per_step
    while taken < num_packs and held[taken - 1] < taken + missing:
        taken += per_step
    taken = min(taken, num_packs)
    if missing:  # packs that cost as much as the dearest of those taken (full packs, often) may go too
        tied = int(np.searchsorted(pack_costs[by_cost], pack_costs[by_cost[taken - 1]], side="right"))
        taken += (tied - taken) // per_step * per_step
    count = taken + missing
    if held[taken - 1] < count:  # fewer items than slots: each its own pack, or the packs as they are
        if not fillers:
            return plan, 0
        taken, count = num_packs, int(held[-1])
    recut = _recut(plan, items, item_pack, by_cost[:taken], count, max_pieces)
    if recut is None and fillers and count > taken:  # no room in the fresh packs: re-cut at the same count
        taken = count = min(num_packs, per_step)
        recut = _recut(plan, items, item_pack, by_cost[:taken], count, max_pieces)
    if recut is None:
        return plan, 0
    target, loads = recut
    if count == taken:
        before = pack_costs[by_cost[:taken]]
        if loads.max() - loads.min() >= before.max() - before.min():
            return plan, 0
    return rebuilt(plan, items, by_cost[:taken], target, count)[0], count


def item_packs(plan: PackPlan, items: Items) -> np.ndarray:
    """int64 ``[I]`` the pack of every item (-1 for an item with no piece in ``plan``)."""
    pack_of_piece = np.repeat(np.arange(len(plan)), np.diff(plan.pack_offsets))
    out = np.full(items.size.size, -1, np.int64)
    out[items.of_piece] = pack_of_piece
    return out


def spread_items(plan: PackPlan, items: Items, packs: np.ndarray) -> np.ndarray:
    """int64 sorted ids of the items of ``packs`` (int64 pack ids of ``plan``)."""
    return np.flatnonzero(np.isin(item_packs(plan, items), packs))


def _recut(plan: PackPlan, items: Items, item_pack: np.ndarray, emptied: np.ndarray, count: int, max_pieces: int):
    """``(int64 [I] fresh pack of every item (-1: not moved), float64 [count] their costs)`` of the items of
    packs ``emptied`` re-cut into ``count`` packs, or None when one fits none."""
    moved = np.flatnonzero(np.isin(item_pack, emptied))
    order = moved[np.argsort(-items.cost[moved], kind="stable")]
    vision_budget = plan.vision_budget if plan.vision_length is not None else 0
    target, loads, ok = _place_items(order, items.cost, items.size, items.vision, items.pieces, int(count),
                                     int(plan.pack_size), int(vision_budget), int(max_pieces))
    if not ok:
        return None
    out = np.full(items.size.size, -1, np.int64)
    out[order] = target
    return out, loads


def rebuilt(plan: PackPlan, items: Items, emptied: np.ndarray, target: np.ndarray, count: int):
    """``(plan', renumber)``: ``plan`` with packs ``emptied`` (int64 ids) replaced by ``count`` fresh packs
    after the untouched ones, which keep their order (``target``: int64 ``[I]`` the fresh pack of every
    moved item); ``renumber``: int64 ``[P]`` the new id of every untouched pack (-1 for the emptied)."""
    num_packs = len(plan)
    pack_of_piece = np.repeat(np.arange(num_packs), np.diff(plan.pack_offsets))
    gone = np.zeros(num_packs, bool)
    gone[emptied] = True
    renumber = np.where(gone, -1, np.cumsum(~gone) - 1)
    pack_of = renumber[pack_of_piece]
    moved = gone[pack_of_piece]
    pack_of[moved] = (num_packs - emptied.size) + target[items.of_piece[moved]]
    total = num_packs - emptied.size + count
    offsets = np.zeros(total + 1, np.int64)
    np.cumsum(np.bincount(pack_of, minlength=total), out=offsets[1:])
    order = np.lexsort((plan.start, plan.sample_index, pack_of))  # within a pack: input order, as plan_packs gives
    sample_index, start, length = plan.sample_index[order], plan.start[order], plan.length[order]
    vision = None if plan.vision_length is None else plan.vision_length[order]
    shared = None
    if plan.shared_length is not None:
        shared = piece_shared(sample_index, offsets, items.group_of, items.layout)
    stats = PackStats.from_packs(length if shared is None else length - shared, offsets, plan.pack_size,
                                 align=plan.align, num_samples=plan.stats.num_samples, cuts=plan.stats.cuts,
                                 vision_length=vision, vision_budget=plan.vision_budget)
    return replace(plan, sample_index=sample_index, start=start, length=length, pack_offsets=offsets, stats=stats,
                   vision_length=vision, shared_length=shared), renumber


def recut(plan: PackPlan, items: Items, count: int, max_pieces: int = 0) -> PackPlan | None:
    """Every pack of ``plan`` re-cut, item by item as :func:`spread_slack` re-cuts, into ``count`` packs (at
    most as many as it has items); None when an item fits none of them."""
    every = np.arange(len(plan))
    done = _recut(plan, items, item_packs(plan, items), every, count, max_pieces)
    return None if done is None else rebuilt(plan, items, every, done[0], count)[0]
