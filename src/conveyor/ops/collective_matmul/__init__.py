"""Collective matmuls over device rings: all-gather x matmul and matmul x reduce-scatter."""

from conveyor.ops.collective_matmul.api import RingConfig, all_gather_matmul, matmul_reduce_scatter
from conveyor.plans.ring import RingBlocks, RingPlan, RingStep, ring_plan

__all__ = [
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "RingBlocks",
    "RingConfig",
    "RingPlan",
    "RingStep",
    "ring_plan",
]
