"""mpmd_map with jax Refs, closures over traced values, vmap, jit errors, Pallas scratch spellings,
run_scoped and debug_print: the upstream scenarios that used to fail, one regression test each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv

F32 = jnp.float32


def _one(fn, out=jax.ShapeDtypeStruct((4,), F32), **kw):
    return cv.mpmd_map([(cv.Mesh(c=1), fn)], out, **kw)


def _data(seed, shape=(4,)):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) + 2.0, F32)


def _scale_ref_in_place(r, o):
    """Writes part of an input Ref and copies it out: the caller must see both."""
    r[1] = r[1] * 10.0
    o[...] = r[...] + 1.0


@pytest.mark.parametrize("jit", [False, True])
def test_ref_inputs_are_updated_in_place(jit):
    x = _data(1)
    expect = x.at[1].multiply(10.0)

    def f(x):
        r = jax.new_ref(x)
        out = _one(_scale_ref_in_place)(r)
        return r[...], out

    ref_after, out = (jax.jit(f) if jit else f)(x)
    np.testing.assert_array_equal(ref_after, expect)
    np.testing.assert_array_equal(out, expect + 1.0)


def _eager_ref_views() -> bool:
    """jax 0.11 raises NotImplementedError for `ref.at[...]` outside jit (its views work under
    jit)."""
    try:
        jax.new_ref(jnp.zeros(2)).at[:1]
    except NotImplementedError:
        return False
    return True


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_view_of_a_ref_is_updated_in_place_and_the_rest_is_kept(jit):
    if not jit and not _eager_ref_views():
        pytest.skip(
            f"jax {jax.__version__} has no eager Ref.at (JAX raises NotImplementedError); the jit "
            "case covers views"
        )
    x = _data(2, (6,))

    def f(x):
        r = jax.new_ref(x)
        out = _one(_scale_ref_in_place)(r.at[1:5])
        return r[...], out

    r_after, out = (jax.jit(f) if jit else f)(x)
    np.testing.assert_array_equal(r_after, x.at[2].multiply(10.0))
    np.testing.assert_array_equal(out, x[1:5].at[1].multiply(10.0) + 1.0)


def test_ref_inputs_mixed_with_arrays_and_several_programs():
    x, y = _data(3), _data(4)

    def writer(a, r, o, flag):
        r[...] = a[...] * 2.0
        cv.semaphore_signal(flag)

    def reader(a, r, o, flag):
        cv.semaphore_wait(flag)
        o[...] = r[...] + a[...]

    @jax.jit
    def f(x, y):
        r = jax.new_ref(y)
        out = cv.mpmd_map(
            [(cv.Mesh(w=1), writer), (cv.Mesh(r=1), reader)],
            jax.ShapeDtypeStruct((4,), F32),
            scratch_shapes=[cv.SemaphoreType()],
        )(x, r)
        return r[...], out

    r_after, out = f(x, y)
    np.testing.assert_array_equal(r_after, x * 2.0)
    np.testing.assert_array_equal(out, x * 3.0)


@pytest.mark.parametrize("transform", ["eager", "jit", "vmap"])
def test_closed_over_refs_are_shared_memory_updated_in_place(transform):
    def f(x):
        r = jax.new_ref(x)

        def first(o, flag):
            r[0] = r[0] + 100.0
            cv.semaphore_signal(flag)

        def second(o, flag):
            cv.semaphore_wait(flag)
            o[...] = r[...] * 2.0  # sees the first program's write: one buffer for both closures

        out = cv.mpmd_map(
            [(cv.Mesh(a=1), first), (cv.Mesh(b=1), second)],
            jax.ShapeDtypeStruct((4,), F32),
            scratch_shapes=[cv.SemaphoreType()],
        )()
        return r[...], out

    if transform == "vmap":
        xs = jnp.stack([_data(5), _data(6)])
        r_after, out = jax.vmap(f)(xs)
        expect = xs.at[:, 0].add(100.0)
    else:
        x = _data(5)
        r_after, out = (jax.jit(f) if transform == "jit" else f)(x)
        expect = x.at[0].add(100.0)
    np.testing.assert_array_equal(r_after, expect)
    np.testing.assert_array_equal(out, expect * 2.0)


def test_closed_over_traced_values():
    x, s = _data(7), 3.0

    @jax.jit
    def f(x, s):
        table = x * 2.0  # a traced array, closed over

        def prog(o):
            o[...] = table + s  # and a traced scalar

        return _one(prog)()

    np.testing.assert_allclose(f(x, s), x * 2.0 + s, rtol=0, atol=0)


@pytest.mark.parametrize("jit", [False, True])
def test_vmap_runs_the_call_once_per_batch_element(jit):
    xs = jnp.stack([_data(8), _data(9), _data(10)])

    def double(x, o):
        o[...] = x[...] * 2.0 + lax.axis_index("c").astype(F32)

    f = jax.vmap(_one(double))
    np.testing.assert_array_equal((jax.jit(f) if jit else f)(xs), xs * 2.0)


def _stuck(x, o, s):
    cv.semaphore_wait(s)


def test_a_deadlock_under_jit_is_recovered_as_mpmd_deadlock():
    f = jax.jit(
        _one(_stuck, scratch_shapes=[cv.SemaphoreType()], compiler_params={"timeout_s": 0.3})
    )
    with pytest.raises(cv.MpmdDeadlock, match=r"program 0 \('_stuck'\) at c=0: waits on semaphore"):
        with cv.mpmd_errors():
            f(jnp.zeros(4))
    # without it: XLA's error
    with pytest.raises(jax.errors.JaxRuntimeError, match="with cv.mpmd_errors"):
        f(jnp.zeros(4))

    @cv.mpmd_errors()
    def step(x):
        return f(x)

    with pytest.raises(cv.MpmdDeadlock):
        step(jnp.zeros(4))


def test_other_errors_pass_through_mpmd_errors_unchanged():
    with pytest.raises(KeyError, match="unrelated"):
        with cv.mpmd_errors():
            raise KeyError("unrelated")


def test_a_program_error_keeps_its_type_and_names_the_instance():
    """An out-of-bounds write found while the programs run: the executor's own IndexError, with a
    note naming the instance (never rebuilt from its class, which JAX's error classes break)."""

    def writes_past_the_end(x, o):
        o[lax.axis_index("c") + 4] = 1.0

    with pytest.raises(IndexError, match=r"raised by program 0 \('writes_past_the_end'\) at c=0"):
        _one(writes_past_the_end)(jnp.zeros(4))
    with pytest.raises(IndexError, match="out of bounds"):
        with cv.mpmd_errors():
            jax.jit(_one(writes_past_the_end))(jnp.zeros(4))
    # Without mpmd_errors, the runtime error XLA raises names the instance in its text too.
    with pytest.raises(
        jax.errors.JaxRuntimeError,
        match=r"out of bounds[\s\S]*raised by program 0 \('writes_past_the_end'\) at c=0",
    ):
        jax.jit(_one(writes_past_the_end))(jnp.zeros(4))


def test_refs_passed_twice_or_aliased_are_refused():
    r = jax.new_ref(jnp.zeros(4))
    with pytest.raises(ValueError, match="inputs 0 and 1 are the same jax Ref"):
        _one(lambda a, b, o: None)(r, r)
    with pytest.raises(NotImplementedError, match="inputs 0 and 1 are the same jax Ref"):
        _one(lambda a, b, o: None)(r, r)  # what code written for upstream Pallas catches
    with pytest.raises(ValueError, match="inputs 0 and 1 are the same jax Ref"):
        # Two views of one Ref (under jit: jax 0.11 has no eager Ref.at).
        jax.jit(
            lambda: _one(lambda a, b, o: None, out=jax.ShapeDtypeStruct((2,), F32))(
                *(lambda v: (v.at[:2], v.at[2:]))(jax.new_ref(jnp.zeros(4)))
            )
        )()
    with pytest.raises(
        ValueError, match="input 0 is a jax Ref, which the programs already update in place"
    ):
        _one(lambda a, o: None, input_output_aliases={0: 0})(r)


def test_two_inputs_aliased_to_one_output_are_refused():
    with pytest.raises(ValueError, match="maps inputs 0 and 1 to output 0"):
        _one(lambda a, b, o: None, input_output_aliases={0: 0, 1: 0})


def test_barrier_wait_on_a_semaphore_is_a_type_error():
    with pytest.raises(
        TypeError,
        match=r"at c=0: cv.barrier_wait needs a cv.BarrierType scratch, got scratch 0 "
        r"\(semaphore\)",
    ):
        _one(lambda o, s: cv.barrier_wait(s), scratch_shapes=[cv.SemaphoreType()])()


@pytest.mark.parametrize(
    "sem",
    [pltpu.SemaphoreType.REGULAR((2,)), plgpu.SemaphoreType.REGULAR((2,))],
    ids=["pltpu", "plgpu"],
)
def test_pallas_scratch_spellings_are_synonyms(sem):
    x = _data(11)

    def producer(x, o, stage, sems, bar):
        stage[...] = x[...] + 1.0
        cv.semaphore_signal(sems.at[1])
        cv.barrier_wait(bar)

    def consumer(x, o, stage, sems, bar):
        cv.semaphore_wait(sems.at[1])
        o[...] = stage[...] * 2.0
        cv.barrier_wait(bar)

    out = cv.mpmd_map(
        [(cv.Mesh(p=1), producer), (cv.Mesh(q=1), consumer)],
        jax.ShapeDtypeStruct((4,), F32),
        scratch_shapes=[pltpu.VMEM((4,), F32), sem, plgpu.Barrier(num_arrivals=2)],
    )(x)
    np.testing.assert_array_equal(out, (x + 1.0) * 2.0)


def test_what_scratch_cannot_be_is_refused_by_name():
    with pytest.raises(TypeError, match="scratch 0 is a DMA semaphore"):
        _one(lambda o, s: None, scratch_shapes=[pltpu.SemaphoreType.DMA(())])
    with pytest.raises(ValueError, match=r"scratch bar: a plgpu.Barrier .* num_arrivals=1"):
        _one(lambda o, *, bar: None, scratch_shapes={"bar": plgpu.Barrier(num_arrivals=4)})
    with pytest.raises(TypeError, match=r"scratch 1\[0\] must be a jax.ShapeDtypeStruct"):
        _one(lambda o, a, b: None, scratch_shapes=[cv.SemaphoreType(), ["not a shape"]])
    with pytest.raises(TypeError, match="keys must be str"):
        _one(lambda o, **k: None, scratch_shapes={1: cv.SemaphoreType()})
    with pytest.raises(TypeError, match="cost_estimate must be a pl.CostEstimate"):
        _one(lambda o: None, cost_estimate={"flops": 1})
    with pytest.raises(TypeError, match="metadata must be a dict of str to str"):
        _one(lambda o: None, metadata={"k": 1})


def test_nested_scratch_keeps_its_structure():
    x = _data(12)

    def prog(x, o, *, bufs, sync):
        first, (second,) = bufs
        first[...] = x[...] + 1.0
        second[...] = first[...] * 3.0
        cv.semaphore_signal(sync["sem"])
        cv.semaphore_wait(sync["sem"])
        o[...] = second[...]

    out = _one(
        prog,
        scratch_shapes={
            "bufs": [jax.ShapeDtypeStruct((4,), F32), (jax.ShapeDtypeStruct((4,), F32),)],
            "sync": {"sem": cv.SemaphoreType()},
        },
        cost_estimate=pl.CostEstimate(flops=8, transcendentals=0, bytes_accessed=32),
        metadata={"owner": "tests"},
    )(x)
    np.testing.assert_array_equal(out, (x + 1.0) * 3.0)


def test_run_scoped_gives_each_instance_its_own_memory():
    x = _data(13, (2, 4))

    def prog(x, o):
        me = lax.axis_index("core")

        def body(mine):
            mine[...] = x[me] * (me + 1).astype(F32)
            o[me] = mine[...]

        pl.run_scoped(body, pltpu.VMEM((4,), F32))

    out = cv.mpmd_map([(cv.Mesh(core=2), prog)], jax.ShapeDtypeStruct((2, 4), F32))(x)
    np.testing.assert_array_equal(out, x * jnp.asarray([[1.0], [2.0]]))


def test_debug_print_prints_per_instance(capfd):
    def prog(o):
        me = lax.axis_index("core")
        pl.debug_print("core {} wrote {}", me, me * 7)
        o[me] = me.astype(F32)

    cv.mpmd_map([(cv.Mesh(core=2), prog)], jax.ShapeDtypeStruct((2,), F32))()
    printed = capfd.readouterr().out
    assert "[program 0 ('prog') at core=0] core 0 wrote 0" in printed
    assert "[program 0 ('prog') at core=1] core 1 wrote 7" in printed
