"""Pack planning: which samples go in which pack, computed from lengths only.

Planning knows nothing of tensors. A plan is a flat list of *pieces*
(``sample_index``, ``start``, ``length``: a token range of one input sample)
grouped into packs by ``pack_offsets`` (CSR layout). Without truncation or
splitting every piece is a whole sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Sequence

import numpy as np

from thdpack.planning import binpack
from thdpack.common.align import INT64_MAX, check_int, first_non_int64, round_up
from thdpack.planning.options import PlanOptions, plan_options
from thdpack.planning.packing import PackStats, cut_overflow
from thdpack.planning.prefix_budget import as_layout, group_slots, piece_shared
from thdpack.common.samples import SampleError


@dataclass(frozen=True)
class PackPlan:
    """Which token ranges of which samples go in which pack.

    Attributes (all int64 numpy arrays):
        sample_index: ``[m]`` input row of each piece.
        start: ``[m]`` first token of the piece within its sample.
        length: ``[m]`` real tokens of the piece.
        pack_offsets: ``[num_packs + 1]`` pieces of pack k are ``pack_offsets[k]:pack_offsets[k+1]``.
        dropped: ``[d]`` input rows dropped by ``overflow="drop"``.
        vision_length: ``[m]`` vision patches of each piece, or None when planned
            without a vision budget.
        shared_length: ``[m]`` tokens of each piece laid out by an earlier piece of its pack (its
            group's shared prefix, counted once: ``plan_packs(..., shared_prefix=...)``), or None
            when planned without shared prefixes. ``length - shared_length`` are the stream's tokens.
        audio_length: ``[m]`` audio frames of each piece, or None when planned without an audio
            budget (``plan_packs(audio_lengths=..., audio_budget=...)``); ``audio_budget`` its budget.
            ``stats`` counts tokens and vision patches only.
    """

    sample_index: np.ndarray
    start: np.ndarray
    length: np.ndarray
    pack_offsets: np.ndarray
    dropped: np.ndarray
    pack_size: int
    align: int
    algorithm: str
    overflow: str
    seed: int
    stats: PackStats = field(repr=False)
    vision_length: np.ndarray | None = field(default=None, repr=False)
    vision_budget: int | None = None
    shared_length: np.ndarray | None = field(default=None, repr=False)
    audio_length: np.ndarray | None = field(default=None, repr=False)
    audio_budget: int | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.pack_offsets) - 1

    @cached_property
    def packs(self) -> list[np.ndarray]:
        """One int64 array of input sample indices per pack."""
        if len(self) == 0:
            return []
        return np.split(self.sample_index, self.pack_offsets[1:-1])

    def pack(self, k: int) -> np.ndarray:
        """Input sample indices of pack ``k`` (int64 ``[n_k]``)."""
        return self.sample_index[self.pack_offsets[k] : self.pack_offsets[k + 1]]

    def pack_slice(self, k: int) -> slice:
        """Where pack ``k``'s pieces sit in the CSR arrays (``k`` from ``-len(plan)``, counting from the
        end, to ``len(plan) - 1``); an IndexError naming ``k`` and the number of packs otherwise."""
        n = len(self.pack_offsets) - 1
        check_int(k, "pack", -n, below=n, hint=f" (the plan has {n} packs; a negative pack counts from the end)",
                  error=IndexError)
        k = int(k) % n
        return slice(int(self.pack_offsets[k]), int(self.pack_offsets[k + 1]))

    def pieces(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sample_index, start, length)`` of the pieces in pack ``k``."""
        sl = self.pack_slice(k)
        return self.sample_index[sl], self.start[sl], self.length[sl]

    def pack_vision(self, k: int) -> np.ndarray:
        """Vision patches of the pieces in pack ``k`` (int64 ``[n_k]``; zeros without a vision budget)."""
        sl = self.pack_slice(k)
        if self.vision_length is None:
            return np.zeros(sl.stop - sl.start, np.int64)
        return self.vision_length[sl]

    def pack_audio(self, k: int) -> np.ndarray:
        """Audio frames of the pieces in pack ``k`` (int64 ``[n_k]``; zeros without an audio budget)."""
        sl = self.pack_slice(k)
        if self.audio_length is None:
            return np.zeros(sl.stop - sl.start, np.int64)
        return self.audio_length[sl]

    def pack_lengths(self, k: int) -> np.ndarray:
        """Real lengths of the pieces in pack ``k`` (int64 ``[n_k]``)."""
        return self.length[self.pack_slice(k)]

    @property
    def is_whole_samples(self) -> bool:
        """True when every piece is a whole, untruncated sample."""
        return self.stats.samples_truncated == 0 and self.stats.samples_split == 0

    def gather(self, samples, k: int) -> list:
        """The samples of pack ``k`` from an indexable ``samples``, cut to their pieces."""
        from thdpack.common.samples import slice_sample

        idx, start, length = self.pieces(k)
        if self.is_whole_samples:
            return [samples[i] for i in idx.tolist()]
        return [
            slice_sample(samples[i], a, a + n, index=i) for i, a, n in zip(idx.tolist(), start.tolist(), length.tolist())
        ]


def validate_lengths(lengths) -> np.ndarray:
    """``lengths`` as a 1-D int64 array; ``ValueError`` naming the first bad sample."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.dtype == object or (arr.dtype == np.uint64 and arr.size and arr.max() > INT64_MAX):
        bad = first_non_int64(arr.tolist())  # None, beyond int64 (it would wrap to a negative length)
        if bad is not None:
            i, value = bad
            raise SampleError.at(i, f" has length {value!r}; lengths must be integers in int64 range")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f":
            raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
        non_integral = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if non_integral.size:
            i = int(non_integral[0])
            raise SampleError.at(i, f" has length {arr[i].item()!r}; lengths must be integers")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        what = "is empty (length 0)" if arr[i] == 0 else f"has negative length {int(arr[i])}"
        raise SampleError.at(i, f" {what}; every sample needs at least one token ({bad.size} such samples)")
    return arr


def plan_packs(
    lengths: Sequence[int] | np.ndarray,
    pack_size: int | None = None,
    *,
    vision_lengths: Sequence[int] | np.ndarray | None = None,
    groups: Sequence[int] | np.ndarray | None = None,
    shared_prefix: Sequence[int] | np.ndarray | None = None,
    audio_lengths: Sequence[int] | np.ndarray | None = None,
    **plan_keywords,
) -> PackPlan:
    """Plan packs of at most ``pack_size`` tokens from sample lengths:
    ``plan_packs(lengths, 4096, align=8, overflow="truncate")``.

    Args (in full: docs/loaders.md, "plan_packs: arguments"):
        lengths: ``[n]`` integer token counts, each >= 1.
        pack_size, **plan_keywords: the fields of :class:`thdpack.planning.options.PlanOptions`
            (``pack_size``; ``algorithm="bfd"`` / ``"ffd"`` / ``"first_fit_shuffle"`` / ``"sequential"``,
            ``align=1``, ``overflow="error"`` / ``"truncate"`` / ``"split"`` / ``"drop"``,
            ``max_samples_per_pack=None``, ``seed=0``, ``vision_budget=None``, ``audio_budget=None``).
        vision_lengths: with ``vision_budget``, ``[n]`` vision patches per sample (>= 0), a second
            budget; a sample with patches is never truncated or split.
        audio_lengths: with ``audio_budget``, ``[n]`` audio frames per sample (>= 0), a third budget
            kept as ``vision_lengths`` is (never cut); the algorithms then run on every budget at once
            (docs/loaders.md, "plan_packs: arguments"). Plans without it are unchanged.
        groups: ``[n]`` integer group id per sample: a group's samples land in one pack (never cut).
        shared_prefix: with ``groups``, ``[n]`` the prefix each sample shares with its group, counted
            once per pack; or a :class:`thdpack.planning.prefix_budget.SharedLayout` (a group laid out as a
            trie: each member's shared tokens and added slots).

    Returns:
        A :class:`PackPlan`. Within a pack, pieces are ordered by input index
        (then by start, for split samples).

    Raises:
        ValueError: a sample over ``pack_size`` with ``overflow="error"``, a group over ``pack_size``,
            ``shared_prefix`` without ``groups``, or invalid lengths / options.
        TypeError: an unknown keyword.
    """
    options = plan_options("plan_packs", {"pack_size": pack_size, **plan_keywords})
    if shared_prefix is not None and groups is None:
        raise ValueError("shared_prefix needs groups=: a prefix is shared by the samples of one group (one pack)")
    if groups is not None:
        return _plan_groups(lengths, groups, vision_lengths, options, shared_prefix, audio_lengths)
    check_kernel_limits(options)
    return _plan_pieces(validate_lengths(lengths), vision_lengths, options, audio_lengths)


def _plan_pieces(lengths: np.ndarray, vision_lengths, options: PlanOptions, audio_lengths=None) -> PackPlan:
    """:func:`plan_packs` without groups: int64 ``[n]`` checked ``lengths`` cut by the overflow
    policy into pieces, which the kernel of ``options.algorithm`` places."""
    pack_size, align, overflow, vision_budget = options.pack_size, options.align, options.overflow, options.vision_budget
    over = lengths > options.usable_length
    vision = vision_overflow(lengths, over, vision_lengths, vision_budget, overflow, pack_size)
    if vision is not None and overflow == "drop":
        over = over | (vision > vision_budget)
    audio = audio_overflow(lengths, over, audio_lengths, options.audio_budget, overflow, pack_size)
    if audio is not None and overflow == "drop":
        over = over | (audio > options.audio_budget)
    pieces = cut_overflow(lengths, overflow, pack_size, align, over=over)
    vsizes = None if vision is None else vision[pieces.sample_index]  # pieces of cut samples have none
    asizes = None if audio is None else audio[pieces.sample_index]
    pack_of, num_packs = _place(round_up(pieces.length, align), vsizes, options, asizes)
    by_pack, pack_offsets = _csr(pack_of, num_packs)
    length = pieces.length[by_pack]
    vision_length = None if vision is None else vsizes[by_pack]
    audio_length = None if audio is None else asizes[by_pack]
    budget = None if vision is None else int(vision_budget)
    stats = PackStats.from_packs(length, pack_offsets, int(pack_size), align=int(align), num_samples=int(lengths.size),
                                 cuts=pieces.cuts, vision_length=vision_length, vision_budget=budget)
    return _plan_of(options, pieces.sample_index[by_pack], pieces.start[by_pack], length, pack_offsets,
                    pieces.dropped, stats, vision_length, budget, audio_length)


def _plan_of(options: PlanOptions, sample_index, start, length, pack_offsets, dropped, stats: PackStats,
             vision_length, vision_budget, audio_length=None) -> PackPlan:
    """The :class:`PackPlan` of placed pieces (int64 arrays as its attributes), planned with ``options``."""
    return PackPlan(
        sample_index=sample_index, start=start, length=length, pack_offsets=pack_offsets, dropped=dropped,
        pack_size=int(options.pack_size), align=int(options.align), algorithm=options.algorithm,
        overflow=options.overflow, seed=int(options.seed), stats=stats, vision_length=vision_length,
        vision_budget=vision_budget, audio_length=audio_length,
        audio_budget=None if audio_length is None else int(options.audio_budget),
    )


def check_kernel_limits(options: PlanOptions) -> None:
    """``ValueError`` when the placement kernel of ``options.algorithm`` cannot take its
    ``pack_size`` (``"bfd"``'s room index takes O(pack_size) memory)."""
    if options.algorithm == "bfd" and options.pack_size > _BEST_FIT_MAX_PACK_SIZE:
        raise ValueError(
            f"pack_size={options.pack_size} is too large for 'bfd' (its room index takes O(pack_size) memory; "
            f"limit {_BEST_FIT_MAX_PACK_SIZE}); use algorithm='ffd'"
        )


_KERNELS = {  # algorithm -> (one budget, two budgets: tokens and vision patches)
    "bfd": (binpack.best_fit, binpack.best_fit_2d),
    "ffd": (binpack.first_fit, binpack.first_fit_2d),
    "first_fit_shuffle": (binpack.first_fit, binpack.first_fit_2d),
    "sequential": (binpack.next_fit, binpack.next_fit_2d),
}


_KERNELS_ND = {  # algorithm -> kernel on d budgets (tokens, vision patches if budgeted, audio frames)
    "bfd": binpack.best_fit_nd,
    "ffd": binpack.first_fit_nd,
    "first_fit_shuffle": binpack.first_fit_nd,
    "sequential": binpack.next_fit_nd,
}


def _place(sizes: np.ndarray, vsizes: np.ndarray | None, options: PlanOptions,
           asizes: np.ndarray | None = None) -> tuple[np.ndarray, int]:
    """Run the kernel of ``options.algorithm`` over int64 ``[m]`` aligned sizes (and ``[m]`` vision
    patches, or None; and ``[m]`` audio frames, or None). Returns (int64 ``[m]`` pack of each piece,
    number of packs)."""
    algorithm, seed, pack_size = options.algorithm, options.seed, options.pack_size
    if asizes is not None:
        return _place_nd(sizes, vsizes, asizes, options)
    if vsizes is None:
        order = _placement_order(sizes, algorithm, seed, pack_size)
        budgets = (np.ascontiguousarray(sizes[order]), int(pack_size))
    else:
        order = _placement_order_2d(sizes, vsizes, algorithm, seed, pack_size, options.vision_budget)
        budgets = (np.ascontiguousarray(sizes[order]), np.ascontiguousarray(vsizes[order]), int(pack_size),
                   int(options.vision_budget))
    kernel = _KERNELS[algorithm][vsizes is not None]
    bin_sorted, num_packs = kernel(*budgets, int(options.max_samples_per_pack or 0))
    pack_of = np.empty_like(bin_sorted)
    pack_of[order] = bin_sorted
    return pack_of, num_packs


def _place_nd(sizes, vsizes, asizes, options: PlanOptions) -> tuple[np.ndarray, int]:
    """:func:`_place` with an audio budget: the d-budget kernel of ``options.algorithm`` (d = 2 or 3);
    ``"bfd"`` / ``"ffd"`` place by decreasing largest share of any budget, ties in input order."""
    columns, capacities = [sizes], [options.pack_size]
    if vsizes is not None:
        columns.append(vsizes)
        capacities.append(options.vision_budget)
    columns.append(asizes)
    capacities.append(options.audio_budget)
    matrix = np.stack(columns, axis=1).astype(np.int64)
    capacities = np.asarray(capacities, np.int64)
    if options.algorithm in ("bfd", "ffd"):
        order = np.argsort(-(matrix / capacities).max(axis=1), kind="stable")
    else:
        order = _placement_order(sizes, options.algorithm, options.seed, options.pack_size)
    kernel = _KERNELS_ND[options.algorithm]
    bin_sorted, num_packs = kernel(np.ascontiguousarray(matrix[order]), capacities,
                                   int(options.max_samples_per_pack or 0))
    pack_of = np.empty_like(bin_sorted)
    pack_of[order] = bin_sorted
    return pack_of, num_packs


def _csr(pack_of: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """CSR layout of a placement: (int64 ``[m]`` piece order, pack after pack, int64
    ``[num_packs + 1]`` pack offsets). Stable: pieces keep their (sample, start) order within a pack."""
    by_pack = binpack.bucket_order(pack_of, num_packs, False)
    pack_offsets = np.zeros(num_packs + 1, dtype=np.int64)
    np.cumsum(np.bincount(pack_of, minlength=num_packs), out=pack_offsets[1:])
    return by_pack, pack_offsets


def _plan_groups(lengths, groups, vision_lengths, options: PlanOptions, shared_prefix=None,
                 audio_lengths=None) -> PackPlan:
    """:func:`plan_packs` with ``groups``: each group planned as one item of its members'
    summed aligned length (its shared prefix once; and vision patches, audio frames), then expanded
    in the same pack order."""
    lengths = validate_lengths(lengths)
    pack_size, align, vision_budget = options.pack_size, options.align, options.vision_budget
    if options.max_samples_per_pack is not None:
        raise ValueError("max_samples_per_pack is not available with groups (a group counts as one item); drop one")
    gid = check_groups(groups, lengths.size)
    group_of = number_groups(gid)
    num_groups = int(group_of.max()) + 1 if group_of.size else 0
    layout = as_layout(shared_prefix, lengths, gid, group_of, align)
    if layout is None:
        group_sizes = np.bincount(group_of, weights=round_up(lengths, align), minlength=num_groups).astype(np.int64)
    else:
        group_sizes = group_slots(layout, group_of)
    _check_group_fits(group_sizes, group_of, gid, pack_size, "tokens (aligned)", "pack_size")
    vision, group_vision = None, None
    if vision_lengths is not None or vision_budget is not None:
        vision = vision_overflow(lengths, np.zeros(lengths.size, bool), vision_lengths, vision_budget, "drop", pack_size)
        group_vision = np.bincount(group_of, weights=vision, minlength=num_groups).astype(np.int64)
        _check_group_fits(group_vision, group_of, gid, vision_budget, "vision patches", "vision_budget")
    audio, group_audio = None, None
    if audio_lengths is not None or options.audio_budget is not None:
        audio = audio_overflow(lengths, np.zeros(lengths.size, bool), audio_lengths, options.audio_budget, "drop",
                               pack_size)
        group_audio = np.bincount(group_of, weights=audio, minlength=num_groups).astype(np.int64)
        _check_group_fits(group_audio, group_of, gid, options.audio_budget, "audio frames", "audio_budget")
    outer = plan_packs(group_sizes, vision_lengths=group_vision, audio_lengths=group_audio,
                       **replace(options, align=1).keywords())
    members = np.argsort(group_of, kind="stable")  # members of group g, by input index, are contiguous
    member_counts = np.bincount(group_of, minlength=num_groups)
    member_start = np.cumsum(member_counts) - member_counts
    placed = outer.sample_index  # groups in pack order
    counts = member_counts[placed]
    within = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    sample_index = members[np.repeat(member_start[placed], counts) + within]
    pack_offsets = np.concatenate([[0], np.cumsum(counts)])[outer.pack_offsets]
    pack_of = np.repeat(np.arange(len(outer)), np.diff(pack_offsets))
    sample_index = sample_index[np.lexsort((sample_index, pack_of))]  # by input index within a pack
    length = lengths[sample_index]
    vision_length = None if vision is None else vision[sample_index]
    budget = None if vision is None else int(vision_budget)
    shared = None if layout is None else piece_shared(sample_index, pack_offsets, group_of, layout)
    stats = PackStats.from_packs(length if shared is None else length - shared, pack_offsets, int(pack_size),
                                 align=int(align), num_samples=int(lengths.size), vision_length=vision_length,
                                 vision_budget=budget)
    plan = _plan_of(options, sample_index, np.zeros(sample_index.size, np.int64), length,
                    pack_offsets.astype(np.int64), np.zeros(0, np.int64), stats, vision_length, budget,
                    None if audio is None else audio[sample_index])
    return plan if shared is None else replace(plan, shared_length=shared)


def check_groups(groups, n: int) -> np.ndarray:
    """``groups`` as int64 ``[n]``; ``ValueError`` naming what is wrong."""
    gid = np.asarray(groups)
    if gid.shape != (n,) or (gid.size and gid.dtype.kind not in "iu"):
        raise ValueError(
            f"groups must be integers with one group id per sample ({n}), got shape {gid.shape} and dtype {gid.dtype}"
        )
    return gid.astype(np.int64)


def number_groups(gid: np.ndarray) -> np.ndarray:
    """int64 ``[n]`` group of every sample, groups numbered 0.. by first appearance (so that
    ``"sequential"`` keeps the input order)."""
    _, first, inverse = np.unique(gid, return_index=True, return_inverse=True)
    rank = np.empty_like(first)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size)
    return rank[inverse.reshape(-1)]


def _check_group_fits(group_totals, group_of, gid, budget, what: str, budget_name: str) -> None:
    over = np.flatnonzero(group_totals > budget)
    if over.size:
        g = int(over[0])
        members = np.flatnonzero(group_of == g)
        shown = ", ".join(map(str, members[:8].tolist())) + (", ..." if members.size > 8 else "")
        raise ValueError(
            f"group {int(gid[members[0]])} (samples {shown}) has {int(group_totals[g])} {what}, more than "
            f"{budget_name}={budget}; a group's samples share one pack here: raise {budget_name}, drop the group, "
            f"or let groups span several packs of one rank with plan_balanced(groups=..., micro_batches=M) "
            f"(TokenBudgetBatchSampler(balance='compute')) ({over.size} group(s) too large)"
        )


# counting sorts and the best-fit room index take O(pack_size) memory; beyond this, sort / refuse
_BUCKET_SORT_MAX_KEYS = 1 << 24
_BEST_FIT_MAX_PACK_SIZE = 1 << 26


def _placement_order(sizes: np.ndarray, algorithm: str, seed: int, pack_size: int) -> np.ndarray:
    if algorithm in ("bfd", "ffd"):  # decreasing size; ties in input order
        if pack_size <= _BUCKET_SORT_MAX_KEYS:
            return binpack.bucket_order(sizes, pack_size + 1, True)
        return np.argsort(-sizes, kind="stable")
    if algorithm == "first_fit_shuffle":
        return np.random.default_rng(seed).permutation(sizes.size)
    return np.arange(sizes.size)


def vision_overflow(lengths, over, vision_lengths, vision_budget, overflow, pack_size) -> np.ndarray | None:
    """Checked ``[n]`` int64 vision patches (None without a vision budget); raises for
    samples that break the vision budget, or that would have to be cut, unless dropped.
    ``vision_budget``, ``overflow``, ``pack_size``: as in a valid :class:`PlanOptions`."""
    return _budget_overflow(lengths, over, vision_lengths, vision_budget, overflow, pack_size, name="vision",
                            unit="vision patches", whole="a VLM sample", why="its placeholders must match its grids")


def audio_overflow(lengths, over, audio_lengths, audio_budget, overflow, pack_size) -> np.ndarray | None:
    """Checked ``[n]`` int64 audio frames (None without an audio budget), as :func:`vision_overflow`
    checks vision patches: raises for a sample over ``audio_budget`` (unless ``overflow="drop"``) or
    with audio that would have to be truncated or split (audio frames cannot be cut)."""
    return _budget_overflow(lengths, over, audio_lengths, audio_budget, overflow, pack_size, name="audio",
                            unit="audio frames", whole="a sample with audio",
                            why="its audio placeholders must match its frames")


def _budget_overflow(lengths, over, values, budget, overflow, pack_size, *, name: str, unit: str, whole: str,
                     why: str) -> np.ndarray | None:
    """The one rule of a second or third budget (``name``: ``vision`` or ``audio``): ``values`` ``[n]`` checked
    integers >= 0, or None without ``budget``; a sample over ``budget`` raises unless ``overflow="drop"``, and one
    with ``values`` > 0 that ``truncate`` / ``split`` would cut raises (``whole`` is never cut: ``why``)."""
    if (values is None) != (budget is None):
        raise ValueError(f"{name}_lengths and {name}_budget go together: pass both or neither")
    if values is None:
        return None
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.size != lengths.size:
        raise ValueError(f"{name}_lengths must be 1-D with one entry per sample ({lengths.size}), got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name}_lengths must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        i = int(bad[0])
        raise SampleError.at(i, f" has negative {name} length {int(arr[i])}")
    if overflow == "drop":
        return arr
    too_many = np.flatnonzero(arr > budget)
    if too_many.size:
        i = int(too_many[0])
        raise SampleError.at(
            i, f" has {int(arr[i])} {unit}, more than {name}_budget={budget}; "
            f"{too_many.size} sample(s) are over. Use overflow='drop' or raise {name}_budget."
        )
    cut = np.flatnonzero(over & (arr > 0))
    if cut.size and overflow in ("truncate", "split"):
        i = int(cut[0])
        raise SampleError.at(
            i, f" has {int(lengths[i])} tokens, more than pack_size={pack_size}, and {int(arr[i])} "
            f"{unit}: {whole} cannot be {overflow} ({why}). Use overflow='drop' or raise pack_size."
        )
    return arr


def _placement_order_2d(sizes, vsizes, algorithm: str, seed: int, pack_size: int, vision_budget: int) -> np.ndarray:
    if algorithm in ("bfd", "ffd"):  # decreasing larger share of either budget; ties in input order
        key = np.maximum(sizes * int(vision_budget), vsizes * int(pack_size))
        return np.argsort(-key, kind="stable")
    return _placement_order(sizes, algorithm, seed, pack_size)
