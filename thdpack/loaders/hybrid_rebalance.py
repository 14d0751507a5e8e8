"""Run-time samples under hybrid (per-sample) context parallelism: every data-parallel × CP rank's samples
planned together (:func:`thdpack.planning.hybrid_cp.plan_hybrid_cp`) and sent to the block of ranks that runs
each, then built into the rank's micro-batch shards (``thdpack.shard(samples, plan=, rank=)``).

::

    rank 0: samples a b (a: 64k)   all_gather    plan_hybrid_cp:           rank 0..7: a's shards (k = 8)
    rank 1: samples c d        ─▶  lengths    ─▶ a on 8 ranks, b c on 1, ─▶ then each rank its k = 1 packs
    ...                                          d e on 2, ...  all_to_all (a sample to every rank of its block)

The collectives are :mod:`thdpack.loaders.exchange`'s (one ``all_gather_object`` of the lengths, one uneven
all-to-all of the encoded samples); :func:`thdpack.rebalance` with ``hybrid_cp=`` calls this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from thdpack.batching.batch import ThdBatch
from thdpack.batching.hybrid_shards import _hybrid_cp_shards
from thdpack.common.align import check_bool, check_positive_int
from thdpack.common.samples import SampleError, get_field, sample_list, to_int_array
from thdpack.loaders.exchange import Comm, decode_sample, encode_sample, exchange_blobs
from thdpack.planning.hybrid_cp import HybridCPPlan, plan_hybrid_cp
from thdpack.planning.plan import number_groups

# BatchLayout keywords that shape the plan's padding (the rest only fill slots)
PADDING_KEYWORDS = ("tp_size", "sequence_parallel", "pad_multiple")


@dataclass(frozen=True)
class HybridCP:
    """``rebalance(..., hybrid_cp=HybridCP(max_tokens_per_rank))``: plan the step under hybrid CP.

    Attributes:
        max_tokens_per_rank: the tokens one rank holds in a micro-batch (megatron-core's
            ``max_seqlen_per_dp_cp_rank``).
        pack: pack a block's samples into micro-batches (True) or one sample per micro-batch (megatron-core's
            own schedule), as :func:`thdpack.plan_hybrid_cp`.
    """

    max_tokens_per_rank: int
    pack: bool = True

    def __post_init__(self):
        check_positive_int(self.max_tokens_per_rank, "HybridCP.max_tokens_per_rank")
        check_bool(self.pack, "HybridCP.pack")


def rebalance_hybrid_cp(local_samples: Sequence, hybrid_cp: HybridCP | int, *, group=None, cost=None, groups=None,
                        **layout) -> tuple[list[ThdBatch], HybridCPPlan, np.ndarray]:
    """Plan this step's samples, wherever they were made, under hybrid CP and give this rank its shards.

    A collective over ``group``, the **data-parallel × CP** ranks (megatron-core's
    ``get_data_parallel_group(with_context_parallel=True)``; None: the default group): call it on every rank
    with that rank's samples (the ranks of a static CP group hold different samples here, not copies).

    Args:
        local_samples: this rank's samples (mappings with ``input_ids`` and ``labels`` / ``loss_mask``).
        hybrid_cp: a :class:`HybridCP`, or its ``max_tokens_per_rank``.
        group: the process group (or a :class:`thdpack.loaders.exchange.Comm`).
        cost, groups: as :func:`thdpack.plan_hybrid_cp` (``groups``: per rank, one id per local sample; the same
            id on two ranks is two groups).
        **layout: :class:`thdpack.batching.BatchLayout` keywords for every micro-batch (``tp_size``,
            ``sequence_parallel``, ``pad_multiple`` also shape the plan), and ``vlm``,
            ``sample_values``.

    Returns:
        ``(batches, plan, offsets)``: this rank's micro-batches (``thdpack.shard(samples, plan=, rank=)``, their
        ``sample_index`` global ids), the plan every rank computed, and int64 ``[R + 1]``: rank ``r``'s local
        sample ``i`` is global sample ``offsets[r] + i``. ``SampleError`` on every rank (naming the rank and its
        local sample) for a sample no block holds.
    """
    spec = hybrid_cp if isinstance(hybrid_cp, HybridCP) else HybridCP(hybrid_cp)
    comm = Comm.of(group)
    samples, blobs, record = _read(local_samples, groups, comm.world_size > 1)
    records = comm.all_gather_object(record)
    errors = [(r, rec["error"]) for r, rec in enumerate(records) if rec["error"]]
    if errors:
        raise ValueError(f"rebalance(hybrid_cp=...): rank {errors[0][0]}: {errors[0][1]}")
    offsets = np.concatenate([[0], np.cumsum([rec["lengths"].size for rec in records])]).astype(np.int64)
    lengths = np.concatenate([rec["lengths"] for rec in records])
    gid = _global_groups(records, offsets)
    padding = {k: layout[k] for k in PADDING_KEYWORDS if k in layout}
    try:
        plan = plan_hybrid_cp(lengths, comm.world_size, spec.max_tokens_per_rank, cost=cost, groups=gid, pack=spec.pack,
                              **padding)
    except SampleError as exc:
        owner = int(np.searchsorted(offsets, exc.sample, side="right") - 1)
        raise exc.renamed(int(exc.sample - offsets[owner]), f" (local sample of rank {owner})") from None
    held = _fetch(comm, plan, offsets, samples, blobs, [rec["sizes"] for rec in records])
    return _hybrid_cp_shards(held, plan, comm.rank, **layout), plan, offsets


def _global_groups(records: list, offsets: np.ndarray) -> np.ndarray | None:
    """int64 ``[n]`` group of every global sample (a rank's groups renumbered into its own range of ids; a
    sample of a rank without groups alone), or None when no rank gave groups."""
    if all(rec["groups"] is None for rec in records):
        return None
    parts = []
    for r, rec in enumerate(records):
        n = rec["lengths"].size
        alone = -(int(offsets[r]) + np.arange(n, dtype=np.int64)) - 1
        parts.append(alone if rec["groups"] is None else number_groups(rec["groups"]) + int(offsets[r]))
    return np.concatenate(parts)


def _read(local_samples, groups, encode: bool) -> tuple[list, list, dict]:
    """This rank's samples, their encodings and the record every rank gathers (an error there, not raised,
    so that every rank raises it after the gather)."""
    try:
        samples = sample_list(local_samples, "rebalance")
        lengths = np.zeros(len(samples), np.int64)
        for i, sample in enumerate(samples):
            if not isinstance(sample, Mapping):
                raise SampleError.at(i, f" is a {type(sample).__name__}; rebalance sends mappings (dicts)")
            lengths[i] = to_int_array(get_field(sample, "input_ids", i, required=True), sample=i,
                                      field="input_ids").size
        gid = None
        if groups is not None:
            gid = np.asarray(groups.tolist() if hasattr(groups, "tolist") else groups)
            if gid.shape != lengths.shape or (gid.size and gid.dtype.kind not in "iu"):
                raise ValueError(f"groups must hold one integer group id per local sample ({lengths.size}), got "
                                 f"shape {gid.shape} and dtype {gid.dtype}")
            gid = gid.astype(np.int64)
        blobs = [encode_sample(s) if encode else b"" for s in samples]
    except (TypeError, ValueError) as exc:
        return [], [], {"lengths": np.zeros(0, np.int64), "groups": None, "sizes": np.zeros(0, np.int64),
                        "error": str(exc).replace("\n", " ")}
    sizes = np.array([len(b) for b in blobs], np.int64)
    return samples, blobs, {"lengths": lengths, "groups": gid, "sizes": sizes, "error": None}


def _fetch(comm: Comm, plan: HybridCPPlan, offsets: np.ndarray, samples: list, blobs: list, sizes: list) -> dict:
    """``{global id: sample}`` of every sample this rank's micro-batches hold: each sample goes to every rank
    of its block, in one all-to-all."""
    me, world = comm.rank, comm.world_size
    needs = [set(plan.rank_samples(r)) for r in range(world)]
    mine = range(int(offsets[me]), int(offsets[me + 1]))
    send = [[] if d == me else [blobs[g - offsets[me]] for g in mine if g in needs[d]] for d in range(world)]
    incoming = [[g for g in range(int(offsets[s]), int(offsets[s + 1])) if g in needs[me]] for s in range(world)]
    receive = [np.zeros(0, np.int64) if s == me else sizes[s][np.array(ids, np.int64) - offsets[s]]
               for s, ids in enumerate(incoming)]
    held = {g: samples[g - int(offsets[me])] for g in incoming[me]}
    for s, items in enumerate(exchange_blobs(comm, send, receive)):
        held.update((g, decode_sample(item)) for g, item in zip(incoming[s], items))
    return held
