"""Ranks, not steps: how far a plan's ranks are apart, the least any plan could reach, and filling the
last step rank by rank.

A step waits for its costliest rank, so the ``straggler`` of a plan is ``max_r C_r / mean_r C_r`` over
the ranks' costs ``C_r`` summed over its steps (every micro-batch that runs counts: a repeated pack, a
filler). :func:`rank_floor` is a cost that the costliest rank of *any* plan of the same items reaches,
on ``R`` ranks of ``S·M`` micro-batches each, every micro-batch at most ``pack_size`` tokens. It is the
largest of:

* the mean: ``(Σ item costs + F · c_min) / R``, ``F`` the micro-batches no item can fill (each item
  fills at most one, a group over one pack at most ``min(M, members)``), each at least one piece;
* for every ``j``, the ``⌈j/R⌉`` cheapest of the ``j`` costliest items (some rank runs that many of
  them), plus ``c_min`` for each of that rank's micro-batches they cannot fill: with ``j = 1`` the
  costliest item (a long sample, a group) and one piece in each other micro-batch; with ``j = I`` the
  pigeonhole of many items on few ranks;

``c_min`` being the cheapest piece alone. An item costs what it costs in one pack (a group's shared
prefix once), which no plan undercuts. :func:`straggler_bound` is ``max(1, floor / mean)`` with the
plan's own mean: no plan whose ranks cost as much in all does better, so it is never above the plan's
straggler, and a plan is balanced as well as its items allow when the two are close.

Details: docs/rl.md, "Filling the last step rank by rank (thdpack.planning.rank_fill)".
"""

from __future__ import annotations

import numpy as np

from thdpack.common.jit import njit
from thdpack.planning.plan import PackPlan
from thdpack.planning.spread import Items, item_packs, rebuilt, spread_items


def rank_floor(item_cost: np.ndarray, item_slots: np.ndarray, piece_min: float, num_replicas: int,
               slots_per_rank: int) -> float:
    """The least cost the costliest rank of any plan reaches (see the module's docstring).

    Args:
        item_cost: float64 ``[I]`` what every item (a piece, or a group) costs at the least.
        item_slots: int64 ``[I]`` the most micro-batches every item can fill (1 for an item that fits a
            pack; ``min(M, members)`` for a group over one).
        piece_min: the cost of the cheapest piece alone (what any micro-batch costs at the least).
        num_replicas: ``R``; slots_per_rank: ``S·M`` micro-batches of every rank.

    Returns a float >= 0 (0.0 without items or micro-batches).
    """
    if item_cost.size == 0 or slots_per_rank == 0:
        return 0.0
    R, slots = int(num_replicas), int(slots_per_rank)
    empty = max(0, R * slots - int(np.minimum(item_slots, slots).sum()))  # micro-batches no item fills
    mean = (float(item_cost.sum()) + empty * piece_min) / R
    order = np.argsort(-item_cost, kind="stable")
    cost, fills = item_cost[order], np.maximum.accumulate(item_slots[order])
    j = np.arange(1, cost.size + 1)
    q = -(-j // R)  # some rank runs at least q of the j costliest
    window = np.concatenate([[0.0], np.cumsum(cost)])
    least = window[j] - window[j - q] + np.maximum(0, slots - q * fills) * piece_min
    return max(mean, float(least.max()))


def straggler(rank_costs: np.ndarray) -> float:
    """``max / mean`` of float64 ``[R]`` per-rank costs (1.0 when they are all 0)."""
    mean = float(rank_costs.mean()) if rank_costs.size else 0.0
    return float(rank_costs.max()) / mean if mean > 0 else 1.0


def straggler_bound(floor: float, rank_costs: np.ndarray) -> float:
    """``max(1, floor / mean)`` of float64 ``[R]`` per-rank costs: no plan with the same mean has a lower
    straggler (:func:`rank_floor` gives ``floor``)."""
    mean = float(rank_costs.mean()) if rank_costs.size else 0.0
    return max(1.0, floor / mean) if mean > 0 else 1.0


def relabel(loads: np.ndarray) -> np.ndarray:
    """int64 ``[S, R]`` ``perm``: rank ``r`` of step ``s`` runs what rank ``perm[s, r]`` ran, so that the
    ranks' totals even out. ``loads``: float64 ``[S, R]`` every rank's cost in every step. Steps are taken
    by decreasing spread (``max − min``); each gives its costliest share to the rank with the least total
    so far (ties: the lowest rank, the earlier share)."""
    num_steps, num_ranks = loads.shape
    perm = np.empty((num_steps, num_ranks), np.int64)
    total = np.zeros(num_ranks)
    spread = loads.max(axis=1) - loads.min(axis=1) if num_steps else np.zeros(0)
    for s in np.argsort(-spread, kind="stable").tolist():
        shares = np.argsort(-loads[s], kind="stable")
        ranks = np.argsort(total, kind="stable")
        perm[s, ranks] = shares
        total[ranks] += loads[s, shares]
    return perm


@njit
def _fill_slots(order, cost, size, vision, pieces, base, per_rank, capacity, vision_capacity, max_pieces, cost_cap,
                fill_all, fixed):
    """The rule, compiled: items in ``order`` (int64 ``[k]``, decreasing cost) into ``R·per_rank`` slots
    (rank ``r``'s are ``r·per_rank ...``), ``base`` float64 ``[R]`` what each rank runs already. Each item
    goes to the least-loaded rank (ties: the lowest) that can take it: in a slot of its own while the
    rank has an empty one, else in its least-loaded slot with room (``size`` tokens, ``vision`` patches,
    ``pieces``, the slot's cost at most ``cost_cap``). With ``fill_all``, once the items left are as many
    as the empty slots, each goes to an empty slot. Returns (int64 ``[k]`` the slot of each item in
    ``order``, float64 slot costs, the slots' room in tokens, patches and pieces, the ranks' totals,
    True), or (partial, ..., False) as soon as an item fits nowhere. ``fixed``: int64 ``[k]`` the rank an
    item must go to, in a slot of its own (a pack of a group's bundle), or -1; such items come first."""
    num_ranks = base.shape[0]
    k = order.shape[0]
    total = base.copy()
    load = np.zeros(num_ranks * per_rank)
    room = np.full(load.size, capacity, np.int64)
    vroom = np.full(load.size, vision_capacity, np.int64)
    left = np.full(load.size, max_pieces if max_pieces > 0 else 1 << 62, np.int64)
    opened = np.zeros(num_ranks, np.int64)
    empty = load.size
    out = np.full(k, -1, np.int64)
    for i in range(k):
        j = order[i]
        forced = fill_all and k - i <= empty
        best, slot = -1, -1
        if fixed[i] >= 0 and opened[fixed[i]] < per_rank:
            best, slot = fixed[i], fixed[i] * per_rank + opened[fixed[i]]
        for q in range(num_ranks if fixed[i] < 0 else 0):
            mine = -1
            if opened[q] < per_rank:
                mine = q * per_rank + opened[q]
            elif not forced:
                for t in range(q * per_rank, (q + 1) * per_rank):
                    if (room[t] >= size[j] and vroom[t] >= vision[j] and left[t] >= pieces[j]
                            and load[t] + cost[j] <= cost_cap and (mine < 0 or load[t] < load[mine])):
                        mine = t
            if mine >= 0 and (best < 0 or total[q] < total[best]):
                best, slot = q, mine
        if best < 0 or room[slot] < size[j] or vroom[slot] < vision[j] or cost[j] > cost_cap:
            return out, load, room, vroom, left, total, False
        if slot == best * per_rank + opened[best] and opened[best] < per_rank:
            opened[best] += 1
            empty -= 1
        out[i] = slot
        load[slot] += cost[j]
        total[best] += cost[j]
        room[slot] -= size[j]
        vroom[slot] -= vision[j]
        left[slot] -= pieces[j]
    return out, load, room, vroom, left, total, True


@njit
def _fits(t, j, size, vision, pieces, cost, room, vroom, left, load, cost_cap, gone):
    """Whether slot ``t`` takes item ``j`` once ``gone`` (an item, or -1) has left it."""
    if gone >= 0:
        return (room[t] + size[gone] >= size[j] and vroom[t] + vision[gone] >= vision[j]
                and left[t] + pieces[gone] >= pieces[j] and load[t] - cost[gone] + cost[j] <= cost_cap)
    return room[t] >= size[j] and vroom[t] >= vision[j] and left[t] >= pieces[j] and load[t] + cost[j] <= cost_cap


@njit
def _best_change(out, order, cost, size, vision, pieces, load, room, vroom, left, count, per_rank, cost_cap, hi, lo,
                 gap, fixed):
    """The move (an item of rank ``hi`` to a slot of rank ``lo``) or swap (with an item of ``lo``) that lowers
    the larger of the two ranks' costs most: ``(item position, other position or -1, slot, gain)``."""
    best_i, best_j, best_t, best_gain = -1, -1, -1, 0.0
    k = out.shape[0]
    mine, theirs = np.empty(k, np.int64), np.empty(k, np.int64)  # the free items of ranks hi and lo
    a = b = 0
    for i in range(k):
        if fixed[i] < 0 and out[i] // per_rank == hi:
            mine[a] = i
            a += 1
        elif fixed[i] < 0 and out[i] // per_rank == lo:
            theirs[b] = i
            b += 1
    for x in range(a):
        i = mine[x]
        if count[out[i]] <= 1:  # a slot is never emptied
            continue
        ci = cost[order[i]]
        gain = min(ci, gap - ci)
        if gain <= best_gain:
            continue
        for t in range(lo * per_rank, (lo + 1) * per_rank):
            if count[t] > 0 and _fits(t, order[i], size, vision, pieces, cost, room, vroom, left, load, cost_cap, -1):
                best_i, best_j, best_t, best_gain = i, -1, t, gain
                break
    for x in range(a):
        i = mine[x]
        for y in range(b):
            j = theirs[y]
            d = cost[order[i]] - cost[order[j]]
            gain = min(d, gap - d)
            if d <= 0 or gain <= best_gain:
                continue
            if (_fits(out[i], order[j], size, vision, pieces, cost, room, vroom, left, load, cost_cap, order[i])
                    and _fits(out[j], order[i], size, vision, pieces, cost, room, vroom, left, load, cost_cap,
                              order[j])):
                best_i, best_j, best_t, best_gain = i, j, out[j], gain
    return best_i, best_j, best_t, best_gain


@njit
def _place(i, t, out, order, cost, size, vision, pieces, load, room, vroom, left, count, total, per_rank):
    """Item at position ``i`` from its slot to slot ``t``."""
    j, a = order[i], out[i]
    load[a] -= cost[j]
    room[a] += size[j]
    vroom[a] += vision[j]
    left[a] += pieces[j]
    count[a] -= 1
    total[a // per_rank] -= cost[j]
    load[t] += cost[j]
    room[t] -= size[j]
    vroom[t] -= vision[j]
    left[t] -= pieces[j]
    count[t] += 1
    total[t // per_rank] += cost[j]
    out[i] = t


@njit
def _improve(out, order, cost, size, vision, pieces, load, room, vroom, left, total, per_rank, cost_cap, rounds, fixed):
    """After the greedy fill: while the costliest rank can trade an item (a move, or a swap) with a cheaper
    one that lowers the larger of the two, the best such trade with the cheapest rank that has one, at most
    ``rounds`` times. Never empties a slot,
    keeps every slot within its room and ``cost_cap``, never moves a ``fixed`` item. Updates the arrays in
    place."""
    count = np.zeros(load.shape[0], np.int64)
    for i in range(out.shape[0]):
        count[out[i]] += 1
    for _ in range(rounds):
        hi = np.argmax(total)
        i = -1
        for lo in np.argsort(total):  # the cheapest rank first, then the others below the costliest
            gap = total[hi] - total[lo]
            if gap <= 1e-12 * max(total[hi], 1.0):
                break
            i, j, t, gain = _best_change(out, order, cost, size, vision, pieces, load, room, vroom, left, count,
                                         per_rank, cost_cap, hi, lo, gap, fixed)
            if i >= 0 and gain > 1e-12 * total[hi]:
                break
            i = -1
        if i < 0:
            return
        if j < 0:
            _place(i, t, out, order, cost, size, vision, pieces, load, room, vroom, left, count, total, per_rank)
        else:
            a = out[i]
            _place(i, t, out, order, cost, size, vision, pieces, load, room, vroom, left, count, total, per_rank)
            _place(j, a, out, order, cost, size, vision, pieces, load, room, vroom, left, count, total, per_rank)


# the most trades _improve makes after a fill
_ROUNDS = 256


def improve_ranks(order: np.ndarray, start: np.ndarray, items: Items, base: np.ndarray, per_rank: int, capacity: int,
                  vision_capacity: int, max_pieces: int = 0, cost_cap: float = np.inf):
    """:func:`_improve` from a fill that fits: the items ``order`` (int64 ``[k]``) in slots ``start`` (int64
    ``[k]``, each within its room). Returns what :func:`fill_ranks` returns."""
    num_slots = base.size * per_rank
    cost, size, vision, pieces = (a[order] for a in (items.cost, items.size, items.vision, items.pieces))
    load = np.bincount(start, weights=cost, minlength=num_slots)
    room = capacity - np.bincount(start, weights=size, minlength=num_slots).astype(np.int64)
    vroom = vision_capacity - np.bincount(start, weights=vision, minlength=num_slots).astype(np.int64)
    left = (max_pieces if max_pieces > 0 else 1 << 62) - np.bincount(start, weights=pieces, minlength=num_slots)
    total = base.astype(np.float64) + load.reshape(base.size, per_rank).sum(axis=1)
    out, at = start.copy(), np.arange(order.size)
    _improve(out, at, cost, size, vision, pieces, load, room, vroom, left.astype(np.int64), total, int(per_rank),
             float(cost_cap), min(4 * order.size, _ROUNDS), np.full(order.size, -1, np.int64))
    slot_of_item = np.full(items.size.size, -1, np.int64)
    slot_of_item[order] = out
    return slot_of_item, load


def fill_ranks(order: np.ndarray, items: Items, base: np.ndarray, per_rank: int, capacity: int,
               vision_capacity: int, max_pieces: int = 0, cost_cap: float = np.inf, fill_all: bool = True,
               fixed: np.ndarray | None = None):
    """:func:`_fill_slots` over :class:`Items` ``items``, then :func:`_improve`: ``(int64 [I] slot of every
    item (-1: not in order), float64 [R·per_rank] slot costs)``, or None when an item fits no slot."""
    fixed = np.full(order.size, -1, np.int64) if fixed is None else fixed.astype(np.int64)
    args = (items.cost, items.size, items.vision, items.pieces)
    slots, loads, room, vroom, left, total, ok = _fill_slots(order, *args, base.astype(np.float64), int(per_rank),
                                                             int(capacity), int(vision_capacity), int(max_pieces),
                                                             float(cost_cap), bool(fill_all), fixed)
    if not ok:
        return None
    _improve(slots, order, *args, loads, room, vroom, left, total, int(per_rank), float(cost_cap),
             min(4 * order.size, _ROUNDS), fixed)
    out = np.full(items.size.size, -1, np.int64)
    out[order] = slots
    return out, loads


def refill_last_step(plan: PackPlan, items: Items, steps: np.ndarray, slot_costs: np.ndarray, filler: np.ndarray,
                     *, recut: bool, num_last: int = 1, max_pieces: int = 0, cost_cap: float = np.inf,
                     fill_all: bool = True, from_current: bool = False):
    """The earlier steps relabelled and the last ``num_last`` steps filled rank by rank (see the module's
    docstring).

    Args:
        plan: the :class:`PackPlan` of ``steps``; items: its :class:`Items`.
        steps: int64 ``[S, R, M]`` pack ids (``S >= num_last``); slot_costs: float64 ``[S, R, M]`` what every
            slot costs (a repeated pack or a filler its own cost).
        filler: bool ``[S, R, M]``: the slot runs a filler (only in the last step). Without a re-cut it moves
            along; with one it is left out (its pack must not be in the refilled steps otherwise).
        recut: re-cut the packs of the last ``num_last`` steps, item by item, into ``num_last·R·M`` slots
            (``M·num_last`` per rank; a rank's slots by decreasing cost, step after step); their packs must
            be in no earlier step. Else (``num_last`` 1) the last step's slots move whole.
        max_pieces: the most pieces a pack holds (0: no limit); cost_cap: the most a fresh pack may cost.
        fill_all: every slot gets an item while there are items enough (else a rank that runs much
            already may keep empty slots, for fillers).
        from_current: start from the items where they are (each re-cut pack a slot) and only trade them
            between ranks (:func:`improve_ranks`), instead of the greedy fill: it always fits.

    Returns ``(plan, steps, empty)``: the plan (with a re-cut: the fresh packs after the untouched ones),
    int64 ``[S, R, M]`` steps and bool ``[S, R, M]``: the filler slots moved along (no re-cut), or the
    slots no item went to (a re-cut; the caller fills them, ``steps`` holds 0 there). None when the items
    do not fit (no room in the slots, or a slot over ``cost_cap``).
    """
    num_steps, num_ranks, micro_batches = steps.shape
    keep = num_steps - num_last
    perm = relabel(slot_costs[:keep].sum(axis=2))
    earlier = np.take_along_axis(steps[:keep], perm[:, :, None], axis=1)
    base = np.take_along_axis(slot_costs[:keep].sum(axis=2), perm, axis=1).sum(axis=0)
    before = np.take_along_axis(filler[:keep], perm[:, :, None], axis=1)
    if not recut:  # the last step's slots are the items, each opening a slot
        last, last_cost = steps[-1].reshape(-1), slot_costs[-1].reshape(-1)
        zero = np.zeros(last.size, np.int64)
        order = np.argsort(-last_cost, kind="stable")
        slot_of = fill_ranks(order, Items(zero, zero, zero, zero, last_cost), base, micro_batches, 0, 0)[0]
        at = np.empty(last.size, np.int64)
        at[slot_of] = np.arange(last.size)  # the item (old slot) every slot now holds
        shape = (1, num_ranks, micro_batches)
        return plan, np.concatenate([earlier, last[at].reshape(shape)]), \
            np.concatenate([before, filler[-1].reshape(-1)[at].reshape(shape)])
    packs = np.unique(steps[keep:][~filler[keep:]])
    moved = spread_items(plan, items, packs)
    order = moved[np.argsort(-items.cost[moved], kind="stable")]
    vision_budget = plan.vision_budget if plan.vision_length is not None else 0
    per_rank = num_last * micro_batches
    limits = (plan.pack_size, vision_budget, max_pieces, cost_cap)
    if from_current:  # every item where it is (slot r·per_rank + k·M + m: step keep + k, rank r, place m)
        where = np.full(len(plan), -1, np.int64)
        tail = steps[keep:].transpose(1, 0, 2).reshape(-1)
        real = ~filler[keep:].transpose(1, 0, 2).reshape(-1)
        where[tail[real]] = np.flatnonzero(real)
        done = improve_ranks(order, where[item_packs(plan, items)[order]], items, base, per_rank, *limits)
    else:
        done = fill_ranks(order, items, base, per_rank, *limits, fill_all)
    if done is None:
        return None
    slot_of_item, loads = done
    used = np.zeros(num_ranks * per_rank, bool)
    used[slot_of_item[order]] = True
    fresh = np.cumsum(used) - 1  # the fresh pack of every used slot, in slot order
    new_plan, renumber = rebuilt(plan, items, packs, np.where(slot_of_item >= 0, fresh[slot_of_item], -1),
                                 int(used.sum()))
    # a rank's slots by decreasing cost, step after step: the refilled steps hold slots of similar cost
    by_cost = np.argsort(-loads.reshape(num_ranks, per_rank), axis=1, kind="stable") + \
        (np.arange(num_ranks) * per_rank)[:, None]
    ids = np.where(used, len(plan) - packs.size + fresh, 0)[by_cost]
    last = ids.reshape(num_ranks, num_last, micro_batches).transpose(1, 0, 2)
    empty = (~used)[by_cost].reshape(num_ranks, num_last, micro_batches).transpose(1, 0, 2)
    return new_plan, np.concatenate([renumber[earlier], last]), np.concatenate([before, empty])


def refill_around_bundles(plan: PackPlan, items: Items, bundles: list[np.ndarray], pack_costs: np.ndarray,
                          shape: tuple[int, int, int], *, max_pieces: int = 0):
    """Every step filled rank by rank around the bundles (a group over one pack: its packs in one step of one
    rank). Bundles go first, costliest first, each to the least-loaded rank with a step that has room for
    it (that rank's step with the most free slots); then the items of the other packs fill the ranks'
    slots as :func:`refill_last_step` fills them, for fillers (``fill_all`` off), the room left in the
    bundles' packs included.

    Args:
        plan: the :class:`PackPlan`; items: its :class:`Items` (groups); bundles: int64 pack ids of each
            bundle; pack_costs: float64 ``[P]``; shape: ``(S, R, M)`` of the steps.

    Returns ``(plan, steps, empty)`` as :func:`refill_last_step` (every pack re-cut, a bundle's packs
    keeping their members), or None when a bundle or an item finds no room.
    """
    num_steps, num_ranks, micro_batches = shape
    free = np.full((num_steps, num_ranks), micro_batches, np.int64)
    total = np.zeros(num_ranks)
    cell = np.empty((len(bundles), 2), np.int64)
    for b in np.argsort([-pack_costs[x].sum() for x in bundles], kind="stable").tolist():
        ranks = np.flatnonzero((free >= bundles[b].size).any(axis=0))
        if not ranks.size:
            return None
        r = int(ranks[np.argmin(total[ranks])])
        s = int(np.argmax(free[:, r]))
        free[s, r] -= bundles[b].size
        total[r] += pack_costs[bundles[b]].sum()
        cell[b] = s, r
    parts = np.concatenate(bundles)
    part_cell = np.repeat(cell, [x.size for x in bundles], axis=0)
    joined = _with_parts(plan, items, parts, pack_costs)
    first = items.size.size  # pseudo-item first + p: the pieces of part p
    moved = np.setdiff1d(np.unique(joined.of_piece), first + np.arange(parts.size))
    order = np.concatenate([first + np.arange(parts.size), moved[np.argsort(-joined.cost[moved], kind="stable")]])
    fixed = np.concatenate([part_cell[:, 1], np.full(moved.size, -1, np.int64)])
    per_rank = num_steps * micro_batches
    vision_budget = plan.vision_budget if plan.vision_length is not None else 0
    done = fill_ranks(order, joined, np.zeros(num_ranks), per_rank, plan.pack_size, vision_budget, max_pieces,
                      fill_all=False, fixed=fixed)
    if done is None:
        return None
    slot_of_item, loads = done
    used = np.zeros(num_ranks * per_rank, bool)
    used[slot_of_item[order]] = True
    fresh = np.cumsum(used) - 1
    new_plan, _ = rebuilt(plan, joined, np.arange(len(plan)), np.where(slot_of_item >= 0, fresh[slot_of_item], -1),
                          int(used.sum()))
    ids = np.where(used, fresh, -1)
    return new_plan, *_bundle_layout(slot_of_item[first:], part_cell, ids, loads, shape)


def _with_parts(plan: PackPlan, items: Items, parts: np.ndarray, pack_costs: np.ndarray) -> Items:
    """``items`` and one more per pack of ``parts`` (int64 pack ids, the bundles'), ``I + p`` holding the
    pieces of ``parts[p]`` (its tokens counted unshared, as its group was packed)."""
    first = items.size.size
    pack_of_piece = np.repeat(np.arange(len(plan)), np.diff(plan.pack_offsets))
    part_of_pack = np.full(len(plan), -1, np.int64)
    part_of_pack[parts] = np.arange(parts.size)
    part = part_of_pack[pack_of_piece]
    in_part = part >= 0
    of_piece = np.where(in_part, first + part, items.of_piece)
    aligned = -(-plan.length // plan.align) * plan.align
    size = np.bincount(part[in_part], weights=aligned[in_part], minlength=parts.size).astype(np.int64)
    vision = np.zeros(parts.size, np.int64)
    if plan.vision_length is not None:
        vision = np.bincount(part[in_part], weights=plan.vision_length[in_part], minlength=parts.size).astype(np.int64)
    pieces = np.bincount(part[in_part], minlength=parts.size).astype(np.int64)
    return Items(of_piece, np.concatenate([items.size, size]), np.concatenate([items.vision, vision]),
                 np.concatenate([items.pieces, pieces]), np.concatenate([items.cost, pack_costs[parts]]),
                 items.group_of, items.layout)


def _bundle_layout(part_slot: np.ndarray, part_cell: np.ndarray, ids: np.ndarray, loads: np.ndarray,
                   shape: tuple[int, int, int]):
    """``(steps, empty)`` of :func:`refill_around_bundles`: every bundle pack's slot (``part_slot``) in its
    cell ``(step, rank)``, then every rank's other filled slots (``ids``: int64 fresh pack per slot, -1
    unused) by decreasing cost into its free places, step after step; places left over are empty (0 in
    ``steps``)."""
    num_steps, num_ranks, micro_batches = shape
    steps = np.zeros(shape, np.int64)
    empty = np.ones(shape, bool)
    fill = np.zeros((num_steps, num_ranks), np.int64)
    for t, (s, r) in zip(part_slot.tolist(), part_cell.tolist()):
        steps[s, r, fill[s, r]], empty[s, r, fill[s, r]] = ids[t], False
        fill[s, r] += 1
    per_rank = num_steps * micro_batches
    taken = np.zeros(ids.size, bool)
    taken[part_slot] = True
    for r in range(num_ranks):
        mine = np.arange(r * per_rank, (r + 1) * per_rank)
        mine = mine[(ids[mine] >= 0) & ~taken[mine]]
        mine = mine[np.argsort(-loads[mine], kind="stable")]
        places = [(s, m) for s in range(num_steps) for m in range(fill[s, r], micro_batches)]
        for t, (s, m) in zip(mine.tolist(), places):
            steps[s, r, m], empty[s, r, m] = ids[t], False
    return steps, empty
