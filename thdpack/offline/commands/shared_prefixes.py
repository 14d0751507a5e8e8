"""``share_prefix: true`` builds: the token prefix each group of a build (a preference pair, a ``group_column``
group) lays out once, found from the tokenized rows before planning.

A group's prefix is its members' longest common token prefix, ended early where their targets would differ
(a member's token ``t >= 1`` a target in one and not another: row ``t - 1`` would carry two labels), the rule
of :func:`thdpack.batching.shared_prefix.group_prefixes`. For preference rows it is the prompt's tokens or
more (the chosen and rejected answers may begin alike), and it stays correct where a token merges across the
prompt / answer boundary (TRL's caveat: there the prompt's token count is not a common prefix). It is kept
under the same minimum and padding rule as ``group_prefixes``: at least ``min_prefix_len`` tokens, two or more
members, and ``round_up(p) + Σ round_up(Lⱼ − p) < Σ round_up(Lⱼ)``; else 0 (the group is laid out unshared).
The loader (``PackedRowCollator(share_prefix=True)``) declares these prefixes to ``build_thd_batch``, which
checks them against the tokens and arrives at the same layout, so every pack fits ``pack_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thdpack.batching.builder import build_thd_batch
from thdpack.batching.shared_prefix import group_shares
from thdpack.common.align import round_up
from thdpack.offline.store.gather import CHUNK_TOKENS, RowPieces, group_boundaries
from thdpack.planning.prefix_budget import SharedLayout, one_level_layout

TRIE_MIN_MEMBERS = 3  # a pair's trie is its one-level prefix: only larger groups can share deeper


@dataclass(frozen=True)
class TrieShares:
    """A ``share_prefix`` build some of whose groups the loader lays out as tries (shared segments at several
    levels): ``layout`` the planner's budget per sequence (:class:`thdpack.planning.prefix_budget.SharedLayout`,
    its ``prefix`` the one-level prefixes), ``stored`` int64 ``[sequences]`` the ``prefix_len`` column: the
    one-level prefix on every member of a one-level group (declared to the loader's build, as before), and on a
    trie group's members the tokens earlier members lay out (0 on the first; the loader declares nothing there and
    its build finds the trie: the same rule on the same samples)."""

    layout: SharedLayout
    stored: np.ndarray

    @property
    def one_level(self) -> np.ndarray:
        """int64 ``[sequences]`` each sequence's group's one-level prefix."""
        return self.layout.prefix

    def take(self, index: np.ndarray) -> "TrieShares":
        """The shares of the sequences ``index`` (whole groups, in order; a group may come twice: a mixture's
        repeated unit)."""
        return TrieShares(self.layout.subset(index), self.stored[index])

    @classmethod
    def joined(cls, parts: list) -> "TrieShares":
        """Sources' shares one after another (their groups apart)."""
        return cls(SharedLayout.joined([p.layout for p in parts]), np.concatenate([p.stored for p in parts]))


def one_level_shares(lengths: np.ndarray, group: np.ndarray, usable: np.ndarray, align: int,
                     prefix: np.ndarray) -> TrieShares:
    """The :class:`TrieShares` of one-level prefixes (``prefix``, :func:`common_prefixes`): a group's first usable
    member adds the prefix, every other shares it."""
    seqs = np.flatnonzero(usable & (lengths > 0))
    first = np.zeros(lengths.size, bool)
    if seqs.size:
        first[seqs[np.unique(group[seqs], return_index=True)[1]]] = True
    return TrieShares(one_level_layout(lengths, prefix, first, align), prefix.astype(np.int64))


def common_prefixes(table, targets: str, lengths: np.ndarray, group: np.ndarray, usable: np.ndarray, align: int,
                    min_prefix_len: int) -> np.ndarray:
    """int64 ``[sequences]`` the prefix each tokenized sequence shares with its group (0: unshared, and for
    sequences not ``usable``).

    Args:
        table: the tokenized rows (``pyarrow.Table`` with ``input_ids`` and the ``targets`` column), one
            row per sequence.
        targets: ``loss_mask`` or ``labels``.
        lengths: int64 ``[sequences]`` tokens of each sequence.
        group: int64 ``[sequences]`` group number of each sequence.
        usable: bool ``[sequences]`` the sequences to be planned (the others count for nothing).
        align: the per-sample (here: per-segment) alignment multiple.
        min_prefix_len: the shortest prefix shared.
    """
    seqs = np.flatnonzero(usable & (lengths > 0))
    prefix = np.zeros(lengths.size, np.int64)
    if seqs.size == 0:
        return prefix
    g = group[seqs]
    order = np.argsort(g, kind="stable")
    first = np.unique(g[order], return_index=True)[1]
    ref_of_group = np.zeros(int(g.max()) + 1, np.int64)
    ref_of_group[g[order][first]] = seqs[order][first]  # each group's first usable member
    ref = ref_of_group[g]
    lcp = _prefix_with(table, targets, seqs, ref, np.minimum(lengths[seqs], lengths[ref]))
    low = np.full(ref_of_group.size, np.iinfo(np.int64).max)
    np.minimum.at(low, g, lcp)  # the common prefix of a set: the least one with any one member
    p = low[g]
    size = np.bincount(g, minlength=ref_of_group.size)
    lens = lengths[seqs]
    shared = np.bincount(g, weights=round_up(lens - p, align), minlength=ref_of_group.size)
    shared[g[order][first]] += round_up(p[order][first], align)
    alone = np.bincount(g, weights=round_up(lens, align), minlength=ref_of_group.size)
    keep = (size[g] > 1) & (p >= min_prefix_len) & (shared[g] < alone[g])
    prefix[seqs] = np.where(keep, p, 0)
    return prefix


def common_prefixes_of_dataset(shared: tuple, *args) -> np.ndarray:
    """:func:`common_prefixes` with ``shared = (dataset, targets)``, ``dataset`` a file-backed ``datasets.Dataset``
    of the tokenized rows (it pickles as its file paths: an ``engine: ray`` build's Ray task reads the tokens
    where it runs); ``args``: the other arguments, from ``lengths`` on."""
    dataset, targets = shared
    return common_prefixes(dataset.data.table, targets, *args)


def trie_shares(table, targets: str, lengths: np.ndarray, group: np.ndarray, usable: np.ndarray, align: int,
                min_prefix_len: int, prefix: np.ndarray) -> TrieShares | None:
    """The :class:`TrieShares` of a build whose groups of :data:`TRIE_MIN_MEMBERS` or more usable sequences the
    loader's build lays out deeper than their one-level prefixes (``prefix``, :func:`common_prefixes`); None when
    no group is (the one-level build, byte for byte). Each such group's layout is found as the loader finds it:
    ``thdpack.batching.shared_prefix.group_shares`` on its members as samples (tokens and ``targets``), in order.
    Arguments as :func:`common_prefixes`."""
    seqs = np.flatnonzero(usable & (lengths > 0))
    order = seqs[np.argsort(group[seqs], kind="stable")]
    members_of = np.split(order, np.flatnonzero(np.diff(group[order])) + 1) if order.size else []
    base = one_level_shares(lengths, group, usable, align, prefix)
    shared, slots, stored = base.layout.shared.copy(), base.layout.slots.copy(), base.stored.copy()
    ids, tgt = table.column("input_ids"), table.column(targets)
    deeper = False
    for members in members_of:
        if members.size < TRIE_MIN_MEMBERS:
            continue
        samples = [{"input_ids": np.asarray(ids[int(j)].values), targets: np.asarray(tgt[int(j)].values), "g": 0}
                   for j in members]
        layout = group_shares(build_thd_batch(samples), samples, "g", min_prefix_len, align)
        if int(layout.slots.sum()) < int(slots[members].sum()):  # the loader's build picks the trie
            shared[members], slots[members], stored[members] = layout.shared, layout.slots, layout.shared
            deeper = True
    if not deeper:
        return None
    return TrieShares(SharedLayout(shared, slots, prefix.astype(np.int64)), stored)


def trie_shares_of_dataset(shared: tuple, *args) -> TrieShares | None:
    """:func:`trie_shares` with ``shared = (dataset, targets)`` (as :func:`common_prefixes_of_dataset`)."""
    dataset, targets = shared
    return trie_shares(dataset.data.table, targets, *args)


def _prefix_with(table, targets: str, seqs: np.ndarray, ref: np.ndarray, span: np.ndarray) -> np.ndarray:
    """int64 ``[k]``: how many of the first ``span[i]`` tokens sequence ``seqs[i]`` shares with sequence
    ``ref[i]`` (tokens equal, and for tokens ``t >= 1`` the target equal too), read :data:`CHUNK_TOKENS` at a
    time."""
    ids, tgt = RowPieces(table, "input_ids"), RowPieces(table, targets)
    out = np.zeros(seqs.size, np.int64)
    cuts = group_boundaries(span, CHUNK_TOKENS)
    for a, b in zip(cuts[:-1], cuts[1:]):
        rows, other, n = seqs[a:b], ref[a:b], span[a:b]
        zero = np.zeros(rows.size, np.int64)
        target_differs = tgt.gather(rows, zero, n) != tgt.gather(other, zero, n)
        target_differs[(np.cumsum(n) - n)[n > 0]] = False  # a sample's first token is never a target
        out[a:b] = _first_true((ids.gather(rows, zero, n) != ids.gather(other, zero, n)) | target_differs, n)
    return out


def _first_true(flags: np.ndarray, n: np.ndarray) -> np.ndarray:
    """int64 ``[k]`` the first position where ``flags`` (bool, ``k`` segments of ``n`` values back to back)
    is true within each segment; ``n`` where it never is."""
    start = np.cumsum(n) - n
    seg = np.repeat(np.arange(n.size), n)
    hit = np.flatnonzero(flags)
    out = n.astype(np.int64).copy()
    np.minimum.at(out, seg[hit], hit - start[seg[hit]])
    return out
