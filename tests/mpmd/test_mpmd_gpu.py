"""mpmd_map on Mosaic GPU: programs as warpgroups of one kernel, checked by the GPU interpreter
(race detection on) against the CPU executor, and exported for cuda."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import ON_GPU, gpu_interpret
from tests.mpmd.programs import NB, R, barrier_lockstep, producer_consumer

GPU = dict(backend="mosaic_gpu", compiler_params=plgpu.CompilerParams())


@pytest.mark.timeout(300)
def test_barrier_producer_consumer_agrees_with_the_cpu_executor():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 128)), jnp.float32)
    gpu = jax.jit(barrier_lockstep(interpret=gpu_interpret(detect_races=True), **GPU))(x)
    cpu = barrier_lockstep()(x)
    np.testing.assert_array_equal(gpu, (x + 1.0) * 2.0)
    np.testing.assert_array_equal(gpu, cpu)


@pytest.mark.timeout(300)
def test_aliased_outputs_keep_the_input_where_no_program_writes():
    """input_output_aliases on warpgroups: the output starts as the input (a jax Ref the kernel
    updates in place); each instance rewrites one row, the other rows keep the input's values."""
    x = jnp.asarray(np.random.default_rng(4702).standard_normal((4, 128)), jnp.float32)

    def scale(x_ref, o_ref):
        i = lax.axis_index("c")
        o_ref[i] = x_ref[i] * 3.0

    f = cv.mpmd_map(
        [(cv.Mesh(c=2), scale)],
        jax.ShapeDtypeStruct((4, 128), jnp.float32),
        input_output_aliases={0: 0},
        interpret=gpu_interpret(detect_races=True),
        **GPU,
    )
    np.testing.assert_array_equal(jax.jit(f)(x), x.at[:2].multiply(3.0))
    exported = jax.export.export(
        jax.jit(
            cv.mpmd_map(
                [(cv.Mesh(c=2), scale)],
                jax.ShapeDtypeStruct((4, 128), jnp.float32),
                input_output_aliases={0: 0},
                **GPU,
            )
        ),
        platforms=["cuda"],
    )(x)
    assert "output_operand_alias" in exported.mlir_module()


def test_mesh_coordinates_on_warpgroups():
    def first(o1, o2):
        o1[lax.axis_index("x"), lax.axis_index("y")] = (
            lax.axis_index("x") * 10 + lax.axis_index("y")
        ).astype(jnp.float32)

    def second(o1, o2):
        o2[lax.axis_index("z")] = (lax.axis_index("z") + 100).astype(jnp.float32)

    a, b = cv.mpmd_map(
        [(cv.Mesh(x=2, y=2), first), (cv.Mesh(z=2), second)],
        (jax.ShapeDtypeStruct((2, 2), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.float32)),
        interpret=gpu_interpret(detect_races=True),
        **GPU,
    )()
    np.testing.assert_array_equal(a, [[0, 1], [10, 11]])
    np.testing.assert_array_equal(b, [100, 101])


@pytest.mark.skipif(
    not ON_GPU,
    reason=(
        "semaphores need a real GPU: the jax 0.12 Mosaic GPU interpreter cannot run them (this "
        "case is exported for cuda below on every machine)"
    ),
)
def test_semaphore_producer_consumer_on_a_real_gpu():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((NB * R, 128)), jnp.float32)
    np.testing.assert_array_equal(jax.jit(producer_consumer(**GPU))(x), (x + 1.0) * 2.0)


def test_semaphore_producer_consumer_exports_for_cuda():
    f = producer_consumer(**GPU)
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        jax.ShapeDtypeStruct((NB * R, 128), jnp.float32)
    )
    assert "cuda" in exported.platforms and exported.mlir_module()


def test_pallas_semaphore_scratch_and_a_cost_estimate_export_for_cuda():
    """Semaphores are kernel scratch (plgpu.SemaphoreType.REGULAR), not allocated outside the
    kernel."""

    def signal(x, o, sems):
        o[...] = x[...] + 1.0
        cv.fence()
        cv.semaphore_signal(sems.at[0])

    def wait(x, o, sems):
        cv.semaphore_wait(sems.at[0])

    from jax.experimental import pallas as pl

    from conveyor._compat import gpu_kernel_takes_cost_estimate

    cost = pl.CostEstimate(flops=128, transcendentals=0, bytes_accessed=1024)
    x = jax.ShapeDtypeStruct((128,), jnp.float32)

    def call(**kw):
        return cv.mpmd_map(
            [(cv.Mesh(a=1), signal), (cv.Mesh(b=1), wait)],
            jax.ShapeDtypeStruct((128,), jnp.float32),
            scratch_shapes=[plgpu.SemaphoreType.REGULAR((1,))],
            name="signal_wait",
            **kw,
            **GPU,
        )

    assert "signal_wait" in jax.export.export(jax.jit(call()), platforms=["cuda"])(x).mlir_module()
    if gpu_kernel_takes_cost_estimate():
        exported = jax.export.export(jax.jit(call(cost_estimate=cost)), platforms=["cuda"])(x)
        assert "signal_wait" in exported.mlir_module()
    else:  # jax 0.11: plgpu.kernel has no cost_estimate; refused by name, never dropped
        with pytest.raises(
            NotImplementedError, match="cost_estimate on mosaic_gpu needs jax >= 0.12"
        ):
            jax.export.export(jax.jit(call(cost_estimate=cost)), platforms=["cuda"])(x)


def test_what_the_gpu_path_cannot_do_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="input 0 is a jax Ref"):
        cv.mpmd_map(
            [(cv.Mesh(c=1), lambda x, o: None)], jax.ShapeDtypeStruct((4,), jnp.float32), **GPU
        )(jax.new_ref(jnp.zeros(4)))
    with pytest.raises(NotImplementedError, match="interpreter of jax 0.12 cannot run semaphores"):
        producer_consumer(interpret=plgpu.InterpretGPUParams(), **GPU)(
            jnp.zeros((NB * R, 128), jnp.float32)
        )


def test_the_backend_is_named_not_guessed_from_argument_types():
    one = lambda **kw: cv.mpmd_map(
        [(cv.Mesh(c=1), lambda o: None)], jax.ShapeDtypeStruct((4,), jnp.float32), **kw
    )
    with pytest.raises(
        ValueError,
        match=r"backend must be one of \('cpu', 'mosaic_gpu', 'mosaic_tpu'\) or None, "
        r"got 'gpu'",
    ):
        one(backend="gpu")
    with pytest.raises(
        TypeError, match=r"compiler_params has no 'backend' key; pass backend='mosaic_gpu' instead"
    ):
        one(compiler_params={"backend": "mosaic_gpu"})
    with pytest.raises(
        ValueError,
        match=r"compiler_params is a plgpu.CompilerParams, for backend='mosaic_gpu'; "
        r"got backend='cpu'",
    ):
        one(compiler_params=plgpu.CompilerParams())
    with pytest.raises(
        NotImplementedError, match="compiler_params fields are not passed to the kernel yet"
    ):
        one(
            backend="mosaic_gpu", compiler_params=plgpu.CompilerParams(unsafe_no_auto_barriers=True)
        )
    with pytest.raises(
        ValueError, match=r"pltpu.CompilerParams, for backend='mosaic_tpu'; got backend='cpu'"
    ):
        one(compiler_params=pltpu.CompilerParams())
    with pytest.raises(TypeError, match=r"compiler_params must be a dict"):
        one(compiler_params="fast")
    with pytest.raises(ValueError, match="the cpu backend has none"):
        one(interpret=plgpu.InterpretGPUParams())


def test_debug_reaches_the_kernel_and_bad_values_are_refused(capfd):
    """debug=True reaches plgpu.kernel (Pallas prints the kernel's jaxpr when lowering); a wait
    deadline is the CPU executor's and is refused on mosaic_gpu; a debug that is neither a bool
    nor a dict is refused on every backend."""

    def one(debug, backend="mosaic_gpu"):
        kw = GPU if backend == "mosaic_gpu" else {}
        return cv.mpmd_map(
            [(cv.Mesh(c=1), lambda x, o: o.__setitem__(..., x[...] + 1.0))],
            jax.ShapeDtypeStruct((128,), jnp.float32),
            debug=debug,
            **kw,
        )

    x = jax.ShapeDtypeStruct((128,), jnp.float32)
    jax.export.export(jax.jit(one(False)), platforms=["cuda"])(x)
    assert capfd.readouterr().out == ""
    jax.export.export(jax.jit(one(True)), platforms=["cuda"])(x)
    assert "lambda" in capfd.readouterr().out  # the printed kernel jaxpr
    with pytest.raises(TypeError, match="on mosaic_gpu: debug must be True or False"):
        one({"timeout_s": 5})
    with pytest.raises(TypeError, match="debug must be True, False or a dict"):
        one("yes", backend="cpu")
