"""delay_release keeps a slot's contents until delay_release steps after its use (TPU interpreter).

The body reads, at step s, the slot step s - 1 used (through the slot buffer behind its block ref),
as asynchronous work left in flight by step s - 1 would. With the interpreter's DMAs executed when
they are started ("eager"), a refill issued too early has already overwritten that slot: with
delay_release=1 the body must see step s - 1's block; with delay_release=0 it must not (the
control that proves the test can fail when a lowering ignores delay_release: there the race
detector reports the refill's DMA writing the slot the body reads, and the values are wrong).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests import schedule

STEPS, SLOTS, BLOCK = 6, 2, (8, 128)


def previous_slot_seen(delay_release, detect_races=True):
    """Output block s = what the slot of step s - 1 holds while step s runs (block 0: zeros)."""

    def kernel(x_ref, o_ref):
        def body(idx, xb, ob):
            (s,) = idx
            slots = xb.ref  # the (SLOTS, *BLOCK) buffer whose slot s % SLOTS the pipeline handed us
            ob[...] = jnp.where(s > 0, slots[(s + SLOTS - 1) % SLOTS], 0.0)

        spec = cv.BlockSpec(BLOCK, lambda i: (i, 0))
        cv.emit_pipeline(
            body,
            grid=(STEPS,),
            in_specs=[spec],
            out_specs=[spec],
            max_concurrent_steps=SLOTS,
            delay_release=delay_release,
        )(x_ref, o_ref)

    shape = (STEPS * BLOCK[0], BLOCK[1])
    params = pltpu.InterpretParams(detect_races=detect_races, dma_execution_mode="eager")
    return cv.kernel(
        kernel, jax.ShapeDtypeStruct(shape, jnp.float32), backend="mosaic_tpu", interpret=params
    )


def _x():
    return jnp.asarray(
        np.random.default_rng(5).standard_normal((STEPS * BLOCK[0], BLOCK[1])), jnp.float32
    )


def _previous_blocks(x):
    rows = BLOCK[0]
    return np.concatenate([np.zeros(BLOCK, np.float32), np.asarray(x[:-rows])])


def test_delay_release_1_keeps_the_previous_block_until_the_step_after():
    x = _x()
    np.testing.assert_array_equal(jax.jit(previous_slot_seen(1))(x), _previous_blocks(x))


def test_without_delay_the_slot_is_refilled_early():
    x = _x()
    # the refill's DMA writes the slot being read
    with pytest.raises(Exception, match="RACE DETECTED"):
        jax.block_until_ready(jax.jit(previous_slot_seen(0))(x))
    seen = np.asarray(jax.jit(previous_slot_seen(0, detect_races=False))(x))
    rows = BLOCK[0]
    # From step 1 on, the slot of step s - 1 already holds step s + 1's block.
    np.testing.assert_array_equal(seen[rows : (STEPS - 1) * rows], np.asarray(x[2 * rows :]))


@pytest.mark.parametrize("delay_release, refill_gap", [(0, 0), (1, 1)])
def test_slot_refill_waits_delay_release_steps_after_use(delay_release, refill_gap):
    p = cv.pipeline.plan(
        grid=(STEPS,),
        in_specs=[cv.BlockSpec(BLOCK, lambda i: (i, 0))],
        max_concurrent_steps=2,
        delay_release=delay_release,
    )
    last_use = {}
    waits, fetches = schedule.fetch_waits(p), schedule.fetches(p)
    for a in schedule.issued(p):
        if a in waits:
            last_use[schedule.slot(a)] = a.at
        elif a in fetches and a.at >= 0 and schedule.slot(a) in last_use:
            # a refill is issued (after the body of step a.at) `refill_gap` steps after the slot's
            # last use
            assert a.at - last_use[schedule.slot(a)] == refill_gap
