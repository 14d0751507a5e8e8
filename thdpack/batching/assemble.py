"""Compiled one-pass assembly of the THD stream (or of one CP rank's shard).

Inputs are the samples' tokens concatenated (``ids``, ``source`` labels, and an
optional loss mask), ``[S]``, and per-sample real and padded lengths. Outputs
are written straight into preallocated arrays: no padded intermediate.

Validation happens in the same pass; on bad input a kernel stops and returns
``(code, token)`` so the caller can name the sample (codes below).
"""

from __future__ import annotations

import numpy as np

from thdpack.common.jit import njit
from thdpack.parallel.dual_chunk import chunk_length, rank_chunks

OK = 0
NEGATIVE_ID = 1
BAD_LABEL = 2
BAD_MASK = 3


@njit
def _validate(ids, source, has_source, mask, has_mask, ignore_index):
    """``(status, first bad token, zero_one)``: branch-free reductions first (they vectorise),
    the token-by-token search only when something is wrong. ``zero_one``: whether some id or
    label is 0 or 1, what a bool in a list of them reads as (only then does the caller look
    for one: :func:`thdpack.common.samples.refuse_bools`)."""
    low = 2
    for t in range(ids.shape[0]):
        low = min(low, ids[t])
    bad = low < 0
    zero_one = low <= 1
    if has_source:
        for t in range(source.shape[0]):
            bad |= (source[t] < 0) & (source[t] != ignore_index)
            zero_one |= (source[t] & -2) == 0
    if has_mask:
        for t in range(mask.shape[0]):
            bad |= (mask[t] != 0) & (mask[t] != 1)
    if not bad:
        return OK, 0, zero_one
    for t in range(ids.shape[0]):
        if ids[t] < 0:
            return NEGATIVE_ID, t, zero_one
        if has_source and source[t] < 0 and source[t] != ignore_index:
            return BAD_LABEL, t, zero_one
        if has_mask and mask[t] != 0 and mask[t] != 1:
            return BAD_MASK, t, zero_one
    return OK, 0, zero_one


@njit
def _fill_targets(out, dst, ids, source, has_source, mask, has_mask, src, s, ignore_index):
    """``out[dst + j]`` = label of token ``src + j + 1`` for ``j < s - 1``; the last is ignored.

    The one place the target rule lives: the label is ``source`` (or the id without
    labels), and a mask 0 turns it into ``ignore_index``, so with both labels and a
    mask a token is a target only where both say so.
    (Separate tight loops: a per-token helper call defeats numba's vectorisation.)
    """
    if has_source:
        for j in range(s - 1):
            out[dst + j] = source[src + j + 1]
    else:
        for j in range(s - 1):
            out[dst + j] = ids[src + j + 1]
    if has_mask:
        for j in range(s - 1):
            if mask[src + j + 1] == 0:
                out[dst + j] = ignore_index
    out[dst + s - 1] = ignore_index


@njit
def _cumulative(seq_lens, padded):
    """int32 ``[n+1]`` cumulative real and padded lengths."""
    n = seq_lens.shape[0]
    cu = np.zeros(n + 1, np.int32)
    cu_padded = np.zeros(n + 1, np.int32)
    for i in range(n):
        cu[i + 1] = cu[i] + seq_lens[i]
        cu_padded[i + 1] = cu_padded[i] + padded[i]
    return cu, cu_padded


@njit
def assemble_stream(ids, source, has_source, mask, has_mask, seq_lens, padded, pad_token_id, ignore_index):
    """The whole stream.

    Returns ``(status, token, zero_one, input_ids, labels, loss_mask, position_ids, cu, cu_padded)``
    (``zero_one``: see :func:`_validate`): int64 ``[T]`` (bool for the mask) and int32 ``[n+1]`` ×2.
    """
    status, token, zero_one = _validate(ids, source, has_source, mask, has_mask, ignore_index)
    cu, cu_padded = _cumulative(seq_lens, padded)
    n = seq_lens.shape[0]
    total = cu_padded[n]
    input_ids = np.empty(total, np.int64)
    labels = np.empty(total, np.int64)
    position_ids = np.empty(total, np.int64)
    loss_mask = np.empty(total, np.bool_)
    if status != OK:
        return status, token, zero_one, input_ids, labels, loss_mask, position_ids, cu, cu_padded
    for i in range(n):
        src, dst, s, p = cu[i], cu_padded[i], seq_lens[i], padded[i]
        for j in range(s):
            input_ids[dst + j] = ids[src + j]
        _fill_targets(labels, dst, ids, source, has_source, mask, has_mask, src, s, ignore_index)
        for j in range(s, p):
            input_ids[dst + j] = pad_token_id
            labels[dst + j] = ignore_index
        for j in range(p):
            position_ids[dst + j] = j  # pad slots continue their sample's count
    for t in range(total):
        loss_mask[t] = labels[t] != ignore_index
    return status, token, zero_one, input_ids, labels, loss_mask, position_ids, cu, cu_padded


@njit
def assemble_shard(ids, source, has_source, mask, has_mask, seq_lens, padded, pad_token_id, ignore_index, cp_size, cp_rank):
    """One CP rank's shard, without building the whole stream.

    Each padded span ``P`` is cut into ``2·cp`` chunks of ``h = P / (2·cp)``; the
    rank keeps chunk ``r`` then chunk ``2·cp − 1 − r`` (TransformerEngine's split,
    :mod:`thdpack.parallel.dual_chunk`).

    Returns ``(status, token, zero_one, input_ids, labels, loss_mask, position_ids, cu,
    cu_padded, partition_indices, local_seq_lens)`` (``zero_one``: see :func:`_validate`);
    per-token arrays are ``[T / cp]``, cumulative lengths int32 and global.
    """
    status, token, zero_one = _validate(ids, source, has_source, mask, has_mask, ignore_index)
    cu, cu_padded = _cumulative(seq_lens, padded)
    n = seq_lens.shape[0]
    local_total = cu_padded[n] // cp_size
    input_ids = np.empty(local_total, np.int64)
    labels = np.empty(local_total, np.int64)
    position_ids = np.empty(local_total, np.int64)
    loss_mask = np.empty(local_total, np.bool_)
    partition = np.empty(local_total, np.int64)
    local_lens = np.zeros(n, np.int32)
    if status != OK:
        return status, token, zero_one, input_ids, labels, loss_mask, position_ids, cu, cu_padded, partition, local_lens
    longest = 0
    for i in range(n):
        longest = max(longest, seq_lens[i])
    targets = np.empty(longest, np.int64)  # one sample's targets, reused
    first_chunk, second_chunk = rank_chunks(cp_size, cp_rank)
    out = 0
    for i in range(n):
        src, s = cu[i], seq_lens[i]
        _fill_targets(targets, 0, ids, source, has_source, mask, has_mask, src, s, ignore_index)
        h = chunk_length(padded[i], cp_size)
        for c in range(2):
            first = h * (first_chunk if c == 0 else second_chunk)
            real = min(max(s - first, 0), h)  # real tokens of this chunk
            for j in range(h):
                partition[out + j] = cu_padded[i] + first + j
                position_ids[out + j] = first + j
            for j in range(real):
                input_ids[out + j] = ids[src + first + j]
                labels[out + j] = targets[first + j]
            for j in range(real, h):
                input_ids[out + j] = pad_token_id
                labels[out + j] = ignore_index
            local_lens[i] += real
            out += h
    for t in range(local_total):
        loss_mask[t] = labels[t] != ignore_index
    return status, token, zero_one, input_ids, labels, loss_mask, position_ids, cu, cu_padded, partition, local_lens
