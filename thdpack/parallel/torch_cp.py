"""PyTorch native context parallel (``torch.distributed.tensor.experimental``) for a pack.

torch's CP API shards a buffer along its sequence axis in ``cp`` contiguous pieces, after an
optional rearrangement that a *load balancer* provides: ``buffer[rearrange]`` before sharding
(``_context_parallel_shard``, ``_create_cp_block_mask``) and ``unsharded[restore]`` after
gathering (``context_parallel_unshard``). For a pack, the balance that matters is per document:
each document's padded span cut into ``2·cp`` chunks, rank ``r`` keeping chunks ``r`` and
``2·cp − 1 − r`` (thdpack's dual-chunk rule, :mod:`thdpack.parallel.dual_chunk`).

Here ``rearrange`` is rank-major: rank 0's tokens (document after document), then rank 1's, ...,
so torch's contiguous piece ``r`` of ``buffer[rearrange]`` is exactly
:func:`thdpack.thd_partition_indices` for rank ``r``, and ``buffer[rearrange]`` sharded by torch
equals ``thdpack.shard(batch, cp_size=, cp_rank=)``'s tensors on every rank. That is the layout torch's
``_PerDocumentHeadTailLoadBalancer`` docstring draws; its torch 2.13 code emits the same chunks
document-major (document, then rank), so torch's contiguous pieces of a multi-document pack are
not the documented per-document chunks (the first rank gets the first documents whole) and
their attention cost is not balanced.

Nothing of torch's CP is imported: :class:`TorchCPLoadBalancer` has the one method torch's CP calls
on a load balancer (``_generate_indices``), without torch's private classes.
"""

from __future__ import annotations

import numpy as np
import torch

from thdpack.common.align import check_int
from thdpack.parallel.cp import _padded_lengths  # the offsets' one validation, shared with thd_partition_indices
from thdpack.parallel.dual_chunk import chunk_length, rank_chunks


def torch_cp_indices(batch_or_cu_seqlens_padded, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rearrange and restore indices of a pack for PyTorch native context parallel.

    Args:
        batch_or_cu_seqlens_padded: a whole :class:`thdpack.ThdBatch` (not a CP shard) or its
            int ``[n+1]`` ``cu_seqlens_padded`` (list, numpy, or a torch tensor on any device);
            every padded length a multiple of ``2·cp_size`` (build with ``cp_size=``).
        cp_size: number of CP ranks (1 gives the identity).

    Returns:
        ``(rearrange, restore)``, both int64 ``[T]`` (``T = cu_seqlens_padded[-1]``), on the
        input's device: ``x[rearrange]`` lists rank 0's tokens, then rank 1's, ... (rank ``r``'s
        piece ``x[rearrange][r·T/cp : (r+1)·T/cp]`` is ``x[thd_partition_indices(cu, cp, r)]``),
        and ``x[rearrange][restore] == x``.
    """
    check_int(cp_size, "cp_size", 1)
    cu = _cu_seqlens_padded(batch_or_cu_seqlens_padded)
    device = cu.device if isinstance(cu, torch.Tensor) else torch.device("cpu")
    if device.type != "cpu":  # n+1 offsets read back once: numpy is far faster than torch on these small arrays
        cu = cu.cpu()
    cu, lengths = _padded_lengths(cu, cp_size)  # numpy int64, validated as for thd_partition_indices
    rearrange = _rank_major(cu, lengths, int(cp_size))
    restore = np.empty_like(rearrange)
    restore[rearrange] = np.arange(rearrange.shape[0], dtype=np.int64)
    return torch.from_numpy(rearrange).to(device), torch.from_numpy(restore).to(device)


def _rank_major(cu: np.ndarray, lengths: np.ndarray, cp_size: int) -> np.ndarray:
    """int64 ``[T]``: every rank's dual chunks (:mod:`thdpack.parallel.dual_chunk`), rank after rank,
    document after document within a rank; all ``2·cp·n`` chunks at once (no loop over ranks)."""
    total = int(cu[-1])
    if cp_size == 1:
        return np.arange(total, dtype=np.int64)
    h = chunk_length(lengths, cp_size)  # [n]
    first, second = rank_chunks(cp_size, np.arange(cp_size, dtype=np.int64))  # [cp] each
    chunk = np.stack([first, second], 1)  # [cp, 2]: the chunk numbers rank r keeps, in order
    starts = (cu[:-1, None] + chunk[:, None, :] * h[:, None]).reshape(-1)  # [cp, n, 2] stream starts
    sizes = np.broadcast_to(h[None, :, None], (cp_size, h.shape[0], 2)).reshape(-1)
    return np.repeat(starts - (np.cumsum(sizes) - sizes), sizes) + np.arange(total, dtype=np.int64)


class TorchCPLoadBalancer:
    """A load balancer for torch's CP API that keeps thdpack's per-document dual chunks per rank.

    Pass it as ``load_balancer=`` to ``torch.distributed.tensor.experimental._attention``'s
    ``_context_parallel_shard`` (tensors and FlexAttention ``BlockMask`` buffers) and
    ``context_parallel_unshard``; rank ``r``'s shard of a ``[1, T]`` (or ``[1, H, T, D]``)
    buffer is then the buffer at :func:`thdpack.thd_partition_indices` ``(cu, cp, r)``, the
    tokens of ``thdpack.shard(batch, cp_size=, cp_rank=)``. A ``BlockMask`` buffer needs ``T`` to be a multiple
    of ``cp · 128`` (torch's block size; build with ``pad_to=``). The ``context_parallel``
    context manager (SDPA) takes no load balancer: it splits the whole stream head-tail, as
    for one document, and SDPA has no document mask there.

    Args:
        batch_or_cu_seqlens_padded, cp_size: as in :func:`torch_cp_indices`.
        device: where the indices live (default: the input's device); torch indexes the
            buffers with them, so put them where the buffers are.
    """

    def __init__(self, batch_or_cu_seqlens_padded, cp_size: int, device=None):
        rearrange, restore = torch_cp_indices(batch_or_cu_seqlens_padded, cp_size)
        if device is not None:
            rearrange, restore = rearrange.to(device), restore.to(device)
        self.cp_size = cp_size
        self.rearrange, self.restore = rearrange, restore

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        """int64 ``[1, T]``: ``restore`` indices when ``restore`` is true, else ``rearrange``
        (torch's load-balancer protocol: one row, the same layout for every row of the batch)."""
        return (self.restore if restore else self.rearrange).unsqueeze(0)

    def __repr__(self) -> str:
        return f"TorchCPLoadBalancer(cp_size={self.cp_size}, num_tokens={self.rearrange.numel()})"


def _cu_seqlens_padded(batch_or_cu):
    """The ``cu_seqlens_padded`` of a whole batch, or the offsets themselves; a CP shard is refused
    (its tokens are already one rank's)."""
    cu = getattr(batch_or_cu, "cu_seqlens_padded", None)
    if cu is None:
        return batch_or_cu
    shard = getattr(batch_or_cu, "shard", None)
    if shard is not None and shard.cp_size != 1:
        raise ValueError(f"batch is a CP shard (cp_size={shard.cp_size}, rank {shard.cp_rank}); "
                         "torch_cp_indices takes the whole batch")
    return cu
