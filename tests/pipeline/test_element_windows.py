"""`pl.Element(n)` block dimensions: a window of n whose index-map entry is an element offset, not a
block index (ragged kernels read rows starting anywhere). Windows here overlap and start off any
block boundary, and the array is not a multiple of the window; outputs start poisoned (xla) or
uninitialized (interpreters, race detection on)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

STEPS, ROWS, LANES = 4, 8, 128
ARRAY_ROWS = 3 * (STEPS - 1) + 1 + ROWS + 2  # the last window ends 2 rows before the array does


def start(g):
    return 3 * g + 1


def _kernel(x_ref, o_ref):
    def double(idx, xb, ob):
        ob[...] = 2.0 * xb[...]

    cv.emit_pipeline(
        double,
        grid=(STEPS,),
        max_concurrent_steps=2,
        in_specs=[pl.BlockSpec((pl.Element(ROWS), LANES), lambda g: (start(g), 0))],
        out_specs=[pl.BlockSpec((ROWS, LANES), lambda g: (g, 0))],
    )(x_ref, o_ref)


def _interpret(backend):
    return {
        "xla": False,
        "mosaic_tpu": pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
        "mosaic_gpu": gpu_interpret(detect_races=True),
    }[backend]


OUT = jax.ShapeDtypeStruct((STEPS * ROWS, LANES), jnp.float32)


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu", "mosaic_gpu"])
def test_element_windows_read_from_element_offsets(backend):
    x = np.random.default_rng(4718).integers(-8, 9, (ARRAY_ROWS, LANES)).astype(np.float32)
    out = np.asarray(
        jax.jit(cv.kernel(_kernel, OUT, backend=backend, interpret=_interpret(backend)))(x)
    )
    want = np.concatenate([2.0 * x[start(g) : start(g) + ROWS] for g in range(STEPS)])
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("backend, platform", [("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")])
def test_element_windows_export(backend, platform):
    x = jax.ShapeDtypeStruct((ARRAY_ROWS, LANES), jnp.float32)
    f = jax.jit(cv.kernel(_kernel, OUT, backend=backend))
    assert jax.export.export(f, platforms=[platform])(x).platforms == (platform,)


def test_plan_offsets_and_bounds():
    p = cv.pipeline.plan(
        grid=(STEPS,), in_specs=[pl.BlockSpec((pl.Element(ROWS), LANES), lambda g: (start(g), 0))]
    )
    op = p.inputs[0]
    assert op.block_shape == (ROWS, LANES) and op.element_dims == (0,)
    assert [p.offsets(op, g) for g in range(STEPS)] == [(start(g), 0) for g in range(STEPS)]
    from conveyor.pipeline.lowering import block_in_bounds

    assert block_in_bounds(p, op, 3, (start(3) + ROWS, LANES))  # ends at the array's end
    assert not block_in_bounds(p, op, 3, (start(3) + ROWS - 1, LANES))  # one row past it
    assert cv.sim.check(p).ok


def test_other_dimension_kinds_are_refused_by_name():
    with pytest.raises(
        NotImplementedError,
        match=r"in\[0\]: block dimension 0 is Element\(8, padding=\(0, 2\)\): "
        r"pl.Element with padding is not supported",
    ):
        cv.pipeline.plan(
            grid=(2,), in_specs=[pl.BlockSpec((pl.Element(8, (0, 2)), 128), lambda g: (g, 0))]
        )
    with pytest.raises(
        NotImplementedError, match=r"in\[0\]: block dimension 0 is Indirect\(8\): pl.Indirect"
    ):
        cv.pipeline.plan(
            grid=(2,), in_specs=[pl.BlockSpec((pl.Indirect(8), 128), lambda g: (g, 0))]
        )
    with pytest.raises(
        ValueError, match=r"out\[0\]: block dimension 1 is 'x': expected a positive int"
    ):
        cv.pipeline.plan(grid=(2,), out_specs=[cv.BlockSpec((8, "x"), lambda g: (g, 0))])


def test_numpy_integer_block_sizes_are_accepted():
    for spec in (
        cv.BlockSpec((np.int64(8), 128), lambda g: (g, 0)),
        pl.BlockSpec((np.int32(8), 128), lambda g: (g, 0)),
    ):
        p = cv.pipeline.plan(grid=(2,), in_specs=[spec])
        assert p.inputs[0].block_shape == (8, 128) and all(
            type(d) is int for d in p.inputs[0].block_shape
        )
