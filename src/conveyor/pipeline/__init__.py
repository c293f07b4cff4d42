"""Software pipelines: the plan (pure data) and its executors."""

from conveyor.pipeline.api import (
    PrefetchedBlocks,
    emit_pipeline,
    emit_pipeline_warp_specialized,
    emit_pipeline_with_allocations,
)
from conveyor.kernel import checked_schedule
from conveyor.plans.pipeline import OperandPlan, PipelinePlan, plan
from conveyor.plans.specs import BlockSpec
from conveyor.plans.warp import PipelineState, WarpSpecializedPlan

__all__ = [
    "emit_pipeline",
    "emit_pipeline_with_allocations",
    "PrefetchedBlocks",
    "checked_schedule",
    "emit_pipeline_warp_specialized",
    "WarpSpecializedPlan",
    "PipelineState",
    "plan",
    "BlockSpec",
    "PipelinePlan",
    "OperandPlan",
]
