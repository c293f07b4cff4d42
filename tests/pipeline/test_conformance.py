"""Conformance: the copies and waits each Mosaic lowering issues, recorded while its interpreter
runs the kernel, are the plan's program's, operand by operand.

The lowerings record the program's own typed actions (`record_issued`), built by the plan's
constructors, each with the grid step it is issued in; they must be the program's copies and
waits, as many times each (the recording callbacks are unordered, so order is checked between
grid steps, not within one). Mosaic GPU waits for its stores by bulk-group count, not per slot,
so its write-back waits are not compared there; its fetches, fetch waits and stores are.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from conveyor.pipeline.lowering import record_issued
from conveyor.plans.program import Copy, Signal, Wait
from tests import schedule
from tests.platform import gpu_interpreter_always

# Each case runs in about a second; a lowering that waits for a copy it never issued fails at the
# interpreters' wait deadline (tests/conftest.py, 60 s), naming the semaphore or barrier.
pytestmark = pytest.mark.timeout(120)

B = (8, 128)
X = cv.BlockSpec(B, lambda i, k: (i, k))
W = cv.BlockSpec(B, lambda i, k: (k, 0))
BIAS = cv.BlockSpec(B, lambda i, k: (0, 0))
OUT = cv.BlockSpec(B, lambda i, k: (i, 0))  # revisited over k: written back when i changes
OUT_EACH = cv.BlockSpec(B, lambda i, k: (i, k))  # a new block every step
ROW = cv.BlockSpec(B, lambda i, k: (i, 0))  # an input reused across k: fetched when i changes
REVISIT = cv.BlockSpec(B, lambda i, k: (k % 2, 0))  # blocks 0 1 0 | 0 1 0 ...: block 0 comes back
AHEAD = pl.BlockSpec(B, lambda i, k: (i, 0), pipeline_mode=pl.Buffered(2, use_lookahead=True))

# name -> (grid, in_specs, out_specs, max_concurrent_steps, delay_release)
CONFIGS = {
    "one slot": ((2, 3), [X, BIAS], [OUT], 1, 0),
    "double buffered": ((2, 3), [X, W, BIAS], [OUT], 2, 0),
    "three slots, delay 1": ((3, 2), [X, W], [OUT, OUT_EACH], 3, 1),
    "four slots, delay 2": ((2, 4), [X], [OUT_EACH], 4, 2),
    "own buffer counts": (
        (2, 3),
        [pl.BlockSpec(B, lambda i, k: (i, k), pipeline_mode=pl.Buffered(3)), W],
        [pl.BlockSpec(B, lambda i, k: (i, 0), pipeline_mode=pl.Buffered(1))],
        2,
        0,
    ),
    "unchanged blocks reused": ((3, 3), [ROW, REVISIT, X], [OUT_EACH], 2, 0),
    "lookahead": (
        (4, 3),
        [
            AHEAD,
            pl.BlockSpec(
                B, lambda i, k: (k % 2, 0), pipeline_mode=pl.Buffered(3, use_lookahead=True)
            ),
        ],
        [OUT],
        3,
        1,
    ),
}


def _run(backend, grid, in_specs, out_specs, mcs, delay):
    def body(idx, *refs):
        ins, outs = refs[: len(in_specs)], refs[len(in_specs) :]
        total = sum(r[...] for r in ins)
        for o in outs:
            o[...] = total

    def kernel(*refs):
        cv.emit_pipeline(
            body,
            grid=grid,
            in_specs=in_specs,
            out_specs=out_specs,
            max_concurrent_steps=mcs,
            delay_release=delay,
        )(*refs)

    rng = np.random.default_rng(0)
    shapes = {
        id(X): (grid[0] * 8, grid[1] * 128),
        id(W): (grid[1] * 8, 128),
        id(BIAS): B,
        id(ROW): (grid[0] * 8, 128),
        id(REVISIT): (16, 128),
        id(AHEAD): (grid[0] * 8, 128),
        id(OUT): (grid[0] * 8, 128),
        id(OUT_EACH): (grid[0] * 8, grid[1] * 128),
    }
    args = [
        jnp.asarray(
            rng.standard_normal(shapes.get(id(s), (grid[0] * 8, grid[1] * 128))), jnp.float32
        )
        for s in in_specs
    ]
    outs = [
        jax.ShapeDtypeStruct(shapes.get(id(s), (grid[0] * 8, 128)), jnp.float32) for s in out_specs
    ]
    # the records are debug callbacks, which Mosaic GPU lowers in a plain pipeline only in its
    # interpreter ("Unimplemented primitive ... debug_callback" on an H200)
    interpret = pltpu.InterpretParams() if backend == "mosaic_tpu" else gpu_interpreter_always()
    with record_issued() as log:
        jax.block_until_ready(cv.kernel(kernel, outs, backend=backend, interpret=interpret)(*args))
    plan = cv.emit_pipeline(
        body,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        max_concurrent_steps=mcs,
        delay_release=delay,
    ).plan
    return log, plan


def _compared(actions, backend):
    """The copies and waits compared on `backend`, as a multiset."""
    return collections.Counter(
        a
        for a in actions
        if backend == "mosaic_tpu" or not (isinstance(a, Wait) and a.counter[0] == "stored")
    )


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("backend", ["mosaic_tpu", "mosaic_gpu"])
def test_lowering_issues_the_plans_program(backend, name):
    grid, in_specs, out_specs, mcs, delay = CONFIGS[name]
    log, plan = _run(backend, grid, in_specs, out_specs, mcs, delay)
    assert log, "nothing was recorded: the lowering issued no copy through `issued`"
    got, want = _compared(log, backend), _compared(schedule.issued(plan), backend)
    assert got == want, (sorted(map(str, got - want)), sorted(map(str, want - got)))


def test_warp_specialized_memory_thread_fetches_as_planned():
    """The GPU memory thread's fetches (operand, slot, step), in order, are the program's copies."""
    spec_x, spec_bias = X, BIAS

    def body(idx, xb, bb, ob):
        ob[...] = xb[...] + bb[...]

    pipe = cv.emit_pipeline_warp_specialized(
        body,
        grid=(2, 3),
        in_specs=[spec_x, spec_bias],
        out_specs=[OUT],
        max_concurrent_steps=3,
        delay_release=1,
        memory_registers=40,
        wg_axis="wg",
        num_compute_wgs=2,
    )
    x = jnp.asarray(np.random.default_rng(1).standard_normal((16, 384)), jnp.float32)
    bias = jnp.ones(B, jnp.float32)
    with record_issued() as log:
        jax.block_until_ready(
            cv.kernel(
                lambda x_ref, b_ref, o_ref: pipe(x_ref, b_ref, o_ref),
                jax.ShapeDtypeStruct((16, 128), jnp.float32),
                num_threads=3,
                thread_name="wg",
                backend="mosaic_gpu",
                interpret=gpu_interpreter_always(),  # debug callbacks: interpreter only
            )(x, bias)
        )
    program = pipe.plan.program()
    copies = collections.Counter(a for a in log if isinstance(a, Copy))
    assert copies == collections.Counter(program.copies())
    assert {c.queue for c in copies} == {"loads", "stores"}


@pytest.mark.parametrize("mcs, delay", [(2, 0), (3, 1)])
def test_warp_specialized_barriers_are_the_programs(mcs, delay):
    """The memory thread's consumed-barrier waits (barrier, slot, phase), the compute threads'
    releases (slot, phase) and output-barrier arrivals, as many of each as the program has."""

    def body(idx, xb, wb, ob):
        ob[...] = xb[...] + wb[...]

    pipe = cv.emit_pipeline_warp_specialized(
        body,
        grid=(2, 3),
        in_specs=[X, W],
        out_specs=[OUT],
        max_concurrent_steps=mcs,
        delay_release=delay,
        wg_axis="wg",
        memory_registers=40,
        num_compute_wgs=2,
    )
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((16, 384)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 128)), jnp.float32)
    with record_issued() as log:
        jax.block_until_ready(
            cv.kernel(
                lambda x_ref, w_ref, o_ref: pipe(x_ref, w_ref, o_ref),
                jax.ShapeDtypeStruct((16, 128), jnp.float32),
                num_threads=3,
                thread_name="wg",
                backend="mosaic_gpu",
                interpret=gpu_interpreter_always(),  # debug callbacks: interpreter only
            )(x, w)
        )

    def barrier_records(actions):
        return collections.Counter(
            a for a in actions if isinstance(a, (Wait, Signal)) and a.counter[0] != "stored"
        )

    planned = barrier_records(a for _, actions in pipe.plan.program().actors for a in actions)
    # the program's waits on the output barrier are not recorded
    planned -= collections.Counter(
        a for a in planned.elements() if isinstance(a, Wait) and a.counter == ("out_ready",)
    )
    got = barrier_records(log)
    assert planned and got == planned, (
        sorted(map(str, got - planned)),
        sorted(map(str, planned - got)),
    )
