"""cv.emit_pipeline: build the plan, then hand it to the launching kernel's backend."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from conveyor.kernel import current_context
from conveyor.pipeline import plan as plan_lib, xla as xla_exec


def _check_shapes(p: plan_lib.PipelinePlan, refs):
    for op, ref in zip(p.inputs + p.outputs, refs):
        if len(op.block_shape) != len(ref.shape):
            raise ValueError(f"{op.name}: block_shape {op.block_shape} has {len(op.block_shape)} dims, "
                             f"the ref has shape {tuple(ref.shape)}")
        for d, (b, s) in enumerate(zip(op.block_dims, ref.shape)):
            if s % b:
                raise ValueError(f"{op.name}: block_shape {op.block_shape} does not divide the array shape "
                                 f"{tuple(ref.shape)} (dimension {d}: {s} % {b} != 0); pad the array or "
                                 f"choose a dividing block")


def emit_pipeline(body: Callable[..., Any], *, grid: Sequence[int], in_specs: Sequence[Any] = (),
                  out_specs: Sequence[Any] = (), max_concurrent_steps: int = 1, delay_release: int = 0,
                  init_carry: Any = None) -> Callable[..., Any]:
    """A software pipeline over `grid`: block copies into on-chip memory overlapped with `body`.

    Returns a function to call inside a `cv.kernel` body with the global-memory refs (inputs, then
    outputs). `body(indices, *in_block_refs, *out_block_refs)` runs once per grid step, row-major;
    `indices` is the tuple of grid indices (the same convention on every backend). With
    `init_carry`, `body(indices, *refs, carry)` returns the next carry and the pipeline returns the
    last one. Schedule and output residency: see `conveyor.pipeline.plan`. Block shapes must
    divide the arrays (a ValueError says which operand and dimension does not).
    """
    p = plan_lib.plan(grid=grid, in_specs=in_specs, out_specs=out_specs,
                      max_concurrent_steps=max_concurrent_steps, delay_release=delay_release)

    def run(*refs):
        ctx = current_context("emit_pipeline(...)(refs)")
        n_in, n_out = len(p.inputs), len(p.outputs)
        if len(refs) != n_in + n_out:
            raise ValueError(f"pipeline: expected {n_in} input refs and {n_out} output refs "
                             f"({n_in + n_out} in all, matching in_specs/out_specs), got {len(refs)}")
        _check_shapes(p, refs)
        if ctx.backend == "xla":
            return xla_exec.run_pipeline(p, body, refs[:n_in], refs[n_in:], init_carry, init_carry is not None)
        if ctx.backend == "mosaic_tpu":
            from conveyor.pipeline import mosaic_tpu
            return mosaic_tpu.run_pipeline(p, body, refs[:n_in], refs[n_in:], init_carry, init_carry is not None)
        if ctx.backend == "mosaic_gpu":
            from conveyor.pipeline import mosaic_gpu
            return mosaic_gpu.run_pipeline(p, body, refs[:n_in], refs[n_in:], init_carry, init_carry is not None)
        raise NotImplementedError(f"emit_pipeline: backend {ctx.backend!r} is not implemented yet")

    run.plan = p
    return run
