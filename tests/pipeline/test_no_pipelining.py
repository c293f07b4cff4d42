"""no_pipelining (the debug schedule) and one-slot outputs (pl.Buffered(1)), on every backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpreter_always
from conveyor.plans.program import Compute, Copy, Wait
from tests import schedule

X_SPEC = cv.BlockSpec((16, 128), lambda i, j, k: (i, k))
W_SPEC = cv.BlockSpec((128, 128), lambda i, j, k: (k, j))


def _interpret(backend, dma_mode="on_wait"):
    return {
        "xla": False,
        "mosaic_tpu": pltpu.InterpretParams(detect_races=True, dma_execution_mode=dma_mode),
        # the bodies here are float32 jnp matmuls, which Mosaic GPU does not lower (wgmma
        # pipelines: test_dot.py): its interpreter checks the schedule on every platform
        "mosaic_gpu": gpu_interpreter_always(detect_races=True),
    }[backend]


def _matmul(out_spec, **options):
    def kernel(x_ref, w_ref, o_ref):
        def body(idx, xb, wb, ob):
            ob[...] = jnp.where(idx[2] == 0, 0.0, ob[...]) + xb[...] @ wb[...]

        cv.emit_pipeline(
            body, grid=(2, 2, 3), in_specs=[X_SPEC, W_SPEC], out_specs=[out_spec], **options
        )(x_ref, w_ref, o_ref)

    return kernel


@pytest.mark.parametrize(
    "backend, dma_mode",
    [("xla", None), ("mosaic_tpu", "on_wait"), ("mosaic_tpu", "eager"), ("mosaic_gpu", None)],
)
@pytest.mark.parametrize("variant", ["no_pipelining", "buffered_1_output"])
def test_matmul_accumulating_in_a_one_slot_output(backend, dma_mode, variant):
    rng = np.random.default_rng(4721)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((32, 384), (384, 256)))
    if variant == "no_pipelining":
        kernel = _matmul(cv.BlockSpec((16, 128), lambda i, j, k: (i, j)), no_pipelining=True)
    else:  # inputs double-buffered, the output in one slot
        kernel = _matmul(
            pl.BlockSpec((16, 128), lambda i, j, k: (i, j), pipeline_mode=pl.Buffered(1)),
            max_concurrent_steps=2,
        )
    f = cv.kernel(
        kernel,
        jax.ShapeDtypeStruct((32, 256), jnp.float32),
        backend=backend,
        interpret=_interpret(backend, dma_mode),
    )
    # f32 sums of 384 products of unit normals: error ~ 384 * 2^-24 * |partial sums| << 1e-3.
    np.testing.assert_allclose(
        jax.jit(f)(x, w),
        np.asarray(x, np.float64) @ np.asarray(w, np.float64),
        rtol=1e-4,
        atol=1e-3,
    )


def test_no_pipelining_schedule_has_nothing_in_flight_during_a_body():
    out = cv.BlockSpec((16, 128), lambda i, j, k: (i, j))
    p = cv.pipeline.plan(
        grid=(2, 2, 3), in_specs=[X_SPEC, W_SPEC], out_specs=[out], no_pipelining=True
    )
    assert [op.num_slots for op in p.inputs + p.outputs] == [1, 1, 1]
    in_flight = set()  # the counters of the copies in flight
    for a in schedule.thread(p):
        if isinstance(a, Copy):
            in_flight.add(a.signals[0])
        elif isinstance(a, Wait):
            in_flight.discard(a.counter)
        elif isinstance(a, Compute):
            assert not in_flight, (a.step, in_flight)
    assert not in_flight
    assert cv.sim.check(p).ok
    # The pipelined schedule does overlap: the same walk finds copies in flight during bodies.
    pipelined = cv.pipeline.plan(
        grid=(2, 2, 3), in_specs=[X_SPEC, W_SPEC], out_specs=[out], max_concurrent_steps=2
    )
    flights = []
    for a in schedule.thread(pipelined):
        if isinstance(a, Copy) and a.queue == "loads":
            flights.append(a.step)
        elif isinstance(a, Compute) and any(t > a.step for t in flights):
            break
    else:
        pytest.fail("the pipelined schedule never had a fetch in flight during a body")


def test_no_pipelining_refuses_buffering_options():
    spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
    with pytest.raises(
        ValueError, match=r"no_pipelining=True .* cannot be combined with max_concurrent_steps=2"
    ):
        cv.pipeline.plan(grid=(4,), in_specs=[spec], no_pipelining=True, max_concurrent_steps=2)
    with pytest.raises(ValueError, match=r"no_pipelining: expected a bool, got 1"):
        cv.pipeline.plan(grid=(4,), in_specs=[spec], no_pipelining=1)
    with pytest.raises(ValueError, match=r"out\[0\]: pipeline_mode=Buffered\(3\) is not supported"):
        cv.pipeline.plan(
            grid=(4,),
            out_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0), pipeline_mode=pl.Buffered(3))],
        )


def test_warp_specialized_refuses_one_slot_outputs_on_gpu():
    spec = cv.BlockSpec((64, 128), lambda i: (i, 0))
    one_slot = pl.BlockSpec((64, 128), lambda i: (i, 0), pipeline_mode=pl.Buffered(1))

    def kernel(x_ref, o_ref):
        cv.emit_pipeline_warp_specialized(
            lambda idx, xb, ob: None,
            grid=(4,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=2,
            in_specs=[spec],
            out_specs=[one_slot],
        )(x_ref, o_ref)

    shape = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    f = cv.kernel(kernel, shape, backend="mosaic_gpu", num_threads=3, thread_name="wg")
    with pytest.raises(
        NotImplementedError, match=r"one-slot outputs \(out\[0\]: pl.Buffered\(1\)\)"
    ):
        jax.export.export(jax.jit(f), platforms=["cuda"])(shape)


# ---- per-input buffering: pl.Buffered(n) on an input ------------------------------------------


def _buffered(n, imap):
    return pl.BlockSpec(
        (16, 128) if imap is X_SPEC.index_map else (128, 128), imap, pipeline_mode=pl.Buffered(n)
    )


@pytest.mark.parametrize(
    "backend, dma_mode",
    [("xla", None), ("mosaic_tpu", "on_wait"), ("mosaic_tpu", "eager"), ("mosaic_gpu", None)],
)
@pytest.mark.parametrize("x_slots, w_slots, delay", [(3, 1, 0), (1, 2, 0), (3, 2, 1)])
def test_inputs_with_their_own_buffer_counts(backend, dma_mode, x_slots, w_slots, delay):
    rng = np.random.default_rng(4722)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((32, 384), (384, 256)))

    def kernel(x_ref, w_ref, o_ref):
        def body(idx, xb, wb, ob):
            ob[...] = jnp.where(idx[2] == 0, 0.0, ob[...]) + xb[...] @ wb[...]

        cv.emit_pipeline(
            body,
            grid=(2, 2, 3),
            delay_release=delay,
            max_concurrent_steps=2,
            in_specs=[_buffered(x_slots, X_SPEC.index_map), _buffered(w_slots, W_SPEC.index_map)],
            out_specs=[cv.BlockSpec((16, 128), lambda i, j, k: (i, j))],
        )(x_ref, w_ref, o_ref)

    f = cv.kernel(
        kernel,
        jax.ShapeDtypeStruct((32, 256), jnp.float32),
        backend=backend,
        interpret=_interpret(backend, dma_mode),
    )
    np.testing.assert_allclose(
        jax.jit(f)(x, w),
        np.asarray(x, np.float64) @ np.asarray(w, np.float64),
        rtol=1e-4,
        atol=1e-3,
    )


def test_per_input_lookahead_in_the_schedule():
    p = cv.pipeline.plan(
        grid=(6,),
        max_concurrent_steps=2,
        in_specs=[
            pl.BlockSpec((8, 128), lambda i: (i, 0), pipeline_mode=pl.Buffered(4)),
            cv.BlockSpec((8, 128), lambda i: (i, 0)),
        ],
    )
    a, b = p.inputs
    assert (a.num_slots, b.num_slots) == (4, 2)
    assert list(p.prologue_steps(a)) == [0, 1, 2, 3] and list(p.prologue_steps(b)) == [0, 1]
    fetched_at = {(c.operand, c.step): c.at for c in schedule.fetches(p)}
    assert fetched_at[("in[0]", 4)] == 0 and fetched_at[("in[1]", 2)] == 0  # 4 and 2 steps ahead
    assert cv.sim.check(p).ok and cv.sim.check(p, in_flight_steps=0).ok
    with pytest.raises(
        ValueError,
        match=r"in\[0\]: pipeline_mode=Buffered\(1\) is not supported .* more than "
        r"delay_release=1",
    ):
        cv.pipeline.plan(
            grid=(6,),
            max_concurrent_steps=2,
            delay_release=1,
            in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0), pipeline_mode=pl.Buffered(1))],
        )


def test_warp_specialized_refuses_per_input_buffering():
    spec = pl.BlockSpec((64, 128), lambda i: (i, 0), pipeline_mode=pl.Buffered(3))
    with pytest.raises(NotImplementedError, match=r"per-input buffering \(in\[0\]"):
        cv.emit_pipeline_warp_specialized(
            lambda idx, xb: None,
            grid=(4,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=2,
            in_specs=[spec],
            max_concurrent_steps=2,
        )
