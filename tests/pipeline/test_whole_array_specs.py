"""Whole-array specs: a BlockSpec without block_shape is the whole array as one block (upstream's
`pl.BlockSpec()`), fetched once before the first step or written back once after the last; and a
spec without index_map visits block 0 in every dimension.

Data are small random integers in float32 (sums exact); outputs start poisoned (xla) or
uninitialized (interpreters, race detection on), so a block never written shows up.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret
from tests import schedule

ROWS = pl.BlockSpec((8, 128), lambda i: (i, 0))
STEPS = 4


def _kernel(table_spec, total_spec):
    """o = x + the table at every step; total = the sum of x's row blocks (a whole-array output
    resident over the grid)."""

    def body(x_ref, t_ref, o_ref, s_ref):
        def step(idx, xb, tb, ob, sb):
            @pl.when(idx[0] == 0)
            def _():
                sb[...] = jnp.zeros_like(sb)

            ob[...] = xb[...] + tb[...]
            sb[...] += xb[...]

        cv.emit_pipeline(
            step,
            grid=(STEPS,),
            in_specs=[ROWS, table_spec],
            out_specs=[ROWS, total_spec],
            max_concurrent_steps=2,
        )(x_ref, t_ref, o_ref, s_ref)

    return body


def _interpret(backend):
    return {
        "xla": False,
        "mosaic_tpu": pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
        "mosaic_gpu": gpu_interpret(detect_races=True),
    }[backend]


SHAPES = (
    jax.ShapeDtypeStruct((STEPS * 8, 128), jnp.float32),
    jax.ShapeDtypeStruct((8, 128), jnp.float32),
)


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu", "mosaic_gpu"])
@pytest.mark.parametrize("spelling", ["pl.BlockSpec()", "cv.BlockSpec(None)", "no index_map"])
def test_whole_array_blocks_are_exact(backend, spelling):
    spec = {
        "pl.BlockSpec()": pl.BlockSpec(),
        "cv.BlockSpec(None)": cv.BlockSpec(None),
        "no index_map": pl.BlockSpec((8, 128)),
    }[spelling]
    rng = np.random.default_rng(4730)
    x = rng.integers(-4, 5, (STEPS * 8, 128)).astype(np.float32)
    t = rng.integers(-4, 5, (8, 128)).astype(np.float32)
    f = cv.kernel(_kernel(spec, spec), SHAPES, backend=backend, interpret=_interpret(backend))
    out, total = jax.jit(f)(x, t)
    np.testing.assert_array_equal(out, x + np.tile(t, (STEPS, 1)))
    np.testing.assert_array_equal(total, x.reshape(STEPS, 8, 128).sum(0))


@pytest.mark.parametrize("backend, platform", [("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")])
def test_whole_array_specs_export(backend, platform):
    f = jax.jit(cv.kernel(_kernel(pl.BlockSpec(), pl.BlockSpec()), SHAPES, backend=backend))
    assert jax.export.export(f, platforms=[platform])(*SHAPES).platforms == (platform,)


def test_plan_sizes_whole_blocks_from_the_arrays():
    p = cv.pipeline.plan(
        grid=(STEPS,),
        in_specs=[ROWS, pl.BlockSpec()],
        out_specs=[cv.BlockSpec(None)],
        max_concurrent_steps=2,
    )
    table = p.inputs[1]
    assert table.whole_array and table.invariant and table.num_slots == 1
    assert p.unresolved == ("in[1]", "out[0]")
    for call in (cv.sim.check, lambda q: cv.sim.simulate(q, "h100")):
        with pytest.raises(
            ValueError, match=r"in\[1\], out\[0\] have whole-array specs .*with_array_shapes"
        ):
            call(p)
    sized = p.with_array_shapes([(32, 128), (16, 256), (8, 64)])
    assert sized.inputs[1].block_shape == (16, 256) and sized.outputs[0].block_shape == (8, 64)
    assert sized.block_indices(sized.inputs[1], 3) == (0, 0)
    assert cv.sim.check(sized).ok
    # One fetch of the table (before step 0) and one write-back of the output (after the last step).
    assert [c.at for c in schedule.fetches(sized) if c.operand == "in[1]"] == [-1]
    assert [c.at for c in schedule.stores(sized) if c.operand == "out[0]"] == [STEPS - 1]


def test_a_grid_dependent_map_on_a_whole_array_spec_is_refused():
    p = cv.pipeline.plan(grid=(STEPS,), in_specs=[pl.BlockSpec(None, lambda i: (i, 0))])
    with pytest.raises(
        ValueError,
        match=r"in\[0\]: a whole-array spec \(no block_shape\) has one block, so its "
        r"index_map must not depend on the grid",
    ):
        p.with_array_shapes([(32, 128)])
