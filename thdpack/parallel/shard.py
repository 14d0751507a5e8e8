"""Which part of a pack a :class:`thdpack.ThdBatch` holds: :class:`Shard`, the batch's ``shard`` field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

LAYOUTS = ("whole", "cp", "ulysses", "hybrid-cp")


@dataclass(frozen=True, eq=False)
class Shard:
    """The whole stream, or one rank's shard of it (``ThdBatch.shard``).

    Attributes:
        layout: ``"whole"`` (:data:`WHOLE`); ``"cp"``, the dual-chunk CP shard of
            ``thdpack.shard(batch, cp_size=, cp_rank=)`` (per-token tensors: the rank's ``T / cp_size`` tokens;
            ``cu_seqlens``, ``cu_seqlens_padded`` and ``max_seqlen`` stay global); ``"ulysses"``,
            ``thdpack.shard(batch, sp_size=, sp_rank=)`` (the rank's contiguous ``T' / (cp_size·sp_size)`` tokens of
            the stream padded to ``T'``); ``"hybrid-cp"``, a micro-batch of ``thdpack.shard(samples, plan=, rank=)``
            (a ``"cp"`` shard over its block when ``cp_size > 1``, else whole).
        cp_size, cp_rank: the ring CP size and this rank's place in it (``1, 0`` without CP).
        sp_size, sp_rank: the Ulysses size and rank (``1, 0`` but on a ``"ulysses"`` shard).
        block_start: ``"hybrid-cp"`` only: the first data-parallel × CP position of the block of ``cp_size``
            ranks the batch runs on (:mod:`thdpack.parallel.hybrid_blocks`); else None.
        local_cu_seqlens_padded: int32 ``[n+1]``, ``cu_seqlens_padded // cp_size``: the layout attention sees
            (after the all-to-all on a Ulysses shard); None when the batch is not split.
        local_seq_lens: int32 ``[n]`` real tokens of each sample on this rank; None when not split.
        partition_indices: int64 ``[T_local]`` position of each local token in the global (padded) stream;
            None when not split.
    """

    layout: str = "whole"
    cp_size: int = 1
    cp_rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0
    block_start: int | None = None
    local_cu_seqlens_padded: torch.Tensor | None = None
    local_seq_lens: torch.Tensor | None = None
    partition_indices: torch.Tensor | None = None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"Shard layout must be one of {LAYOUTS}, got {self.layout!r}")

    def map(self, fn) -> "Shard":
        """A copy with ``fn`` applied to every tensor (``ThdBatch.to``, ``pin_memory``)."""
        names = ("local_cu_seqlens_padded", "local_seq_lens", "partition_indices")
        return dataclasses.replace(self, **{k: fn(getattr(self, k)) for k in names if getattr(self, k) is not None})


WHOLE = Shard()
