"""A FlexAttention ``BlockMask`` for document-causal attention over a THD stream, from its offsets.

``torch.nn.attention.flex_attention.create_block_mask(mask_mod, ...)`` finds the blocks by
evaluating ``mask_mod`` on every ``(q, kv)`` pair, ``T²`` of them (1G for a 32k-token pack).
The blocks of a document-causal mask follow from the document boundaries alone, so this module
computes them with offset arithmetic, per ``Q_BLOCK × KV_BLOCK`` tile rather than per token pair,
and hands them to ``BlockMask.from_kv_blocks``. The result is the one ``create_block_mask``
gives for the same mask (block counts, block indices in the same order, full and partial blocks
apart), at a small fraction of the cost (``benchmarks/layouts.py --sections block_mask``).

Which blocks (``s(t)``: the first slot of the document holding slot ``t``, see
:mod:`thdpack.attention.documents`; ``kv`` is visible from ``q`` iff ``s(q) <= kv <= q``). For the
query tile of rows ``q0 .. q1`` and the key tile of columns ``k0 .. k1``:

- *some* pair is visible iff ``k1 >= s(q0)`` and ``k0 <= q1``: the keys the rows see together are
  the single range ``s(q0) .. q1`` (a row that starts a document sees the rows before it end theirs);
- *every* pair is visible (a full block, no ``mask_mod`` call) iff ``k1 <= q0`` and ``k0 >= s(q1)``,
  and the tile lies inside the stream (``create_block_mask`` pads the mask past ``T`` with False,
  so a tile cut by the stream end is never full);
- partial blocks are the visible ones that are not full: there the kernel calls the mask_mod,
  ``kv <= q and kv >= s(q)``, exact per token.
"""

from __future__ import annotations

import numpy as np
import torch

from thdpack.attention.documents import check_offsets, document_starts

DEFAULT_BLOCK_SIZE = 128  # torch.nn.attention.flex_attention._DEFAULT_SPARSE_BLOCK_SIZE


def check_block_size(block_size) -> tuple[int, int]:
    """``(q_block, kv_block)`` from an integer in ``[1, 2**31)`` or a pair of them (the tables are int32);
    ``ValueError`` naming the value otherwise."""
    pair = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    ok = len(pair) == 2 and all(
        not isinstance(b, bool) and isinstance(b, (int, np.integer)) and 1 <= b < 2**31 for b in pair)
    if not ok:
        raise ValueError(f"block_size must be an integer >= 1 (and < 2**31) or a (q_block, kv_block) pair of them, "
                         f"got {block_size!r}")
    return int(pair[0]), int(pair[1])


def document_block_mask(cu_seqlens_padded, total: int | None = None, *, block_size=DEFAULT_BLOCK_SIZE,
                        device=None):
    """The document-causal FlexAttention ``BlockMask`` of a THD stream, built from its offsets.

    Slot ``q`` attends to slot ``kv`` iff both lie in the same sample's padded span and
    ``kv <= q`` (documents as :func:`thdpack.attention.documents.document_ids_from_offsets` assigns them: pad
    slots and a ``pad_to`` tail belong to the sample before them). Equal, block for block, to
    ``create_block_mask(and_masks(causal, document_mask), 1, None, T, T, BLOCK_SIZE=block_size)``.

    Args:
        cu_seqlens_padded: int ``[n+1]`` cumulative padded lengths (tensor on any device, numpy or list).
        total: the stream length ``T`` (default ``cu_seqlens_padded[-1]``; slots past it belong to the
            last sample).
        block_size: the tile size, an integer or a ``(q_block, kv_block)`` pair (128: FlexAttention's
            default; its CUDA kernels want multiples of their own tile, e.g. 128 or 64).
        device: where to build the mask (default: the device of ``cu_seqlens_padded``). Build it where
            attention runs: ``BlockMask.to(device)`` moves the block tensors but not the ``[T]`` tensor
            the mask_mod reads.

    Returns:
        ``BlockMask`` with ``shape == (1, 1, T, T)``: ``kv_num_blocks`` / ``full_kv_num_blocks``
        int32 ``[1, 1, ceil(T / q_block)]``, ``kv_indices`` / ``full_kv_indices`` int32
        ``[1, 1, ceil(T / q_block), ceil(T / kv_block)]``, and a mask_mod exact on partial blocks.
        Memory: ``O(T + (T / q_block)·(T / kv_block))``, no ``[T, T]`` tensor.
    """
    bq, bk = check_block_size(block_size)
    cu, total = check_offsets(cu_seqlens_padded, total)
    return build_block_mask(cu if device is None else cu.to(device), total, bq, bk)


def build_block_mask(cu: torch.Tensor, total: int, q_block: int, kv_block: int):
    """:func:`document_block_mask` on validated offsets: ``cu`` int64 ``[n+1]`` (its device is the
    mask's), ``total >= max(cu[-1], 1)``."""
    partial, full = block_layout(cu, total, q_block, kv_block)
    q_rows = -(-total // q_block) * q_block  # the kernels may evaluate rows of the last tile past T
    starts = document_starts(cu, torch.arange(q_rows, device=cu.device))

    def document_causal(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= starts[q_idx])

    return block_mask_from_tiles(partial, full, document_causal, total, q_block, kv_block)


def block_mask_from_tiles(partial: torch.Tensor, full: torch.Tensor, mask_mod, total: int, q_block: int,
                          kv_block: int):
    """A ``BlockMask`` of a ``(total, total)`` stream from bool ``[R, C]`` tile masks (``partial``: some pairs
    visible, ``mask_mod`` decides; ``full``: every pair visible), through ``BlockMask.from_kv_blocks``."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        raise ImportError(f"a BlockMask needs FlexAttention (torch >= 2.5), and this is torch {torch.__version__}; "
                          "use attention_mask_4d() or the flash kwargs") from None
    tables = (*_ordered(partial), *_ordered(full))
    options = dict(BLOCK_SIZE=(q_block, kv_block), mask_mod=mask_mod, seq_lengths=(total, total))
    try:
        mask = BlockMask.from_kv_blocks(*tables, **options, compute_q_blocks=False)
    except TypeError:  # an older torch without compute_q_blocks: it builds the q tables itself
        mask = BlockMask.from_kv_blocks(*tables, **options)
    # the q-major tables the backward pass reads, from the tile masks we hold (from_kv_blocks would
    # rebuild these dense masks from the kv tables and argsort them: half the cost of the whole mask)
    mask.q_num_blocks, mask.q_indices = _ordered(partial.T)
    mask.full_q_num_blocks, mask.full_q_indices = _ordered(full.T)
    return mask


def block_layout(cu: torch.Tensor, total: int, q_block: int, kv_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``, bool ``[ceil(T / q_block), ceil(T / kv_block)]`` each: which tiles hold some
    but not all visible pairs, and which hold only visible pairs (the rules: the module docstring)."""
    device = cu.device
    q_first = torch.arange(-(-total // q_block), device=device) * q_block
    q_last = torch.clamp(q_first + q_block, max=total) - 1
    starts = document_starts(cu, torch.cat([q_first, q_last]))
    start_first, start_last = starts[: q_first.shape[0], None], starts[q_first.shape[0]:, None]
    cols = torch.arange(-(-total // kv_block), device=device)
    col_first, col_last = cols * kv_block, cols * kv_block + kv_block - 1  # a tile's last column, even past T
    visible = (col_last >= start_first) & (col_first <= q_last[:, None])
    inside = (q_first + q_block <= total)[:, None]
    full = inside & (col_last <= q_first[:, None]) & (col_first >= start_last)
    return visible & ~full, full


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num, indices)``, int32 ``[1, 1, R]`` and ``[1, 1, R, C]``, of a bool ``[R, C]`` tile mask:
    each row's marked columns ascending, then its other columns ascending (the order of
    flex_attention's ``_dense_to_ordered``, a stable descending argsort), by counting, not sorting."""
    marked = dense.to(torch.int32)
    num = marked.sum(-1, dtype=torch.int32)
    rank = torch.where(dense, marked.cumsum(-1), num[:, None] + (1 - marked).cumsum(-1)) - 1
    cols = torch.arange(dense.shape[1], device=dense.device, dtype=torch.int32).expand(rank.shape)
    indices = torch.empty(rank.shape, dtype=torch.int32, device=dense.device).scatter_(-1, rank.to(torch.int64), cols)
    return num[None, None], indices[None, None]
