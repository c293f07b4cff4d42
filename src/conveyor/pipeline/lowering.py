"""Helpers shared by the plan's executors (xla, mosaic_tpu, mosaic_gpu)."""
from __future__ import annotations

from jax.experimental import pallas as pl

from conveyor.pipeline.plan import OperandPlan, PipelinePlan


def block_view(p: PipelinePlan, op: OperandPlan, ref, step):
    """The global-memory view of `op`'s block at `step`; squeezed dims are indexed by an integer."""
    idx = tuple(off if spec is None else pl.ds(off, size)
                for off, size, spec in zip(p.offsets(op, step), op.block_dims, op.block_shape))
    return ref.at[idx]


def call_body(body, indices, blocks, carry, has_carry: bool):
    """Run the user's body with the pipeline convention; returns the next carry (or None)."""
    if has_carry:
        return body(indices, *blocks, carry)
    if body(indices, *blocks) is not None:
        raise TypeError("pipeline body returned a value but no init_carry was given")
    return carry
