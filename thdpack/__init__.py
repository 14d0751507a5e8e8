"""thdpack: compact THD (packed, padding-free) training batches for LLMs and VLMs.

Data flows one way::

    samples -> plan_packs (lengths only) -> build_thd_batch -> consumer
"""

from thdpack.align import cp_pad_multiple
from thdpack.balance import BalancedPlan, CostModel, plan_balanced
from thdpack.batch import ThdBatch, shard_for_cp
from thdpack.build import build_thd_batch
from thdpack.collate import PackedBatches, ThdCollator
from thdpack.flops import FlopsAccumulator, FlopsMeter, model_flops, overcount_report, seqlen_squared_sum, throughput
from thdpack.cp import local_seq_lens, thd_partition_indices
from thdpack.plan import PackPlan, PackStats, plan_packs
from thdpack.sampler import TokenBudgetBatchSampler
from thdpack.samples import SampleError
from thdpack.stream import StreamingPacker
import thdpack.vlm  # noqa: E402,F401  registers the vision extension that build_thd_batch(model_config=) calls

__version__ = "0.1.0"

__all__ = [
    "BalancedPlan",
    "CostModel",
    "FlopsAccumulator",
    "FlopsMeter",
    "model_flops",
    "overcount_report",
    "seqlen_squared_sum",
    "throughput",
    "StreamingPacker",
    "plan_balanced",
    "PackPlan",
    "PackStats",
    "PackedBatches",
    "SampleError",
    "ThdBatch",
    "ThdCollator",
    "TokenBudgetBatchSampler",
    "build_thd_batch",
    "cp_pad_multiple",
    "local_seq_lens",
    "shard_for_cp",
    "thd_partition_indices",
    "plan_packs",
]


# Offline packed datasets, imported on first use: `import thdpack` stays free of pyarrow/datasets.
_LAZY = {"load_packed": "thdpack.offline", "PackedDataset": "thdpack.offline", "PackedRowCollator": "thdpack.offline"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'thdpack' has no attribute {name!r}")
