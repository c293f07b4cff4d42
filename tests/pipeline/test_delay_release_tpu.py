"""delay_release protects a slot that a body's asynchronous work still reads (TPU interpreter).

The body starts a DMA out of its input slot at step s and waits for it at step s + 1. With
delay_release=1 the refill of that slot waits one step: the kernel runs race-free and correct under
the TPU interpreter's race detector. With delay_release=0 the plan refills the slot at the end of
step s while the DMA may still read it; jax 0.12's interpreter does NOT report this (in on_wait
mode the DMAs execute at their waits, in the right order, so no conflicting access is observed):
that case is checked on the plan's events here, and is the checker's job (issue #5).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv

STEPS, BLOCK = 6, (8, 128)


def kernel_with_inflight_copy(delay_release):
    def kernel(x_ref, o_ref, stash, sems):
        def body(idx, xb, ob):
            (s,) = idx

            def copy(step):  # the un-awaited work: input slot -> stash[step % 2]
                return pltpu.make_async_copy(xb, stash.at[step % 2], sems.at[step % 2])

            @pl.when(s > 0)
            def _():
                copy(s - 1).wait()  # finish the previous step's copy (it read its slot until now)
            copy(s).start()
            ob[...] = xb[...] * 2.0

            @pl.when(s == STEPS - 1)
            def _():
                copy(s).wait()

        spec = cv.BlockSpec(BLOCK, lambda i: (i, 0))
        cv.emit_pipeline(body, grid=(STEPS,), in_specs=[spec], out_specs=[spec],
                         max_concurrent_steps=2, delay_release=delay_release)(x_ref, o_ref)

    shape = (STEPS * BLOCK[0], BLOCK[1])
    return cv.kernel(kernel, jax.ShapeDtypeStruct(shape, jnp.float32), backend="mosaic_tpu",
                     scratch_shapes=[jax.ShapeDtypeStruct((2, *BLOCK), jnp.float32), pltpu.SemaphoreType.DMA((2,))],
                     interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait"))


def _x():
    return jnp.asarray(np.random.default_rng(5).standard_normal((STEPS * BLOCK[0], BLOCK[1])), jnp.float32)


def test_delay_release_1_is_race_free():
    x = _x()
    np.testing.assert_array_equal(jax.jit(kernel_with_inflight_copy(1))(x), x * 2)


@pytest.mark.parametrize("delay_release, refill_gap", [(0, 0), (1, 1)])
def test_slot_refill_waits_delay_release_steps_after_use(delay_release, refill_gap):
    p = cv.pipeline.plan(grid=(STEPS,), in_specs=[cv.BlockSpec(BLOCK, lambda i: (i, 0))],
                         max_concurrent_steps=2, delay_release=delay_release)
    last_use = {}
    for e in p.events():
        if e.kind == "wait_fetch":
            last_use[e.slot] = e.step
        elif e.kind == "fetch" and e.step >= 0 and e.slot in last_use:
            # a refill is issued (after the body of e.step) `refill_gap` steps after the slot's last use
            assert e.step - last_use[e.slot] == refill_gap
