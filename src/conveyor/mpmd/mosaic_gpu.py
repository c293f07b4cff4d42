"""mpmd_map on Mosaic GPU: every (program, mesh point) becomes one warpgroup of a single kernel.

Design notes: docs/internals/mpmd.md, section `mpmd/mosaic_gpu.py`.
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from conveyor._compat import gpu_kernel_options
from conveyor.interpreters import gpu_params

from conveyor.jaxprs import call_with_axis_values
from conveyor.aliasing import call_with_aliases
from conveyor.mpmd.programs import call_program, refuse_ref_inputs, split_refs
from conveyor.mpmd.scratch import ScratchLayout
from conveyor.kernel import mpmd_program
from conveyor.sync import BarrierType, SemaphoreType

THREAD_AXIS = "_cv_mpmd_instance"


def kernel_scratch(layout: ScratchLayout, total: int) -> list:
    """Mosaic GPU scratch types for the (normalised) scratch leaves."""
    out = []
    for s in layout.leaves:
        if isinstance(s, SemaphoreType):
            out.append(plgpu.SemaphoreType.REGULAR(tuple(s.shape)))
        elif isinstance(s, BarrierType):
            out.append(plgpu.Barrier(num_arrivals=total))
        else:
            out.append(plgpu.SMEM(tuple(s.shape), s.dtype))
    return out


def build(
    programs,
    axes,
    out_leaves,
    layout: ScratchLayout,
    aliases,
    interpret,
    name,
    cost_estimate=None,
    *,
    debug: bool = False,
):
    instances = [(i, fn, point) for i, (mesh, fn) in enumerate(programs) for point in mesh.points()]
    total = len(instances)
    if interpret and any(isinstance(s, SemaphoreType) for s in layout.leaves):
        raise NotImplementedError(
            "mpmd_map on mosaic_gpu: the Mosaic GPU interpreter of jax 0.12 cannot run semaphores; "
            "synchronise with cv.BarrierType under the interpreter, or export for cuda to check "
            "the lowering"
        )
    scratch_types = kernel_scratch(layout, total)

    def call(*inputs):
        refuse_ref_inputs("mosaic_gpu", inputs)
        n_in, n_out = len(inputs), len(out_leaves)

        def body(*refs):
            ins, outs, scratch_refs = split_refs(refs, n_in, n_out)
            tid = lax.axis_index(THREAD_AXIS)
            with mpmd_program("mosaic_gpu"):
                for t, (i, fn, point) in enumerate(instances):

                    @pl.when(tid == t)
                    def _(i=i, fn=fn, point=point):
                        values = {k: (axes[k], v) for k, v in point.items()}
                        values[THREAD_AXIS] = (total, t)
                        call_with_axis_values(
                            lambda: call_program(i, fn, (*ins, *outs), scratch_refs, layout), values
                        )

        def make_kernel(kernel_body, out_type):
            return plgpu.kernel(
                kernel_body,
                out_type=out_type,
                scratch_types=scratch_types,
                num_threads=total,
                thread_name=THREAD_AXIS,
                **gpu_kernel_options(cost_estimate=cost_estimate, kernel_name=name),
                interpret=gpu_params(interpret),
                debug=debug,
            )

        return call_with_aliases(make_kernel, body, inputs, out_leaves, aliases, fence_aliased=True)

    return call
