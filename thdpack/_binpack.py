"""Bin-packing kernels on integer sizes (compiled with numba when available).

Every kernel takes item sizes in *placement order* and returns, for each item,
the bin it went to, plus the number of bins opened. Bins are numbered in the
order they were opened. Sizes must satisfy ``1 <= size <= capacity``.

``max_items <= 0`` means no limit on items per bin.
"""

from __future__ import annotations

import numpy as np

from thdpack._jit import njit


@njit
def _tree_add(tree, leaves, leaf, delta):
    i = leaf + leaves
    while i >= 1:
        tree[i] += delta
        i >>= 1


@njit
def _first_present_at_or_after(tree, leaves, start):
    """Smallest leaf index >= start whose count is non-zero, else -1.

    ``tree`` is a sum tree over ``leaves`` leaves stored at ``tree[leaves:]``.
    """
    i = start + leaves
    if tree[i] > 0:
        return start
    while True:
        while i & 1:  # climb while we are a right child
            i >>= 1
        if i == 0:
            return -1
        i += 1  # step to the right sibling
        if tree[i] > 0:
            break
    while i < leaves:  # descend to the leftmost non-empty leaf
        i = 2 * i
        if tree[i] == 0:
            i += 1
    return i - leaves


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
        room = _first_present_at_or_after(tree, leaves, s)
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
        tree[i] = rem
        i >>= 1
        while i >= 1:
            left = tree[2 * i]
            right = tree[2 * i + 1]
            tree[i] = left if left > right else right
            i >>= 1
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
