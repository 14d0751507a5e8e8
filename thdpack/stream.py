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

from torch.utils.data import IterableDataset

from thdpack.plan import OVERFLOW_POLICIES
from thdpack.samples import get_field, slice_sample, to_int_array


@dataclass
class _OpenPack:
    room: int
    items: list = field(default_factory=list)
    real_tokens: int = 0


def _default_length(sample, index: int) -> int:
    return int(to_int_array(get_field(sample, "input_ids", index, required=True), sample=index, field="input_ids").size)


class StreamingPacker(IterableDataset):
    """An iterable of packs (each a list of samples) over an iterable of samples.

    Use it as ``DataLoader(StreamingPacker(stream, 4096), batch_size=None,
    collate_fn=ThdCollator())`` (``num_workers=0``, or give each worker its own
    shard of the stream).

    Args:
        samples: any iterable of samples (mappings with ``input_ids``).
        pack_size: token budget of a pack, after rounding each sample up to ``align``.
        buffer_size: most packs held open at once (memory and reordering bound).
            Larger buffers pack tighter; see ``benchmarks/balance.py``.
        align: per-sample multiple (:func:`thdpack.cp_pad_multiple`).
        overflow: ``"error"``, ``"truncate"``, ``"split"`` or ``"drop"`` for a
            sample longer than ``pack_size`` (as in :func:`thdpack.plan_packs`).
        max_samples_per_pack: optional cap on samples per pack.
        length_fn: ``(sample, index) -> int`` token count (default: ``len(input_ids)``).

    Resuming: ``state_dict()`` holds the number of input samples consumed, the
    open packs (with their samples) and packs decided but not yet yielded.
    After ``load_state_dict(state)``, iterating a fresh packer over the same
    stream skips the consumed samples (or, with ``skip_consumed=False``, expects
    the stream itself to resume after them) and yields exactly the packs an
    uninterrupted run would have yielded next.
    """

    def __init__(
        self,
        samples: Iterable,
        pack_size: int,
        *,
        buffer_size: int = 64,
        align: int = 1,
        overflow: str = "error",
        max_samples_per_pack: int | None = None,
        length_fn: Callable | None = None,
        skip_consumed: bool = True,
    ):
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        for name, value in (("pack_size", pack_size), ("buffer_size", buffer_size), ("align", align)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.limit = pack_size // align * align
        if self.limit == 0:
            raise ValueError(f"pack_size ({pack_size}) is smaller than align ({align}); nothing can fit")
        self.samples = samples
        self.pack_size = pack_size
        self.buffer_size = buffer_size
        self.align = align
        self.overflow = overflow
        self.max_samples_per_pack = max_samples_per_pack
        self.length_fn = length_fn or _default_length
        self.skip_consumed = skip_consumed
        self._reset()

    def _reset(self) -> None:
        self._consumed = 0
        self._open: list[_OpenPack] = []
        self._ready: list[list] = []
        self.stats = {"packs": 0, "real_tokens": 0, "samples_truncated": 0, "tokens_truncated": 0,
                      "samples_dropped": 0, "tokens_dropped": 0, "samples_split": 0}
        self._resumed = False

    # ---- packing --------------------------------------------------------
    def _pieces(self, sample, index: int, length: int):
        """(sample, length) pieces that fit a pack, applying the overflow policy."""
        if length < 1:
            raise ValueError(f"sample {index} is empty; every sample needs at least one token")
        if length <= self.limit:
            return [(sample, length)]
        if self.overflow == "error":
            raise ValueError(
                f"sample {index} has {length} tokens, more than pack_size={self.pack_size}"
                + (f" after aligning to {self.align}" if self.align > 1 else "")
                + "; use overflow='truncate', 'split' or 'drop'"
            )
        if self.overflow == "drop":
            self.stats["samples_dropped"] += 1
            self.stats["tokens_dropped"] += length
            return []
        if self.overflow == "truncate":
            self.stats["samples_truncated"] += 1
            self.stats["tokens_truncated"] += length - self.limit
            return [(slice_sample(sample, 0, self.limit), self.limit)]
        self.stats["samples_split"] += 1
        return [
            (slice_sample(sample, a, min(a + self.limit, length)), min(self.limit, length - a))
            for a in range(0, length, self.limit)
        ]

    def _place(self, sample, length: int) -> None:
        size = -(-length // self.align) * self.align
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
        self.stats["packs"] += 1
        self.stats["real_tokens"] += pack.real_tokens

    def __iter__(self) -> Iterator[list]:
        if not self._resumed:
            self._reset()
        self._resumed = False
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
            for piece, length in self._pieces(sample, index, self.length_fn(sample, index)):
                self._place(piece, length)
            self._consumed += 1
        for pack in list(self._open):  # end of stream: flush in opening order
            self._emit(pack)
        while self._ready:
            yield self._ready.pop(0)

    # ---- resume ---------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "consumed": self._consumed,
            "open": [(p.room, list(p.items), p.real_tokens) for p in self._open],
            "ready": [list(items) for items in self._ready],
            "stats": dict(self.stats),
        }

    def load_state_dict(self, state: dict) -> None:
        self._consumed = int(state["consumed"])
        self._open = [_OpenPack(room, list(items), real) for room, items, real in state["open"]]
        self._ready = [list(items) for items in state["ready"]]
        self.stats = dict(state["stats"])
        self._resumed = True


_END = object()
