"""Rollout tries: the samples of a group that share token prefixes at several levels (a task's system
prompt, then turn one for some rollouts, turn two for fewer, ...), every shared segment laid out once.

A group's trie is found from the tokens alone (no template): the members' longest common prefix whose
tokens and targets agree (the one-level rule of :mod:`thdpack.batching.shared_prefix`) is a shared
segment when it holds at least ``min_prefix_len`` tokens; the members are then split by their next token
(and the target of the segment's last row) and each part of two or more members is searched again from
there; a part sharing fewer than ``min_prefix_len`` tokens is split further before giving up, and a
member alone ends in its own segment. Segments are laid out depth first, a group where its first member
was given, children in the order of their first member; each names its parent segment (any earlier
one), its position ids continue from its parent's::

    A = s s s t t a a     B = s s s t t b     C = s s s c c c       (min_prefix_len 2)
    stream    s s s | t t | a a | b | c c c
    parents   -1      0     1     1   0          positions 0 1 2 | 3 4 | 5 6 | 5 | 3 4 5

A group keeps its one-level layout (today's bytes) unless its trie lays out fewer slots once padded, or
when it declares its prefix (``prefix_len``); VLM groups keep one level. A trie deeper than
:data:`thdpack.attention.tree_mask.MAX_TRIE_DEPTH` shared levels is refused.
"""

from __future__ import annotations

import numpy as np
import torch

from thdpack.attention.tree_mask import MAX_TRIE_DEPTH
from thdpack.batching.prefix_tree import PrefixTree
from thdpack.common.align import round_up


def trie_segments(ids, labels, cu, group_of: np.ndarray, prefix: np.ndarray, keep_one_level: np.ndarray,
                  min_prefix_len: int, multiple: int, *, always: bool = False) -> dict | None:
    """The stream's segments (as ``shared_prefix._segments``: ``src``, ``length``, ``parent``, ``sample``,
    ``pos0`` int64 ``[S]``; ``own``, ``pref`` int64 ``[n]``, ``pref`` here the parent of the sample's own
    segment) when some group's trie lays out fewer padded slots than its one-level layout; None when none
    does (build the one-level batch). ``ids``, ``labels``: the unshared stream (no padding), ``cu`` int64
    ``[n+1]`` its offsets; ``group_of`` int64 ``[n]`` numbered groups; ``prefix`` ``[n]`` the one-level
    prefixes (``group_prefixes``); ``keep_one_level`` bool ``[n]`` (a declared prefix). ``always``: the
    segments even when no group goes deeper (tests: equal to the one-level ones)."""
    layouts, deeper = group_layouts(ids, labels, cu, group_of, prefix, keep_one_level, min_prefix_len, multiple)
    if not (deeper or always):
        return None
    nodes, placed = [], set()
    for j, g in enumerate(group_of.tolist()):  # a group that shares where its first member was given
        trie = layouts[g]
        if all(parent < 0 for _, _, _, parent, _ in trie):
            nodes.append((j, 0, int(cu[j + 1] - cu[j]), -1, j))  # a sample laid out alone, where given
            continue
        if g in placed:
            continue
        placed.add(g)
        base = len(nodes)
        nodes += [(i, start, length, parent if parent < 0 else parent + base, sample)
                  for i, start, length, parent, sample in trie]
    return _segment_arrays(nodes, cu, group_of.size)


def group_layouts(ids, labels, cu, group_of: np.ndarray, prefix: np.ndarray, keep_one_level: np.ndarray,
                  min_prefix_len: int, multiple: int) -> tuple[dict, bool]:
    """``({group number: nodes}, deeper)``: each group's layout as :func:`trie_segments` picks it (its trie where
    that lays out fewer padded slots than one level), nodes ``(src sample, start, length, parent, sample)``;
    ``deeper``: some group's trie was picked. Arguments as :func:`trie_segments`."""
    layouts, deeper = {}, False
    for members in _groups_in_order(group_of):
        trie = _one_level(cu, members, int(prefix[members[0]]))
        if members.size > 1 and not keep_one_level[members[0]]:
            found = []
            _emit(ids, labels, cu, members.tolist(), 0, -1, min_prefix_len, found, 0)
            if _slots(found, multiple) < _slots(trie, multiple):
                trie, deeper = found, True
        layouts[int(group_of[members[0]])] = trie
    return layouts, deeper


def member_layout(ids, labels, cu, group_of: np.ndarray, prefix: np.ndarray, keep_one_level: np.ndarray,
                  min_prefix_len: int, multiple: int) -> tuple[np.ndarray, np.ndarray]:
    """``(shared, slots)``, int64 ``[n]``: for every sample, its tokens that earlier members of its group lay out
    (its group's layout as :func:`group_layouts` picks it, members in the order given), and the padded slots it
    adds: the segments it is the first member under, each ``round_up(length, multiple)``. A group's slots sum to
    its layout's; with one level a member after the first shares the prefix, the first adds it. The planner's
    budget (:class:`thdpack.planning.prefix_budget.SharedLayout`). Arguments as :func:`trie_segments`."""
    lens = (cu[1:] - cu[:-1]).astype(np.int64)
    added = np.zeros(lens.size, np.int64)
    slots = np.zeros(lens.size, np.int64)
    layouts, _ = group_layouts(ids, labels, cu, group_of, prefix, keep_one_level, min_prefix_len, multiple)
    for nodes in layouts.values():
        for src, _, length, _, _ in nodes:  # a node's src is the first member below it: the one that adds it
            added[src] += length
            slots[src] += round_up(length, multiple)
    return lens - added, slots


def _groups_in_order(group_of: np.ndarray) -> list[np.ndarray]:
    """Each group's members (ascending), groups in the order of their first member."""
    out = {}
    for j, g in enumerate(group_of.tolist()):
        out.setdefault(g, []).append(j)
    return [np.asarray(m, np.int64) for m in out.values()]


def _one_level(cu, members: np.ndarray, p: int) -> list[tuple]:
    """Nodes ``(sample of src, start, length, parent, sample or -1)`` of the one-level layout."""
    lens = (cu[members + 1] - cu[members]).tolist()
    if p == 0:
        return [(int(j), 0, n, -1, int(j)) for j, n in zip(members, lens)]
    return [(int(members[0]), 0, p, -1, -1)] + [(int(j), p, n - p, 0, int(j)) for j, n in zip(members, lens)]


def _emit(ids, labels, cu, members: list, start: int, parent: int, min_len: int, out: list, depth: int) -> None:
    """Append the nodes of ``members`` (sharing their first ``start`` tokens, under node ``parent``) to ``out``."""
    if len(members) == 1:
        j = members[0]
        out.append((j, start, int(cu[j + 1] - cu[j]) - start, parent, j))
        return
    shared = _common_length(ids, labels, cu, members, start)
    if shared < min_len:  # not worth a segment here: its parts may share more
        for part in _split(ids, labels, cu, members, start + shared, shared > 0):
            _emit(ids, labels, cu, part, start, parent, min_len, out, depth)
        return
    if depth == MAX_TRIE_DEPTH:
        raise ValueError(f"samples {members[:8]} share prefixes more than MAX_TRIE_DEPTH={MAX_TRIE_DEPTH} levels "
                         "deep; thdpack packs tries up to that depth: raise min_prefix_len or split the group")
    node = len(out)
    out.append((members[0], start, shared, parent, -1))
    for part in _split(ids, labels, cu, members, start + shared, True):
        _emit(ids, labels, cu, part, start + shared, node, min_len, out, depth + 1)


def _common_length(ids, labels, cu, members: list, start: int) -> int:
    """Tokens from ``start`` on which ``members`` agree, their targets of rows ``start .. start+L-2`` too."""
    m = np.asarray(members)
    room = int((cu[m + 1] - cu[m]).min()) - start
    rows = (cu[m] + start)[:, None] + np.arange(room)[None, :]
    tok_ok = (ids[rows] == ids[rows[:1]]).all(0)
    tok_end = int(np.argmin(tok_ok)) if not tok_ok.all() else room
    lab_ok = (labels[rows[:, : max(room - 1, 0)]] == labels[rows[:1, : max(room - 1, 0)]]).all(0)
    lab_end = int(np.argmin(lab_ok)) + 1 if not lab_ok.all() else room
    return min(tok_end, lab_end)


def _split(ids, labels, cu, members: list, at: int, by_target: bool) -> list[list]:
    """``members`` parted by their token at ``at`` (and the target of row ``at - 1`` when ``by_target``); a
    member ending at ``at`` is a part alone. Parts in the order of their first member."""
    parts = {}
    for j in members:
        ended = cu[j] + at >= cu[j + 1]
        key = ("end", j) if ended else (int(ids[cu[j] + at]), int(labels[cu[j] + at - 1]) if by_target else 0)
        parts.setdefault(key, []).append(j)
    return list(parts.values())


def _slots(nodes: list, multiple: int) -> int:
    return sum(round_up(length, multiple) for _, _, length, _, _ in nodes)


def _segment_arrays(nodes: list, cu, n: int) -> dict:
    src = np.asarray([cu[j] + start for j, start, _, _, _ in nodes], np.int64)
    arrays = {k: np.asarray([node[i] for node in nodes], np.int64)
              for i, k in ((2, "length"), (3, "parent"), (4, "sample"), (1, "pos0"))}
    own = np.full(n, -1, np.int64)
    own[arrays["sample"][arrays["sample"] >= 0]] = np.flatnonzero(arrays["sample"] >= 0)
    return {"src": src, **arrays, "own": own, "pref": arrays["parent"][own]}


def trie_prefix_tree(flat, prefix: np.ndarray, segs: dict, cu_padded: np.ndarray, ignore: int) -> PrefixTree:
    """The :class:`PrefixTree` of a trie's stream (``prefix`` unused: each sample's shared tokens are its own
    segment's ``pos0``): every sample's rows along its path from the root, the target table."""
    cu = flat.cu_seqlens.numpy().astype(np.int64)
    lens = cu[1:] - cu[:-1]
    own, parent, length, pos0 = segs["own"], segs["parent"], segs["length"], segs["pos0"]
    rows = np.empty(int(cu[-1]), np.int64)
    for j in range(lens.size):
        s = int(own[j])
        while s >= 0:
            rows[cu[j] + pos0[s]: cu[j] + pos0[s] + length[s]] = cu_padded[s] + np.arange(length[s])
            s = int(parent[s])
    shared = pos0[own]
    sample_of = np.repeat(np.arange(lens.size), lens)
    flat_labels = flat.labels.numpy()
    targets = np.flatnonzero(flat.loss_mask.numpy())
    up = parent[own]
    has_first = (shared > 0) & (lens > shared)
    first_rows = np.where(has_first, cu_padded[np.maximum(up, 0)] + length[np.maximum(up, 0)] - 1, -1)
    first_labels = np.where(has_first, flat_labels[np.where(has_first, cu[:-1] + shared - 1, 0)], ignore)
    as_t = torch.from_numpy
    return PrefixTree(
        parents=as_t(parent), segment_sample=as_t(segs["sample"]), sample_segment=as_t(own),
        prefix_lens=as_t(shared.astype(np.int64)), sample_lens=as_t(lens), first_rows=as_t(first_rows.astype(np.int64)),
        first_labels=as_t(first_labels.astype(np.int64)), unshared_rows=as_t(rows),
        target_rows=as_t(rows[targets]), target_labels=as_t(flat_labels[targets].astype(np.int64)),
        target_samples=as_t(sample_of[targets].astype(np.int64)),
    )
