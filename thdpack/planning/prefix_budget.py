"""Shared prefixes against the pack budget: a group whose members share a prefix of ``p`` tokens is laid
out once as ``[prefix][member 1][member 2]...`` (``build_thd_batch(share_prefix=...)``), so it takes
``round_up(p) + Σ round_up(Lⱼ − p)`` slots of a pack, not ``Σ round_up(Lⱼ)``.

``shared_prefix`` (``plan_packs(..., groups=..., shared_prefix=...)``) is int ``[n]``: the prefix each
sample shares with its group, the same for every member of a group, 0 for a group laid out unshared.
It is what the builder will share (``thdpack.batching.shared_prefix.group_prefixes`` computes it from
the samples; an offline build would store it per row). A group of one sample shares nothing.

A group laid out as a trie (shared segments at several levels: ``thdpack.batching.trie``) takes the slots of
its segments; :class:`SharedLayout` gives the planners each member's share of them (the collator's
``share_prefix`` plans so). Internally every shared prefix is a layout (:func:`as_layout`: one level is the
trie of one shared segment), counted exactly for a group whole in a pack (:func:`piece_shared`); a group over
several packs counts its one-level prefix once in each of them (an upper bound on what a trie of its members
there lays out).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thdpack.common.align import integer_array, round_up


@dataclass(frozen=True)
class SharedLayout:
    """What each sample adds to its group's layout when shared segments are laid out once (one level or a trie),
    for ``plan_packs(..., groups=..., shared_prefix=SharedLayout(...))``
    (:func:`thdpack.batching.trie.member_layout` computes it as the builder will lay the group out).

    Attributes:
        shared: int ``[n]`` tokens of each sample that earlier members of its group (in input order) lay out.
        slots: int ``[n]`` padded slots each sample adds (its new segments, each aligned); a group's sum is
            its layout's size.
        prefix: int ``[n]`` the group's one-level prefix (:func:`thdpack.batching.shared_prefix.group_prefixes`),
            counted once in each pack of a group over several packs; None: 0 (nothing shared there).
    """

    shared: np.ndarray
    slots: np.ndarray
    prefix: np.ndarray | None = None

    @classmethod
    def joined(cls, parts: list) -> "SharedLayout":
        """Layouts of disjoint sets of groups one after another (each keeps its members' shares)."""
        return cls(*(np.concatenate([np.zeros_like(p.shared) if getattr(p, name) is None else getattr(p, name)
                                     for p in parts]).astype(np.int64) for name in ("shared", "slots", "prefix")))

    def subset(self, rows: np.ndarray) -> "SharedLayout":
        """The layout of the samples ``rows`` (whole groups, in input order)."""
        return SharedLayout(self.shared[rows], self.slots[rows], None if self.prefix is None else self.prefix[rows])

    def checked(self, lengths: np.ndarray) -> "SharedLayout":
        """Int64 copies; ``ValueError`` naming the sample unless ``0 <= shared <= length`` and
        ``slots >= length - shared``."""
        shared = np.asarray(integer_array(self.shared, "SharedLayout.shared"), np.int64)
        slots = np.asarray(integer_array(self.slots, "SharedLayout.slots"), np.int64)
        if shared.shape != lengths.shape or slots.shape != lengths.shape:
            raise ValueError(f"SharedLayout needs one entry per sample ({lengths.size}) in shared and slots, got "
                             f"{shared.shape} and {slots.shape}")
        prefix = np.zeros_like(shared) if self.prefix is None else \
            np.asarray(integer_array(self.prefix, "SharedLayout.prefix"), np.int64)
        if prefix.shape != lengths.shape:
            raise ValueError(f"SharedLayout.prefix needs one entry per sample ({lengths.size}), got {prefix.shape}")
        bad = np.flatnonzero((shared < 0) | (shared > lengths) | (slots < lengths - shared) | (prefix < 0)
                             | (prefix > lengths))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"SharedLayout: sample {i} (length {int(lengths[i])}) has shared={int(shared[i])}, "
                             f"slots={int(slots[i])} and prefix={int(prefix[i])}; need 0 <= shared <= length, "
                             "slots >= length - shared and 0 <= prefix <= length")
        return SharedLayout(shared, slots, prefix)


def check_shared_prefix(shared_prefix, lengths: np.ndarray, gid: np.ndarray, group_of: np.ndarray) -> np.ndarray:
    """int64 ``[n]`` checked ``shared_prefix`` (0 for groups of one); ``ValueError`` naming the sample or the
    group unless each is an integer in ``[0, length]``, the same for every member of a group."""
    prefix = np.asarray(integer_array(shared_prefix, "shared_prefix", " (one prefix length per sample)"))
    if prefix.shape != lengths.shape:
        raise ValueError(f"shared_prefix must hold one prefix length per sample ({lengths.size}), got shape "
                         f"{prefix.shape}")
    prefix = prefix.astype(np.int64)
    bad = np.flatnonzero((prefix < 0) | (prefix > lengths))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"shared_prefix[{i}] is {int(prefix[i])}, outside [0, {int(lengths[i])}] (sample {i}'s length)")
    num_groups = int(group_of.max()) + 1 if group_of.size else 0
    low = np.full(num_groups, np.iinfo(np.int64).max)
    np.minimum.at(low, group_of, prefix)
    high = np.zeros(num_groups, np.int64)
    np.maximum.at(high, group_of, prefix)
    differs = np.flatnonzero(low != high)
    if differs.size:
        members = np.flatnonzero(group_of == differs[0])
        shown = ", ".join(map(str, members[:8].tolist())) + (", ..." if members.size > 8 else "")
        raise ValueError(f"group {int(gid[members[0]])} (samples {shown}) has shared_prefix values "
                         f"{sorted(set(prefix[members].tolist()))}; a group's members share one prefix (or 0)")
    size = np.bincount(group_of, minlength=num_groups)
    return np.where(size[group_of] > 1, prefix, 0)


def as_layout(shared_prefix, lengths: np.ndarray, gid: np.ndarray, group_of: np.ndarray,
              align: int) -> SharedLayout | None:
    """The checked :class:`SharedLayout` of a planner's ``shared_prefix`` argument: None, a layout, or int
    ``[n]`` one-level prefixes (:func:`check_shared_prefix`), laid out as ``[prefix][member 1][member 2]...``:
    the group's first member (input order) adds ``round_up(p) + round_up(L - p)`` slots, each other member
    ``round_up(L - p)`` and shares ``p`` tokens."""
    if shared_prefix is None:
        return None
    if isinstance(shared_prefix, SharedLayout):
        return shared_prefix.checked(lengths)
    prefix = check_shared_prefix(shared_prefix, lengths, gid, group_of)
    first = np.zeros(lengths.size, bool)
    first[np.unique(group_of, return_index=True)[1]] = True
    return one_level_layout(lengths, prefix, first, align)


def one_level_layout(lengths: np.ndarray, prefix: np.ndarray, first: np.ndarray, align: int) -> SharedLayout:
    """One-level prefixes (int ``[n]``) as a :class:`SharedLayout`: ``first`` (bool ``[n]``) marks each group's
    first member, which adds ``round_up(p) + round_up(L - p)`` slots; every other member adds ``round_up(L - p)``
    and shares ``p`` tokens."""
    slots = round_up(lengths - prefix, align) + np.where(first, round_up(prefix, align), 0)
    return SharedLayout(np.where(first, 0, prefix).astype(np.int64), slots.astype(np.int64),
                        np.asarray(prefix, np.int64))


def group_slots(layout: SharedLayout, group_of: np.ndarray) -> np.ndarray:
    """int64 ``[G]`` slots of every group laid out with its shared segments once."""
    num_groups = int(group_of.max()) + 1 if group_of.size else 0
    return np.bincount(group_of, weights=layout.slots, minlength=num_groups).astype(np.int64)


def piece_shared(sample_index: np.ndarray, pack_offsets: np.ndarray, group_of: np.ndarray,
                 layout: SharedLayout) -> np.ndarray:
    """int64 ``[m]`` tokens of each piece laid out by an earlier piece of its pack (``PackPlan.shared_length``):
    for a group whole in the pack, its layout's ``shared``; for a group over several packs, its one-level prefix
    for every member but the first of the group in that pack (0 for that one)."""
    pack_of = np.repeat(np.arange(len(pack_offsets) - 1), np.diff(pack_offsets))
    num_groups = int(group_of.max()) + 1 if group_of.size else 1
    key = pack_of * num_groups + group_of[sample_index]
    prefix = np.zeros(sample_index.size, np.int64) if layout.prefix is None else layout.prefix[sample_index].copy()
    _, first, inverse, count = np.unique(key, return_index=True, return_inverse=True, return_counts=True)
    prefix[first] = 0  # (a sort: key reaches packs x groups, far too many for a bincount)
    whole = count[inverse.reshape(-1)] == np.bincount(group_of, minlength=num_groups)[group_of[sample_index]]
    return np.where(whole, layout.shared[sample_index], prefix)
