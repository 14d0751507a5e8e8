"""The packing core: the rules every planner shares, each defined once.

- :func:`usable_length`: the longest real length whose aligned length fits a pack.
- :data:`OVERFLOW_POLICIES` and :func:`cut_overflow`: what becomes of a sample whose
  aligned length exceeds ``pack_size`` (an error naming it, truncated, split or dropped).
- :class:`PackStats`: the summary of placed pieces, from their lengths and pack offsets
  (:meth:`PackStats.from_packs`), or from running totals (:class:`PackTotals`) for a stream.

Used by :func:`thdpack.plan_packs`, :func:`thdpack.plan_balanced`,
:class:`thdpack.StreamingPacker`, :class:`thdpack.TokenBudgetBatchSampler` and the offline
build and statistics. Integers only: nothing here knows tensors or samples.
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, fields

import numpy as np

from thdpack.common.align import round_up
from thdpack.common.samples import SampleError

OVERFLOW_POLICIES = ("error", "truncate", "split", "drop")


def check_overflow(overflow) -> None:
    """``ValueError`` unless ``overflow`` is one of :data:`OVERFLOW_POLICIES`."""
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")


def usable_length(pack_size: int, align: int) -> int:
    """The longest real length whose length rounded up to ``align`` fits ``pack_size``:
    ``pack_size`` rounded down to a multiple of ``align``. ``ValueError`` when that is 0."""
    limit = pack_size // align * align
    if limit == 0:
        raise ValueError(f"pack_size ({pack_size}) is smaller than align ({align}); nothing can fit")
    return limit


@dataclass(frozen=True)
class Cuts:
    """What an overflow policy did: samples truncated / dropped / split and the tokens lost."""

    samples_truncated: int = 0
    tokens_truncated: int = 0
    samples_dropped: int = 0
    tokens_dropped: int = 0
    samples_split: int = 0

    def __add__(self, other: "Cuts") -> "Cuts":
        return Cuts(*(a + b for a, b in zip(astuple(self), astuple(other))))


@dataclass(frozen=True)
class Pieces:
    """Token ranges of input samples that each fit a pack.

    Attributes:
        sample_index, start, length: int64 ``[m]``: piece j is tokens
            ``start[j] : start[j] + length[j]`` of sample ``sample_index[j]``, in (sample, start) order.
        dropped: int64 ``[d]`` samples left out by ``overflow="drop"``.
        cuts: the counts of what was cut.
    """

    sample_index: np.ndarray
    start: np.ndarray
    length: np.ndarray
    dropped: np.ndarray
    cuts: Cuts


def overflow_error(index: int, length: int, pack_size: int, align: int, count: int = 1) -> SampleError:
    """The error of ``overflow="error"``: sample ``index`` has ``length`` tokens, too many for a
    pack (``count`` samples are)."""
    return SampleError.at(
        index,
        f" has {length} tokens"
        + (f" ({round_up(length, align)} after aligning to {align})" if align > 1 else "")
        + f", more than pack_size={pack_size}; {count} sample(s) are too long. "
        "Use overflow='truncate', 'split' or 'drop', or raise pack_size."
    )


def cut_overflow(lengths: np.ndarray, overflow: str, pack_size: int, align: int, *, over: np.ndarray | None = None,
                 names: np.ndarray | None = None) -> Pieces:
    """Apply ``overflow`` to the samples too long for a pack of ``pack_size`` at ``align``.

    Args:
        lengths: int64 ``[n]`` real lengths, each >= 1.
        overflow: one of :data:`OVERFLOW_POLICIES`: ``"error"`` raises :func:`overflow_error`
            naming the first over-long sample, ``"truncate"`` keeps its first
            :func:`usable_length` tokens, ``"split"`` cuts it into pieces of that length (all
            kept), ``"drop"`` leaves it out.
        over: bool ``[n]`` the samples to treat as over-long (default: longer than
            :func:`usable_length`; :func:`thdpack.plan_packs` adds those over the vision budget).
        names: int64 ``[n]`` what errors call the samples (default ``0..n-1``; a stream gives
            its positions).

    Returns:
        :class:`Pieces`; every sample not over-long is one whole piece.
    """
    limit = usable_length(pack_size, align)
    if over is None:
        over = lengths > limit
    n_over = int(over.sum())
    index = np.arange(lengths.size, dtype=np.int64)
    whole = Pieces(index, np.zeros(lengths.size, np.int64), lengths, np.zeros(0, np.int64), Cuts())
    if n_over == 0:
        return whole
    first = int(np.flatnonzero(over)[0])
    if overflow == "error":
        name = first if names is None else int(names[first])
        raise overflow_error(name, int(lengths[first]), pack_size, align, n_over)
    if overflow == "truncate":
        cuts = Cuts(samples_truncated=n_over, tokens_truncated=int((lengths[over] - limit).sum()))
        return Pieces(index, whole.start, np.minimum(lengths, limit), whole.dropped, cuts)
    if overflow == "drop":
        keep = ~over
        cuts = Cuts(samples_dropped=n_over, tokens_dropped=int(lengths[over].sum()))
        return Pieces(index[keep], whole.start[keep], lengths[keep], np.flatnonzero(over), cuts)
    return Pieces(*_split(lengths, limit), whole.dropped, Cuts(samples_split=n_over))


def _split(lengths: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every sample cut into pieces of ``limit`` tokens (the last one shorter): int64 ``[m]``
    ``(sample_index, start, length)`` in (sample, start) order, from int64 ``[n]`` ``lengths``."""
    n_pieces = -(-lengths // limit)
    sample_index = np.repeat(np.arange(lengths.size, dtype=np.int64), n_pieces)
    first_piece = np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    start = (np.arange(sample_index.size, dtype=np.int64) - first_piece) * limit
    return sample_index, start, np.minimum(limit, lengths[sample_index] - start)


@dataclass
class PackTotals:
    """The additive counts behind a :class:`PackStats` (plain ints), kept up to date pack by
    pack by a stream (:meth:`add_pack`, :meth:`add_cuts`) and saved in its ``state_dict``."""

    num_packs: int = 0
    num_samples: int = 0
    num_pieces: int = 0
    real_tokens: int = 0
    aligned_tokens: int = 0
    max_pieces_per_pack: int = 0
    min_pack_tokens: int = 0  # real tokens of the emptiest pack (0 without packs)
    max_pack_tokens: int = 0
    vision_patches: int = 0
    max_pack_vision: int = 0
    cuts: Cuts = Cuts()

    def add_pack(self, pieces: int, real_tokens: int, aligned_tokens: int) -> None:
        """Count one more pack of ``pieces`` pieces."""
        self.min_pack_tokens = min(self.min_pack_tokens, real_tokens) if self.num_packs else real_tokens
        self.max_pack_tokens = max(self.max_pack_tokens, real_tokens)
        self.max_pieces_per_pack = max(self.max_pieces_per_pack, pieces)
        self.num_packs += 1
        self.num_pieces += pieces
        self.real_tokens += real_tokens
        self.aligned_tokens += aligned_tokens

    def add_cuts(self, cuts: Cuts) -> None:
        """Count what an overflow policy cut."""
        self.cuts = self.cuts + cuts

    def as_dict(self) -> dict:
        """The counts as one flat dict of ints (keys :data:`PACK_TOTALS_KEYS`)."""
        return {**{name: getattr(self, name) for name in _COUNT_KEYS}, **asdict(self.cuts)}

    @classmethod
    def from_dict(cls, counts: dict) -> "PackTotals":
        """The inverse of :meth:`as_dict`."""
        cuts = Cuts(**{name: counts[name] for name in CUT_KEYS})
        return cls(**{name: counts[name] for name in _COUNT_KEYS}, cuts=cuts)


CUT_KEYS = tuple(f.name for f in fields(Cuts))
_COUNT_KEYS = tuple(f.name for f in fields(PackTotals) if f.name != "cuts")
PACK_TOTALS_KEYS = _COUNT_KEYS + CUT_KEYS


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

    @classmethod
    def from_packs(cls, length: np.ndarray, pack_offsets: np.ndarray, pack_size: int, *, align: int = 1,
                   num_samples: int | None = None, cuts: Cuts = Cuts(), vision_length: np.ndarray | None = None,
                   vision_budget: int | None = None) -> "PackStats":
        """The statistics of placed pieces.

        Args:
            length: int64 ``[m]`` real length of every piece, pack after pack.
            pack_offsets: int64 ``[num_packs + 1]``: pack k holds pieces ``pack_offsets[k]:pack_offsets[k+1]``.
            pack_size, align: the budget and the multiple every piece was rounded up to.
            num_samples: input samples given to the planner (default ``m``).
            cuts: what the overflow policy cut.
            vision_length, vision_budget: int64 ``[m]`` vision patches per piece and the
                per-pack budget, for plans made with one.
        """
        return cls.from_totals(pack_totals(length, pack_offsets, align, num_samples, cuts, vision_length),
                               pack_size, vision_budget)

    @classmethod
    def from_totals(cls, totals: PackTotals, pack_size: int, vision_budget: int | None = None) -> "PackStats":
        """The statistics behind ``totals``: the ratios and the lower bound are derived here, and only here."""
        t = totals
        num_packs = t.num_packs
        lower_bound = -(-t.aligned_tokens // pack_size)
        vision = {}
        if vision_budget is not None:
            lower_bound = max(lower_bound, -(-t.vision_patches // vision_budget))
            vision = dict(vision_budget=int(vision_budget), vision_patches=t.vision_patches,
                          max_pack_vision=t.max_pack_vision)
        return cls(
            num_packs=num_packs, num_samples=t.num_samples, num_pieces=t.num_pieces, lower_bound=lower_bound,
            pack_size=int(pack_size), real_tokens=t.real_tokens, aligned_tokens=t.aligned_tokens,
            efficiency=t.real_tokens / (num_packs * pack_size) if num_packs else 0.0,
            packing_factor=t.num_pieces / num_packs if num_packs else 0.0,
            max_samples_per_pack=t.max_pieces_per_pack,
            min_pack_fill=t.min_pack_tokens / pack_size if num_packs else 0.0,
            max_pack_fill=t.max_pack_tokens / pack_size if num_packs else 0.0,
            **asdict(t.cuts), **vision,
        )

    @property
    def cuts(self) -> Cuts:
        """The truncated / dropped / split counts."""
        return Cuts(**{name: getattr(self, name) for name in CUT_KEYS})

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


def pack_sums(values: np.ndarray, pack_offsets: np.ndarray) -> np.ndarray:
    """``[num_packs]`` sum of ``values`` (``[m]``, pack after pack) over each pack."""
    if len(pack_offsets) == 1:
        return np.zeros(0, values.dtype)
    return np.add.reduceat(values, pack_offsets[:-1])


def pack_totals(length: np.ndarray, pack_offsets: np.ndarray, align: int = 1, num_samples: int | None = None,
                cuts: Cuts = Cuts(), vision_length: np.ndarray | None = None) -> PackTotals:
    """The :class:`PackTotals` of placed pieces (arguments as :meth:`PackStats.from_packs`)."""
    num_packs = len(pack_offsets) - 1
    fill = pack_sums(length, pack_offsets)
    totals = PackTotals(
        num_packs=num_packs, num_samples=int(length.size if num_samples is None else num_samples),
        num_pieces=int(length.size), real_tokens=int(length.sum()), aligned_tokens=int(round_up(length, align).sum()),
        max_pieces_per_pack=int(np.diff(pack_offsets).max()) if num_packs else 0,
        min_pack_tokens=int(fill.min()) if num_packs else 0, max_pack_tokens=int(fill.max()) if num_packs else 0,
        cuts=cuts,
    )
    if vision_length is not None:
        totals.vision_patches = int(vision_length.sum())
        totals.max_pack_vision = int(pack_sums(vision_length, pack_offsets).max()) if num_packs else 0
    return totals
