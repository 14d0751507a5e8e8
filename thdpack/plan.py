"""Pack planning: which samples go in which pack, computed from lengths only.

Planning knows nothing of tensors. A plan is a flat list of *pieces*
(``sample_index``, ``start``, ``length``: a token range of one input sample)
grouped into packs by ``pack_offsets`` (CSR layout). Without truncation or
splitting every piece is a whole sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Sequence

import numpy as np

from thdpack import _binpack
from thdpack.align import INT64_MAX, check_int, first_non_int64, round_up

_check_int = check_int  # the old private name, still imported elsewhere; the rule lives in thdpack.align

ALGORITHMS = ("bfd", "ffd", "first_fit_shuffle", "sequential")
OVERFLOW_POLICIES = ("error", "truncate", "split", "drop")


@dataclass(frozen=True)
class PackStats:
    """Summary of a plan. Token counts are real (unpadded) tokens unless named ``aligned``."""

    num_packs: int
    num_samples: int  # input samples given to the planner
    num_pieces: int  # entries placed in packs (a split sample gives several)
    lower_bound: int  # ceil(sum of aligned lengths / pack_size): no plan can use fewer packs
    pack_size: int
    real_tokens: int  # tokens placed in packs
    aligned_tokens: int  # tokens placed, each piece rounded up to ``align``
    efficiency: float  # real_tokens / (num_packs * pack_size)
    packing_factor: float  # pieces per pack, on average
    max_samples_per_pack: int
    min_pack_fill: float  # smallest real-token fill of a pack, as a fraction of pack_size
    max_pack_fill: float
    samples_truncated: int
    tokens_truncated: int
    samples_dropped: int
    tokens_dropped: int
    samples_split: int
    # with a vision budget (plan_packs(vision_lengths=..., vision_budget=...)); 0 without
    vision_budget: int = 0
    vision_patches: int = 0  # vision patches placed in packs
    max_pack_vision: int = 0  # most vision patches in one pack

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def __str__(self) -> str:
        lines = [
            f"packs            {self.num_packs} (lower bound {self.lower_bound})",
            f"samples          {self.num_samples} -> {self.num_pieces} pieces",
            f"real tokens      {self.real_tokens} (aligned {self.aligned_tokens})",
            f"efficiency       {self.efficiency:.4f}",
            f"packing factor   {self.packing_factor:.2f} samples/pack (max {self.max_samples_per_pack})",
            f"pack fill        {self.min_pack_fill:.3f} .. {self.max_pack_fill:.3f}",
            f"truncated        {self.samples_truncated} samples, {self.tokens_truncated} tokens",
            f"dropped          {self.samples_dropped} samples, {self.tokens_dropped} tokens",
            f"split            {self.samples_split} samples",
        ]
        if self.vision_budget:
            lines.append(
                f"vision patches   {self.vision_patches} (most in a pack {self.max_pack_vision} of {self.vision_budget})"
            )
        return "\n".join(lines)


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

    def pieces(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(sample_index, start, length)`` of the pieces in pack ``k``."""
        sl = slice(self.pack_offsets[k], self.pack_offsets[k + 1])
        return self.sample_index[sl], self.start[sl], self.length[sl]

    def pack_vision(self, k: int) -> np.ndarray:
        """Vision patches of the pieces in pack ``k`` (int64 ``[n_k]``; zeros without a vision budget)."""
        if self.vision_length is None:
            return np.zeros(int(self.pack_offsets[k + 1] - self.pack_offsets[k]), np.int64)
        return self.vision_length[self.pack_offsets[k] : self.pack_offsets[k + 1]]

    def pack_lengths(self, k: int) -> np.ndarray:
        """Real lengths of the pieces in pack ``k`` (int64 ``[n_k]``)."""
        return self.length[self.pack_offsets[k] : self.pack_offsets[k + 1]]

    @property
    def is_whole_samples(self) -> bool:
        """True when every piece is a whole, untruncated sample."""
        return self.stats.samples_truncated == 0 and self.stats.samples_split == 0

    def gather(self, samples, k: int) -> list:
        """The samples of pack ``k`` from an indexable ``samples``, cut to their pieces."""
        from thdpack.samples import slice_sample

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
            raise ValueError(f"sample {i} has length {value!r}; lengths must be integers in int64 range")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind != "f":
            raise ValueError(f"lengths must be integers, got dtype {arr.dtype}")
        non_integral = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if non_integral.size:
            i = int(non_integral[0])
            raise ValueError(f"lengths must be integers; sample {i} has length {arr[i].item()!r}")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        what = "is empty (length 0)" if arr[i] == 0 else f"has negative length {int(arr[i])}"
        raise ValueError(f"sample {i} {what}; every sample needs at least one token ({bad.size} such samples)")
    return arr


def plan_packs(
    lengths: Sequence[int] | np.ndarray,
    pack_size: int,
    *,
    algorithm: str = "bfd",
    align: int = 1,
    overflow: str = "error",
    max_samples_per_pack: int | None = None,
    seed: int = 0,
    vision_lengths: Sequence[int] | np.ndarray | None = None,
    vision_budget: int | None = None,
    groups: Sequence[int] | np.ndarray | None = None,
) -> PackPlan:
    """Plan packs of at most ``pack_size`` tokens from sample lengths.

    Args:
        lengths: ``[n]`` integer token counts, each >= 1.
        pack_size: token budget of a pack (after each piece is rounded up to ``align``).
        algorithm: ``"bfd"`` best-fit decreasing over the whole input (global, not
            windowed); ``"ffd"`` first-fit decreasing; ``"first_fit_shuffle"`` first fit
            in an order randomised by ``seed`` (for curricula that must not sort);
            ``"sequential"`` next fit in input order (streams).
        align: each length is rounded up to a multiple of this before fitting, so
            that per-sample CP/TP padding (see :func:`thdpack.cp_pad_multiple`) still fits.
        overflow: what to do with a sample whose aligned length exceeds ``pack_size``:
            ``"error"`` (ValueError naming it), ``"truncate"`` (keep its first tokens),
            ``"split"`` (cut into pack-size pieces, all kept) or ``"drop"``. Truncated,
            split and dropped tokens are counted in ``plan.stats``.
        max_samples_per_pack: optional cap on pieces per pack.
        seed: randomness for ``"first_fit_shuffle"``. Plans are deterministic.
        vision_lengths, vision_budget: a second budget for VLMs: ``[n]`` vision
            patches per sample (>= 0; :func:`thdpack.vlm.vision_lengths`) and the
            most patches a pack may hold (the ViT's memory and time scale with
            patches, not text tokens). Each pack then stays within both budgets
            (2-D variants of the same algorithms; ``"bfd"``/``"ffd"`` place samples
            by decreasing larger share of either budget). A sample with vision
            patches is never truncated or split (its placeholders must match its
            grids): if it is too long, or has more patches than ``vision_budget``,
            only ``overflow="drop"`` applies; other policies raise.
        groups: ``[n]`` integer group id of every sample (e.g. a preference pair's chosen
            and rejected sequences): the samples of a group land in one pack. Each group is
            planned as one item of its members' summed aligned length (and vision patches),
            then expanded in the same pack order. A group longer than ``pack_size`` is a
            ``ValueError`` naming it, whatever ``overflow`` says (members are never cut);
            ``max_samples_per_pack`` is not available with groups.

    Returns:
        A :class:`PackPlan`. Within a pack, pieces are ordered by input index
        (then by start, for split samples).
    """
    if groups is not None:
        return _plan_groups(
            lengths, pack_size, groups, algorithm=algorithm, align=align, overflow=overflow,
            max_samples_per_pack=max_samples_per_pack, seed=seed, vision_lengths=vision_lengths,
            vision_budget=vision_budget,
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
    check_int(pack_size, "pack_size", 1)
    check_int(align, "align", 1)
    if max_samples_per_pack is not None:
        check_int(max_samples_per_pack, "max_samples_per_pack", 1)
    if algorithm == "bfd" and pack_size > _BEST_FIT_MAX_PACK_SIZE:
        raise ValueError(
            f"pack_size={pack_size} is too large for 'bfd' (its room index takes O(pack_size) memory; "
            f"limit {_BEST_FIT_MAX_PACK_SIZE}); use algorithm='ffd'"
        )
    limit = pack_size // align * align  # longest real length whose aligned length fits
    if limit == 0:
        raise ValueError(f"pack_size ({pack_size}) is smaller than align ({align}); nothing can fit")

    lengths = validate_lengths(lengths)
    n = lengths.size
    over = lengths > limit
    vision = _vision_overflow(lengths, over, vision_lengths, vision_budget, overflow, pack_size)
    if vision is not None and overflow == "drop":
        over = over | (vision > vision_budget)
    n_over = int(over.sum())
    sample_index = np.arange(n, dtype=np.int64)
    start = np.zeros(n, dtype=np.int64)
    length = lengths
    dropped = np.zeros(0, dtype=np.int64)
    samples_truncated = tokens_truncated = tokens_dropped = samples_split = 0

    if n_over:
        if overflow == "error":
            i = int(np.flatnonzero(over)[0])
            raise ValueError(
                f"sample {i} has {int(lengths[i])} tokens"
                + (f" ({int(round_up(lengths[i:i+1], align)[0])} after aligning to {align})" if align > 1 else "")
                + f", more than pack_size={pack_size}; {n_over} sample(s) are too long. "
                "Use overflow='truncate', 'split' or 'drop', or raise pack_size."
            )
        if overflow == "truncate":
            samples_truncated = n_over
            tokens_truncated = int((lengths[over] - limit).sum())
            length = np.minimum(lengths, limit)
        elif overflow == "drop":
            dropped = np.flatnonzero(over)
            tokens_dropped = int(lengths[over].sum())
            keep = ~over
            sample_index, start, length = sample_index[keep], start[keep], lengths[keep]
        else:  # split
            samples_split = n_over
            n_pieces = -(-lengths // limit)
            sample_index = np.repeat(sample_index, n_pieces)
            first_piece = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
            start = (np.arange(sample_index.size, dtype=np.int64) - first_piece) * limit
            length = np.minimum(limit, lengths[sample_index] - start)

    sizes = round_up(length, align)
    if vision is None:
        order = _placement_order(sizes, algorithm, seed, pack_size)
        kernel = {
            "bfd": _binpack.best_fit,
            "ffd": _binpack.first_fit,
            "first_fit_shuffle": _binpack.first_fit,
            "sequential": _binpack.next_fit,
        }[algorithm]
        bin_sorted, num_packs = kernel(
            np.ascontiguousarray(sizes[order]), int(pack_size), int(max_samples_per_pack or 0)
        )
    else:  # two budgets: tokens and vision patches (pieces of split / truncated samples have none)
        vsizes = vision[sample_index]
        order = _placement_order_2d(sizes, vsizes, algorithm, seed, pack_size, vision_budget)
        kernel = {
            "bfd": _binpack.best_fit_2d,
            "ffd": _binpack.first_fit_2d,
            "first_fit_shuffle": _binpack.first_fit_2d,
            "sequential": _binpack.next_fit_2d,
        }[algorithm]
        bin_sorted, num_packs = kernel(
            np.ascontiguousarray(sizes[order]),
            np.ascontiguousarray(vsizes[order]),
            int(pack_size),
            int(vision_budget),
            int(max_samples_per_pack or 0),
        )
    pack_of = np.empty_like(bin_sorted)
    pack_of[order] = bin_sorted
    # pieces were created in (sample, start) order, so a stable sort by pack keeps it within packs
    by_pack = _binpack.bucket_order(pack_of, num_packs, False)
    counts = np.bincount(pack_of, minlength=num_packs)
    pack_offsets = np.zeros(num_packs + 1, dtype=np.int64)
    np.cumsum(counts, out=pack_offsets[1:])
    sample_index, start, length = sample_index[by_pack], start[by_pack], length[by_pack]
    vision_length = None if vision is None else vsizes[by_pack]

    stats = _pack_stats(
        length, sizes, pack_offsets, int(pack_size), int(n), vision_length,
        None if vision is None else int(vision_budget),
        samples_truncated=samples_truncated, tokens_truncated=tokens_truncated,
        samples_dropped=int(dropped.size), tokens_dropped=tokens_dropped, samples_split=samples_split,
    )
    return PackPlan(
        sample_index=sample_index,
        start=start,
        length=length,
        pack_offsets=pack_offsets,
        dropped=dropped,
        pack_size=int(pack_size),
        align=int(align),
        algorithm=algorithm,
        overflow=overflow,
        seed=int(seed),
        stats=stats,
        vision_length=vision_length,
        vision_budget=None if vision is None else int(vision_budget),
    )


def _pack_stats(length, sizes, pack_offsets, pack_size: int, num_samples: int, vision_length, vision_budget,
                **cuts) -> PackStats:
    """The :class:`PackStats` of placed pieces: ``length`` / ``sizes`` (aligned) ``[m]`` in pack
    order, ``pack_offsets`` ``[num_packs + 1]``; ``cuts``: the truncated / dropped / split counts."""
    num_packs = len(pack_offsets) - 1
    counts = np.diff(pack_offsets)
    fill = np.add.reduceat(length, pack_offsets[:-1]) if num_packs else np.zeros(0, np.int64)
    real_tokens = int(length.sum())
    aligned_tokens = int(sizes.sum())
    lower_bound = int(math.ceil(aligned_tokens / pack_size))
    vision_stats = {}
    if vision_length is not None:
        vision_patches = int(vision_length.sum())
        lower_bound = max(lower_bound, -(-vision_patches // vision_budget))
        vfill = np.add.reduceat(vision_length, pack_offsets[:-1]) if num_packs else np.zeros(0, np.int64)
        vision_stats = dict(
            vision_budget=vision_budget,
            vision_patches=vision_patches,
            max_pack_vision=int(vfill.max()) if num_packs else 0,
        )
    return PackStats(
        num_packs=int(num_packs),
        num_samples=num_samples,
        num_pieces=int(length.size),
        lower_bound=lower_bound,
        pack_size=pack_size,
        real_tokens=real_tokens,
        aligned_tokens=aligned_tokens,
        efficiency=real_tokens / (num_packs * pack_size) if num_packs else 0.0,
        packing_factor=length.size / num_packs if num_packs else 0.0,
        max_samples_per_pack=int(counts.max()) if num_packs else 0,
        min_pack_fill=float(fill.min() / pack_size) if num_packs else 0.0,
        max_pack_fill=float(fill.max() / pack_size) if num_packs else 0.0,
        **cuts,
        **vision_stats,
    )


def _plan_groups(lengths, pack_size, groups, *, algorithm, align, overflow, max_samples_per_pack, seed,
                 vision_lengths, vision_budget) -> PackPlan:
    """:func:`plan_packs` with ``groups``: each group planned as one item of its members'
    summed aligned length (and vision patches), then expanded in the same pack order."""
    lengths = validate_lengths(lengths)
    check_int(align, "align", 1)
    if max_samples_per_pack is not None:
        raise ValueError("max_samples_per_pack is not available with groups (a group counts as one item); drop one")
    gid = _check_groups(groups, lengths.size)
    group_of = _number_groups(gid)
    num_groups = int(group_of.max()) + 1 if group_of.size else 0
    sizes = round_up(lengths, align)
    group_sizes = np.bincount(group_of, weights=sizes, minlength=num_groups).astype(np.int64)
    _check_group_fits(group_sizes, group_of, gid, pack_size, "tokens (aligned)", "pack_size")
    vision, group_vision = None, None
    if vision_lengths is not None or vision_budget is not None:
        vision = _vision_overflow(lengths, np.zeros(lengths.size, bool), vision_lengths, vision_budget, "drop", pack_size)
        group_vision = np.bincount(group_of, weights=vision, minlength=num_groups).astype(np.int64)
        _check_group_fits(group_vision, group_of, gid, vision_budget, "vision patches", "vision_budget")
    outer = plan_packs(group_sizes, pack_size, algorithm=algorithm, align=1, overflow=overflow, seed=seed,
                       vision_lengths=group_vision, vision_budget=vision_budget)
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
    stats = _pack_stats(length, sizes[sample_index], pack_offsets, int(pack_size), int(lengths.size), vision_length,
                        None if vision is None else int(vision_budget), samples_truncated=0, tokens_truncated=0,
                        samples_dropped=0, tokens_dropped=0, samples_split=0)
    return PackPlan(
        sample_index=sample_index, start=np.zeros(sample_index.size, np.int64), length=length,
        pack_offsets=pack_offsets.astype(np.int64), dropped=np.zeros(0, np.int64), pack_size=int(pack_size),
        align=int(align), algorithm=algorithm, overflow=overflow, seed=int(seed), stats=stats,
        vision_length=vision_length, vision_budget=None if vision is None else int(vision_budget),
    )


def _check_groups(groups, n: int) -> np.ndarray:
    """``groups`` as int64 ``[n]``; ``ValueError`` naming what is wrong."""
    gid = np.asarray(groups)
    if gid.shape != (n,) or (gid.size and gid.dtype.kind not in "iu"):
        raise ValueError(
            f"groups must be integers with one group id per sample ({n}), got shape {gid.shape} and dtype {gid.dtype}"
        )
    return gid.astype(np.int64)


def _number_groups(gid: np.ndarray) -> np.ndarray:
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
            return _binpack.bucket_order(sizes, pack_size + 1, True)
        return np.argsort(-sizes, kind="stable")
    if algorithm == "first_fit_shuffle":
        return np.random.default_rng(seed).permutation(sizes.size)
    return np.arange(sizes.size)


def _vision_overflow(lengths, over, vision_lengths, vision_budget, overflow, pack_size) -> np.ndarray | None:
    """Checked ``[n]`` int64 vision patches (None without a vision budget); raises for
    samples that break the vision budget, or that would have to be cut, unless dropped."""
    if (vision_lengths is None) != (vision_budget is None):
        raise ValueError("vision_lengths and vision_budget go together: pass both or neither")
    if vision_lengths is None:
        return None
    check_int(vision_budget, "vision_budget", 1)
    if int(pack_size) * int(vision_budget) >= 2**56:
        raise ValueError(f"pack_size · vision_budget must be < 2**56, got {pack_size} · {vision_budget}")
    vision = np.asarray(vision_lengths)
    if vision.ndim != 1 or vision.size != lengths.size:
        raise ValueError(f"vision_lengths must be 1-D with one entry per sample ({lengths.size}), got shape {vision.shape}")
    if vision.size and vision.dtype.kind not in "iu":
        raise ValueError(f"vision_lengths must be integers, got dtype {vision.dtype}")
    vision = vision.astype(np.int64, copy=False)
    bad = np.flatnonzero(vision < 0)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sample {i} has negative vision length {int(vision[i])}")
    if overflow == "drop":
        return vision
    too_many = np.flatnonzero(vision > vision_budget)
    if too_many.size:
        i = int(too_many[0])
        raise ValueError(
            f"sample {i} has {int(vision[i])} vision patches, more than vision_budget={vision_budget}; "
            f"{too_many.size} sample(s) are over. Use overflow='drop' or raise vision_budget."
        )
    cut = np.flatnonzero(over & (vision > 0))
    if cut.size and overflow in ("truncate", "split"):
        i = int(cut[0])
        raise ValueError(
            f"sample {i} has {int(lengths[i])} tokens, more than pack_size={pack_size}, and {int(vision[i])} "
            f"vision patches: a VLM sample cannot be {overflow} (its placeholders must match its grids). "
            "Use overflow='drop' or raise pack_size."
        )
    return vision


def _placement_order_2d(sizes, vsizes, algorithm: str, seed: int, pack_size: int, vision_budget: int) -> np.ndarray:
    if algorithm in ("bfd", "ffd"):  # decreasing larger share of either budget; ties in input order
        key = np.maximum(sizes * int(vision_budget), vsizes * int(pack_size))
        return np.argsort(-key, kind="stable")
    return _placement_order(sizes, algorithm, seed, pack_size)
