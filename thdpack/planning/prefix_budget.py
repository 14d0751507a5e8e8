"""Shared prefixes against the pack budget: a group whose members share a prefix of ``p`` tokens is laid
out once as ``[prefix][member 1][member 2]...`` (``build_thd_batch(share_prefix=...)``), so it takes
``round_up(p) + Σ round_up(Lⱼ − p)`` slots of a pack, not ``Σ round_up(Lⱼ)``.

``shared_prefix`` (``plan_packs(..., groups=..., shared_prefix=...)``) is int ``[n]``: the prefix each
sample shares with its group, the same for every member of a group, 0 for a group laid out unshared.
It is what the builder will share (``thdpack.batching.shared_prefix.group_prefixes`` computes it from
the samples; an offline build would store it per row). A group of one sample shares nothing.

A group laid out as a trie (shared segments at several levels: ``thdpack.batching.trie``) takes the slots of
its segments; :class:`SharedLayout` gives ``plan_packs`` each member's share of them (the collator's
``share_prefix`` plans so), for groups planned whole into one pack.
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
    """

    shared: np.ndarray
    slots: np.ndarray

    def checked(self, lengths: np.ndarray) -> "SharedLayout":
        """Int64 copies; ``ValueError`` naming the sample unless ``0 <= shared <= length`` and
        ``slots >= length - shared``."""
        shared = np.asarray(integer_array(self.shared, "SharedLayout.shared"), np.int64)
        slots = np.asarray(integer_array(self.slots, "SharedLayout.slots"), np.int64)
        if shared.shape != lengths.shape or slots.shape != lengths.shape:
            raise ValueError(f"SharedLayout needs one entry per sample ({lengths.size}) in shared and slots, got "
                             f"{shared.shape} and {slots.shape}")
        bad = np.flatnonzero((shared < 0) | (shared > lengths) | (slots < lengths - shared))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"SharedLayout: sample {i} (length {int(lengths[i])}) has shared={int(shared[i])} and "
                             f"slots={int(slots[i])}; need 0 <= shared <= length and slots >= length - shared")
        return SharedLayout(shared, slots)


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


def shared_sizes(lengths: np.ndarray, prefix: np.ndarray, group_of: np.ndarray, align: int) -> np.ndarray:
    """int64 ``[G]`` slots of every group laid out with its prefix once: ``round_up(p) + Σ round_up(Lⱼ − p)``
    (``Σ round_up(Lⱼ)`` where ``p`` is 0)."""
    num_groups = int(group_of.max()) + 1 if group_of.size else 0
    own = round_up(lengths - prefix, align)
    sizes = np.bincount(group_of, weights=own, minlength=num_groups).astype(np.int64)
    first = np.unique(group_of, return_index=True)[1]
    sizes[group_of[first]] += round_up(prefix[first], align)
    return sizes


def shared_lengths(sample_index: np.ndarray, pack_offsets: np.ndarray, group_of: np.ndarray,
                   prefix: np.ndarray) -> np.ndarray:
    """int64 ``[m]`` tokens of each piece laid out by an earlier piece of its pack: its group's prefix for
    every member but the first of the group in that pack, 0 otherwise (``PackPlan.shared_length``)."""
    pack_of = np.repeat(np.arange(len(pack_offsets) - 1), np.diff(pack_offsets))
    key = pack_of * (int(group_of.max()) + 1 if group_of.size else 1) + group_of[sample_index]
    out = prefix[sample_index].copy()
    out[np.unique(key, return_index=True)[1]] = 0
    return out
