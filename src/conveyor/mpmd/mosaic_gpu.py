"""mpmd_map on Mosaic GPU: every (program, mesh point) becomes one warpgroup of a single kernel.

The kernel has as many threads (warpgroups) as instances; thread t runs its program with
`lax.axis_index` of the program's axes fixed to its point (the body is traced per instance with
those indices as constants). Shared scratch lives in SMEM; `cv.BarrierType` is an mbarrier every
warpgroup arrives on; `cv.SemaphoreType` becomes GMEM semaphores allocated outside the kernel
(`plgpu.alloc_semaphore`) and passed in, since Mosaic GPU kernels take semaphores as operands.

Limits (jax 0.12): the Mosaic GPU interpreter cannot run semaphores (its re-trace refuses them:
"Cannot signal on a non-semaphore Ref"), so kernels with `cv.SemaphoreType` are verified by
`jax.export(..., platforms=["cuda"])` only; `input_output_aliases` is not supported by
`plgpu.kernel`.
"""
from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from conveyor._compat import call_with_axis_values
from conveyor.mpmd.api import call_program
from conveyor.sync import SYNC_BACKEND, BarrierType, SemaphoreType

THREAD_AXIS = "_cv_mpmd_instance"


def build(programs, axes, out_leaves, scratch, scratch_names, aliases, interpret, name):
    if aliases:
        raise NotImplementedError("mpmd_map on mosaic_gpu: input_output_aliases is not supported by plgpu.kernel; "
                                  "copy the input into the output in a program instead")
    instances = [(i, fn, point) for i, (mesh, fn) in enumerate(programs) for point in mesh.points()]
    total = len(instances)
    sem_slots = [k for k, s in enumerate(scratch) if isinstance(s, SemaphoreType)]
    if sem_slots and interpret:
        raise NotImplementedError("mpmd_map on mosaic_gpu: the Mosaic GPU interpreter of jax 0.12 cannot run "
                                  "semaphores; synchronise with cv.BarrierType under the interpreter, or export "
                                  "for cuda to check the lowering")
    kernel_scratch = []
    for k, s in enumerate(scratch):
        if isinstance(s, SemaphoreType):
            continue
        if isinstance(s, BarrierType):
            kernel_scratch.append(plgpu.Barrier(num_arrivals=total))
        elif hasattr(s, "shape") and hasattr(s, "dtype"):
            kernel_scratch.append(plgpu.SMEM(tuple(s.shape), s.dtype))
        else:
            raise ValueError(f"mpmd_map on mosaic_gpu: scratch {scratch_names[k] if scratch_names else k} must be a "
                             f"ShapeDtypeStruct, cv.SemaphoreType or cv.BarrierType, got {s!r}")

    def call(*inputs):
        n_in, n_out, n_sem = len(inputs), len(out_leaves), len(sem_slots)

        def body(*refs):
            sems, ins = refs[:n_sem], refs[n_sem:n_sem + n_in]
            outs = refs[n_sem + n_in:n_sem + n_in + n_out]
            rest = iter(refs[n_sem + n_in + n_out:])
            sem_iter = iter(sems)
            scratch_refs = [next(sem_iter) if isinstance(s, SemaphoreType) else next(rest) for s in scratch]
            tid = lax.axis_index(THREAD_AXIS)
            token = SYNC_BACKEND.set("mosaic_gpu")
            try:
                for t, (i, fn, point) in enumerate(instances):
                    @pl.when(tid == t)
                    def _(i=i, fn=fn, point=point):
                        values = {k: (axes[k], v) for k, v in point.items()}
                        values[THREAD_AXIS] = (total, t)

                        call_with_axis_values(lambda: call_program(i, fn, (*ins, *outs), scratch_refs, scratch_names),
                                              values)
            finally:
                SYNC_BACKEND.reset(token)

        kernel = plgpu.kernel(body, out_type=tuple(jax.ShapeDtypeStruct(tuple(s.shape), s.dtype) for s in out_leaves),
                              scratch_types=kernel_scratch, num_threads=total, thread_name=THREAD_AXIS,
                              interpret=(plgpu.InterpretGPUParams() if interpret is True else interpret) or None)
        semaphores = [plgpu.alloc_semaphore(tuple(scratch[k].shape)) for k in sem_slots]
        return kernel(*semaphores, *inputs)

    return call
