"""A kernel that waits for something nothing will do fails after the wait deadline, naming what
it waited for, on both Pallas interpreters, instead of hanging the test run
(`_compat.interpreter_wait_deadline`; tests/conftest.py sets 60 s for the whole suite)."""
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from conveyor import _compat

SUITE_DEADLINE_S = 60   # as tests/conftest.py sets it


@pytest.fixture
def short_deadline():
    _compat.interpreter_wait_deadline(1.5)
    try:
        yield
    finally:
        _compat.interpreter_wait_deadline(SUITE_DEADLINE_S)


def test_tpu_semaphore_wait_nothing_signals(short_deadline):
    def kernel(o_ref, sem):
        pl.semaphore_wait(sem, 1)   # nothing signals it
        o_ref[...] = jnp.ones_like(o_ref)
    f = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                       scratch_shapes=[pltpu.SemaphoreType.REGULAR], interpret=pltpu.InterpretParams())
    with pytest.raises(Exception, match=r"TPU interpreter: core 0 waited 1.5 s on semaphore \d+ for a count of 1"):
        jax.block_until_ready(f())


def test_gpu_barrier_wait_nothing_arrives_at(short_deadline):
    def kernel(x_ref, o_ref):
        def body(scratch, barrier):
            plgpu.barrier_wait(barrier.at[0])   # no copy was issued on it: no arrival
            o_ref[...] = scratch[...]
        pl.run_scoped(body, plgpu.SMEM((8, 128), jnp.float32), plgpu.Barrier(num_barriers=1))
    f = cv.kernel(kernel, jax.ShapeDtypeStruct((8, 128), jnp.float32), backend="mosaic_gpu",
                  interpret=plgpu.InterpretGPUParams())
    with pytest.raises(Exception, match=r"GPU interpreter: Warpgroup\(.*\) waited 1.5 s at barrier \d+ "
                                        r"\(1 arrival\(s\) per phase\)"):
        jax.block_until_ready(jax.jit(f)(jnp.ones((8, 128))))


def test_deadline_must_be_positive():
    with pytest.raises(ValueError, match="seconds must be > 0, got 0"):
        _compat.interpreter_wait_deadline(0)
