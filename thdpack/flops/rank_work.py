"""Per-rank work under hybrid (per-sample) context parallelism: what each data-parallel × CP rank computes
when every sample runs on its own aligned block of ``k`` ranks (:mod:`thdpack.parallel.hybrid_blocks`).

A sample of ``s`` real tokens, padded to ``P`` (a multiple of ``2k``) and run on the block
``start .. start + k − 1``, is cut into ``2k`` chunks of ``h = P / 2k``; the rank at position ``j`` of the
block holds chunks ``j`` and ``2k − 1 − j`` (:mod:`thdpack.parallel.dual_chunk`). Chunk ``c`` holds the real
positions ``[a, b)``, ``a = min(s, c·h)``, ``b = min(s, (c + 1)·h)``, so the rank gets

- ``P / k`` slots (every linear layer runs on them, pad slots included) and ``b − a`` real tokens per chunk;
- ``b² − a²`` of the sample's ``s²`` (causal attention: queries at ``[a, b)`` against keys ``0 .. q``, the
  convention of :func:`thdpack.flops.cp_seqlen_squared_share`; TransformerEngine skips pad slots).

Each sample's shares add up, over its block, to ``s``, ``P`` and ``s²`` exactly, so the ranks' totals are the
whole batch's counts: ``model_flops`` of them sums to the batch's model FLOPs. The rule ``s²/k`` per rank is
exact only when ``s = P``; the real tokens of a padded sample sit at its start, so the ranks holding its last
chunks get less.
"""

from __future__ import annotations

import numpy as np

from thdpack.common.align import check_int, integer_array
from thdpack.parallel.dual_chunk import chunk_length, rank_chunks


def _arrays(seq_lens, padded_lengths, cp_sizes, block_starts, world_size: int):
    """The four per-sample arrays as int64 numpy ``[n]``, checked: one line naming the sample otherwise."""
    check_int(world_size, "world_size", 1, hint=" (the data-parallel × context-parallel ranks)")
    out = []
    for name, values in (("seq_lens", seq_lens), ("padded_lengths", padded_lengths), ("cp_sizes", cp_sizes),
                         ("block_starts", block_starts)):
        arr = integer_array(values, name)
        arr = (arr.cpu().numpy() if hasattr(arr, "cpu") else np.asarray(arr)).astype(np.int64).reshape(-1)
        out.append(arr)
    s, p, k, start = out
    if not s.shape == p.shape == k.shape == start.shape:
        raise ValueError(f"seq_lens, padded_lengths, cp_sizes and block_starts must have one entry per sample, got "
                         f"{s.shape[0]}, {p.shape[0]}, {k.shape[0]} and {start.shape[0]}")
    bad = np.flatnonzero((k < 1) | (k & (k - 1)) | (start < 0) | (start % np.maximum(k, 1)) | (start + k > world_size)
                         | (s < 0) | (p < s) | (p % (2 * np.maximum(k, 1)) * (k > 1)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"sample {i}: cp_size={k[i]} at block position {start[i]} with {s[i]} tokens padded to "
                         f"{p[i]} is not a hybrid-CP layout on {world_size} ranks (cp_size a power of two, the block "
                         "aligned and inside the ranks, the padded length >= the length and a multiple of 2·cp_size)")
    return s, p, k, start


def hybrid_cp_rank_counts(seq_lens, padded_lengths, cp_sizes, block_starts, world_size: int) -> dict:
    """Every rank's counts under hybrid CP.

    Args:
        seq_lens: int ``[n]`` real lengths of the samples.
        padded_lengths: int ``[n]`` their padded lengths (multiples of ``2·k`` when ``k > 1``).
        cp_sizes: int ``[n]`` each sample's CP size ``k`` (a power of two).
        block_starts: int ``[n]`` the first data-parallel × CP position of its block (a multiple of ``k``).
        world_size: ``R``, the data-parallel × CP ranks.

    Returns:
        ``{"num_tokens", "num_padded_tokens", "seqlen_squared_sum"}``, each int64 numpy ``[R]``: the real
        tokens, the slots, and the exact share of ``Σ sᵢ²`` of every rank (module docstring).
    """
    s, p, k, start = _arrays(seq_lens, padded_lengths, cp_sizes, block_starts, world_size)
    sample = np.repeat(np.arange(s.shape[0]), k)  # one row per (sample, position in its block)
    position = np.arange(sample.shape[0]) - np.repeat(np.cumsum(k) - k, k)
    rank = start[sample] + position
    s_, k_ = s[sample], k[sample]
    h = chunk_length(p[sample], k_)
    tokens = np.zeros_like(s_)
    square = np.zeros_like(s_)
    for c in rank_chunks(k_, position):
        lo, hi = np.minimum(s_, c * h), np.minimum(s_, (c + 1) * h)
        tokens += hi - lo
        square += hi * hi - lo * lo
    alone = k_ == 1  # a sample on one rank: no chunks, the whole of it (chunk_length would be P // 2)
    tokens[alone], square[alone] = s_[alone], s_[alone] * s_[alone]
    out = {}
    named = (("num_tokens", tokens), ("num_padded_tokens", p[sample] // k_), ("seqlen_squared_sum", square))
    for name, values in named:
        total = np.zeros(world_size, dtype=np.int64)
        np.add.at(total, rank, values)
        out[name] = total
    return out


def hybrid_cp_rank_flops(config, seq_lens, padded_lengths, cp_sizes, block_starts, world_size: int, *,
                         padded: bool = False, **options) -> np.ndarray:
    """float64 ``[R]``: every rank's training FLOPs under hybrid CP, :func:`thdpack.flops.model_flops` of its
    counts (:func:`hybrid_cp_rank_counts`). ``padded=False`` counts its real tokens (model FLOPs: the ranks'
    values add up to the batch's); ``padded=True`` its slots, pad slots included (the work its linear layers
    do). ``options``: :func:`thdpack.flops.model_flops`'s (``gated_mlp``, ``layer_types``, ...). A model whose
    FLOPs need more than tokens and ``Σ sᵢ²`` (sliding windows, top-k attention) is ``model_flops``'s
    ``ValueError``."""
    from thdpack.flops.model import model_flops

    counts = hybrid_cp_rank_counts(seq_lens, padded_lengths, cp_sizes, block_starts, world_size)
    tokens = counts["num_padded_tokens" if padded else "num_tokens"]
    return np.array([float(model_flops(config, int(t), int(q), **options))
                     for t, q in zip(tokens, counts["seqlen_squared_sum"])], dtype=np.float64)
