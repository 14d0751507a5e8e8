"""A plan in a DataLoader: the batch sampler, the streaming packer, the collators, dataset mixtures and run-time
rebalancing. ``ThdCollator``, ``TokenBudgetBatchSampler``, ``StreamingPacker``, ``IndexedDataset``, ``rebalance`` and
``rebalance_steps`` are ``thdpack``'s."""

from thdpack.loaders.collate import PackedBatches
from thdpack.loaders.hybrid_rebalance import rebalance_hybrid_cp
from thdpack.loaders.mixture_dataset import MixtureDataset
from thdpack.loaders.rebalance import RebalanceHandle, StepsHandle

__all__ = ["PackedBatches", "MixtureDataset", "RebalanceHandle", "StepsHandle", "rebalance_hybrid_cp"]
