"""A :class:`thdpack.ThdBatch` as megatron-core's ``PackedSeqParams``: :func:`to_packed_seq_params`,
:func:`packed_seq_params_dict`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from thdpack.attention.static import static_seq_params
from thdpack.batching.batch import ThdBatch
from thdpack.batching.prefix_tree import refuse_tree
from thdpack.parallel.groups import GROUP, check_process_group


def packed_seq_params_dict(batch: ThdBatch, cp_group=None) -> dict:
    """Megatron-core ``PackedSeqParams`` fields as a dict (global metadata, also on
    a CP shard: TransformerEngine derives the per-rank layout itself).

    ``total_tokens`` (int) is the global stream length ``cu_seqlens_padded[-1]``, on a CP
    shard too: megatron-core (>= 0.19) builds ``seq_idx`` int32 ``[1, total_tokens]`` from it
    and ``cu_seqlens_q_padded`` (else ``cu_seqlens_q``; sample i's slots hold i), which its
    Mamba mixer scans by; Mamba's context parallelism exchanges sequence shards for head
    shards before the scan, so the scan sees the whole stream. Without it ``seq_idx`` stays
    None and the mixer scans the pack as one sequence.

    ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded`` are ``cu_seqlens_padded`` (int32
    ``[n+1]``) when the batch has an alignment multiple (``pad_multiple > 1``: CP, FP8, ...) or
    some sample is padded (``pad_to``), and None otherwise, when the padded and real layouts are
    equal: as Megatron-Bridge leaves them (it sets them whenever ``pad_seq_to_mult > 1``), since
    TransformerEngine picks a slower kernel when they are set. With an alignment they stay set
    even when every length is already a multiple: megatron-core's CP paths hand
    ``cu_seqlens_q_padded`` to TransformerEngine's partitioning unconditionally. Megatron-core
    reads ``cu_seqlens_q`` where they are None (``seq_idx`` included), so the layout is the same
    either way.

    With ``max_num_seqs`` (static shapes): every offset field int32 ``[max_num_seqs + 1]``, the
    padded ones always set, ``max_seqlen_q/kv`` = ``total_tokens``
    (:func:`thdpack.attention.static.static_seq_params`); megatron-core's ``seq_idx`` is unchanged.
    A shared-prefix batch is a ``ValueError`` (varlen kernels cannot express its tree).

    A hybrid-CP batch adds ``local_cp_size`` and ``cp_group``: docs/megatron.md, "packed_seq_params_dict:
    a hybrid-CP batch (local_cp_size, cp_group)".
    """
    refuse_tree("packed_seq_params_dict() (varlen cu_seqlens: TE THD, megatron-core)", batch)
    hybrid = _hybrid_cp_fields(batch, cp_group)
    unpadded = batch.pad_multiple == 1 and torch.equal(batch.cu_seqlens_padded, batch.cu_seqlens)
    padded = None if unpadded else batch.cu_seqlens_padded
    fields = {
        "qkv_format": "thd",
        "cu_seqlens_q": batch.cu_seqlens,
        "cu_seqlens_kv": batch.cu_seqlens,
        "cu_seqlens_q_padded": padded,
        "cu_seqlens_kv_padded": padded,
        "max_seqlen_q": batch.max_seqlen,
        "max_seqlen_kv": batch.max_seqlen,
        "total_tokens": int(batch.cu_seqlens_padded[-1]),
    }
    fields = fields if batch.max_num_seqs is None else static_seq_params(fields, batch.max_num_seqs)
    return {**fields, **hybrid}


def _hybrid_cp_fields(batch: ThdBatch, cp_group) -> dict:
    """``{}`` for a batch that is not hybrid-CP; else ``local_cp_size`` and ``cp_group`` (see
    :func:`packed_seq_params_dict`)."""
    if not isinstance(cp_group, Mapping) and not callable(cp_group):
        check_process_group(cp_group, "cp_group", f"{GROUP}, a mapping {{cp_size: group}}, a function of "
                            "group_size or None")
    if batch.shard.block_start is None:
        if cp_group is not None:
            raise ValueError("cp_group is for a hybrid-CP batch (thdpack.shard(samples, plan=, rank=)); this batch is "
                             f"not one (cp_size={batch.shard.cp_size}): static CP runs on megatron-core's own CP group")
        return {}
    k = batch.shard.cp_size
    if k == 1:
        return {"local_cp_size": 1, "cp_group": None}
    group = cp_group
    if isinstance(cp_group, Mapping):
        group = cp_group.get(k)
    elif callable(cp_group):
        group = cp_group(group_size=k)
    check_process_group(group, f"cp_group's group of {k} ranks")
    where = f"position {batch.shard.cp_rank} of the block of {k} ranks at {batch.shard.block_start}"
    if group is None:
        raise ValueError(f"this hybrid-CP batch runs on {where}: pass that block's process group as cp_group= "
                         "(thdpack.parallel.hybrid_blocks.hybrid_cp_groups(), or megatron-core's "
                         "parallel_state.get_hybrid_data_context_parallel_groups)")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if (size, rank) != (k, batch.shard.cp_rank):
            raise ValueError(f"cp_group has {size} ranks and this process is its rank {rank}; this batch is "
                             f"{where}: give the group of this block")
    return {"local_cp_size": k, "cp_group": group}


def to_packed_seq_params(batch: ThdBatch, cp_group=None):
    """Megatron-core's ``PackedSeqParams`` when ``megatron.core`` is importable,
    else a dict with the same field names (see :func:`packed_seq_params_dict`).
    Fields the installed ``PackedSeqParams`` lacks are left out (``total_tokens`` came in
    megatron-core 0.19; 0.16.x, the newest for Python 3.11, has none). The padded fields are
    None when the batch has no alignment multiple and no sample is padded. A hybrid-CP batch adds
    ``local_cp_size`` and ``cp_group`` (``cp_group=``: see :func:`packed_seq_params_dict`)."""
    refuse_tree("megatron-core PackedSeqParams (varlen cu_seqlens)", batch)
    fields = packed_seq_params_dict(batch, cp_group)
    try:
        from megatron.core.packed_seq_params import PackedSeqParams
    except ImportError:
        return fields
    known = {f.name for f in dataclasses.fields(PackedSeqParams)}
    return PackedSeqParams(**{k: v for k, v in fields.items() if k in known})
