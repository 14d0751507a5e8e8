"""Packing a stream with a bounded buffer, resumable exactly.

For data that does not fit a global plan (``IterableDataset``, ``datasets``
streaming): samples arrive one by one; each goes to the open pack it fits
best (best fit over at most ``buffer_size`` open packs); when too many packs
are open, the fullest is emitted. Memory holds only the open packs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from thdpack.common.align import check_bool, check_int, round_up
from thdpack.loaders.collate import with_sample_index
from thdpack.planning.options import plan_options
from thdpack.planning.packing import PACK_TOTALS_KEYS, PackStats, PackTotals, cut_overflow
from thdpack.loaders.sampler import check_state_dict, distributed_default
from thdpack.common.samples import SampleError, check_sample_stream, get_field, slice_sample, to_int_array


@dataclass
class _OpenPack:
    room: int
    items: list = field(default_factory=list)
    real_tokens: int = 0


# the planning keywords a stream takes (best fit over its open packs: no algorithm, seed or vision budget)
_STREAM_OPTIONS = ("pack_size", "align", "overflow", "max_samples_per_pack")


def _default_length(sample, index: int) -> int:
    return int(to_int_array(get_field(sample, "input_ids", index, required=True), sample=index, field="input_ids").size)


class StreamingPacker(IterableDataset):
    """An iterable of packs (each a list of samples) over an iterable of samples.

    Use it as ``DataLoader(StreamingPacker(stream, 4096), batch_size=None, collate_fn=ThdCollator())``.

    Each sample of a pack (a mapping) is yielded as a dict with ``"sample_index"``: its
    position in the stream (all shares counted; a piece of a split sample has its sample's),
    unless it has that field already; :class:`thdpack.ThdCollator` puts it in
    ``batch.sample_index``. Other samples are yielded as they are.

    Each DP rank × DataLoader worker packs its own share of the stream (sample ``i`` to share ``i % shares``):
    docs/loaders.md, "StreamingPacker: stream shares".

    Args:
        samples: any iterable of samples (mappings with ``input_ids``); iterating
            it again must give the same samples in the same order.
        pack_size, **plan_keywords: the planning keywords ``pack_size``, ``align``, ``overflow``,
            ``max_samples_per_pack`` (docs/loaders.md).
        buffer_size: most packs held open at once (memory and reordering bound).
            Larger buffers pack tighter; see ``benchmarks/balance.py``.
        length_fn: ``(sample, index) -> int`` token count (default: ``len(input_ids)``): an
            integer >= 1 (a float, a negative count or None is a ``ValueError`` naming the sample).
        num_replicas, rank: data-parallel world; default from ``torch.distributed``.

    ``stats`` is the :class:`thdpack.planning.PackStats` of the packs emitted so far (this
    share's samples only), counted as :func:`thdpack.plan_packs` counts a plan.

    Resuming: ``state_dict()`` / ``load_state_dict()`` (with workers: torchdata's ``StatefulDataLoader``):
    docs/resume.md, "StreamingPacker: what its state holds".
    """

    def __init__(
        self,
        samples: Iterable,
        pack_size: int | None = None,
        *,
        buffer_size: int = 64,
        length_fn: Callable | None = None,
        skip_consumed: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
        **plan_keywords,
    ):
        check_sample_stream(samples, "StreamingPacker")
        options = plan_options("StreamingPacker", {"pack_size": pack_size, **plan_keywords}, fields=_STREAM_OPTIONS)
        check_int(buffer_size, "buffer_size", 1)
        if length_fn is not None and not callable(length_fn):
            raise TypeError(f"length_fn must be a function (sample, index) -> int, got {type(length_fn).__name__}")
        self.options = options
        self.samples = samples
        self.buffer_size = buffer_size
        # the options this packer reads, by name (and in its state's fingerprint)
        self.pack_size, self.align, self.overflow = options.pack_size, options.align, options.overflow
        self.max_samples_per_pack, self.limit = options.max_samples_per_pack, options.usable_length
        self.length_fn = length_fn or _default_length
        self.skip_consumed = check_bool(skip_consumed, "skip_consumed")
        self.num_replicas, self.rank = distributed_default(num_replicas, rank)
        self._reset()

    def _reset(self) -> None:
        self._consumed = 0
        self._open: list[_OpenPack] = []
        self._ready: list[list] = []
        self._totals = PackTotals()
        self._resumed = False
        self._share: tuple[int, int] | None = None  # (share, shares) of the loaded state, or of the last run

    @property
    def stats(self) -> PackStats:
        """The :class:`thdpack.planning.PackStats` of the packs emitted so far."""
        return PackStats.from_totals(self._totals, self.pack_size)

    def _current_share(self) -> tuple[int, int]:
        """``(share, shares)`` of the stream this process packs: DP rank-major, DataLoader worker-minor."""
        info = get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        return self.rank * workers + worker, self.num_replicas * workers

    # ---- packing --------------------------------------------------------
    def _pieces(self, sample, index: int, length: int):
        """(sample, length) pieces that fit a pack: the sample whole, or what the overflow
        policy (:func:`thdpack.planning.packing.cut_overflow`) keeps of it; each with its
        stream position ``index`` as ``"sample_index"`` (:func:`thdpack.loaders.collate.with_sample_index`)."""
        if length < 1:
            raise SampleError.at(index, " is empty; every sample needs at least one token")
        self._totals.num_samples += 1
        if length <= self.limit:
            return [(with_sample_index(sample, index), length)]
        cut = cut_overflow(np.array([length], np.int64), self.overflow, self.pack_size, self.align,
                           names=np.array([index]))
        self._totals.add_cuts(cut.cuts)
        return [(with_sample_index(slice_sample(sample, a, a + n, index=index), index), n)
                for a, n in zip(cut.start.tolist(), cut.length.tolist())]

    def _length(self, sample, index: int) -> int:
        """``length_fn(sample, index)``, checked to be an integer >= 1 (a count of tokens)."""
        length = self.length_fn(sample, index)
        if self.length_fn is _default_length:
            return length  # len(input_ids): 0 is an empty sample, named as such
        check_int(length, "length_fn(sample, index)", 1, hint=" (the sample's token count)",
                  error=lambda message: SampleError.at(index, f": {message}"))
        return int(length)

    def _place(self, sample, length: int) -> None:
        size = round_up(length, self.align)
        best = None
        for pack in self._open:
            if pack.room >= size and (best is None or pack.room < best.room):
                best = pack
        if best is None:
            best = _OpenPack(room=self.pack_size)
            self._open.append(best)
        best.room -= size
        best.items.append(sample)
        best.real_tokens += length
        full = best.room < self.align or (
            self.max_samples_per_pack is not None and len(best.items) >= self.max_samples_per_pack
        )
        if full:
            self._emit(best)
        elif len(self._open) > self.buffer_size:
            self._emit(min(self._open, key=lambda p: p.room))  # the fullest; ties: the oldest

    def _emit(self, pack: _OpenPack) -> None:
        self._open.remove(pack)
        self._ready.append(pack.items)
        self._totals.add_pack(len(pack.items), pack.real_tokens, self.pack_size - pack.room)

    def __iter__(self) -> Iterator[list]:
        share, shares = self._current_share()
        if self._resumed:
            self._check_share(self._share)
        else:
            self._reset()
        self._resumed, self._share = False, (share, shares)
        source = iter(self.samples)
        if self._consumed and self.skip_consumed:
            source = itertools.islice(source, self._consumed, None)
        while True:
            while self._ready:
                yield self._ready.pop(0)
            sample = next(source, _END)
            if sample is _END:
                break
            index = self._consumed
            if index % shares == share:
                for piece, length in self._pieces(sample, index, self._length(sample, index)):
                    self._place(piece, length)
            self._consumed += 1
        for pack in list(self._open):  # end of stream: flush in opening order
            self._emit(pack)
        while self._ready:
            yield self._ready.pop(0)

    # ---- resume ---------------------------------------------------------
    def _fingerprint(self) -> str:
        return (f"pack_size={self.pack_size}, buffer_size={self.buffer_size}, align={self.align}, "
                f"overflow={self.overflow!r}, max_samples_per_pack={self.max_samples_per_pack}")

    def state_dict(self) -> dict:
        """A plain, picklable snapshot: ``{"consumed", "open", "ready", "stats", "share", "fingerprint"}``
        (``stats``: the :class:`~thdpack.planning.packing.PackTotals` behind :attr:`stats`, as a dict)."""
        return {
            "consumed": self._consumed,
            "open": [(p.room, list(p.items), p.real_tokens) for p in self._open],
            "ready": [list(items) for items in self._ready],
            "stats": self._totals.as_dict(),
            "share": list(self._share or self._current_share()),
            "fingerprint": self._fingerprint(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state`` (see the class docstring).

        Raises:
            ValueError: ``state`` is not such a dict, lacks a key, holds a negative or
                non-integer count, was saved by a packer with other settings, or by
                another DP rank / DataLoader worker.
        """
        _check_state(state, self._fingerprint())
        self._check_share(tuple(state["share"]))
        self._consumed = int(state["consumed"])
        self._open = [_OpenPack(room, list(items), real) for room, items, real in state["open"]]
        self._ready = [list(items) for items in state["ready"]]
        self._totals = PackTotals.from_dict(state["stats"])
        self._share = tuple(state["share"])
        self._resumed = True

    def _check_share(self, saved: tuple[int, int]) -> None:
        here = self._current_share()
        if tuple(saved) != here:
            raise ValueError(
                f"state_dict['share'] is share {saved[0]} of {saved[1]}, but this packer reads share {here[0]} of "
                f"{here[1]} (rank · num_workers + worker); resume every rank and worker from its own state, with "
                "the same num_replicas and num_workers (StatefulDataLoader does this per worker)"
            )


_STATE_KEYS = ("consumed", "open", "ready", "stats", "share", "fingerprint")


def _check_state(state, fingerprint: str) -> None:
    """Keys, types and settings of a :meth:`StreamingPacker.state_dict`; one ValueError naming the key."""
    check_state_dict(state, _STATE_KEYS, "StreamingPacker", _check_state_values)
    if state["fingerprint"] != fingerprint:
        raise ValueError(
            f"state_dict was saved by a StreamingPacker with {state['fingerprint']}, but this one has {fingerprint}; "
            "resume with the same settings"
        )


def _check_state_values(state: dict) -> None:
    check_int(state["consumed"], "state_dict['consumed']", 0)
    for key in ("open", "ready"):
        if not isinstance(state[key], (list, tuple)):
            raise ValueError(f"state_dict[{key!r}] must be a list, got {type(state[key]).__name__}")
    if any(not isinstance(p, (list, tuple)) or len(p) != 3 for p in state["open"]):
        raise ValueError("state_dict['open'] must hold (room, samples, real_tokens) triples")
    _check_totals(state["stats"])
    share = state["share"]
    if not isinstance(share, (list, tuple)) or len(share) != 2:
        raise ValueError(f"state_dict['share'] must be [share, shares], got {share!r}")
    check_int(share[1], "state_dict['share'][1]", 1)
    check_int(share[0], "state_dict['share'][0]", 0)


def _check_totals(totals) -> None:
    """``state_dict['stats']``: a dict of the :class:`~thdpack.planning.packing.PackTotals` counts, each an integer >= 0."""
    if not isinstance(totals, dict):
        raise ValueError(f"state_dict['stats'] must be a dict, got {type(totals).__name__}")
    if sorted(totals) != sorted(PACK_TOTALS_KEYS):
        raise ValueError(f"state_dict['stats'] must have the keys {', '.join(PACK_TOTALS_KEYS)}, got {sorted(totals)}")
    for key in PACK_TOTALS_KEYS:
        check_int(totals[key], f"state_dict['stats'][{key!r}]", 0)


_END = object()
