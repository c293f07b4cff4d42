"""Warp-specialized pipelines: one table on xla and mosaic_gpu (GPU interpreter, race detection on).

Outputs start poisoned (NaN), so a block no compute thread wrote, or one stored before every
compute thread finished, shows up in the comparison. Interpreter runs are under a timeout because
a barrier nobody arrives at hangs the GPU interpreter.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl

import conveyor as cv
from tests.tolerance import matmul_tolerance
from conveyor.plans import warp
from conveyor.plans.program import Signal, Wait
from tests.platform import gpu_interpret, gpu_interpreter_always

BACKENDS = ["xla", "mosaic_gpu"]


def arr(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def run(kernel_body, out_shape, *args, threads, backend, interpret=None):
    """`interpret`: the GPU interpreter's settings where the test needs it on every platform
    (`gpu_interpreter_always`), else the platform's (`gpu_interpret`)."""
    if interpret is None:
        interpret = gpu_interpret(detect_races=True) if backend == "mosaic_gpu" else False
    return jax.jit(
        cv.kernel(
            kernel_body,
            out_shape,
            backend=backend,
            interpret=interpret,
            num_threads=threads,
            thread_name="wg",
        )
    )(*args)


def share(compute_idx, rows, num_compute):
    """The rows a compute thread owns: an equal slice of the block."""
    per = rows // num_compute
    return pl.ds(compute_idx * per, per)


def compute_index(memory_idx):
    """This compute thread's position among the compute threads (skipping the memory thread)."""
    t = lax.axis_index("wg")
    return jnp.where(t > memory_idx, t - 1, t) if memory_idx is not None else t


def release(consumed, step, delay):
    """Manual consumed barriers written the upstream way: release step s - delay, from step delay
    on."""
    for b in consumed:

        @pl.when(step >= delay)
        def _():
            cv.barrier_arrive(b)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "num_compute, mcs, delay, memory_idx, manual",
    [
        (1, 2, 0, None, False),
        (2, 2, 0, None, False),
        (2, 3, 1, None, False),
        (2, 2, 0, 0, False),
        (1, 2, 0, None, True),
        (2, 3, 0, 1, True),
        (2, 3, 1, None, True),
        (1, 3, 2, 0, True),
    ],
)
def test_elementwise_scale_shift(backend, num_compute, mcs, delay, memory_idx, manual):
    x, y = arr(num_compute + 10 * mcs, 96, 128), arr(delay + 7, 96, 128)

    def k(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob, *barriers):
            rows = share(compute_index(memory_idx), 16, num_compute)
            ob[rows, :] = 2.0 * xb[rows, :] - yb[rows, :]
            release(barriers, idx[0], delay)

        spec = cv.BlockSpec((16, 128), lambda i: (i, 0))
        cv.emit_pipeline_warp_specialized(
            body,
            grid=(6,),
            memory_registers=40,
            in_specs=[spec, spec],
            out_specs=[spec],
            max_concurrent_steps=mcs,
            delay_release=delay,
            wg_axis="wg",
            num_compute_wgs=num_compute,
            manual_consumed_barriers=manual,
            memory_thread_idx=memory_idx,
        )(x_ref, y_ref, o_ref)

    out = run(
        k, jax.ShapeDtypeStruct(x.shape, x.dtype), x, y, threads=num_compute + 1, backend=backend
    )
    np.testing.assert_array_equal(out, 2.0 * x - y)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "steps, mcs, delay", [(2, 3, 1), (2, 4, 1), (1, 3, 1), (2, 4, 2), (3, 4, 2)]
)
def test_fewer_steps_than_slots_keeps_delay_release(backend, steps, mcs, delay):
    """A static grid shorter than max_concurrent_steps shrinks the slots but keeps delay_release:
    the body's manual releases (step s - delay, from step delay on) are the ones the memory thread
    waits for. Dropping the delay made it wait for a step-0 release nobody makes (a hang)."""
    x, y = arr(steps + mcs, 16 * steps, 128), arr(delay, 16 * steps, 128)

    def k(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob, *barriers):
            ob[...] = 2.0 * xb[...] - yb[...]
            release(barriers, idx[0], delay)

        spec = cv.BlockSpec((16, 128), lambda i: (i, 0))
        pipe = cv.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=[spec, spec],
            out_specs=[spec],
            max_concurrent_steps=mcs,
            delay_release=delay,
            wg_axis="wg",
            num_compute_wgs=1,
            manual_consumed_barriers=True,
        )
        assert pipe.plan.pipeline.delay_release == delay
        pipe(x_ref, y_ref, o_ref)

    out = run(k, jax.ShapeDtypeStruct(x.shape, x.dtype), x, y, threads=2, backend=backend)
    np.testing.assert_array_equal(out, 2.0 * x - y)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_compute", [1, 2])
def test_matmul_accumulates_in_resident_output_shared_by_compute_threads(backend, num_compute):
    x, w = arr(1, 32, 256), arr(2, 256, 128)

    def k(x_ref, w_ref, o_ref):
        def body(idx, xb, wb, ob):
            _, kk = idx
            rows = share(compute_index(None), 16, num_compute)
            ob[rows, :] = jnp.where(kk == 0, 0.0, ob[rows, :]) + xb[rows, :] @ wb[...]

        cv.emit_pipeline_warp_specialized(
            body,
            grid=(2, 4),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=num_compute,
            in_specs=[
                cv.BlockSpec((16, 64), lambda i, k: (i, k)),
                cv.BlockSpec((64, 128), lambda i, k: (k, 0)),
            ],
            out_specs=[cv.BlockSpec((16, 128), lambda i, k: (i, 0))],
        )(x_ref, w_ref, o_ref)

    out = run(
        k,
        jax.ShapeDtypeStruct((32, 128), jnp.float32),
        x,
        w,
        threads=num_compute + 1,
        backend=backend,
        # a float32 jnp matmul, which Mosaic GPU does not lower (wgmma pipelines: test_dot.py)
        interpret=gpu_interpreter_always(detect_races=True) if backend == "mosaic_gpu" else None,
    )
    # another summation order: tests/tolerance.py
    np.testing.assert_allclose(out, x @ w, rtol=0, atol=matmul_tolerance(x, w))


@pytest.mark.timeout(240)
def test_carry_coroutine_and_invariant_input(backend):
    """Each compute thread keeps a running sum of its rows in the carry; the coroutine's epilogue
    stores it. An index-invariant bias is fetched once."""
    x, b = arr(3, 64, 128), arr(4, 8, 128)

    def k(x_ref, b_ref, o_ref, s_ref):
        def body(idx, xb, bb, ob, carry):
            rows = share(compute_index(None), 8, 2)
            ob[rows, :] = xb[rows, :] + bb[rows, :]
            return carry + xb[rows, :]

        def coroutine():
            final = yield jnp.zeros((4, 128), jnp.float32)
            s_ref[share(compute_index(None), 8, 2), :] = final

        cv.emit_pipeline_warp_specialized(
            body,
            grid=(8,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=2,
            carry_coroutine=coroutine,
            in_specs=[
                cv.BlockSpec((8, 128), lambda i: (i, 0)),
                cv.BlockSpec((8, 128), lambda i: (0, 0)),
            ],
            out_specs=[cv.BlockSpec((8, 128), lambda i: (i, 0))],
        )(x_ref, b_ref, o_ref)

    out, sums = run(
        k,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((8, 128), jnp.float32)),
        x,
        b,
        threads=3,
        backend=backend,
    )
    np.testing.assert_array_equal(out, x + jnp.tile(b, (8, 1)))
    np.testing.assert_allclose(sums, x.reshape(8, 8, 128).sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(240)
def test_exports_for_cuda():
    def k(x_ref, o_ref):
        def body(idx, xb, ob):
            rows = share(lax.axis_index("wg"), 64, 2)
            ob[rows, :] = xb[rows, :] + 1.0

        spec = cv.BlockSpec((64, 128), lambda i: (i, 0))
        cv.emit_pipeline_warp_specialized(
            body,
            grid=(4,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=2,
            in_specs=[spec],
            out_specs=[spec],
        )(x_ref, o_ref)

    shape = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    f = cv.kernel(k, shape, backend="mosaic_gpu", num_threads=3, thread_name="wg")
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(shape)
    assert "cuda" in exported.platforms and exported.mlir_module()


def _simple(body=None, **options):
    spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
    body = body or (lambda idx, xb, ob: ob.__setitem__(..., xb[...]))
    kw = dict(
        grid=(4,),
        memory_registers=40,
        wg_axis="wg",
        num_compute_wgs=1,
        in_specs=[spec],
        out_specs=[spec],
    )
    kw.update(options)
    return cv.emit_pipeline_warp_specialized(body, **kw)


def _launch(pipeline, threads=2, thread_name="wg", backend="xla", **call_options):
    x = jnp.ones((32, 128), jnp.float32)
    return cv.kernel(
        lambda x_ref, o_ref: pipeline(x_ref, o_ref, **call_options),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        num_threads=threads,
        thread_name=thread_name,
        backend=backend,
    )(x)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(memory_registers=41), "memory_registers: expected a multiple of 8"),
        (dict(memory_registers=8), "memory_registers"),
        (dict(num_compute_wgs=0), "num_compute_wgs: expected an int >= 1"),
        (dict(memory_thread_idx=2), r"memory_thread_idx: expected an int in \[0, 1\]"),
        (dict(wg_axis=3), "wg_axis"),
        (dict(max_concurrent_steps=1, delay_release=1), "must be greater than delay_release"),
        (dict(carry_coroutine=3), "carry_coroutine: expected a generator function"),
    ],
)
def test_bad_options(options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _simple(**options)


def test_kernel_thread_count_must_match():
    with pytest.raises(
        ValueError, match="needs a kernel launched with num_threads=2, thread_name='wg'"
    ):
        _launch(_simple(), threads=3)
    with pytest.raises(ValueError, match="thread_name='other'"):
        _launch(_simple(), thread_name="other")


def test_coroutine_must_yield_exactly_once():
    def body(idx, xb, ob, carry):
        ob[...] = xb[...]
        return carry

    def never():
        return
        yield

    def twice():
        yield 0.0
        yield 1.0

    with pytest.raises(ValueError, match="without yielding"):
        _launch(_simple(body, carry_coroutine=never))
    with pytest.raises(ValueError, match="yielded a second time"):
        _launch(_simple(body, carry_coroutine=twice))


def test_manual_barrier_never_arrived_is_reported_not_hung():
    def body(idx, xb, ob, consumed):
        ob[...] = xb[...]

    with pytest.raises(ValueError, match="never arrives on the consumed barrier of in\\[0\\]"):
        _launch(_simple(body, manual_consumed_barriers=True))


def test_not_on_tpu_and_threads_need_a_name():
    with pytest.raises(NotImplementedError, match="mosaic_tpu"):
        cv.kernel(
            lambda x, o: None,
            jax.ShapeDtypeStruct((8,), jnp.float32),
            num_threads=2,
            thread_name="wg",
            backend="mosaic_tpu",
        )
    with pytest.raises(ValueError, match="needs thread_name"):
        cv.kernel(lambda x, o: None, jax.ShapeDtypeStruct((8,), jnp.float32), num_threads=2)


def test_plan_roles_and_registers():
    wp = _simple(
        num_compute_wgs=2, memory_thread_idx=0, max_concurrent_steps=3, delay_release=1
    ).plan
    assert wp.compute_threads == (1, 2) and wp.leader == 1 and wp.num_threads == 3
    assert wp.compute_registers == 232  # (512 - 40) // 2 = 236, rounded down to a multiple of 8
    prog = wp.program()
    memory = [
        a for a in prog["memory thread"] if isinstance(a, Wait) and a.counter[0] == "consumed"
    ]
    # 4 steps, 3 slots, lookahead 2: the fetch of step 3 refills the slot of step 0 and waits for
    # its
    # release by both compute threads (phase 0 of slot 0: 2 arrivals); the drain waits for the
    # releases of steps 1 and 2 (step 3's is never made: released one step late).
    assert [(a.counter, a.amount) for a in memory] == [
        (("consumed", "shared", 0), 2),
        (("consumed", "shared", 1), 2),
        (("consumed", "shared", 2), 2),
    ]
    fetch_3 = next(
        i for i, a in enumerate(prog["memory thread"]) if getattr(a, "name", "") == "in[0]@step3"
    )
    assert prog["memory thread"][fetch_3 - 1] == memory[0]
    for c in ("compute[1]", "compute[2]"):
        releases = [
            a.counter for a in prog[c] if isinstance(a, Signal) and a.counter[0] == "consumed"
        ]
        assert releases == [
            ("consumed", "shared", 0),
            ("consumed", "shared", 1),
            ("consumed", "shared", 2),
        ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "num_compute, mcs, delay, consumed_too", [(1, 2, 0, False), (2, 3, 1, True)]
)
def test_manual_produced_barriers(backend, num_compute, mcs, delay, consumed_too):
    """The body waits for each input's copy itself, starting on x before y has been waited for
    (upstream's manual_produced_barriers); with manual consumed barriers too, they come after."""
    # Small integers in float32: 3x - y is exact however it is fused.
    x, y = jnp.round(4 * arr(20 + mcs, 96, 128)), jnp.round(4 * arr(21 + delay, 96, 128))

    def k(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob, x_landed, y_landed, *consumed):
            rows = share(compute_index(None), 16, num_compute)
            cv.wait_produced(x_landed)
            ob[rows, :] = 3.0 * xb[rows, :]
            cv.wait_produced(y_landed)
            ob[rows, :] = ob[rows, :] - yb[rows, :]
            release(consumed, idx[0], delay)

        spec = cv.BlockSpec((16, 128), lambda i: (i, 0))
        cv.emit_pipeline_warp_specialized(
            body,
            grid=(6,),
            memory_registers=40,
            in_specs=[spec, spec],
            out_specs=[spec],
            max_concurrent_steps=mcs,
            delay_release=delay,
            wg_axis="wg",
            num_compute_wgs=num_compute,
            manual_produced_barriers=True,
            manual_consumed_barriers=consumed_too,
        )(x_ref, y_ref, o_ref)

    out = run(
        k, jax.ShapeDtypeStruct(x.shape, x.dtype), x, y, threads=num_compute + 1, backend=backend
    )
    np.testing.assert_array_equal(out, 3.0 * x - y)


def test_manual_produced_barrier_never_waited_is_reported():
    def body(idx, xb, ob, landed):
        ob[...] = xb[...]

    with pytest.raises(
        ValueError, match=r"never waits on the produced barrier of in\[0\].*cv.wait_produced"
    ):
        _launch(_simple(body, manual_produced_barriers=True))


def test_manual_produced_barriers_refuse_invariant_inputs_and_non_bools():
    spec, bias = cv.BlockSpec((8, 128), lambda i: (i, 0)), cv.BlockSpec((8, 128), lambda i: (0, 0))
    with pytest.raises(NotImplementedError, match=r"index-invariant inputs \(in\[1\]\)"):
        _simple(manual_produced_barriers=True, in_specs=[spec, bias])
    with pytest.raises(ValueError, match="manual_produced_barriers: expected a bool"):
        _simple(manual_produced_barriers="yes")


@pytest.mark.timeout(240)
def test_manual_produced_barriers_export_for_cuda():
    def k(x_ref, o_ref):
        def body(idx, xb, ob, landed):
            cv.wait_produced(landed)
            ob[...] = xb[...] + 1.0

        spec = cv.BlockSpec((64, 128), lambda i: (i, 0))
        cv.emit_pipeline_warp_specialized(
            body,
            grid=(4,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=1,
            manual_produced_barriers=True,
            in_specs=[spec],
            out_specs=[spec],
        )(x_ref, o_ref)

    shape = jax.ShapeDtypeStruct((256, 128), jnp.float32)
    f = cv.kernel(k, shape, backend="mosaic_gpu", num_threads=2, thread_name="wg")
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(shape)
    assert "cuda" in exported.platforms and exported.mlir_module()


@pytest.mark.timeout(240)
def test_manual_produced_barrier_skipped_is_a_race_on_the_gpu_interpreter():
    """The compute threads leave the waits to the body: one that skips them reads a slot the
    memory thread's copy is writing. The GPU interpreter reports it one of two ways, depending on
    how its threads interleave: its race detector ("RACE DETECTED"), or, when the copy's barrier
    completes a phase before any thread waited on it, its barrier check ("no threads observed
    phase 0"; seen on a loaded machine). Both are this bug; a correct body gets neither."""
    x = arr(30, 96, 128)

    def k(x_ref, o_ref):
        def body(idx, xb, ob, landed):
            ob[...] = xb[...] + 1.0

        spec = cv.BlockSpec((16, 128), lambda i: (i, 0))
        cv.emit_pipeline_warp_specialized(
            body,
            grid=(6,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=1,
            manual_produced_barriers=True,
            in_specs=[spec],
            out_specs=[spec],
        )(x_ref, o_ref)

    with pytest.raises(
        Exception,
        match=r"RACE DETECTED|Barrier completed phase \d+, but no threads observed "
        r"phase \d+",
    ):
        run(
            k,
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            x,
            threads=2,
            backend="mosaic_gpu",
            interpret=gpu_interpreter_always(detect_races=True),  # the race detector's verdict
        )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_compute, memory_idx", [(1, None), (2, None), (2, 0)])
def test_compute_context_value_carry(backend, num_compute, memory_idx):
    """Upstream's compute_context: each compute thread runs its prologue, the pipeline with a value
    carry (a running sum of its rows), and an epilogue storing the final carry."""
    x = jnp.round(4 * arr(40 + num_compute, 64, 128))  # small integers: sums are exact
    per = 8 // num_compute

    def k(x_ref, o_ref, s_ref):
        def body(idx, xb, ob, carry):
            rows = share(compute_index(memory_idx), 8, num_compute)
            ob[rows, :] = xb[rows, :] * 2.0
            return carry + xb[rows, :]

        def context(eval_pipeline):
            final = eval_pipeline(jnp.full((per, 128), 1.0, jnp.float32))
            s_ref[share(compute_index(memory_idx), 8, num_compute), :] = final

        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
        cv.emit_pipeline_warp_specialized(
            body,
            grid=(8,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=num_compute,
            memory_thread_idx=memory_idx,
            compute_context=context,
            in_specs=[spec],
            out_specs=[spec],
        )(x_ref, o_ref)

    out, sums = run(
        k,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((8, 128), jnp.float32)),
        x,
        threads=num_compute + 1,
        backend=backend,
    )
    np.testing.assert_array_equal(out, 2.0 * x)
    np.testing.assert_array_equal(sums, x.reshape(8, 8, 128).sum(0) + 1.0)


def test_compute_context_ref_carry_allocated_in_the_context():
    """A Ref carry allocated by each compute thread's context (how upstream kernels keep a wgmma
    accumulator): every step gets the same ref, and the epilogue reads it after the pipeline.
    On xla only: the GPU interpreter refuses scoped SMEM inside one thread and does not model
    plgpu.ACC; on mosaic_gpu this path is the gmm kernel's, exported for cuda in tests/ops/gmm."""
    backend = "xla"
    x = jnp.round(4 * arr(50, 64, 128))

    def k(x_ref, o_ref, s_ref):
        def body(idx, xb, ob, acc):
            rows = share(compute_index(None), 8, 2)
            ob[rows, :] = xb[rows, :] + 1.0
            acc[...] += xb[rows, :]
            return acc

        def context(eval_pipeline):
            def with_acc(acc):
                final = eval_pipeline(acc)
                s_ref[share(compute_index(None), 8, 2), :] = final[...]

            with_acc(jax.new_ref(jnp.zeros((4, 128), jnp.float32)))

        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
        cv.emit_pipeline_warp_specialized(
            body,
            grid=(8,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=2,
            compute_context=context,
            in_specs=[spec],
            out_specs=[spec],
        )(x_ref, o_ref)

    out, sums = run(
        k,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((8, 128), jnp.float32)),
        x,
        threads=3,
        backend=backend,
    )
    np.testing.assert_array_equal(out, x + 1.0)
    np.testing.assert_array_equal(sums, x.reshape(8, 8, 128).sum(0))


@pytest.mark.parametrize(
    "calls, match",
    [
        (0, "returned without calling the pipeline"),
        (2, "called the pipeline .eval_pipeline. a second time"),
    ],
)
def test_compute_context_must_call_the_pipeline_once(calls, match):
    def body(idx, xb, ob, carry):
        ob[...] = xb[...]
        return carry

    def context(eval_pipeline):
        for _ in range(calls):
            eval_pipeline(jnp.float32(0.0))

    with pytest.raises(ValueError, match=match):
        _launch(_simple(body, compute_context=context))


def _chain_kernel(num_compute, mcs, scales, traced_state, manual=False):
    """A kernel running one warp-specialized pipeline per leading index g of x (scaling its rows by
    scales[g]) as a chain START, STEADY..., STOP on one set of allocations; with traced_state the
    middle pipelines run in a fori_loop with a traced pipeline_state."""
    PS = cv.pipeline.PipelineState
    spec = cv.BlockSpec((16, 128), lambda i: (i, 0))
    last = len(scales) - 1

    def make(state, scale):
        def body(idx, xb, ob, *consumed):
            rows = share(compute_index(None), 16, num_compute)
            ob[rows, :] = xb[rows, :] * scale
            for b in consumed:
                cv.barrier_arrive(b)

        return cv.emit_pipeline_warp_specialized(
            body,
            grid=(4,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=num_compute,
            in_specs=[spec],
            out_specs=[spec],
            max_concurrent_steps=mcs,
            pipeline_state=state,
            manual_consumed_barriers=manual,
        )

    def k(x_ref, s_ref, o_ref):
        first = make(PS.START, s_ref[0])

        def chain(allocations):
            first(x_ref.at[0], o_ref.at[0], allocations=allocations)
            if traced_state:

                def middle(g, _):
                    make(jnp.int32(PS.STEADY), s_ref[g])(
                        x_ref.at[g], o_ref.at[g], allocations=allocations
                    )

                lax.fori_loop(1, last, middle, None)
            else:
                for g in range(1, last):
                    make(PS.STEADY, s_ref[g])(x_ref.at[g], o_ref.at[g], allocations=allocations)
            make(PS.STOP, s_ref[last])(x_ref.at[last], o_ref.at[last], allocations=allocations)

        first.with_allocations(chain, x_ref.at[0], o_ref.at[0])

    return k


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "num_compute, mcs, pipelines, traced_state, manual",
    [(1, 2, 2, False, False), (2, 2, 4, True, False), (2, 4, 3, False, True)],
)
def test_chained_pipelines_share_allocations(
    backend, num_compute, mcs, pipelines, traced_state, manual
):
    """Pipelines chained START, STEADY..., STOP: each STEADY / STOP refills the slots the previous
    pipeline's last steps read as they are released (a missing wait is a race the GPU interpreter
    reports; a wait for a release that never comes fails at its deadline). Outputs start as NaN."""
    x = jnp.round(4 * arr(60 + pipelines, pipelines, 64, 128))
    scales = jnp.arange(1, pipelines + 1, dtype=jnp.float32)
    k = _chain_kernel(num_compute, mcs, list(range(pipelines)), traced_state, manual)
    out = run(
        k,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        x,
        scales,
        threads=num_compute + 1,
        backend=backend,
    )
    np.testing.assert_array_equal(out, x * scales[:, None, None])


@pytest.mark.timeout(240)
def test_chained_pipelines_fetch_the_next_prologue_before_the_last_steps_finish():
    """The memory thread's records on the GPU interpreter: only the START fetches before its loop
    without waiting; the STOP's first fetches wait for the START's last releases; only the STOP
    drains."""
    from conveyor.pipeline.lowering import record_issued

    x = jnp.round(4 * arr(70, 2, 64, 128))
    k = _chain_kernel(1, 2, [0, 1], False)
    with record_issued() as log:
        out = run(
            k,
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            x,
            jnp.array([1.0, 2.0]),
            threads=2,
            backend="mosaic_gpu",
            # the records are debug callbacks, which Mosaic GPU lowers only in its interpreter
            interpret=gpu_interpreter_always(),
        )
    np.testing.assert_array_equal(out, x * jnp.array([1.0, 2.0])[:, None, None])
    waits = collections.Counter(
        a for a in log if isinstance(a, Wait) and a.counter[0] == "consumed"
    )
    # START (4 steps, 2 slots): fetches of steps 2, 3 wait for releases of 0, 1 (issued at steps 0,
    # 1); STOP: its prologue (at -1) waits for the START's releases of steps 2, 3 (as steps -2, -1
    # of its own count), its loop for its steps 0, 1, and its drain (at 4) for its steps 2, 3.
    at_step = [(0, 0), (1, 1), (-1, -2), (-1, -1), (0, 0), (1, 1), (4, 2), (4, 3)]
    assert waits == collections.Counter(
        warp.consumed_wait("shared", 2, 1, step=step, at=at) for at, step in at_step
    )


@pytest.mark.parametrize(
    "options, match",
    [
        (
            dict(pipeline_state=5),
            r"pipeline_state: expected 0 \(START\), 1 \(STEADY\) or 2 \(STOP\), got 5",
        ),
        (dict(pipeline_state="start"), "pipeline_state: expected PipelineState.START"),
        (dict(pipeline_state=0, grid=(3,)), "divisible by max_concurrent_steps=2"),
        (
            dict(pipeline_state=0, max_concurrent_steps=2, delay_release=1),
            "do not support delay_release",
        ),
        (
            dict(pipeline_state=0, in_specs=[cv.BlockSpec((8, 128), lambda i: (0, 0))]),
            "in.0. are index-invariant",
        ),
    ],
)
def test_chained_pipeline_conditions_are_refused_by_name(options, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        _simple(**options)


def test_chained_pipeline_needs_caller_allocations_that_fit():
    with pytest.raises(ValueError, match="needs caller-owned allocations"):
        _launch(_simple(pipeline_state=cv.pipeline.PipelineState.START))
    with pytest.raises(ValueError, match="on xla a pipeline has no on-chip memory"):
        _launch(_simple(), allocations={"slots": []})


def test_chained_pipeline_allocations_must_match_on_gpu():
    """Allocations made for one pipeline refused by a pipeline with other blocks, naming the
    slots."""
    spec8, spec16 = (cv.BlockSpec((s, 128), lambda i: (i, 0)) for s in (8, 16))
    small = _simple(in_specs=[spec8], out_specs=[spec8])
    big = _simple(in_specs=[spec16], out_specs=[spec16], grid=(2,))

    def k(x_ref, o_ref):
        small.with_allocations(lambda a: big(x_ref, o_ref, allocations=a), x_ref, o_ref)

    x = jnp.ones((32, 128), jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"allocations: the slots of in\[0\] are float32\(2, 8, 128\), this pipeline "
        r"needs float32\(2, 16, 128\)",
    ):
        jax.jit(
            cv.kernel(
                k,
                jax.ShapeDtypeStruct(x.shape, x.dtype),
                backend="mosaic_gpu",
                interpret=gpu_interpret(),
                num_threads=2,
                thread_name="wg",
            )
        )(x)


@pytest.mark.timeout(240)
def test_chained_pipelines_export_for_cuda():
    x = jax.ShapeDtypeStruct((3, 64, 128), jnp.float32)
    k = _chain_kernel(2, 2, [0, 1, 2], True)
    f = cv.kernel(k, x, backend="mosaic_gpu", num_threads=3, thread_name="wg")
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        x, jax.ShapeDtypeStruct((3,), jnp.float32)
    )
    assert "cuda" in exported.platforms and exported.mlir_module()
