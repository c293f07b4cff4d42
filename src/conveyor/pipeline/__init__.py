"""Software pipelines: the plan (pure data) and its executors."""
from conveyor.pipeline.api import emit_pipeline
from conveyor.pipeline.plan import BlockSpec, Event, OperandPlan, PipelinePlan, plan

__all__ = ["emit_pipeline", "plan", "BlockSpec", "PipelinePlan", "OperandPlan", "Event"]
