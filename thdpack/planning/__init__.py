"""Which samples share a pack, from lengths alone: the packing core, the planners, their kernels and the balancer over
data-parallel ranks. ``plan_packs``, ``plan_balanced``, ``plan_steps``, ``CostModel`` and ``plan_hybrid_cp`` are ``thdpack``'s."""

from thdpack.planning.balance import BalancedPlan
from thdpack.planning.hybrid_cp import HybridCPPlan
from thdpack.planning.mixture import MixturePlan, plan_mixture, plan_stratified
from thdpack.planning.options import PlanOptions
from thdpack.planning.packing import PackStats
from thdpack.planning.pipeline_parallel.simulate import PipelineShape
from thdpack.planning.plan import PackPlan
from thdpack.planning.pipeline_parallel.steps import StepPlan

__all__ = ["PlanOptions", "PackPlan", "PackStats", "BalancedPlan", "StepPlan", "PipelineShape", "HybridCPPlan", "plan_mixture", "MixturePlan",
           "plan_stratified"]
