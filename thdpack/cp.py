"""Context-parallel (CP) sharding of a THD stream: TransformerEngine's load-balanced
"dual chunk" split, as a pure function of ``cu_seqlens_padded``, ``cp_size`` and ``cp_rank``.

Each sample's padded span of length ``P`` (a multiple of ``2·cp``) is cut into
``2·cp`` chunks of ``h = P / (2·cp)`` tokens; rank ``r`` keeps chunk ``r`` and
chunk ``2·cp − 1 − r``, in that order, sample after sample. Under causal
attention the two chunks together cost every rank the same work.
"""

from __future__ import annotations

import dataclasses

import torch

from thdpack.batch import ThdBatch


def check_cp_args(cp_size, cp_rank) -> None:
    """``ValueError`` unless ``cp_size >= 1`` and ``0 <= cp_rank < cp_size``."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer, got {cp_size!r}")
    if isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an integer in [0, {cp_size}), got {cp_rank!r}")


def _padded_lengths(cu_seqlens_padded, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.as_tensor(cu_seqlens_padded)
    if cu.ndim != 1 or cu.numel() < 1:
        raise ValueError(f"cu_seqlens_padded must be 1-D with at least one entry, got shape {tuple(cu.shape)}")
    cu = cu.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError("cu_seqlens_padded must start at 0 and be non-decreasing")
    if cp_size > 1:
        bad = torch.nonzero(lengths % (2 * cp_size)).flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(
                f"sample {i} has padded length {int(lengths[i])}, not a multiple of 2·cp = {2 * cp_size}; "
                f"build the batch with cp_size={cp_size} (or plan/pad to thdpack.cp_pad_multiple({cp_size}))"
            )
    return cu, lengths


def thd_partition_indices(cu_seqlens_padded, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Stream positions that CP rank ``cp_rank`` keeps, equal to TransformerEngine's
    ``thd_get_partitioned_indices``.

    Args:
        cu_seqlens_padded: int ``[n+1]`` cumulative padded lengths (any device);
            every padded length must be a multiple of ``2·cp_size``.
        cp_size: number of CP ranks (1 gives the identity).
        cp_rank: this rank.

    Returns:
        int64 ``[cu_seqlens_padded[-1] / cp_size]`` on the device of the input.
    """
    check_cp_args(cp_size, cp_rank)
    cu, lengths = _padded_lengths(cu_seqlens_padded, cp_size)
    total = int(cu[-1])
    if cp_size == 1:
        return torch.arange(total, dtype=torch.int64, device=cu.device)
    local_lengths = lengths // cp_size
    local_total = total // cp_size
    sample = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), local_lengths, output_size=local_total)
    local_start = torch.cumsum(local_lengths, 0) - local_lengths
    index = torch.arange(local_total, dtype=torch.int64, device=cu.device) - local_start[sample]
    half = (local_lengths // 2)[sample]
    # first half of the local span is chunk r, second half chunk 2cp-1-r: shift by h·r or h·(2cp-2-r)
    chunk_shift = torch.where(index < half, cp_rank, 2 * cp_size - 2 - cp_rank)
    return cu[:-1][sample] + index + half * chunk_shift


def local_seq_lens(seq_lens, cu_seqlens_padded, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Real tokens of each sample that land on ``cp_rank`` (int32 ``[n]``).

    TransformerEngine's rule: ``clamp(s − r·h, 0, h) + clamp(s − (2cp−1−r)·h, 0, h)``
    with ``h = P / (2·cp)``, since real tokens sit at the start of each padded span.
    """
    check_cp_args(cp_size, cp_rank)
    _, lengths = _padded_lengths(cu_seqlens_padded, cp_size)
    s = torch.as_tensor(seq_lens, device=lengths.device).to(torch.int64)
    h = lengths // (2 * cp_size)
    first = (s - cp_rank * h).clamp(min=0)
    second = (s - (2 * cp_size - 1 - cp_rank) * h).clamp(min=0)
    return (torch.minimum(first, h) + torch.minimum(second, h)).to(torch.int32)


def shard_for_cp(batch: ThdBatch, cp_size: int, cp_rank: int) -> ThdBatch:
    """Rank ``cp_rank``'s shard of ``batch``: every per-token tensor indexed by
    :func:`thd_partition_indices`.

    The shard keeps the *global* ``cu_seqlens``, ``cu_seqlens_padded`` and
    ``max_seqlen`` (TransformerEngine divides by cp itself), and adds
    ``local_cu_seqlens_padded`` (``cu_seqlens_padded // cp_size``: the local
    layout), ``local_seq_lens`` (real tokens per sample on this rank) and
    ``partition_indices`` (where each local token sits in the global stream).
    """
    check_cp_args(cp_size, cp_rank)
    if batch.cp_size != 1:
        raise ValueError(f"batch is already a CP shard (cp_size={batch.cp_size}, rank {batch.cp_rank})")
    if cp_size > 1 and batch.pad_multiple % (2 * cp_size):
        _padded_lengths(batch.cu_seqlens_padded, cp_size)  # raises, naming the sample, if the layout is unusable
    index = thd_partition_indices(batch.cu_seqlens_padded, cp_size, cp_rank).to(batch.input_ids.device)
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids[index],
        labels=batch.labels[index],
        loss_mask=batch.loss_mask[index],
        position_ids=batch.position_ids[index],
        token_extras={k: v[..., index] for k, v in batch.token_extras.items()},
        cp_size=cp_size,
        cp_rank=cp_rank,
        local_cu_seqlens_padded=(batch.cu_seqlens_padded // cp_size).to(torch.int32),
        local_seq_lens=local_seq_lens(batch.seq_lens, batch.cu_seqlens_padded, cp_size, cp_rank),
        partition_indices=index,
    )
