"""TransformerEngine's load-balanced "dual chunk" context-parallel split, as arithmetic.

Each sample's padded span of ``P`` tokens (a multiple of ``2·cp``) is cut into
``2·cp`` chunks of ``h = P / (2·cp)`` tokens; CP rank ``r`` keeps chunk ``r`` and
chunk ``2·cp − 1 − r``, in that order, sample after sample. Under causal attention
the two chunks together cost every rank the same work.

The rule lives here once; :mod:`thdpack.parallel.cp` (indices and per-rank lengths), the compiled
assembler :mod:`thdpack.batching.assemble` and the FLOPs share in :mod:`thdpack.flops` all
call these. Every function works on Python ints, numpy arrays and torch tensors
alike, and inside numba kernels.
"""

from __future__ import annotations

from thdpack.common.jit import jitable


@jitable
def chunk_length(padded_length, cp_size):
    """``h = P // (2·cp)``: the tokens in each of a sample's ``2·cp`` chunks
    (scalar or array of padded lengths ``P``, same kind out)."""
    return padded_length // (2 * cp_size)


@jitable
def rank_chunks(cp_size, cp_rank):
    """``(r, 2·cp − 1 − r)``: the chunk numbers rank ``cp_rank`` keeps, in the order it keeps them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank
