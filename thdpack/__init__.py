"""thdpack: compact THD (packed, padding-free) training batches for LLMs and VLMs.

Data flows one way::

    samples -> plan_packs (lengths only) -> build_thd_batch -> shard -> consumer
                                                  \\-> per-pack lengths -> thdpack.flops

The names the README uses, group by group in the order a user meets them (``__all__`` keeps it):

- check: ``check_packing`` -- packing proven exact on your own model and data, layer by layer, before training (lazy import; ``thdpack check``).
- plan: ``plan_packs``, ``plan_balanced``, ``plan_steps``, ``CostModel``, ``plan_hybrid_cp`` -- which samples share a pack, from lengths alone; packs dealt evenly over data-parallel ranks (a pipeline-parallel step: its micro-batch count and order; under hybrid CP, samples over blocks of ranks).
- build: ``build_thd_batch``, ``ThdBatch``, ``SampleError`` -- one pack's THD stream.
- collate: ``ThdCollator``, ``TokenBudgetBatchSampler``, ``StreamingPacker``, ``IndexedDataset`` -- in a DataLoader.
- rebalance: ``rebalance``, ``rebalance_steps`` -- samples made at run time (RL rollouts) moved to the ranks that run them (a pipeline-parallel step's micro-batches), results back.
- shard: ``cp_pad_multiple``, ``shard``, ``thd_partition_indices``, ``local_seq_lens``, ``torch_cp_indices``, ``TorchCPLoadBalancer`` -- a CP (static or hybrid) or Ulysses SP rank's slice: ``shard``'s keywords pick which.
- offline: ``load_packed`` -- packs built ahead of time (lazy import).

Everything else is public in its subpackage, each name exported once (docs/architecture.md lists them):
``thdpack.planning`` (``PlanOptions``, ``PackPlan``, ``PackStats``, ...), ``thdpack.batching`` (``BatchLayout``),
``thdpack.loaders`` (``PackedBatches``, ``MixtureDataset``, ...), ``thdpack.flops``, ``thdpack.losses``,
``thdpack.offline``, ``thdpack.vlm`` (VLM packing: ``vlm=thdpack.vlm.get_family(model_config)``),
``thdpack.integrations``.
"""

from thdpack.common.align import cp_pad_multiple
from thdpack.common.version import __version__
from thdpack.planning.balance import CostModel, plan_balanced
from thdpack.batching.batch import ThdBatch
from thdpack.batching.sharding import shard
from thdpack.planning.hybrid_cp import plan_hybrid_cp
from thdpack.batching.builder import build_thd_batch
from thdpack.loaders.collate import IndexedDataset, ThdCollator
from thdpack.loaders.rebalance import rebalance, rebalance_steps
from thdpack.parallel.cp import local_seq_lens, thd_partition_indices
from thdpack.parallel.torch_cp import TorchCPLoadBalancer, torch_cp_indices
from thdpack.planning.plan import plan_packs
from thdpack.planning.pipeline_parallel.steps import plan_steps
from thdpack.loaders.sampler import TokenBudgetBatchSampler
from thdpack.common.samples import SampleError
from thdpack.loaders.stream import StreamingPacker


__all__ = [
    # check
    "check_packing",
    # plan
    "plan_packs", "plan_balanced", "plan_steps", "CostModel", "plan_hybrid_cp",
    # build
    "build_thd_batch", "ThdBatch", "SampleError",
    # collate
    "ThdCollator", "TokenBudgetBatchSampler", "StreamingPacker", "IndexedDataset",
    # rebalance
    "rebalance", "rebalance_steps",
    # shard
    "cp_pad_multiple", "shard", "thd_partition_indices", "local_seq_lens", "torch_cp_indices", "TorchCPLoadBalancer",
    # offline
    "load_packed",
]


# Offline packed datasets, imported on first use: `import thdpack` stays free of pyarrow/datasets.
_LAZY = {"load_packed": "thdpack.offline", "check_packing": "thdpack.check"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'thdpack' has no attribute {name!r}")
