"""cv.kernel's scratch_shapes on the Mosaic backends: arrays, and Conveyor's own counting
semaphores (`cv.SemaphoreType`), which become Pallas' REGULAR semaphores."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv


def _body(x_ref, o_ref, sems):
    pl.semaphore_signal(sems.at[1], 2)
    pl.semaphore_wait(sems.at[1], 2)  # back to zero, as Pallas requires at the end

    def step(indices, x_block, o_block):
        o_block[...] = x_block[...] + 1.0

    spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
    cv.emit_pipeline(step, grid=(2,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)


def test_conveyor_semaphores_as_tpu_kernel_scratch():
    x = jnp.asarray(np.random.default_rng(4801).standard_normal((16, 128)), jnp.float32)
    call = cv.kernel(
        _body,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        backend="mosaic_tpu",
        interpret=pltpu.InterpretParams(detect_races=True),
        scratch_shapes=[cv.SemaphoreType((2,))],
    )
    np.testing.assert_array_equal(call(x), x + 1.0)


def test_conveyor_semaphores_as_gpu_kernel_scratch_export_for_cuda():
    def body(x_ref, o_ref, sems):
        o_ref[...] = x_ref[...] + 1.0

    x = jax.ShapeDtypeStruct((128,), jnp.float32)
    call = cv.kernel(body, x, backend="mosaic_gpu", scratch_shapes=[cv.SemaphoreType((2,))])
    exported = jax.export.export(jax.jit(call), platforms=["cuda"])(x)
    assert "mosaic_gpu" in exported.mlir_module()
