"""Ulysses sequence parallelism (DeepSpeed-Ulysses / ALST, verl, LLaMA-Factory, ms-swift) of a THD stream.

Ulysses cuts the token stream into ``sp`` contiguous slices, one per SP rank. Before attention an
all-to-all trades the sequence split for a head split: every rank then holds the *whole* stream for
``num_heads / sp`` heads, so it runs an ordinary varlen attention with the *global* ``cu_seqlens``;
a second all-to-all gives the tokens back. Nothing per document is needed beyond those offsets::

    stream  | s0 s0 s0 s0 s0 | s1 s1 s1 | s2 s2 s2 s2 s2 + + + |   T = 13, sp = 4: padded to 16
    rank 0  | s0 s0 s0 s0 |   tokens  0..3
    rank 1  | s0 s1 s1 s1 |   tokens  4..7
    rank 2  | s2 s2 s2 s2 |   tokens  8..11
    rank 3  | s2 +  +  +  |   tokens 12..15 (``+``: the stream tail, part of sample 2's padded span)

Details: docs/attention.md, "Ulysses: the stream tail, Ulysses × ring, head counts".
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F

from thdpack.common.align import check_int, integer_array
from thdpack.parallel.cp import check_cp_args, local_seq_lens, partition_indices, vision_shard_extras
from thdpack.parallel.dual_chunk import chunk_length, rank_chunks
from thdpack.parallel.shard import Shard

POSITION_EXTRAS = ("mrope_position_ids",)
"""Token extras whose tail slots continue counting (each row from the last slot); others get 0."""


# ---------------------------------------------------------------------------- arguments and sizes


def check_ulysses_args(sp_size, rank, cp_size=1, cp_rank=0, *, names=("sp_size", "rank")) -> None:
    """``ValueError`` naming the argument unless ``sp_size >= 1``, ``0 <= rank < sp_size``,
    ``cp_size >= 1`` and ``0 <= cp_rank < cp_size``; ``names``: what the caller calls the first two."""
    check_int(sp_size, names[0], 1)
    check_int(rank, names[1], 0, below=sp_size, hint=" (the SP rank)")
    check_cp_args(cp_size, cp_rank)


def check_head_counts(sp_size: int, num_heads=None, num_kv_heads=None) -> None:
    """``ValueError`` unless the attention heads split over ``sp_size`` Ulysses ranks: ``num_heads``
    a multiple of ``sp_size``; ``num_kv_heads`` a multiple of ``sp_size`` or a divisor of it (then
    each kv head is replicated ``sp_size / num_kv_heads`` times); ``num_heads`` a multiple of
    ``num_kv_heads`` (GQA). None skips a check."""
    check_int(sp_size, "sp_size", 1)
    if num_heads is not None:
        check_int(num_heads, "num_heads", 1)
        if num_heads % sp_size:
            raise ValueError(f"num_heads={num_heads} is not a multiple of sp_size={sp_size}: Ulysses gives every "
                             f"rank num_heads / sp_size query heads")
    if num_kv_heads is not None:
        check_int(num_kv_heads, "num_kv_heads", 1)
        if num_kv_heads % sp_size and sp_size % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} and sp_size={sp_size}: one must divide the other "
                             f"(kv heads are split over the ranks, or each replicated sp_size / num_kv_heads times)")
        if num_heads is not None and num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")


def ulysses_pad_multiple(sp_size: int, cp_size: int = 1, pad_multiple: int = 1) -> int:
    """The multiple the stream is padded to: ``sp`` alone, ``lcm(2·cp, cp·sp)`` with ring CP
    (every CP shard's local stream splits into ``sp`` equal slices and every padded length stays a
    multiple of ``2·cp``), combined by lcm with the batch's ``pad_multiple`` (so the last sample's
    extended span keeps its alignment)."""
    check_int(sp_size, "sp_size", 1)
    check_int(cp_size, "cp_size", 1)
    check_int(pad_multiple, "pad_multiple", 1)
    multiple = sp_size if cp_size == 1 else math.lcm(2 * cp_size, cp_size * sp_size)
    return math.lcm(multiple, int(pad_multiple))


def ulysses_positions(cu_seqlens_padded, sp_size: int, rank: int, cp_size: int = 1, cp_rank: int = 0) -> np.ndarray:
    """Stream positions of Ulysses rank ``rank`` (of CP rank ``cp_rank``): int64 ``[T / (cp·sp)]``.

    ``cu_seqlens_padded``: int ``[n+1]`` of the stream *already padded* for Ulysses (its total a
    multiple of :func:`ulysses_pad_multiple`; with ``cp_size > 1`` every padded length a multiple of
    ``2·cp``). Without CP the positions are ``[rank·L, (rank+1)·L)``; with CP they are the slice
    ``[rank·L, (rank+1)·L)`` of the CP rank's dual-chunk positions (:func:`thdpack.thd_partition_indices`),
    found chunk by chunk (``O(n + L)``, never the CP rank's ``T / cp`` positions).
    """
    check_ulysses_args(sp_size, rank, cp_size, cp_rank)
    cu = integer_array(cu_seqlens_padded, "cu_seqlens_padded")
    cu = (cu.cpu().numpy() if isinstance(cu, torch.Tensor) else cu).astype(np.int64, copy=False)
    if cu.ndim != 1 or cu.shape[0] < 1 or cu[0] != 0:
        raise ValueError(f"cu_seqlens_padded must be 1-D with at least one entry and start at 0, got shape "
                         f"{tuple(cu.shape)}{f' starting at {cu.flat[0]}' if cu.size else ''}")
    if int(cu[-1]) % (cp_size * sp_size):
        raise ValueError(f"cu_seqlens_padded ends at {int(cu[-1])}, not a multiple of cp·sp = {cp_size * sp_size}; "
                         "pad the stream first (pad_for_ulysses, or build with pad_to=)")
    length = int(cu[-1]) // (cp_size * sp_size)
    start, stop = rank * length, (rank + 1) * length
    if cp_size == 1:
        return np.arange(start, stop, dtype=np.int64)
    _check_cp_aligned(cu, cp_size)
    h = chunk_length(cu[1:] - cu[:-1], cp_size)
    first_chunk, second_chunk = rank_chunks(cp_size, cp_rank)
    chunk_len = np.repeat(h, 2)  # the rank's chunks in local order: sample 0's two, sample 1's two, ...
    chunk_first = np.stack([cu[:-1] + first_chunk * h, cu[:-1] + second_chunk * h], 1).reshape(-1)
    local_end = np.cumsum(chunk_len)
    local_start = local_end - chunk_len
    # each chunk cut to the slice (np.minimum / np.maximum: a fifth of np.clip's cost on small arrays)
    lo, hi = np.minimum(np.maximum(local_start, start), stop), np.minimum(np.maximum(local_end, start), stop)
    taken = hi - lo
    offset = chunk_first + (lo - local_start) - (np.cumsum(taken) - taken)
    return np.repeat(offset, taken) + np.arange(stop - start, dtype=np.int64)


def _check_cp_aligned(cu: np.ndarray, cp_size: int) -> None:
    """``ValueError`` naming the first sample whose padded length (of int64 ``cu``) is negative or not a
    multiple of ``2·cp`` (the message of :func:`thdpack.thd_partition_indices`)."""
    lengths = cu[1:] - cu[:-1]
    if cp_size > 1 and (bool((lengths % (2 * cp_size)).any()) or bool((lengths < 0).any())):
        partition_indices(cu, cp_size, 0)  # raises, naming the sample and the fix


class PaddedLayout:
    """The stream of ``batch`` padded for Ulysses: ``total`` tokens before, ``padded_total`` after;
    ``cu_seqlens_padded`` (int32 ``[n+1]``, the last entry extended; the batch's own tensor when
    there is no tail) and ``max_seqlen`` of the padded stream."""

    def __init__(self, batch, sp_size: int, cp_size: int):
        multiple = ulysses_pad_multiple(sp_size, cp_size, batch.pad_multiple)
        cu = batch.cu_seqlens_padded
        self.total = batch.num_padded_tokens
        self.padded_total = -(-self.total // multiple) * multiple
        self.cu_seqlens_padded, self.max_seqlen = cu, batch.max_seqlen
        if self.padded_total > self.total:  # the tail joins the last sample's padded span
            # through numpy on the host: a quarter of the cost of the same three torch operations
            host = cu.device.type == "cpu"
            extended = (cu if host else cu.cpu()).numpy().astype(np.int32)  # a copy
            extended[-1] = self.padded_total
            self.cu_seqlens_padded = torch.from_numpy(extended) if host else torch.from_numpy(extended).to(cu.device)
            self.max_seqlen = max(self.max_seqlen, self.padded_total - (int(extended[-2]) if extended.size > 1 else 0))


# ---------------------------------------------------------------------------- the stream tail


def _fills(batch, pad_token_id: int) -> dict:
    """What the tail slots of each per-token tensor hold: a constant, or None (count on from the last
    slot, each row); keyed as the batch's fields, token extras under ``("token_extras", key)``."""
    fills = {"input_ids": pad_token_id, "labels": batch.ignore_index, "loss_mask": False, "position_ids": None}
    fills.update({("token_extras", k): None if k in POSITION_EXTRAS else 0 for k in batch.token_extras})
    return fills


class _Take:
    """One rank's tokens of the padded stream (the batch's ``total`` tokens, then a tail up to
    ``padded_total``): the contiguous range ``[start, stop)`` (SP alone: views of the batch's
    tensors when it holds no tail slot, as DeepSpeed's adapter slices; no copy) or the stream
    positions ``index`` (with CP: a gather)."""

    def __init__(self, total: int, padded_total: int, start: int, stop: int, index: torch.Tensor | None = None,
                 needs_tail: bool = True):
        self.total, self.padded_total, self.start, self.stop = total, padded_total, start, stop
        self.index, self.needs_tail = index, needs_tail

    def __call__(self, values: torch.Tensor, fill) -> torch.Tensor:
        """``values`` ``[..., total]`` → ``[..., L]``; ``fill``: the tail's constant, or None to count on."""
        if not self.needs_tail:
            if self.index is None:
                return values[..., self.start:self.stop]
            return values.index_select(-1, self.index)  # a third of the cost of values[..., index]
        lo, hi = (self.start, self.stop) if self.index is None else (0, self.padded_total)
        first = min(lo, self.total)
        skip, slots = max(lo, self.total) - self.total, hi - max(lo, self.total)  # tail slots before / in [lo, hi)
        out = _with_tail(values, first, skip, slots, fill)
        return out if self.index is None else out.index_select(-1, self.index)


_NUMPY_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64,
                 torch.float32, torch.float16}


def _with_tail(values: torch.Tensor, first: int, skip: int, slots: int, fill) -> torch.Tensor:
    """``values[..., first:]`` followed by ``slots`` tail slots (the tail's ``skip`` first ones left
    out): ``fill``, or with ``fill`` None each row counting on from its last slot (``+skip+1, ...``)."""
    if values.device.type == "cpu" and values.dtype in _NUMPY_DTYPES:  # numpy: a fifth of the torch calls' cost
        v = values.numpy()
        out = np.empty((*v.shape[:-1], v.shape[-1] - first + slots), v.dtype)
        head = v.shape[-1] - first
        out[..., :head] = v[..., first:]
        out[..., head:] = fill if fill is not None else v[..., -1:] + np.arange(skip + 1, skip + slots + 1)
        return torch.from_numpy(out)
    head = values.narrow(-1, first, values.shape[-1] - first)
    if fill is not None:
        return F.pad(head, (0, slots), value=fill)
    steps = torch.arange(skip + 1, skip + slots + 1, device=values.device)
    return torch.cat([head, (values[..., -1:] + steps).to(values.dtype)], -1)


def _per_token(batch, take: _Take, pad_token_id: int) -> dict:
    """The ``dataclasses.replace`` changes that give every per-token tensor of ``batch`` through ``take``."""
    fills = _fills(batch, pad_token_id)
    changes = {name: take(getattr(batch, name), fills[name]) for name in ("input_ids", "labels", "loss_mask", "position_ids")}
    changes["token_extras"] = {k: take(v, fills["token_extras", k]) for k, v in batch.token_extras.items()}
    return changes


def _check_batch(batch, owner: str) -> None:
    """``TypeError`` unless ``batch`` is a ThdBatch (read by its fields), ``ValueError`` for a shard."""
    if not dataclasses.is_dataclass(batch) or isinstance(batch, type) or not hasattr(batch, "cu_seqlens_padded"):
        raise TypeError(f"{owner} takes a thdpack.ThdBatch (build_thd_batch, ThdCollator), got {type(batch).__name__}")
    if getattr(batch, "prefix_tree", None) is not None:  # a tree's prefix rows are read by several members
        raise ValueError(f"{owner} cannot shard a shared-prefix batch (DeepSpeed's Ulysses attention runs varlen "
                         "cu_seqlens, which cannot express the tree); build it with share_prefix=None under Ulysses")
    if batch.shard.local_cu_seqlens_padded is not None:
        raise ValueError(f"{owner} takes a whole batch, got a shard (cp_size={batch.shard.cp_size}, "
                         f"sp_size={batch.shard.sp_size}); shard the whole batch once for both")


# ---------------------------------------------------------------------------- the verbs


def pad_for_ulysses(batch, sp_size: int, *, cp_size: int = 1, pad_token_id: int = 0):
    """The whole ``batch`` with its stream padded to a multiple of :func:`ulysses_pad_multiple`
    (the tail of the module docstring), for a consumer that cuts the slices itself (DeepSpeed's
    ``UlyssesSPDataLoaderAdapter`` refuses a stream that ``sp`` does not divide). ``batch`` itself
    when its stream is a multiple already.

    Args:
        batch: a whole :class:`thdpack.ThdBatch` (built with ``cp_size`` when ``cp_size > 1``).
        sp_size, cp_size: the Ulysses and ring CP sizes (integers >= 1).
        pad_token_id: the id of the tail slots (an integer >= 0).

    Returns:
        A :class:`thdpack.ThdBatch` of ``T'`` tokens, ``T'`` the padded length.
    """
    _check_batch(batch, "pad_for_ulysses")
    check_int(pad_token_id, "pad_token_id", 0)
    layout = PaddedLayout(batch, sp_size, cp_size)
    _check_cp_aligned(batch.cu_seqlens_padded.cpu().numpy().astype(np.int64), cp_size)
    if layout.padded_total == layout.total:
        return batch
    changes = _per_token(batch, _Take(layout.total, layout.padded_total, 0, layout.padded_total), pad_token_id)
    return dataclasses.replace(batch, **changes, cu_seqlens_padded=layout.cu_seqlens_padded, max_seqlen=layout.max_seqlen)


def _shard_for_ulysses(batch, sp_size: int, sp_rank: int, *, cp_size: int = 1, cp_rank: int = 0,
                       pad_token_id: int = 0, num_heads: int | None = None, num_kv_heads: int | None = None):
    """What ``thdpack.shard(batch, sp_size=, sp_rank=)`` runs: Ulysses SP rank ``sp_rank``'s contiguous slice of
    ``batch`` (and, with ``cp_size > 1``, of CP rank ``cp_rank``'s dual-chunk shard), with the global offsets every
    rank needs after the all-to-all. The stream is first padded to a multiple of :func:`ulysses_pad_multiple` (the
    tail: see the module docstring), then rank ``sp_rank`` keeps tokens ``[sp_rank·L, (sp_rank+1)·L)`` of it
    (``L = T' / (cp·sp)``; of the CP shard's local stream with ``cp_size > 1``).

    Args:
        batch: a whole :class:`thdpack.ThdBatch`; with ``cp_size > 1`` built with that ``cp_size``
            (every padded length a multiple of ``2·cp``).
        sp_size, sp_rank: the Ulysses group size and this process's rank in it.
        cp_size, cp_rank: ring context parallelism around Ulysses (CP outer, SP inner).
        pad_token_id: the id of the tail slots (an integer >= 0; the collator passes its layout's).
        num_heads, num_kv_heads: when given, checked against ``sp_size`` (:func:`check_head_counts`).

    Returns:
        A :class:`thdpack.ThdBatch` whose ``input_ids``, ``labels`` (targets), ``loss_mask``,
        ``position_ids`` (int64 ``[L]``, the global ones: DeepSpeed all-gathers them) and token
        extras (``[..., L]``) are the rank's ``L`` tokens; ``cu_seqlens``, ``cu_seqlens_padded``
        (int32 ``[n+1]``, of the padded stream) and ``max_seqlen`` are global; its ``shard`` (layout
        ``"ulysses"``) holds ``sp_size`` / ``sp_rank``, ``cp_size`` / ``cp_rank``; ``local_cu_seqlens_padded``
        (int32 ``[n+1]``) and ``local_seq_lens`` (int32 ``[n]``) describe what attention sees after the
        all-to-all (the whole padded stream, or the CP rank's shard of it: ``cu_seqlens_padded //
        cp``), which :func:`thdpack.integrations.to_hf_kwargs` passes as ``cu_seq_lens_q/k``, with the targets
        as ``shift_labels``; ``partition_indices`` (int64 ``[L]``) are the tokens' positions in the
        padded stream. A VLM batch's shard also gets :func:`thdpack.parallel.cp.vision_shard_extras`.
        Without CP and away from the tail, the per-token tensors are views of the batch's (no copy,
        as DeepSpeed's adapter slices); with CP, or on the rank holding the tail, new tensors.
    """
    _check_batch(batch, "shard(batch, sp_size=, sp_rank=)")
    check_ulysses_args(sp_size, sp_rank, cp_size, cp_rank, names=("sp_size", "sp_rank"))
    check_head_counts(sp_size, num_heads, num_kv_heads)
    check_int(pad_token_id, "pad_token_id", 0)
    layout = PaddedLayout(batch, sp_size, cp_size)
    cu, total = layout.cu_seqlens_padded, layout.total
    length = layout.padded_total // (cp_size * sp_size)
    start, stop = sp_rank * length, (sp_rank + 1) * length
    device = batch.input_ids.device
    if cp_size == 1:
        take = _Take(total, layout.padded_total, start, stop, needs_tail=stop > total)
        positions = torch.from_numpy(np.arange(start, stop, dtype=np.int64))  # via numpy: a third of torch.arange
        positions = positions if device.type == "cpu" else positions.to(device)
        local_cu, local_lens = cu, batch.seq_lens
    else:  # the CP rank's positions (validates the 2·cp alignment), then the SP rank's slice of them
        index = ulysses_positions(cu, sp_size, sp_rank, cp_size, cp_rank)
        needs_tail = layout.padded_total > total and index.shape[0] > 0 and int(index.max()) >= total
        positions = torch.as_tensor(index, device=device)
        take = _Take(total, layout.padded_total, start, stop, positions, needs_tail)
        local_cu, local_lens = (cu // cp_size).to(torch.int32), local_seq_lens(batch.seq_lens, cu, cp_size, cp_rank)
    shard = dataclasses.replace(
        batch, **_per_token(batch, take, pad_token_id), cu_seqlens_padded=cu, max_seqlen=layout.max_seqlen,
        shard=Shard("ulysses", cp_size, cp_rank, sp_size, sp_rank, local_cu_seqlens_padded=local_cu,
                    local_seq_lens=local_lens, partition_indices=positions),
    )
    types = batch.token_extras.get("mm_token_type_ids")
    if types is not None:  # VLM: global positions of this rank's vision tokens (tail slots are text)
        whole = F.pad(types, (0, layout.padded_total - total), value=0)
        shard.extras = {**batch.extras, **vision_shard_extras(whole, positions)}
    return shard
