"""A kernel that waits for something nothing will do fails after the wait deadline, naming what
it waited for, on both Pallas interpreters, instead of hanging: every interpreted kernel that
Conveyor launches has the deadline, by default (`cv.set_interpreter_wait_deadline`)."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from conveyor import interpreters


@pytest.fixture
def short_deadline():
    before = interpreters.wait_deadline()
    cv.set_interpreter_wait_deadline(1.5)
    try:
        yield
    finally:
        cv.set_interpreter_wait_deadline(before)


def _tpu_copy_never_started(x_ref, o_ref, sem):
    pltpu.make_async_copy(x_ref, o_ref, sem).wait()  # waits for a DMA that was never started


def _tpu_kernel():
    return cv.kernel(
        _tpu_copy_never_started,
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
        backend="mosaic_tpu",
        scratch_shapes=[pltpu.SemaphoreType.DMA],
        interpret=True,
    )


def test_tpu_dma_never_started_under_jit(short_deadline):
    with pytest.raises(
        Exception,
        match=r"TPU interpreter: core 0 waited 1.5 s on semaphore \d+ for a count of "
        r"\d+, and nothing signals it",
    ):
        jax.block_until_ready(jax.jit(_tpu_kernel())(jnp.ones((8, 128))))


def test_tpu_semaphore_nothing_signals_eagerly(short_deadline):
    def kernel(x_ref, o_ref, sem):
        pl.semaphore_wait(sem, 1)  # nothing signals it
        pltpu.sync_copy(x_ref, o_ref)

    f = cv.kernel(
        kernel,
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
        backend="mosaic_tpu",
        scratch_shapes=[pltpu.SemaphoreType.REGULAR],
        interpret=True,
    )
    with pytest.raises(Exception, match=r"waited 1.5 s on semaphore \d+ for a count of 1"):
        jax.block_until_ready(f(jnp.ones((8, 128))))


def test_gpu_barrier_wait_nothing_arrives_at(short_deadline):
    def kernel(x_ref, o_ref):
        def body(scratch, barrier):
            plgpu.barrier_wait(barrier.at[0])  # no copy was issued on it: no arrival
            o_ref[...] = scratch[...]

        pl.run_scoped(body, plgpu.SMEM((8, 128), jnp.float32), plgpu.Barrier(num_barriers=1))

    f = cv.kernel(
        kernel,
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
        backend="mosaic_gpu",
        interpret=plgpu.InterpretGPUParams(),
    )
    with pytest.raises(
        Exception,
        match=r"GPU interpreter: Warpgroup\(.*\) waited 1.5 s at barrier \d+ "
        r"\(1 arrival\(s\) per phase\)",
    ):
        jax.block_until_ready(jax.jit(f)(jnp.ones((8, 128))))


def test_deadline_is_on_by_default_for_a_new_user():
    """A fresh process that never touched conveyor.testing: the deadlocked kernel fails, it does
    not hang (the subprocess timeout would fail this test), and the error says why."""
    script = textwrap.dedent("""
        import jax, jax.numpy as jnp
        import conveyor as cv
        from tests.test_interpreter_deadline import _tpu_kernel
        assert cv.interpreters.wait_deadline() == 60.0
        cv.set_interpreter_wait_deadline(1.0)
        try:
            jax.block_until_ready(jax.jit(_tpu_kernel())(jnp.ones((8, 128))))
        except Exception as e:
            print(str(e).strip().splitlines()[-1])
    """)
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        "InterpreterDeadlock: Pallas TPU interpreter: core 0 waited 1 s on semaphore" in out.stdout
    ), out.stdout


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "10"])
def test_deadline_must_be_a_positive_number(bad):
    with pytest.raises(
        ValueError,
        match=r"set_interpreter_wait_deadline: seconds must be a finite number > 0 or "
        r"None, got",
    ):
        cv.set_interpreter_wait_deadline(bad)
