"""A pack's vision work split over its context-parallel (CP) ranks, each rank encoding a contiguous
share of the pack's image and video frames balanced by their FLOPs (integers only; the tensors are
:mod:`thdpack.parallel.vision_gather`'s).

Without it every CP rank runs the vision tower on the whole pack. The Qwen-VL towers (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL, Qwen3.5) attend within one frame (temporal patch) of an image or video, and all
else they do is per patch or per frame (patch embedding, MLPs, mergers, deepstack mergers, rotary and
interpolated position embeddings, Qwen2.5-VL's windows, which never cross a frame), so an item of grid
``(t, h, w)`` encodes exactly as ``t`` items of grid ``(1, h, w)``. A **unit** is one such frame:
``h·w`` pixel rows, ``h·w / m²`` merged tokens (``m = spatial_merge_size``). Units run images first,
then videos, each item's frames in order: the order of ``vision_cu_seqlens`` and of the model's image
and video embeddings, so the ranks' outputs concatenated in rank order are the pack's embeddings::

    unit       i0   i1   v0f0 v0f1 v0f2 v0f3 v1f0 v1f1  (v0f2: frame 2 of video 0)
    cost       9    4    3    3    3    3    5    5     total 35, even share 11.7
    cp = 3     └ rank 0 ┘└ rank 1 ──────────┘└ rank 2 ┘
    rank cost  13        12                  10         largest 13: no contiguous split does better

Details: docs/vlm.md, "Vision split: what a unit costs, how the cuts are chosen".
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left, bisect_right
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from thdpack.common.align import check_bool, check_int
from thdpack.common.model_config import config_int
from thdpack.common.samples import get_field
from thdpack.flops.coefficients import flops_coefficients
from thdpack.flops.vision_stats import grid_rows, vision_config_of, vision_seqlen_stats
from thdpack.parallel.groups import check_ranks

IMAGE, VIDEO = 0, 1
# costs are int64: a pack whose vision costs more FLOPs than this is costed in units of 2**k FLOPs
_COST_LIMIT = 2**62


@dataclass(frozen=True)
class VisionCost:
    """FLOPs of one unit (a frame of ``h × w`` patches) of a model's vision tower.

    ``per_patch``, ``per_frame_square``, ``per_window_square``: the coefficients of
    :func:`thdpack.flops.flops_coefficients` multiplying ``vision_patches``,
    ``vision_seqlen_squared_sum`` and ``vision_window_seqlen_squared_sum`` (training FLOPs);
    ``config`` the model config the window sums read; ``spatial_merge_size`` ``m``.
    """

    per_patch: int
    per_frame_square: int
    per_window_square: int
    spatial_merge_size: int
    config: object = None
    _frame_costs: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)  # (h, w) -> FLOPs

    @classmethod
    def from_config(cls, model_config) -> "VisionCost":
        """The unit costs of ``model_config`` (a transformers config or its dict, with a ``vision_config``),
        or ``model_config`` itself when it is a :class:`VisionCost`."""
        if isinstance(model_config, VisionCost):
            return model_config
        vision = vision_config_of(model_config)
        if vision is None:
            raise ValueError("the model config has no vision_config; pass the VLM's config "
                             "(Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3.5)")
        coefficients = flops_coefficients(model_config)
        window = coefficients.per("vision_window_seqlen_squared_sum")
        return cls(per_patch=coefficients.per("vision_patches"),
                   per_frame_square=coefficients.per("vision_seqlen_squared_sum"),
                   per_window_square=window,
                   spatial_merge_size=config_int(vision, "spatial_merge_size", 2, where="vision_config."),
                   config=model_config if window else None)

    def unit_costs(self, hw: np.ndarray) -> list[int]:
        """FLOPs of frames ``hw`` (int ``[k, 2]``: patches along height and width), Python ints."""
        costs, seen = [], self._frame_costs
        for h, w in np.asarray(hw, dtype=np.int64).reshape(-1, 2).tolist():
            if (h, w) not in seen:
                p = h * w
                window = 0
                if self.per_window_square:
                    window = vision_seqlen_stats([[1, h, w]], self.config).window_seqlen_squared_sum
                seen[h, w] = self.per_patch * p + self.per_frame_square * p * p + self.per_window_square * window
            costs.append(seen[h, w])
        return costs


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class VisionSplit:
    """Which CP rank encodes which frames of a pack (:func:`plan_vision_split`).

    Attributes:
        cp_size: the CP ranks.
        spatial_merge_size: ``m``; a unit of ``h × w`` patches gives ``h·w / m²`` merged tokens.
        unit_kind: int8 ``[U]``, 0 image frame, 1 video frame; images first.
        unit_item: int64 ``[U]``, the unit's row of ``image_grid_thw`` / ``video_grid_thw``.
        unit_hw: int64 ``[U, 2]``, the unit's ``(h, w)`` in patches.
        unit_cost: int64 ``[U]``, its FLOPs (:class:`VisionCost`; in units of ``2**cost_shift``).
        cuts: int64 ``[cp + 1]``: rank ``r`` encodes units ``cuts[r] : cuts[r + 1]``.
        placeholder: an empty rank encodes one ``m × m`` placeholder frame (one merged token, dropped
            by the gather) rather than nothing.
        cost_shift: costs are in units of ``2**cost_shift`` FLOPs (0 unless the pack costs >= 2**62).
    """

    cp_size: int
    spatial_merge_size: int
    unit_kind: np.ndarray
    unit_item: np.ndarray
    unit_hw: np.ndarray
    unit_cost: np.ndarray
    cuts: np.ndarray
    placeholder: bool = True
    cost_shift: int = 0

    @property
    def num_units(self) -> int:
        return int(self.unit_kind.size)

    @property
    def num_image_units(self) -> int:
        return int(np.count_nonzero(self.unit_kind == IMAGE))

    @property
    def unit_rows(self) -> np.ndarray:
        """int64 ``[U]`` pixel rows (patches) of each unit, ``h·w``."""
        return self.unit_hw[:, 0] * self.unit_hw[:, 1]

    @property
    def unit_tokens(self) -> np.ndarray:
        """int64 ``[U]`` merged tokens of each unit, ``h·w / m²``."""
        return self.unit_rows // self.spatial_merge_size**2

    @property
    def num_image_tokens(self) -> int:
        """Merged tokens of the pack's images: the gathered embeddings' first rows, videos after them."""
        return int(self.unit_tokens[self.unit_kind == IMAGE].sum())

    @property
    def num_tokens(self) -> int:
        return int(self.unit_tokens.sum())

    @property
    def rank_tokens(self) -> np.ndarray:
        """int64 ``[cp]`` merged tokens each rank contributes to the gathered embeddings."""
        prefix = np.concatenate([[0], np.cumsum(self.unit_tokens)])
        return prefix[self.cuts[1:]] - prefix[self.cuts[:-1]]

    @property
    def local_tokens(self) -> np.ndarray:
        """int64 ``[cp]`` rows of each rank's tower output: :attr:`rank_tokens`, or 1 on an empty rank
        that encodes a placeholder."""
        out = self.rank_tokens.copy()
        if self.placeholder and self.num_units:
            out[self.cuts[1:] == self.cuts[:-1]] = 1
        return out

    @property
    def rank_costs(self) -> np.ndarray:
        """int64 ``[cp]`` FLOPs of each rank's units (placeholders not counted)."""
        prefix = np.concatenate([[0], np.cumsum(self.unit_cost)])
        return prefix[self.cuts[1:]] - prefix[self.cuts[:-1]]

    @property
    def straggler(self) -> float:
        """The most loaded rank's cost over the even share ``total / cp`` (1.0: perfectly even; every rank
        encoding the whole pack, as without the split, is ``cp``); 1.0 without units."""
        total = float(self.unit_cost.sum())
        return float(self.rank_costs.max()) * self.cp_size / total if total else 1.0

    def item_grids(self) -> tuple[np.ndarray, np.ndarray]:
        """int64 ``[k, 3]`` twice: the ``image_grid_thw`` and ``video_grid_thw`` the plan was made from
        (each item's frames counted back into its ``t``): what a batch must hold to be the plan's."""
        out = []
        for kind in (IMAGE, VIDEO):
            mine = self.unit_kind == kind
            _, first, frames = np.unique(self.unit_item[mine], return_index=True, return_counts=True)
            out.append(np.column_stack([frames, self.unit_hw[mine][first]]).astype(np.int64).reshape(-1, 3))
        return out[0], out[1]

    def is_empty(self, rank: int) -> bool:
        """True when ``rank`` has no unit of the pack."""
        check_int(rank, "rank", 0, below=self.cp_size)
        return bool(self.cuts[rank] == self.cuts[rank + 1])

    def rank_pixel_rows(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``((start, stop), (start, stop))``: the rows of ``pixel_values`` and of ``pixel_values_videos``
        that ``rank`` encodes, in that order (a rank's units are contiguous, so each is one range)."""
        check_int(rank, "rank", 0, below=self.cp_size)
        rows = self.unit_rows
        out = []
        for kind in (IMAGE, VIDEO):
            mine = self.unit_kind == kind
            start = np.concatenate([[0], np.cumsum(rows * mine)])  # row offset of every unit in its kind
            lo, hi = int(self.cuts[rank]), int(self.cuts[rank + 1])
            out.append((int(start[lo]), int(start[hi])))
        return out[0], out[1]

    def rank_grid_thw(self, rank: int) -> np.ndarray:
        """int64 ``[k, 3]`` grid of ``rank``'s units for the tower, consecutive frames of one item merged
        into one row ``(frames, h, w)``; ``[[1, m, m]]`` on an empty rank with a placeholder."""
        check_int(rank, "rank", 0, below=self.cp_size)
        lo, hi = int(self.cuts[rank]), int(self.cuts[rank + 1])
        if lo == hi:
            m = self.spatial_merge_size
            return np.array([[1, m, m]] if self.placeholder and self.num_units else np.zeros((0, 3)), np.int64)
        key = self.unit_kind[lo:hi].astype(np.int64) * (1 << 40) + self.unit_item[lo:hi]
        first = np.flatnonzero(np.concatenate([[True], key[1:] != key[:-1]]))
        frames = np.diff(np.append(first, hi - lo))
        return np.column_stack([frames, self.unit_hw[lo:hi][first]]).astype(np.int64)

    def __repr__(self) -> str:
        return (f"VisionSplit(cp_size={self.cp_size}, units={self.num_units} ({self.num_image_units} image frames), "
                f"tokens per rank={self.rank_tokens.tolist()}, straggler={self.straggler:.4f})")


def plan_vision_split(batch, cp_size: int, model_config, *, placeholder: bool = True) -> VisionSplit:
    """Which CP rank encodes which image and video frames of a VLM pack, balanced by FLOPs.

    ::

        split = plan_vision_split(batch, cp, model.config)         # the same on every CP rank
        pixels, grid = vision_rank_inputs(batch, split, cp_rank)    # thdpack.parallel.vision_gather
        out = model.model.visual(pixels, grid_thw=grid)
        embeds, *deepstack = gather_vision_embeddings([out.pooler_output, *deepstack_of(out)], split, cp_group)
        # embeds: [num_tokens, D], images then videos, equal to the tower run on the whole pack

    Args:
        batch: a VLM :class:`thdpack.ThdBatch` (built with ``model_config``), one of its CP shards
            (the same extras), or a mapping with ``image_grid_thw`` / ``video_grid_thw`` (int ``[k, 3]``,
            None or absent without images / videos), such as ``batch.extras``.
        cp_size: CP ranks (an integer >= 1, below 2**20: :func:`thdpack.parallel.groups.check_ranks`).
        model_config: the VLM's transformers config or its dict (its ``vision_config`` sizes the
            costs and gives ``spatial_merge_size``), or a :class:`VisionCost` (``VisionCost.from_config``
            once, for many packs: the config is read once and each frame size costed once).
        placeholder: an empty rank (fewer units than ranks) encodes one placeholder frame, so every rank
            runs the tower (see the module docstring); False: it encodes nothing and gathers a
            ``[0, D]`` tensor. A bool (:func:`thdpack.common.align.check_bool`).

    Returns:
        a :class:`VisionSplit` (integers only; the batch is not changed).
    """
    check_ranks(cp_size, "cp_size", "the context-parallel ranks")
    placeholder = check_bool(placeholder, "placeholder")
    cost = VisionCost.from_config(model_config)
    extras = batch if isinstance(batch, Mapping) else getattr(batch, "extras", None)
    if extras is None:
        raise TypeError(f"batch must be a ThdBatch or a mapping of its vision extras, got {type(batch).__name__}")
    kinds, items, hws = [], [], []
    for kind, field in ((IMAGE, "image_grid_thw"), (VIDEO, "video_grid_thw")):
        value = extras.get(field)
        grid = grid_rows([] if value is None else value)
        _check_grid(grid, field, cost.spatial_merge_size)
        frames = grid[:, 0]
        items.append(np.repeat(np.arange(grid.shape[0], dtype=np.int64), frames))
        hws.append(np.repeat(grid[:, 1:], frames, axis=0))
        kinds.append(np.full(int(frames.sum()), kind, np.int8))
    hw = np.concatenate(hws).reshape(-1, 2).astype(np.int64)
    costs, shift = _int64_costs(cost.unit_costs(hw))
    return VisionSplit(cp_size=int(cp_size), spatial_merge_size=cost.spatial_merge_size,
                       unit_kind=np.concatenate(kinds), unit_item=np.concatenate(items), unit_hw=hw,
                       unit_cost=costs, cuts=balanced_cuts(costs, cp_size), placeholder=placeholder,
                       cost_shift=shift)


def sample_vision_costs(samples, model_config) -> np.ndarray:
    """int64 ``[n]``: the vision tower's training FLOPs of each sample (every frame of its
    ``image_grid_thw`` and ``video_grid_thw``, as :class:`VisionCost` costs them): the per-sample cost a
    data-parallel balance of whole samples needs (``docs/vlm.md``, "Data-parallel ranks")."""
    cost = VisionCost.from_config(model_config)
    out = np.zeros(len(samples), np.int64)
    for i, sample in enumerate(samples):
        for field in ("image_grid_thw", "video_grid_thw"):
            value = get_field(sample, field, i)
            grid = grid_rows([] if value is None else value)
            if grid.shape[0]:
                out[i] += int(np.dot(grid[:, 0], cost.unit_costs(grid[:, 1:])))
    return out


def _check_grid(grid: np.ndarray, field: str, merge: int) -> None:
    bad = np.flatnonzero((grid < 1).any(axis=1) | (grid[:, 1] % merge != 0) | (grid[:, 2] % merge != 0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{field}[{i}] = {grid[i].tolist()}: t, h, w must be >= 1 and h, w multiples of "
                         f"spatial_merge_size={merge}")


def _int64_costs(costs: list[int]) -> tuple[np.ndarray, int]:
    """``costs`` as int64 whose sum stays below 2**62: divided by ``2**shift`` (rounded up) when larger."""
    shift = max(0, sum(costs).bit_length() - _COST_LIMIT.bit_length() + 1)
    return np.array([-(-c >> shift) for c in costs], dtype=np.int64), shift


def balanced_cuts(costs, parts: int) -> np.ndarray:
    """Cut units of ``costs`` (int ``[U]``, >= 0) into ``parts`` contiguous ranges with the least largest
    range cost (``parts`` below 2**20, as a number of ranks).

    Returns int64 ``[parts + 1]``: range ``k`` is ``cuts[k] : cuts[k + 1]``. The largest range cost is the
    least any contiguous split reaches (a binary search on the integer bottleneck ``B``, each step a greedy
    fill); among the splits that reach it, each cut, first to last, lies as near an even share of the
    cost still left over the ranges still left as ``B`` allows, and every range holds at least one unit when
    ``U >= parts``. With ``U < parts`` unit ``k`` is range ``k``
    and the ranges after them are empty.
    """
    check_ranks(parts, "parts", "the ranges: ranks")
    costs = np.asarray(costs, dtype=np.int64).reshape(-1)
    if costs.size and int(costs.min()) < 0:
        raise ValueError("costs must be >= 0")
    n = costs.size
    if n <= parts:
        return np.concatenate([np.arange(n + 1), np.full(parts - n, n)]).astype(np.int64)
    prefix = [0, *np.cumsum(costs).tolist()]  # Python ints: bisect on a list beats numpy on scalars
    bottleneck = _least_bottleneck(prefix, parts, int(costs.max()))
    return _cuts_near_even(prefix, parts, bottleneck)


def _fits(prefix: list[int], parts: int, bottleneck: int) -> bool:
    """Whether the units fit in ``parts`` ranges of cost <= ``bottleneck`` (greedy: each range as long as it can be)."""
    pos, n = 0, len(prefix) - 1
    for _ in range(parts):
        pos = bisect_right(prefix, prefix[pos] + bottleneck) - 1
        if pos == n:
            return True
    return False


def _least_bottleneck(prefix: list[int], parts: int, largest: int) -> int:
    """The least ``B`` the units fit in ``parts`` ranges of: between ``max(largest, total / parts)`` and that
    plus ``largest`` (a greedy fill of ranges of ``total / parts + largest`` always fits)."""
    total = prefix[-1]
    lo = max(largest, -(-total // parts))
    hi = min(total, -(-total // parts) + largest)
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(prefix, parts, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cuts_near_even(prefix: list[int], parts: int, bottleneck: int) -> np.ndarray:
    """Cuts of ranges of cost <= ``bottleneck``, each as near the even share as that allows.

    ``tail[j]``: the first unit from which the remaining units fit in ``j`` ranges (greedy from the end).
    Cut ``k`` (the end of range ``k − 1``, which starts at ``a``) may lie anywhere in ``[tail[parts − k],
    furthest]`` (``furthest``: the last end within ``bottleneck`` of ``a``), which is never empty, and
    keeps one unit for every range left; it is put nearest to an even share of what is left."""
    n = len(prefix) - 1
    tail = [n]
    for _ in range(parts):
        tail.append(bisect_left(prefix, prefix[tail[-1]] - bottleneck))
    cuts = [0]
    total = prefix[-1]
    for k in range(1, parts):
        a = cuts[-1]
        furthest = bisect_right(prefix, prefix[a] + bottleneck) - 1
        lo = max(tail[parts - k], a + 1)
        hi = min(furthest, n - (parts - k))
        target = prefix[a] + (total - prefix[a]) / (parts - k + 1)  # what is left, shared by the ranks left
        j = min(max(bisect_left(prefix, target), lo), hi)
        if j > lo and abs(prefix[j - 1] - target) <= abs(prefix[j] - target):
            j -= 1
        cuts.append(j)
    return np.array(cuts + [n], np.int64)
