"""Bin-packing kernels on integer sizes (compiled with numba when available).

Every kernel takes item sizes in *placement order* and returns, for each item,
the bin it went to, plus the number of bins opened. Bins are numbered in the
order they were opened. Sizes must satisfy ``1 <= size <= capacity``.

``max_items <= 0`` means no limit on items per bin.

The tests hold each kernel to a plain reference: Python loops in
``tests/test_plan.py`` (``first_fit_2d``'s in ``tests/test_vlm.py``), numpy's
stable argsort for ``bucket_order``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from thdpack.common.jit import njit


@njit
def _tree_add(tree, leaves, leaf, delta):
    i = leaf + leaves
    while i >= 1:
        tree[i] += delta
        i >>= 1


@njit
def best_fit(sizes, capacity, max_items):
    """Best fit: each item goes to the open bin with the least room that holds it.

    Open bins are indexed by remaining capacity in a sum tree, so each item costs
    O(log capacity): best-fit decreasing over a million items takes milliseconds.
    """
    n = sizes.shape[0]
    leaves = 1
    while leaves < capacity + 1:
        leaves *= 2
    tree = np.zeros(2 * leaves, np.int64)  # number of open bins per remaining capacity
    head = np.full(capacity + 1, -1, np.int64)  # a stack of bins per remaining capacity
    nxt = np.full(max(n, 1), -1, np.int64)
    count = np.zeros(max(n, 1), np.int64)
    bin_of = np.empty(n, np.int64)
    nbins = 0
    for j in range(n):
        s = sizes[j]
        room = _first_at_or_after_at_least(tree, leaves, s, 1)  # a capacity with an open bin (counts are ints)
        if room < 0:
            b = nbins
            nbins += 1
            rem = capacity - s
        else:
            b = head[room]
            head[room] = nxt[b]
            _tree_add(tree, leaves, room, -1)
            rem = room - s
        bin_of[j] = b
        count[b] += 1
        if rem > 0 and (max_items <= 0 or count[b] < max_items):
            nxt[b] = head[rem]
            head[rem] = b
            _tree_add(tree, leaves, rem, 1)
    return bin_of, nbins


@njit
def _max_tree_set(tree, leaves, leaf, value):
    i = leaf + leaves
    tree[i] = value
    i >>= 1
    while i >= 1:
        left = tree[2 * i]
        right = tree[2 * i + 1]
        tree[i] = left if left > right else right
        i >>= 1


@njit
def first_fit(sizes, capacity, max_items):
    """First fit: each item goes to the lowest-numbered bin that holds it.

    A max tree over bins (unopened bins have full capacity) finds that bin in
    O(log n).
    """
    n = sizes.shape[0]
    leaves = 1
    while leaves < max(n, 1):
        leaves *= 2
    tree = np.full(2 * leaves, capacity, np.int64)
    count = np.zeros(max(n, 1), np.int64)
    bin_of = np.empty(n, np.int64)
    nbins = 0
    for j in range(n):
        s = sizes[j]
        i = 1
        while i < leaves:
            i = 2 * i
            if tree[i] < s:
                i += 1
        b = i - leaves
        count[b] += 1
        rem = tree[i] - s
        if max_items > 0 and count[b] >= max_items:
            rem = -1
        _max_tree_set(tree, leaves, b, rem)
        bin_of[j] = b
        if b >= nbins:
            nbins = b + 1
    return bin_of, nbins


@njit
def next_fit(sizes, capacity, max_items):
    """Next fit: fill the current bin in order; open a new one when an item does not fit."""
    n = sizes.shape[0]
    bin_of = np.empty(n, np.int64)
    b = -1
    rem = -1
    cnt = 0
    for j in range(n):
        s = sizes[j]
        if s > rem or (max_items > 0 and cnt >= max_items):
            b += 1
            rem = capacity
            cnt = 0
        rem -= s
        cnt += 1
        bin_of[j] = b
    return bin_of, b + 1


@njit
def bucket_order(keys, num_keys, descending):
    """Stable permutation sorting non-negative integer ``keys < num_keys``.

    A counting sort: O(n + num_keys), several times faster than ``np.argsort``
    for the bounded keys planning sorts by (lengths, pack ids).
    """
    counts = np.zeros(num_keys + 1, np.int64)
    for k in keys:
        counts[(num_keys - 1 - k if descending else k) + 1] += 1
    for i in range(num_keys):
        counts[i + 1] += counts[i]
    order = np.empty(keys.shape[0], np.int64)
    for j in range(keys.shape[0]):
        k = keys[j]
        slot = num_keys - 1 - k if descending else k
        order[counts[slot]] = j
        counts[slot] += 1
    return order


# ---- two budgets: tokens and vision patches ------------------------------------
#
# The 2-D kernels take a second size per item (``vsizes``, >= 0, e.g. ViT patches)
# and a second capacity; an item fits a bin only when both fit. The 1-D kernels
# above are unchanged.


@njit
def _first_at_or_after_at_least(tree, leaves, start, value):
    """Smallest leaf index >= start whose value is >= ``value``, else -1.

    ``tree`` stores ``leaves`` leaves at ``tree[leaves:]``; each internal node is the max of its
    children, or their sum when every value is a non-negative integer and ``value`` is 1 (then
    ">= 1" means "non-zero" at every level).
    """
    i = start + leaves
    if tree[i] >= value:
        return start
    while True:
        while i & 1:  # climb while we are a right child
            i >>= 1
        if i == 0:
            return -1
        i += 1  # step to the right sibling
        if tree[i] >= value:
            break
    while i < leaves:  # descend to the leftmost leaf holding >= value
        i = 2 * i
        if tree[i] < value:
            i += 1
    return i - leaves


@njit
def best_fit_2d(sizes, vsizes, capacity, vcapacity, max_items):
    """Best fit on two budgets: each item goes to the open bin with the least token
    room that holds it in both budgets (ties: the least vision room).

    Open bins sit in buckets by remaining token room; a max tree over rooms keeps
    the largest remaining vision room of each bucket, so the least room that can
    take the item is found in O(log capacity); the bucket is then scanned.
    """
    n = sizes.shape[0]
    leaves = 1
    while leaves < capacity + 1:
        leaves *= 2
    tree = np.full(2 * leaves, -1, np.int64)  # per token room: max vision room of its open bins
    head = np.full(capacity + 1, -1, np.int64)  # doubly linked bucket per token room
    nxt = np.full(max(n, 1), -1, np.int64)
    prv = np.full(max(n, 1), -1, np.int64)
    vrem = np.zeros(max(n, 1), np.int64)
    count = np.zeros(max(n, 1), np.int64)
    bin_of = np.empty(n, np.int64)
    nbins = 0
    for j in range(n):
        s = sizes[j]
        v = vsizes[j]
        room = _first_at_or_after_at_least(tree, leaves, s, v)
        if room < 0:
            b = nbins
            nbins += 1
            rem = capacity - s
            vr = vcapacity - v
        else:
            # the bin of this bucket with the least vision room that still holds v
            b = -1
            best = vcapacity + 1
            k = head[room]
            while k >= 0:
                if vrem[k] >= v and vrem[k] < best:
                    best = vrem[k]
                    b = k
                k = nxt[k]
            # unlink b and refresh the bucket's max vision room
            if prv[b] >= 0:
                nxt[prv[b]] = nxt[b]
            else:
                head[room] = nxt[b]
            if nxt[b] >= 0:
                prv[nxt[b]] = prv[b]
            top = -1
            k = head[room]
            while k >= 0:
                if vrem[k] > top:
                    top = vrem[k]
                k = nxt[k]
            _max_tree_set(tree, leaves, room, top)
            rem = room - s
            vr = vrem[b] - v
        bin_of[j] = b
        count[b] += 1
        vrem[b] = vr
        if rem > 0 and (max_items <= 0 or count[b] < max_items):
            prv[b] = -1
            nxt[b] = head[rem]
            if head[rem] >= 0:
                prv[head[rem]] = b
            head[rem] = b
            if vr > tree[rem + leaves]:
                _max_tree_set(tree, leaves, rem, vr)
    return bin_of, nbins


_RATIO_STEPS = 6  # balanced-room trees for ratios 2**k, k = -6..6
_RATIO_TREES = 2 * _RATIO_STEPS + 1


@njit
def _balanced(x, y, k):
    """``min(x, 2**k · y)`` for k >= 0, ``min(2**-k · x, y)`` for k < 0 (integers)."""
    if x < 0 or y < 0:
        return -1
    if k >= 0:
        ry = y << k
        return x if x < ry else ry
    rx = x << (-k)
    return rx if rx < y else y


@njit
def _ratio_at_most(x, y, k):
    """``2**k · y <= x``."""
    if k >= 0:
        return (y << k) <= x
    return y <= (x << (-k))


@njit
def _rebuild_max_tree(tree, leaves):
    for i in range(leaves - 1, 0, -1):
        left = tree[2 * i]
        right = tree[2 * i + 1]
        tree[i] = left if left > right else right


class _RoomTrees(NamedTuple):
    """The bins of :func:`first_fit_2d` as the leaves of max trees (unopened bins: full rooms).

    Each tree is an int64 array of ``2 · leaves`` nodes, leaves at ``[leaves:]``, each internal
    node the max of its two children; a bin that takes no more items has room -1.
    """

    token: np.ndarray  # int64 [2·leaves]: token room
    vision: np.ndarray  # int64 [2·leaves]: vision room
    balanced: np.ndarray  # int64 [_RATIO_TREES, 2·leaves]: balanced room for the ratio 2**(q - _RATIO_STEPS)
    leaves: int


class _RatioWindow(NamedTuple):
    """The two grid ratios around an item's ``X / Y``: rows ``lo`` and ``hi`` of
    ``_RoomTrees.balanced`` and the balanced room the item needs in each (``lo = -1``:
    a text-only item, which the token-room tree decides alone)."""

    lo: int
    hi: int
    need_lo: int
    need_hi: int


@njit
def _empty_room_trees(leaves, capacity, vcapacity):
    """``_RoomTrees`` over ``leaves`` unopened bins: every room full."""
    full_x = capacity * vcapacity
    balanced = np.empty((_RATIO_TREES, 2 * leaves), np.int64)
    for q in range(_RATIO_TREES):
        balanced[q, :] = _balanced(full_x, full_x, q - _RATIO_STEPS)
    token = np.full(2 * leaves, capacity, np.int64)
    vision = np.full(2 * leaves, vcapacity, np.int64)
    return _RoomTrees(token, vision, balanced, leaves)


@njit
def _grown_room_trees(trees, capacity, vcapacity):
    """``trees`` over twice as many leaves: the bins kept as the first half, the rest unopened."""
    leaves = trees.leaves
    grown = _empty_room_trees(2 * leaves, capacity, vcapacity)
    first = grown.leaves
    grown.token[first : first + leaves] = trees.token[leaves:]
    grown.vision[first : first + leaves] = trees.vision[leaves:]
    _rebuild_max_tree(grown.token, first)
    _rebuild_max_tree(grown.vision, first)
    for q in range(_RATIO_TREES):
        grown.balanced[q, first : first + leaves] = trees.balanced[q, leaves:]
        _rebuild_max_tree(grown.balanced[q], first)
    return grown


@njit
def _ratio_window(s, v, capacity, vcapacity):
    """The ``_RatioWindow`` of an item of token size ``s`` and vision size ``v``: the grid
    ratios ``2**k <= X / Y < 2**(k+1)`` (clamped to ±_RATIO_STEPS), ``X = s · vcapacity``,
    ``Y = v · capacity``."""
    if v <= 0:
        return _RatioWindow(-1, -1, 0, 0)
    big_x = s * vcapacity
    big_y = v * capacity
    k = -_RATIO_STEPS
    while k < _RATIO_STEPS and _ratio_at_most(big_x, big_y, k + 1):
        k += 1
    lo = k + _RATIO_STEPS
    hi = min(lo + 1, _RATIO_TREES - 1)
    return _RatioWindow(lo, hi, _balanced(big_x, big_y, k), _balanced(big_x, big_y, hi - _RATIO_STEPS))


@njit
def _first_leaf_holding(trees, vroom, s, v, window, stack):
    """The tree node (``leaves + bin``) of the lowest-numbered bin whose rooms hold ``(s, v)``,
    else -1: depth first, left to right, pruning every subtree whose max rooms (token, vision,
    balanced for ``window``) cannot hold the item. ``vroom`` (int64 [bins]) is each bin's exact
    vision room; ``stack`` (int64 [>= 2·depth]) is scratch space."""
    lo, hi, need_lo, need_hi = window
    top = 0
    stack[0] = 1
    while top >= 0:
        node = stack[top]
        top -= 1
        if trees.token[node] < s or trees.vision[node] < v:
            continue
        if lo >= 0 and (trees.balanced[lo, node] < need_lo or trees.balanced[hi, node] < need_hi):
            continue
        if node >= trees.leaves:
            if vroom[node - trees.leaves] >= v:
                return node
            continue
        top += 1
        stack[top] = 2 * node + 1  # right after left
        top += 1
        stack[top] = 2 * node
    return -1


@njit
def _set_bin_rooms(trees, b, rem, vrem, capacity, vcapacity):
    """Write bin ``b``'s token room ``rem`` (-1: the bin is closed) and vision room ``vrem``
    into every tree of ``trees``."""
    _max_tree_set(trees.token, trees.leaves, b, rem)
    _max_tree_set(trees.vision, trees.leaves, b, vrem if rem >= 0 else -1)
    x = rem * vcapacity if rem >= 0 else -1
    y = vrem * capacity if rem >= 0 else -1
    for q in range(_RATIO_TREES):
        _max_tree_set(trees.balanced[q], trees.leaves, b, _balanced(x, y, q - _RATIO_STEPS))


@njit
def first_fit_2d(sizes, vsizes, capacity, vcapacity, max_items):
    """First fit on two budgets: each item goes to the lowest-numbered bin that holds
    it in both budgets.

    Bins are leaves of max trees (unopened bins are empty; the trees double as bins
    open); the search goes depth first, left to right, and prunes a subtree unless
    it may hold the item. With ``x = room · vcapacity`` and ``y = vroom · capacity``
    (both budgets on one scale) a bin holds an item ``(X, Y)`` iff ``x >= X`` and
    ``y >= Y``, which implies ``min(x, r·y) >= min(X, r·Y)`` for every ratio ``r``;
    max trees of that *balanced room* for the grid ratios ``r = 2**k`` either side of
    ``X / Y`` prune bins full in one budget, which max trees of each room alone
    cannot see (any ratio gives a necessary condition, so the search stays exact).
    Worst case O(bins) per item when many bins nearly fit; typically O(log bins)
    (1M items in ~1.5 s; ``best_fit_2d`` is faster). Text-only items (``Y = 0``) need
    only the token-room tree, which is exact for them. Needs
    ``capacity · vcapacity < 2**56`` (int64 headroom for the ratios).
    """
    n = sizes.shape[0]
    trees = _empty_room_trees(1024, capacity, vcapacity)
    vroom = np.full(max(n, 1), vcapacity, np.int64)
    count = np.zeros(max(n, 1), np.int64)
    bin_of = np.empty(n, np.int64)
    stack = np.empty(128, np.int64)
    nbins = 0
    for j in range(n):
        if nbins == trees.leaves:  # every leaf is a bin: double, keeping the leaves
            trees = _grown_room_trees(trees, capacity, vcapacity)
        s = sizes[j]
        v = vsizes[j]
        node = _first_leaf_holding(trees, vroom, s, v, _ratio_window(s, v, capacity, vcapacity), stack)
        b = node - trees.leaves
        count[b] += 1
        rem = trees.token[node] - s
        vroom[b] -= v
        if max_items > 0 and count[b] >= max_items:
            rem = -1
        _set_bin_rooms(trees, b, rem, vroom[b], capacity, vcapacity)
        bin_of[j] = b
        if b >= nbins:
            nbins = b + 1
    return bin_of, nbins


@njit
def next_fit_2d(sizes, vsizes, capacity, vcapacity, max_items):
    """Next fit on two budgets: open a new bin when an item does not fit either budget."""
    n = sizes.shape[0]
    bin_of = np.empty(n, np.int64)
    b = -1
    rem = -1
    vrem = -1
    cnt = 0
    for j in range(n):
        s = sizes[j]
        v = vsizes[j]
        if s > rem or v > vrem or (max_items > 0 and cnt >= max_items):
            b += 1
            rem = capacity
            vrem = vcapacity
            cnt = 0
        rem -= s
        vrem -= v
        cnt += 1
        bin_of[j] = b
    return bin_of, b + 1


# d budgets (tokens, then any others: vision patches, audio frames). An item is a row of
# ``sizes`` (int64 ``[m, d]``, every entry >= 0, tokens >= 1); ``capacities`` is int64 ``[d]``.
# A bin holds an item iff it has room for it in every budget. Used by plan_packs with an audio
# budget; the one- and two-budget kernels above are unchanged.


@njit
def _leaf_holding_all(trees, leaves, start, item):
    """Smallest leaf index >= ``start`` whose value in every max tree ``trees[k]`` is >= ``item[k]``,
    else -1. Each tree's internal nodes are the max of their children, so a node below ``item`` in
    any budget cannot hold it; one that passes every budget may still not (the maxima can come from
    different leaves), hence the search backtracks: exact, depth first, left to right."""
    d = trees.shape[0]
    i = start + leaves
    while True:
        holds = True
        for k in range(d):
            if trees[k, i] < item[k]:
                holds = False
                break
        if holds:
            if i >= leaves:
                return i - leaves
            i = 2 * i
            continue
        while i & 1:  # climb while we are a right child
            i >>= 1
        if i == 0:
            return -1
        i += 1  # the next subtree to the right


@njit
def _max_trees_set(trees, leaves, leaf, values):
    for k in range(trees.shape[0]):
        _max_tree_set(trees[k], leaves, leaf, values[k])


@njit
def _best_in_bucket(first, nxt, rooms, item):
    """The bin of the bucket that starts at ``first`` holding ``item`` in every budget but the first,
    with the least room in the second budget (then the third, ...; then the lowest-numbered); -1 when none does."""
    d = rooms.shape[1]
    b = -1
    k = first
    while k >= 0:
        fits = True
        for q in range(1, d):
            if rooms[k, q] < item[q]:
                fits = False
                break
        if fits:
            better = b < 0 or k < b  # equal rooms: the lowest-numbered bin
            if b >= 0:
                for q in range(1, d):
                    if rooms[k, q] != rooms[b, q]:
                        better = rooms[k, q] < rooms[b, q]
                        break
            if better:
                b = k
        k = nxt[k]
    return b


@njit
def _unlink(trees, leaves, head, nxt, prv, rooms, top, b, room):
    """Take bin ``b`` out of the bucket of token room ``room`` and refresh the bucket's maxima."""
    if prv[b] >= 0:
        nxt[prv[b]] = nxt[b]
    else:
        head[room] = nxt[b]
    if nxt[b] >= 0:
        prv[nxt[b]] = prv[b]
    top[:] = -1
    k = head[room]
    while k >= 0:
        for q in range(1, rooms.shape[1]):
            if rooms[k, q] > top[q - 1]:
                top[q - 1] = rooms[k, q]
        k = nxt[k]
    _max_trees_set(trees, leaves, room, top)


@njit
def best_fit_nd(sizes, capacities, max_items):
    """Best fit on d budgets: each item goes to the open bin with the least token room that holds
    it in every budget (ties: the least room in the second budget, then the third, ..., then the
    lowest-numbered bin).

    As :func:`best_fit_2d`: open bins sit in buckets by remaining token room, and one max tree
    per other budget keeps, per token room, the largest remaining room of the bucket's bins; the
    least token room whose maxima can take the item is found in O(log capacity) and its bucket
    scanned (when no bin of it holds the item in every budget at once, the search goes on right
    of it).
    """
    n = sizes.shape[0]
    d = sizes.shape[1]
    capacity = capacities[0]
    leaves = 1
    while leaves < capacity + 1:
        leaves *= 2
    trees = np.full((d - 1, 2 * leaves), -1, np.int64)  # per token room: max room of each other budget
    head = np.full(capacity + 1, -1, np.int64)  # doubly linked bucket per token room
    nxt = np.full(max(n, 1), -1, np.int64)
    prv = np.full(max(n, 1), -1, np.int64)
    rooms = np.zeros((max(n, 1), d), np.int64)
    count = np.zeros(max(n, 1), np.int64)
    top = np.empty(d - 1, np.int64)
    bin_of = np.empty(n, np.int64)
    nbins = 0
    for j in range(n):
        item = sizes[j]
        s = item[0]
        b = -1
        room = -1
        start = s
        while start <= capacity:
            room = _leaf_holding_all(trees, leaves, start, item[1:])
            if room < 0:
                break
            b = _best_in_bucket(head[room], nxt, rooms, item)
            if b >= 0:
                break
            start = room + 1
        if b < 0:
            b = nbins
            nbins += 1
            for q in range(d):
                rooms[b, q] = capacities[q] - item[q]
        else:
            _unlink(trees, leaves, head, nxt, prv, rooms, top, b, room)
            for q in range(d):
                rooms[b, q] -= item[q]
        bin_of[j] = b
        count[b] += 1
        rem = rooms[b, 0]
        if rem > 0 and (max_items <= 0 or count[b] < max_items):
            prv[b] = -1
            nxt[b] = head[rem]
            if head[rem] >= 0:
                prv[head[rem]] = b
            head[rem] = b
            for q in range(1, d):
                if rooms[b, q] > trees[q - 1, rem + leaves]:
                    _max_tree_set(trees[q - 1], leaves, rem, rooms[b, q])
    return bin_of, nbins


@njit
def first_fit_nd(sizes, capacities, max_items):
    """First fit on d budgets: each item goes to the lowest-numbered bin that holds it in every
    budget. Bins are leaves of one max tree of remaining room per budget (unopened bins have full
    rooms); the search prunes a subtree whose maximum in some budget is too small. Exact; worst
    case O(bins) per item when many bins pass every maximum but hold it in no budget pair (the
    two-budget :func:`first_fit_2d` prunes those with balanced-room trees; this scan does not)."""
    n = sizes.shape[0]
    d = sizes.shape[1]
    leaves = 1
    while leaves < max(n, 1):
        leaves *= 2
    trees = np.empty((d, 2 * leaves), np.int64)
    for q in range(d):
        trees[q, :] = capacities[q]
    count = np.zeros(max(n, 1), np.int64)
    left = np.empty(d, np.int64)
    bin_of = np.empty(n, np.int64)
    nbins = 0
    for j in range(n):
        item = sizes[j]
        b = _leaf_holding_all(trees, leaves, 0, item)
        count[b] += 1
        for q in range(d):
            left[q] = trees[q, b + leaves] - item[q]
        if max_items > 0 and count[b] >= max_items:
            left[:] = -1
        _max_trees_set(trees, leaves, b, left)
        bin_of[j] = b
        if b >= nbins:
            nbins = b + 1
    return bin_of, nbins


@njit
def next_fit_nd(sizes, capacities, max_items):
    """Next fit on d budgets: open a new bin when an item does not fit some budget."""
    n = sizes.shape[0]
    d = sizes.shape[1]
    bin_of = np.empty(n, np.int64)
    rooms = np.full(d, -1, np.int64)
    b = -1
    cnt = 0
    for j in range(n):
        fits = not (max_items > 0 and cnt >= max_items) and b >= 0
        if fits:
            for q in range(d):
                if sizes[j, q] > rooms[q]:
                    fits = False
                    break
        if not fits:
            b += 1
            rooms[:] = capacities
            cnt = 0
        for q in range(d):
            rooms[q] -= sizes[j, q]
        cnt += 1
        bin_of[j] = b
    return bin_of, b + 1
