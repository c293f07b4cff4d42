"""mpmd_map on the CPU executor: concurrent programs on shared memory, semaphores, errors,
timeouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import conveyor as cv

from tests.mpmd.programs import NB, R, producer_consumer


def test_producer_consumer_is_correct_and_deterministic():
    x = jnp.asarray(np.random.default_rng(7).standard_normal((NB * R, 128)), jnp.float32)
    f = producer_consumer()
    first = f(x)
    np.testing.assert_array_equal(first, (x + 1.0) * 2.0)
    for _ in range(2):
        np.testing.assert_array_equal(f(x), first)
    np.testing.assert_array_equal(jax.jit(f)(x), first)


def test_programs_that_would_deadlock_one_after_the_other_run_concurrently():
    """Ping-pong: each side waits for the other's previous move; sequential execution hangs."""

    def ping(o_ref, s):
        def body(i, c):
            cv.semaphore_wait(s.at[0])
            o_ref[i, 0] = i
            cv.semaphore_signal(s.at[1])
            return c

        cv.semaphore_signal(s.at[0])
        lax.fori_loop(0, 8, body, 0)

    def pong(o_ref, s):
        def body(i, c):
            cv.semaphore_wait(s.at[1])
            o_ref[i, 1] = o_ref[i, 0] * 10
            cv.semaphore_signal(s.at[0])
            return c

        lax.fori_loop(0, 8, body, 0)

    out = cv.mpmd_map(
        [(cv.Mesh(a=1), ping), (cv.Mesh(b=1), pong)],
        jax.ShapeDtypeStruct((8, 2), jnp.int32),
        scratch_shapes=[cv.SemaphoreType((2,))],
    )()
    np.testing.assert_array_equal(out, np.stack([np.arange(8), np.arange(8) * 10], 1))


def test_mesh_coordinates_per_program():
    def first(o1, o2):
        o1[lax.axis_index("x"), lax.axis_index("y")] = lax.axis_index("x") * 10 + lax.axis_index(
            "y"
        )

    def second(o1, o2):
        o2[lax.axis_index("z")] = lax.axis_index("z") + 100

    a, b = cv.mpmd_map(
        [(cv.Mesh(x=2, y=3), first), (cv.Mesh(z=4), second)],
        (jax.ShapeDtypeStruct((2, 3), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32)),
    )()
    np.testing.assert_array_equal(a, np.arange(2)[:, None] * 10 + np.arange(3)[None])
    np.testing.assert_array_equal(b, np.arange(4) + 100)


def test_aliasing_updates_in_place_and_keyword_scratch_is_shared():
    x = jnp.arange(16.0).reshape(4, 4)

    def writer(x_ref, o_ref, *, staging, flag):
        staging[...] = x_ref[1] * 100.0
        cv.semaphore_signal(flag)

    def reader(x_ref, o_ref, *, staging, flag):
        cv.semaphore_wait(flag)
        o_ref[1] = staging[...]  # rows 0, 2, 3 keep the input's values (aliased)

    out = cv.mpmd_map(
        [(cv.Mesh(w=1), writer), (cv.Mesh(r=1), reader)],
        jax.ShapeDtypeStruct((4, 4), jnp.float32),
        scratch_shapes={
            "staging": jax.ShapeDtypeStruct((4,), jnp.float32),
            "flag": cv.SemaphoreType(),
        },
        input_output_aliases={0: 0},
    )(x)
    np.testing.assert_array_equal(out, x.at[1].set(x[1] * 100.0))


def test_barrier_and_closed_over_constants():
    table = jnp.asarray([3.0, 5.0])  # closed over: captured by the trace (upstream refuses)

    def left(o_ref, b):
        o_ref[0] = table[0]
        cv.barrier_wait(b)
        o_ref[2] = o_ref[1] + 1.0

    def right(o_ref, b):
        o_ref[1] = table[1]
        cv.barrier_wait(b)
        o_ref[3] = o_ref[0] + 1.0

    out = cv.mpmd_map(
        [(cv.Mesh(l=1), left), (cv.Mesh(r=1), right)],
        jax.ShapeDtypeStruct((4,), jnp.float32),
        scratch_shapes=[cv.BarrierType()],
    )()
    np.testing.assert_array_equal(out, [3.0, 5.0, 6.0, 4.0])


def test_a_wait_nobody_satisfies_times_out_with_a_report():
    def stuck(o_ref, s):
        cv.semaphore_wait(s.at[1])
        o_ref[...] = jnp.zeros_like(o_ref)

    def finishes(o_ref, s):
        cv.semaphore_signal(s.at[0])

    f = cv.mpmd_map(
        [(cv.Mesh(core=2), stuck), (cv.Mesh(t=1), finishes)],
        jax.ShapeDtypeStruct((2,), jnp.float32),
        scratch_shapes=[cv.SemaphoreType((2,))],
        compiler_params={"timeout_s": 0.5},
    )
    with pytest.raises(cv.MpmdDeadlock) as info:
        f()
    msg = str(info.value)
    assert "not satisfied within 0.5 s" in msg
    assert "program 0 ('stuck') at core=0: waits on semaphore scratch 0[1] >= 1 (holds 0)" in msg
    assert "program 0 ('stuck') at core=1: waits on semaphore" in msg
    assert "program 1 ('finishes') at t=0: done" in msg


def _one(fn, out=jax.ShapeDtypeStruct((2,), jnp.float32), **kw):
    return cv.mpmd_map([(cv.Mesh(c=1), fn)], out, **kw)


def test_errors_name_the_program_and_what_is_wrong():
    with pytest.raises(ValueError, match="non-empty sequence"):
        cv.mpmd_map([], jax.ShapeDtypeStruct((1,), jnp.float32))
    with pytest.raises(
        ValueError,
        match=r"axis 'core' has size 2 in program 0 \('f'\) but size 4 in program 1 \('g'\)",
    ):

        def f(o):
            pass

        def g(o):
            pass

        cv.mpmd_map(
            [(cv.Mesh(core=2), f), (cv.Mesh(core=4), g)], jax.ShapeDtypeStruct((1,), jnp.float32)
        )
    with pytest.raises(TypeError, match=r"program 0 \('returns'\) returned an array"):

        def returns(o):
            return o[...]

        _one(returns)()
    with pytest.raises(TypeError, match="input 0 is not an array a ref can hold"):
        _one(lambda x, o: None)("text")
    with pytest.raises(
        TypeError, match="scratch 0 must be a jax.ShapeDtypeStruct, cv.SemaphoreType"
    ):
        _one(lambda o, s: None, scratch_shapes=[object()])
    with pytest.raises(TypeError, match="expected a cv.Mesh"):
        cv.mpmd_map([({"c": 1}, lambda o: None)], jax.ShapeDtypeStruct((1,), jnp.float32))
    with pytest.raises(ValueError, match=r"input 0 \(float32\[3\]\) cannot alias output 0"):
        _one(lambda x, o: None, input_output_aliases={0: 0})(jnp.zeros(3))
    with pytest.raises(
        NameError, match=r"program 1 \('uses_x'\) at y=0: lax.axis_index\('x'\) names an axis"
    ):

        def fine(o):
            pass

        def uses_x(o):
            o[0] = lax.axis_index("x").astype(jnp.float32)

        cv.mpmd_map(
            [(cv.Mesh(x=2), fine), (cv.Mesh(y=1), uses_x)], jax.ShapeDtypeStruct((2,), jnp.float32)
        )()
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        _one(lambda o: None, compiler_params={"timeout_s": 0})
    with pytest.raises(RuntimeError, match="inside a program of cv.mpmd_map"):
        cv.semaphore_signal(None)


def test_unwritten_outputs_stay_poisoned():
    out = _one(lambda o: o.__setitem__(0, 1.0))()
    assert float(out[0]) == 1.0 and np.isnan(float(out[1]))


def test_pallas_semaphore_calls_on_the_cpu_executor_are_refused_by_name():
    """Upstream's SparseCore programs signal one instance's semaphore with
    pl.semaphore_signal(sem, device_id=...); the CPU executor's semaphores are shared by every
    instance, and Pallas's primitive refuses its scratch with a bare dtype error."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    def signal(o, sem):
        pl.semaphore_signal(sem, 1, device_id={"core": 0})

    def wait(o, sem):
        pl.semaphore_wait(sem, 1)

    call = cv.mpmd_map(
        [(cv.Mesh(core=1), signal), (cv.Mesh(core=1), wait)],
        jax.ShapeDtypeStruct((8,), jnp.int32),
        scratch_shapes=[pltpu.SemaphoreType.REGULAR(())],
    )
    with pytest.raises(NotImplementedError, match=r"program 0 \('signal'\) calls pl.semaphore_"):
        call()


def test_debug_prints_each_programs_jaxpr(capfd):
    def add_one(x, o):
        o[...] = x[...] + 1.0

    def run(debug):
        return cv.mpmd_map(
            [(cv.Mesh(a=1), add_one)], jax.ShapeDtypeStruct((4,), jnp.float32), debug=debug
        )(jnp.zeros(4, jnp.float32))

    np.testing.assert_array_equal(run(False), np.ones(4))
    assert capfd.readouterr().out == ""
    np.testing.assert_array_equal(run(True), np.ones(4))
    assert "lambda" in capfd.readouterr().out
    np.testing.assert_array_equal(run({"timeout_s": 5}), np.ones(4))  # a deadline prints nothing
    assert capfd.readouterr().out == ""
