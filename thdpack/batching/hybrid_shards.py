"""One rank's micro-batches of a hybrid-CP plan (:func:`thdpack.planning.hybrid_cp.plan_hybrid_cp`): each a
:class:`~thdpack.ThdBatch` of the micro-batch's samples, built for its block's CP size ``k``: the rank's
dual-chunk shard when ``k > 1`` (chunks ``j`` and ``2k − 1 − j`` of every sample, ``j`` the rank's position
in the block, as ``thdpack.shard(batch, cp_size=k, cp_rank=j)``), the whole micro-batch when ``k = 1``.
Every batch's ``shard`` has layout ``"hybrid-cp"`` and its ``block_start``, so
``thdpack.integrations.to_packed_seq_params(batch, cp_group=...)`` gives megatron-core's ``local_cp_size`` and
the block's ``cp_group``; ``padding_mask`` its pad slots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from thdpack.batching.batch import ThdBatch
from thdpack.batching.builder import build_batch
from thdpack.batching.layout import layout_of, refuse_layout_object
from thdpack.batching.vision_family import check_vlm
from thdpack.common.align import check_int
from thdpack.planning.hybrid_cp import HybridCPPlan

# build_thd_batch keywords besides the layout's that _hybrid_cp_shards passes on (no share_prefix: a prefix tree
# cannot be split over CP ranks)
BUILD_KEYWORDS = ("vlm", "sample_values")


def _hybrid_cp_shards(samples: Sequence | Mapping, plan: HybridCPPlan, rank: int, **layout) -> list[ThdBatch]:
    """The micro-batches data-parallel × CP position ``rank`` runs under ``plan``, in order (what
    ``thdpack.shard(samples, plan=, rank=, **layout)`` runs).

    Args:
        samples: the global batch's samples, by sample id (the plan's indices): a sequence, or a mapping
            holding at least the samples this rank runs (after an exchange, a rank holds only those).
        plan: the :class:`thdpack.planning.hybrid_cp.HybridCPPlan`.
        rank: this process's data-parallel × CP position, ``0 .. plan.world_size − 1``.
        **layout: :class:`thdpack.BatchLayout` keywords (``pad_token_id``, ``ignore_index``, ``tp_size``,
            ``sequence_parallel``, ``pad_multiple``: the plan's, so that each sample gets the plan's padded
            length) and ``vlm``, ``sample_values``. ``cp_size`` / ``cp_rank`` come from the plan;
            ``pad_to`` and ``max_length`` are refused (a micro-batch's length is the plan's).

    Returns:
        list of :class:`thdpack.ThdBatch`: for each micro-batch of ``plan.rank_micro_batches(rank)``, a batch
        with ``sample_index`` the plan's sample ids and ``shard`` of layout ``"hybrid-cp"``: ``cp_size = k``,
        ``cp_rank`` the rank's position in the block, ``block_start`` the block's first position.
        ``ValueError`` when the layout pads a sample to another length than the plan (naming the sample and both
        lengths).
    """
    if not isinstance(plan, HybridCPPlan):
        raise TypeError(f"shard(samples, plan=, rank=) takes a HybridCPPlan (thdpack.plan_hybrid_cp), got "
                        f"{type(plan).__name__}")
    check_int(rank, "rank", 0, below=plan.world_size, hint=" (the data-parallel × CP position)")
    if not hasattr(samples, "__getitem__") or isinstance(samples, (str, bytes)):  # a datasets.Dataset indexes
        raise TypeError(f"samples must be a sequence of samples or a mapping {{sample id: sample}}, got "
                        f"{type(samples).__name__}")
    refuse_layout_object("shard", layout)
    build = {k: layout.pop(k) for k in BUILD_KEYWORDS if k in layout}
    check_vlm(build.get("vlm"), "shard(samples, plan=, rank=)")
    for name in ("cp_size", "cp_rank", "pad_to", "max_length", "share_prefix"):
        if layout.get(name) is not None:
            raise TypeError(f"shard(samples, plan=, rank=) takes no {name}=: the plan decides each micro-batch's CP "
                            "size, rank and length")
    base = layout_of("shard", layout)
    out = []
    for j in plan.rank_micro_batches(rank):
        ids = plan.micro_batch(j)
        k, start = plan.micro_batch_block(j)
        shape = dataclasses.replace(base, cp_size=k, cp_rank=rank - start if k > 1 else None)
        batch = build_batch([_sample(samples, int(i)) for i in ids], shape, sample_index=ids, stacklevel=3, **build)
        _check_lengths(batch, plan, ids)
        batch.shard = dataclasses.replace(batch.shard, layout="hybrid-cp", block_start=start)
        out.append(batch)
    return out


def _sample(samples, i: int):
    try:
        return samples[i]
    except (KeyError, IndexError):
        raise KeyError(f"shard(samples, plan=, rank=): sample {i} of the plan is not in samples (this rank runs "
                       "it)") from None


def _check_lengths(batch: ThdBatch, plan: HybridCPPlan, ids) -> None:
    """``ValueError`` naming the first sample whose length or padded length is not the plan's."""
    got, padded = batch.seq_lens.tolist(), batch.seq_lens_padded.tolist()
    for i, s, p in zip(ids.tolist(), got, padded):
        if s != plan.lengths[i] or p != plan.padded_lengths[i]:
            raise ValueError(f"sample {i} has {s} tokens padded to {p} here, {plan.lengths[i]} padded to "
                             f"{plan.padded_lengths[i]} in the plan: give shard(samples, plan=, rank=) the samples "
                             "and the tp_size / sequence_parallel / pad_multiple the plan was made with")
