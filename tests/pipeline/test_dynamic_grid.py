"""Dynamic grids: pipeline grid sizes known only inside the kernel (traced int32 scalars).

Each kernel grid point p runs a pipeline over a (p, 2) grid: empty at p = 0, and shorter than
max_concurrent_steps at small p, so the prologue's predicated fetches and the empty loop are
exercised on every backend (mosaic ones through their interpreters with race detection; outputs
start poisoned). A first, static pipeline fills the point's region with -1, so blocks the dynamic
pipeline must not touch are checked too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

POINTS, ROW_BLOCKS, BLOCK = 4, 4, (8, 128)
SHAPE = (POINTS * ROW_BLOCKS * BLOCK[0], 2 * BLOCK[1])


def _interpret(backend):
    # eager DMAs: a copy started and never awaited leaves its semaphore non-zero (conftest fails it)
    return {
        "xla": False,
        "mosaic_tpu": pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
        "mosaic_gpu": gpu_interpret(detect_races=True),
    }[backend]


def _fill_then_add(mcs, delay):
    def kernel(x_ref, y_ref, o_ref):
        p = cv.program_id(0)
        region = lambda i, j: (p * ROW_BLOCKS + i, j)  # noqa: E731
        spec = cv.BlockSpec(BLOCK, region)

        def fill(idx, ob):
            ob[...] = jnp.full(BLOCK, -1.0, jnp.float32)

        cv.emit_pipeline(fill, grid=(ROW_BLOCKS, 2), out_specs=[spec])(o_ref)

        def add(idx, xb, yb, ob):
            ob[...] = xb[...] + yb[...]

        cv.emit_pipeline(
            add,
            grid=(p, 2),
            in_specs=[spec, spec],
            out_specs=[spec],
            max_concurrent_steps=mcs,
            delay_release=delay,
        )(x_ref, y_ref, o_ref)

    return kernel


def _expected(x, y):
    want = np.full(SHAPE, -1.0, np.float32)
    rows = BLOCK[0]
    for p in range(POINTS):
        start = p * ROW_BLOCKS * rows
        # blocks i < p of point p
        want[start : start + p * rows] = (x + y)[start : start + p * rows]
    return want


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu", "mosaic_gpu"])
@pytest.mark.parametrize("mcs, delay", [(1, 0), (3, 0), (3, 1)])
def test_dynamic_grid_empty_short_and_long(backend, mcs, delay):
    rng = np.random.default_rng(4715)
    x, y = (jnp.asarray(rng.standard_normal(SHAPE), jnp.float32) for _ in range(2))
    f = cv.kernel(
        _fill_then_add(mcs, delay),
        jax.ShapeDtypeStruct(SHAPE, jnp.float32),
        backend=backend,
        interpret=_interpret(backend),
        grid=(POINTS,),
    )
    np.testing.assert_array_equal(jax.jit(f)(x, y), _expected(np.asarray(x), np.asarray(y)))


def test_dynamic_grid_read_from_data_one_compile():
    """xla: the size comes from an input array; one compiled function runs every size, 0
    included."""
    rng = np.random.default_rng(4716)
    x = jnp.asarray(rng.standard_normal((64, 128)), jnp.float32)

    def kernel(n_ref, x_ref, o_ref):
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

        def double(idx, xb, ob):
            ob[...] = 2.0 * xb[...]

        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
        cv.emit_pipeline(
            double, grid=(n_ref[0],), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2
        )(x_ref, o_ref)

    f = jax.jit(cv.kernel(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype)))
    for n in (0, 1, 5, 8):
        out = np.asarray(f(jnp.asarray([n], jnp.int32), x))
        np.testing.assert_array_equal(out[: 8 * n], 2.0 * np.asarray(x)[: 8 * n])
        np.testing.assert_array_equal(out[8 * n :], 0.0)
    assert f._cache_size() == 1


def test_warp_specialized_dynamic_grid_xla_and_gpu_interpreter():
    rng = np.random.default_rng(4717)
    x = jnp.asarray(rng.standard_normal((4 * 64, 128)), jnp.float32)

    def kernel(x_ref, o_ref):
        p = cv.program_id(0)
        spec = cv.BlockSpec((16, 128), lambda i: (p * 4 + i, 0))

        def my_rows():  # compute threads 0 and 1 each own 8 rows of a block
            return pl.ds(lax.axis_index("wg") * 8, 8)

        def fill(idx, ob):
            ob[my_rows(), :] = jnp.zeros((8, 128), jnp.float32)

        def body(idx, xb, ob):
            ob[my_rows(), :] = xb[my_rows(), :] + 1.0

        cv.emit_pipeline_warp_specialized(
            fill, grid=(4,), memory_registers=40, wg_axis="wg", num_compute_wgs=2, out_specs=[spec]
        )(o_ref)
        cv.emit_pipeline_warp_specialized(
            body,
            grid=(p,),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=2,
            in_specs=[spec],
            out_specs=[spec],
            max_concurrent_steps=2,
        )(x_ref, o_ref)

    for backend in ("xla", "mosaic_gpu"):
        f = cv.kernel(
            kernel,
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            backend=backend,
            num_threads=3,
            thread_name="wg",
            grid=(4,),
            interpret=_interpret(backend),
        )
        out = np.asarray(jax.jit(f)(x))
        want = np.zeros(x.shape, np.float32)
        for p in range(4):
            rows = slice(p * 64, p * 64 + p * 16)
            want[rows] = np.asarray(x)[rows] + 1.0
        np.testing.assert_array_equal(out, want, err_msg=backend)


@pytest.mark.parametrize("backend, platform", [("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")])
def test_dynamic_grid_exports_for_hardware(backend, platform):
    shape = jax.ShapeDtypeStruct(SHAPE, jnp.float32)
    f = jax.jit(cv.kernel(_fill_then_add(3, 1), shape, backend=backend, grid=(POINTS,)))
    exported = jax.export.export(f, platforms=[platform])(shape, shape)
    assert exported.platforms == (platform,)


def test_checker_and_simulator_need_a_concrete_grid():
    spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
    dynamic = cv.pipeline.plan(
        grid=(jnp.int32(6),), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2
    )
    assert not dynamic.is_static
    for call in (lambda p: cv.sim.check(p), lambda p: cv.sim.simulate(p, "h100")):
        with pytest.raises(
            ValueError,
            match=r"grid \(<traced>\) has sizes known only when the kernel runs.*"
            r"with_grid",
        ):
            call(dynamic)
    concrete = dynamic.with_grid((6,))
    assert cv.sim.check(concrete).ok
    static = cv.pipeline.plan(grid=(6,), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2)
    assert concrete.program() == static.program()
    assert cv.sim.simulate(concrete, "h100").time_s == cv.sim.simulate(static, "h100").time_s > 0
    with pytest.raises(ValueError, match=r"grid: expected 1 ints >= 0"):
        dynamic.with_grid((6, 2))
