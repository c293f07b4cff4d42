"""mpmd_map on mosaic_tpu: one program on a TensorCore mesh, a core per instance, run on the TPU
interpreter with race detection in both DMA modes (the real compile for v5e, v6e and v5p is a
`make compile-check` case). Programs are written as TPU kernels are: inputs and outputs in HBM,
moved through per-core VMEM with `pltpu.sync_copy`, cores signalled with
`pl.semaphore_signal(..., device_id={axis: core})`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv

MODES = ["eager", "on_wait"]
BLOCK = (8, 128)


# jax 0.11's TPU interpreter cannot signal another core's semaphore (it raises
# NotImplementedError naming the device_id); jax 0.12's can. Asserted, not skipped.
SIGNALS_ACROSS_CORES = jax.__version_info__ >= (0, 12)


def _interpret(mode):
    return pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)


def _x(cores=2):
    return jnp.asarray(np.random.default_rng(0).standard_normal((cores, *BLOCK)), jnp.float32)


def _handoff(wait: bool):
    """Core 0 doubles its block into the output and signals core 1, which adds one to what core 0
    wrote (read back from HBM) into its own block."""

    def program(x_ref, o_ref, buf, ready):
        core = lax.axis_index("core")

        @pl.when(core == 0)
        def _():
            pltpu.sync_copy(x_ref.at[0], buf)
            buf[...] = buf[...] * 2.0
            pltpu.sync_copy(buf, o_ref.at[0])
            pl.semaphore_signal(ready, 1, device_id={"core": 1})

        @pl.when(core == 1)
        def _():
            if wait:
                pl.semaphore_wait(ready, 1)
            pltpu.sync_copy(o_ref.at[0], buf)
            buf[...] = buf[...] + 1.0
            pltpu.sync_copy(buf, o_ref.at[1])
            if not wait:  # leave no semaphore signalled at exit
                pl.semaphore_wait(ready, 1)

    return program


def _handoff_call(x, *, wait: bool, mode: str):
    """`_handoff` on two TensorCores under the TPU interpreter in DMA mode `mode`."""
    return cv.mpmd_map(
        [(cv.Mesh(core=2), _handoff(wait=wait))],
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[pltpu.VMEM(BLOCK, jnp.float32), pltpu.SemaphoreType.REGULAR],
        backend="mosaic_tpu",
        interpret=_interpret(mode),
    )


@pytest.mark.parametrize("mode", MODES)
def test_cores_hand_work_over_through_hbm_and_a_semaphore(mode):
    x = _x()
    call = _handoff_call(x, wait=True, mode=mode)
    if not SIGNALS_ACROSS_CORES:
        with pytest.raises(NotImplementedError, match="core"):
            call(x)
        return
    out = np.asarray(call(x))
    np.testing.assert_array_equal(out[0], 2 * x[0])  # exact: one multiply by two
    np.testing.assert_array_equal(out[1], 2 * x[0] + 1)


def test_reading_before_the_signal_is_a_race():
    x = _x()
    call = _handoff_call(x, wait=False, mode="on_wait")
    expected = "RACE DETECTED" if SIGNALS_ACROSS_CORES else "core"
    with pytest.raises(Exception, match=expected):
        jax.block_until_ready(call(x))


def test_one_core_takes_conveyors_own_scratch_and_aliases():
    """On one core Conveyor's neutral scratch is that core's VMEM and semaphore; the output starts
    as the input (input_output_aliases) and the program rewrites half of it."""

    def program(x_ref, o_ref, buf, sems):
        pltpu.sync_copy(x_ref.at[0, :4], buf)
        buf[...] = buf[...] - 3.0
        cv.semaphore_signal(sems.at[1])
        cv.semaphore_wait(sems.at[1])
        pltpu.sync_copy(buf, o_ref.at[0, :4])

    x = _x(cores=1)
    call = cv.mpmd_map(
        [(cv.Mesh(core=1), program)],
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        scratch_shapes=[jax.ShapeDtypeStruct((4, 128), jnp.float32), cv.SemaphoreType((2,))],
        input_output_aliases={0: 0},
        backend="mosaic_tpu",
        interpret=_interpret("eager"),
    )
    out = np.asarray(call(x))
    np.testing.assert_array_equal(out[0, :4], x[0, :4] - 3)
    np.testing.assert_array_equal(out[0, 4:], x[0, 4:])


def _one(mesh, scratch=(), **kw):
    return cv.mpmd_map(
        [(mesh, lambda *refs: None)],
        jax.ShapeDtypeStruct((8, 128), jnp.float32),
        scratch_shapes=scratch,
        backend="mosaic_tpu",
        **kw,
    )


def test_what_a_tensorcore_mesh_cannot_take_is_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"2 programs.*only on SparseCore meshes"):
        cv.mpmd_map(
            [(cv.Mesh(a=1), lambda o: None), (cv.Mesh(b=1), lambda o: None)],
            jax.ShapeDtypeStruct((8, 128), jnp.float32),
            backend="mosaic_tpu",
        )()
    with pytest.raises(NotImplementedError, match=r"has one axis.*cv.Mesh\(core=n\)"):
        _one(cv.Mesh(x=2, y=2))()
    shared = jax.ShapeDtypeStruct(BLOCK, jnp.float32)
    with pytest.raises(NotImplementedError, match=r"scratch 0 .* each core has its own.*VMEM"):
        _one(cv.Mesh(core=2), [shared])()
    with pytest.raises(NotImplementedError, match=r"scratch 0 is a cv.BarrierType"):
        _one(cv.Mesh(core=1), [cv.BarrierType()])()
    with pytest.raises(NotImplementedError, match=r"input 0 is a jax Ref"):
        _one(cv.Mesh(core=1))(jax.new_ref(jnp.zeros(BLOCK)))
    with pytest.raises(TypeError, match=r"compiler_params \{'timeout_s': 5\} is the CPU"):
        _one(cv.Mesh(core=1), compiler_params={"timeout_s": 5})
    with pytest.raises(ValueError, match=r"pltpu.CompilerParams, for backend='mosaic_tpu'"):
        cv.mpmd_map(
            [(cv.Mesh(core=1), lambda o: None)],
            jax.ShapeDtypeStruct((8, 128), jnp.float32),
            compiler_params=pltpu.CompilerParams(),
        )


def test_debug_prints_the_kernel_jaxpr_and_a_deadline_is_refused(capfd):
    """debug=True reaches Pallas (which prints the kernel's jaxpr); a wait deadline is the CPU
    executor's and is refused rather than dropped."""

    def double(x_ref, o_ref, buf):
        pltpu.sync_copy(x_ref, buf)
        buf[...] = buf[...] * 2.0
        pltpu.sync_copy(buf, o_ref)

    x = _x(1)[0]

    def call(debug):
        return cv.mpmd_map(
            [(cv.Mesh(core=1), double)],
            jax.ShapeDtypeStruct(BLOCK, jnp.float32),
            scratch_shapes=[pltpu.VMEM(BLOCK, jnp.float32)],
            backend="mosaic_tpu",
            interpret=_interpret("eager"),
            debug=debug,
        )(x)

    np.testing.assert_array_equal(call(False), x * 2.0)
    assert capfd.readouterr().out == ""
    np.testing.assert_array_equal(call(True), x * 2.0)
    assert "lambda" in capfd.readouterr().out  # the printed kernel jaxpr
    with pytest.raises(TypeError, match="on mosaic_tpu: debug must be True or False"):
        call({"timeout_s": 5})
