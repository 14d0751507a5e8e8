"""thdpack: compact THD (packed, padding-free) training batches for LLMs and VLMs.

Data flows one way::

    samples -> plan_packs (lengths only) -> build_thd_batch -> shard_for_cp -> consumer
                                                  \\-> per-pack lengths -> FLOPs

The public surface, group by group in the order a user meets it (``__all__`` keeps it):

- plan: ``plan_packs``, ``PlanOptions``, ``PackPlan``, ``PackStats`` -- which samples share a pack, from lengths alone.
- build: ``build_thd_batch``, ``BatchLayout``, ``ThdBatch``, ``SampleError`` -- one pack's THD stream.
- collate: ``ThdCollator``, ``PackedBatches``, ``TokenBudgetBatchSampler``, ``StreamingPacker``, ``IndexedDataset`` -- in a DataLoader.
- balance: ``plan_balanced``, ``BalancedPlan``, ``CostModel``, ``plan_hybrid_cp``, ``HybridCPPlan`` -- packs dealt evenly over data-parallel ranks; under hybrid (per-sample) CP, samples over blocks of ranks.
- rebalance: ``rebalance``, ``RebalanceHandle`` -- samples made at run time (RL rollouts) moved to the ranks that run them, results back.
- shard: ``cp_pad_multiple``, ``shard_for_cp``, ``hybrid_cp_shards``, ``shard_for_ulysses``, ``thd_partition_indices``, ``local_seq_lens``, ``torch_cp_indices``, ``TorchCPLoadBalancer`` -- a CP (static or hybrid) or Ulysses SP rank's slice.
- flops: ``seqlen_squared_sum``, ``model_flops``, ``FlopsMeter``, ``FlopsAccumulator``, ``throughput``, ``overcount_report`` -- Σsᵢ².
- offline: ``load_packed``, ``PackedDataset``, ``PackedRowCollator`` -- packs built ahead of time (lazy import).
- losses: ``packed_loss`` -- a loss over a packed batch that means what it means unpacked.

Low-level helpers stay importable from their modules (``thdpack.parallel.cp``, ``thdpack.batching.layout``,
``thdpack.losses``, ``thdpack.vlm``, ...). VLM packing: ``vlm=thdpack.vlm.get_family(model_config)``.
"""

from thdpack.common.align import cp_pad_multiple
from thdpack.common.version import __version__
from thdpack.planning.balance import BalancedPlan, CostModel, plan_balanced
from thdpack.batching.batch import ThdBatch, shard_for_cp
from thdpack.batching.hybrid_shards import hybrid_cp_shards
from thdpack.planning.hybrid_cp import HybridCPPlan, plan_hybrid_cp
from thdpack.batching.builder import build_thd_batch
from thdpack.loaders.collate import IndexedDataset, PackedBatches, ThdCollator
from thdpack.loaders.rebalance import RebalanceHandle, rebalance
from thdpack.parallel.cp import local_seq_lens, thd_partition_indices
from thdpack.parallel.torch_cp import TorchCPLoadBalancer, torch_cp_indices
from thdpack.parallel.ulysses import shard_for_ulysses
from thdpack.flops import FlopsAccumulator, FlopsMeter, model_flops, overcount_report, seqlen_squared_sum, throughput
from thdpack.batching.layout import BatchLayout
from thdpack.losses import packed_loss
from thdpack.planning.options import PlanOptions
from thdpack.planning.plan import PackPlan, PackStats, plan_packs
from thdpack.loaders.sampler import TokenBudgetBatchSampler
from thdpack.common.samples import SampleError
from thdpack.loaders.stream import StreamingPacker


__all__ = [
    # plan
    "plan_packs", "PlanOptions", "PackPlan", "PackStats",
    # build
    "build_thd_batch", "BatchLayout", "ThdBatch", "SampleError",
    # collate
    "ThdCollator", "PackedBatches", "TokenBudgetBatchSampler", "StreamingPacker", "IndexedDataset",
    # balance
    "plan_balanced", "BalancedPlan", "CostModel", "plan_hybrid_cp", "HybridCPPlan",
    # rebalance
    "rebalance", "RebalanceHandle",
    # shard
    "cp_pad_multiple", "shard_for_cp", "hybrid_cp_shards", "shard_for_ulysses", "thd_partition_indices", "local_seq_lens",
    "torch_cp_indices", "TorchCPLoadBalancer",
    # flops
    "seqlen_squared_sum", "model_flops", "FlopsMeter", "FlopsAccumulator", "throughput", "overcount_report",
    # offline
    "load_packed", "PackedDataset", "PackedRowCollator",
    # losses
    "packed_loss",
]


# Offline packed datasets, imported on first use: `import thdpack` stays free of pyarrow/datasets.
_LAZY = {"load_packed": "thdpack.offline", "PackedDataset": "thdpack.offline", "PackedRowCollator": "thdpack.offline"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'thdpack' has no attribute {name!r}")
