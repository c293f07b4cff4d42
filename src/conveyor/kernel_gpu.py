"""cv.kernel on the mosaic_gpu backend: a Pallas Mosaic GPU kernel (plgpu.kernel), operands in GMEM.

On CPU it runs through the Mosaic GPU interpreter (`interpret=True` or `plgpu.InterpretGPUParams`);
`jax.export(..., platforms=["cuda"])` compiles it for sm_90 without a GPU.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from conveyor._compat import gpu_kernel_options
from conveyor.aliasing import check_alias_operands, call_with_aliases
from conveyor.interpreters import gpu_params
from conveyor.sync import mosaic_scratch


BARRIER_BYTES = 8


def smem_bytes(buffers) -> int:
    """Bytes of shared memory the buffers take (SMEM arrays, ShapeDtypeStructs and barriers)."""
    total = 0
    for b in buffers:
        if isinstance(b, plgpu.Barrier):
            total += (
                b.num_barriers if isinstance(b.num_barriers, int) else math.prod(b.num_barriers)
            ) * BARRIER_BYTES
        elif hasattr(b, "shape") and hasattr(b, "dtype"):
            total += math.prod(b.shape) * jnp.dtype(b.dtype).itemsize
    return total


def launch(
    body,
    outs,
    scratch,
    single,
    interpret,
    enter_context,
    num_threads=1,
    thread_name=None,
    grid=(),
    grid_names=(),
    aliases=None,
    cost_estimate=None,
):
    aliases = aliases or {}

    def wrapped(*refs):
        with enter_context():
            if body(*refs) is not None:
                raise TypeError("kernel body must return None (it writes outputs through refs)")

    def make_kernel(kernel_body, out_type):
        return plgpu.kernel(
            kernel_body,
            out_type=out_type,
            scratch_types=[
                mosaic_scratch(s, plgpu.SMEM, plgpu.SemaphoreType.REGULAR) for s in scratch
            ],
            interpret=gpu_params(interpret),
            **gpu_kernel_options(cost_estimate=cost_estimate),
            **(
                {"num_threads": num_threads, "thread_name": thread_name}
                if thread_name is not None
                else {}
            ),
            **({"grid": grid, "grid_names": grid_names} if grid else {}),
        )

    def run(*inputs):
        check_alias_operands("cv.kernel", aliases, inputs, outs)
        results = call_with_aliases(make_kernel, wrapped, inputs, outs, aliases, fence_aliased=True)
        return results[0] if single else tuple(results)

    return run
