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

The stream tail. The stream is padded to a multiple of :func:`ulysses_pad_multiple` by
*extending the last sample's padded span* (the convention of ``pad_to``): ``cu_seqlens_padded[-1]``
grows to the padded length, ``cu_seqlens`` (real lengths), ``seq_lens`` and the number of samples do
not change, and ``max_seqlen`` is the largest padded length after it. Tail slots hold
``pad_token_id``, the label ``ignore_index`` (no loss), ``position_ids`` that continue the last
slot's count (the last sample's ``s, s+1, ...`` as its own alignment pads), mRoPE rows
(``mrope_position_ids``) that continue each row's count from the last slot, and 0 in every other
token extra (``mm_token_type_ids``: text). They join the last sample's attention segment after all
its real tokens, so under causal attention no real token sees them.

Ulysses × ring (``cp_size > 1``, the "USP" of yunchang / verl): the batch, built with
``cp_size`` (every padded length a multiple of ``2·cp``), is padded to a multiple of
``lcm(2·cp, cp·sp)``, split into CP shards by TransformerEngine's dual-chunk rule
(:mod:`thdpack.parallel.cp`), and each CP shard's local stream is cut into ``sp`` contiguous
slices. After the SP all-to-all an SP group holds exactly its CP rank's shard (the layout
:func:`thdpack.shard_for_cp` gives for the padded batch), on which ring / p2p attention runs with
the global ``cu_seqlens_padded``. Global rank layout: CP outer, SP inner (SP groups of
consecutive ranks, as DeepSpeed's ``initialize_sequence_parallel`` makes them).

Head counts (what DeepSpeed's ``UlyssesSPAttentionHF`` accepts): ``num_heads % sp == 0``; key/value
heads ``num_kv_heads % sp == 0`` (each rank gets ``num_kv_heads / sp``) or ``sp % num_kv_heads == 0``
(each kv head is replicated ``sp / num_kv_heads`` times, one per rank). Ring attention splits no
heads, so ``cp`` adds no head rule.

This module reads a batch through its fields and builds the shard with ``dataclasses.replace``; it
never imports the batching layer above it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from thdpack.common.align import check_int
from thdpack.parallel.cp import check_cp_args, local_seq_lens, partition_indices, vision_shard_extras

POSITION_EXTRAS = ("mrope_position_ids",)
"""Token extras whose tail slots continue counting (each row from the last slot); others get 0."""


# ---------------------------------------------------------------------------- arguments and sizes


def check_ulysses_args(sp_size, rank, cp_size=1, cp_rank=0, *, names=("sp_size", "rank")) -> None:
    """``ValueError`` naming the argument unless ``sp_size >= 1``, ``0 <= rank < sp_size``,
    ``cp_size >= 1`` and ``0 <= cp_rank < cp_size``; ``names``: what the caller calls the first two."""
    check_int(sp_size, names[0], 1)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < sp_size:
        raise ValueError(f"{names[1]} must be an integer in [0, {sp_size}) (the SP rank), got {rank!r}")
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


def ulysses_cu_seqlens_padded(cu_seqlens_padded: torch.Tensor, multiple: int) -> torch.Tensor:
    """int32 ``[n+1]``: ``cu_seqlens_padded`` with its last entry rounded up to ``multiple`` (the
    stream tail joins the last sample); the tensor itself when it is one already."""
    total = int(cu_seqlens_padded[-1])
    padded_total = -(-total // multiple) * multiple
    if padded_total == total:
        return cu_seqlens_padded
    out = cu_seqlens_padded.to(torch.int32, copy=True)
    out[-1] = padded_total
    return out


# ---------------------------------------------------------------------------- the stream tail


def _tail(batch, length: int, pad_token_id: int) -> dict:
    """The ``length`` tail slots of every per-token tensor (see the module docstring), keyed as the
    batch's fields; token extras under ``("token_extras", key)``."""
    steps = torch.arange(1, length + 1, dtype=torch.int64)
    ids = batch.input_ids
    out = {
        "input_ids": torch.full((length,), pad_token_id, dtype=ids.dtype),
        "labels": torch.full((length,), batch.ignore_index, dtype=batch.labels.dtype),
        "loss_mask": torch.zeros(length, dtype=batch.loss_mask.dtype),
        "position_ids": (batch.position_ids[-1:].cpu() + steps).to(batch.position_ids.dtype),
    }
    for key, value in batch.token_extras.items():
        if key in POSITION_EXTRAS:
            out["token_extras", key] = (value[..., -1:].cpu() + steps).to(value.dtype)
        else:
            out["token_extras", key] = torch.zeros((*value.shape[:-1], length), dtype=value.dtype)
    return {k: v.to(ids.device) for k, v in out.items()}


class _Take:
    """One rank's tokens of the padded stream (the batch's ``total`` tokens, then its tail): a
    contiguous range ``[start, stop)`` (SP alone) or the stream positions ``index`` (with CP)."""

    def __init__(self, total: int, start: int, stop: int, index: torch.Tensor | None):
        self.total, self.start, self.stop, self.index = total, start, stop, index

    def __call__(self, values: torch.Tensor, tail: torch.Tensor | None) -> torch.Tensor:
        """``values`` ``[..., total]`` and its ``tail`` ``[..., k]`` (None when k = 0) → ``[..., L]``."""
        if self.index is not None:
            whole = values if tail is None else torch.cat([values, tail], -1)
            return whole[..., self.index]
        head = values[..., min(self.start, self.total):min(self.stop, self.total)]
        if self.stop <= self.total:
            return head.clone()  # the rank's own memory: a DataLoader worker ships only these tokens
        return torch.cat([head, tail[..., max(self.start, self.total) - self.total:self.stop - self.total]], -1)


def _per_token(batch, take, tail: dict) -> dict:
    """The ``dataclasses.replace`` changes that give every per-token tensor of ``batch`` through ``take``."""
    changes = {name: take(getattr(batch, name), tail.get(name))
               for name in ("input_ids", "labels", "loss_mask", "position_ids")}
    changes["token_extras"] = {k: take(v, tail.get(("token_extras", k))) for k, v in batch.token_extras.items()}
    return changes


def _check_batch(batch, owner: str) -> None:
    """``TypeError`` unless ``batch`` is a ThdBatch (read by its fields), ``ValueError`` for a shard."""
    if not dataclasses.is_dataclass(batch) or isinstance(batch, type) or not hasattr(batch, "cu_seqlens_padded"):
        raise TypeError(f"{owner} takes a thdpack.ThdBatch (build_thd_batch, ThdCollator), got {type(batch).__name__}")
    if batch.local_cu_seqlens_padded is not None:
        raise ValueError(f"{owner} takes a whole batch, got a shard (cp_size={batch.cp_size}, "
                         f"sp_size={getattr(batch, 'sp_size', 1)}); shard the whole batch once for both")


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
    cu = ulysses_cu_seqlens_padded(batch.cu_seqlens_padded, ulysses_pad_multiple(sp_size, cp_size, batch.pad_multiple))
    total, padded_total = batch.num_padded_tokens, int(cu[-1])
    if padded_total == total:
        return batch
    tail = _tail(batch, padded_total - total, pad_token_id)
    changes = _per_token(batch, _Take(total, 0, padded_total, None), tail)
    return dataclasses.replace(batch, **changes, cu_seqlens_padded=cu, max_seqlen=_max_seqlen(cu))


def shard_for_ulysses(batch, sp_size: int, rank: int, *, cp_size: int = 1, cp_rank: int = 0, pad_token_id: int = 0,
                      num_heads: int | None = None, num_kv_heads: int | None = None):
    """Ulysses SP rank ``rank``'s contiguous slice of ``batch`` (and, with ``cp_size > 1``, of CP
    rank ``cp_rank``'s dual-chunk shard), with the global offsets every rank needs after the all-to-all.

    The stream is first padded to a multiple of :func:`ulysses_pad_multiple` (the tail: see the
    module docstring), then rank ``rank`` keeps tokens ``[rank·L, (rank+1)·L)`` of it
    (``L = T' / (cp·sp)``; of the CP shard's local stream with ``cp_size > 1``).

    Args:
        batch: a whole :class:`thdpack.ThdBatch`; with ``cp_size > 1`` built with that ``cp_size``
            (every padded length a multiple of ``2·cp``).
        sp_size, rank: the Ulysses group size and this process's rank in it.
        cp_size, cp_rank: ring context parallelism around Ulysses (CP outer, SP inner).
        pad_token_id: the id of the tail slots (an integer >= 0; the collator passes its layout's).
        num_heads, num_kv_heads: when given, checked against ``sp_size`` (:func:`check_head_counts`).

    Returns:
        A :class:`thdpack.ThdBatch` whose ``input_ids``, ``labels`` (targets), ``loss_mask``,
        ``position_ids`` (int64 ``[L]``, the global ones: DeepSpeed all-gathers them) and token
        extras (``[..., L]``) are the rank's ``L`` tokens; ``cu_seqlens``, ``cu_seqlens_padded``
        (int32 ``[n+1]``, of the padded stream) and ``max_seqlen`` are global; ``sp_size`` /
        ``sp_rank`` and ``cp_size`` / ``cp_rank`` are set; ``local_cu_seqlens_padded`` (int32
        ``[n+1]``) and ``local_seq_lens`` (int32 ``[n]``) describe what attention sees after the
        all-to-all (the whole padded stream, or the CP rank's shard of it: ``cu_seqlens_padded //
        cp``), which :meth:`ThdBatch.to_hf_kwargs` passes as ``cu_seq_lens_q/k``, with the targets
        as ``shift_labels``; ``partition_indices`` (int64 ``[L]``) are the tokens' positions in the
        padded stream. A VLM batch's shard also gets :func:`thdpack.parallel.cp.vision_shard_extras`.
    """
    _check_batch(batch, "shard_for_ulysses")
    check_ulysses_args(sp_size, rank, cp_size, cp_rank)
    check_head_counts(sp_size, num_heads, num_kv_heads)
    check_int(pad_token_id, "pad_token_id", 0)
    cu = ulysses_cu_seqlens_padded(batch.cu_seqlens_padded, ulysses_pad_multiple(sp_size, cp_size, batch.pad_multiple))
    total, padded_total = batch.num_padded_tokens, int(cu[-1])
    length = padded_total // (cp_size * sp_size)
    start, stop = rank * length, (rank + 1) * length
    device = batch.input_ids.device
    if cp_size == 1:
        index, positions = None, torch.arange(start, stop, dtype=torch.int64, device=device)
    else:  # the CP rank's positions (validates the 2·cp alignment), then the SP rank's slice of them
        positions = torch.as_tensor(partition_indices(cu, cp_size, cp_rank)[start:stop], device=device)
        index = positions
    tail = _tail(batch, padded_total - total, pad_token_id) if padded_total > total else {}
    shard = dataclasses.replace(
        batch, **_per_token(batch, _Take(total, start, stop, index), tail),
        cu_seqlens_padded=cu, max_seqlen=_max_seqlen(cu), cp_size=cp_size, cp_rank=cp_rank,
        sp_size=sp_size, sp_rank=rank, local_cu_seqlens_padded=(cu // cp_size).to(torch.int32),
        local_seq_lens=local_seq_lens(batch.seq_lens, cu, cp_size, cp_rank), partition_indices=positions,
    )
    types = batch.token_extras.get("mm_token_type_ids")
    if types is not None:  # VLM: global positions of this rank's vision tokens (tail slots are text)
        tail_types = tail.get(("token_extras", "mm_token_type_ids"))
        whole = types if tail_types is None else torch.cat([types, tail_types], -1)
        shard.extras = {**batch.extras, **vision_shard_extras(whole, positions)}
    return shard


def _max_seqlen(cu: torch.Tensor) -> int:
    """The largest padded length of ``cu`` (int32 ``[n+1]``)."""
    return int((cu[1:] - cu[:-1]).max())
