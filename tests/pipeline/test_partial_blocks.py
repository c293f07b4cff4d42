"""Blocks that do not divide their arrays: the grid covers the array with cdiv blocks and the last
block of a dimension is partial, as upstream's pipelines allow (real shapes are rarely multiples
of the block).

The rule (docs/pipelining.md, conveyor.pipeline.lowering): a partial block copies its part inside
the array; the rest of an input slot reads as zeros, the rest of an output slot is dropped. Checked
on every backend against NumPy with a body whose result depends on those zeros (row sums over
partial column blocks, accumulated across the grid), and an array smaller than one block.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from conveyor.ints import cdiv
from tests.platform import gpu_interpret

BLOCK = (16, 256)
BACKENDS = [
    ("xla", False),
    ("xla checked", False),
    ("mosaic_tpu", pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait")),
    ("mosaic_tpu", pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")),
    ("mosaic_gpu", gpu_interpret(detect_races=True)),
]


def _grid(shape):
    return tuple(cdiv(s, b) for s, b in zip(shape, BLOCK))


def _block_sums(shape, backend, interpret):
    """out[r, c] = the sum over x's column blocks b of x[r, b * 256 + c] (the last block partial:
    its columns past the array must read as zeros), written through partial row blocks.
    Elementwise, so that Mosaic GPU lowers it (a row sum broadcast back did not: "Layout inference
    failed" on an H200)."""
    rows, cols = shape
    grid = _grid(shape)

    def body(idx, xb, ob):
        @pl.when(idx[1] == 0)
        def _():
            ob[...] = jnp.zeros_like(ob)

        ob[...] += xb[...]

    def kernel(x_ref, o_ref):
        cv.emit_pipeline(
            body,
            grid=grid,
            in_specs=[pl.BlockSpec(BLOCK, lambda i, k: (i, k))],
            out_specs=[pl.BlockSpec(BLOCK, lambda i, k: (i, 0))],
            max_concurrent_steps=2,
        )(x_ref, o_ref)

    name = backend.split()[0]
    f = cv.kernel(
        kernel,
        jax.ShapeDtypeStruct((rows, BLOCK[1]), jnp.float32),
        backend=name,
        interpret=interpret,
    )
    # Small integers: every sum is exact in float32, so the comparison is exact.
    x = np.random.default_rng(rows * 1000 + cols).integers(-8, 8, shape).astype(np.float32)
    with cv.pipeline.checked_schedule(backend == "xla checked"):
        out = np.asarray(jax.jit(f)(jnp.asarray(x)))
    return out, x


@pytest.mark.parametrize("backend, interpret", BACKENDS)
# Extents are multiples of the TPU tile (8 float32 rows, 128 lanes), as Mosaic TPU needs.
@pytest.mark.parametrize("shape", [(40, 384), (8, 128)], ids=["partial", "smaller_than_a_block"])
def test_partial_blocks_on_every_backend(backend, interpret, shape):
    out, x = _block_sums(shape, backend, interpret)
    rows, cols = shape
    padded = np.pad(x, ((0, 0), (0, -cols % BLOCK[1])))  # what the partial block must read
    np.testing.assert_array_equal(out, padded.reshape(rows, -1, BLOCK[1]).sum(axis=1))


def test_the_plan_sizes_the_partial_windows():
    """The last block of each partial dimension covers what is left of the array; a block starting
    past the end is out of bounds; the schedule is the usual one (the checker finds it clean)."""
    from conveyor.pipeline.lowering import block_in_bounds

    p = cv.pipeline.plan(
        grid=(3, 2),
        in_specs=[pl.BlockSpec(BLOCK, lambda i, k: (i, k))],
        out_specs=[pl.BlockSpec(BLOCK, lambda i, k: (i, 0))],
    ).with_array_shapes([(40, 300), (40, 256)])
    x, out = p.inputs[0], p.outputs[0]
    assert x.partial_dims == (0, 1) and out.partial_dims == (0,)
    assert p.window(x, 0) == ((0, 16), (0, 256))
    assert p.window(x, 5) == ((32, 8), (256, 44))  # grid (2, 1): 8 rows, 44 columns left
    assert p.window(out, 5) == ((32, 8), (0, 256))
    assert all(block_in_bounds(p, x, s, (40, 300)) for s in range(6))
    past = cv.pipeline.plan(
        grid=(4,), in_specs=[pl.BlockSpec(BLOCK, lambda i: (i, 0))], out_specs=[]
    ).with_array_shapes([(40, 256)])
    assert past.window(past.inputs[0], 3) == ((48, 0), (0, 256))
    assert not block_in_bounds(past, past.inputs[0], 3, (40, 256))  # starts past the end
    assert cv.sim.check(p).ok
    # Dividing blocks record no array shape: the plan is the one without shapes.
    whole = cv.pipeline.plan(
        grid=(2,), in_specs=[pl.BlockSpec(BLOCK, lambda i: (i, 0))], out_specs=[]
    )
    assert whole.with_array_shapes([(32, 256)]) is whole


def _doubling(shape):
    def kernel(x_ref, o_ref):
        cv.emit_pipeline(
            lambda idx, xb, ob: ob.__setitem__(..., xb[...] * 2.0),
            grid=_grid(shape),
            in_specs=[pl.BlockSpec(BLOCK, lambda i, k: (i, k))],
            out_specs=[pl.BlockSpec(BLOCK, lambda i, k: (i, k))],
        )(x_ref, o_ref)

    return kernel


def test_partial_blocks_export_for_tpu_and_cuda():
    x = jax.ShapeDtypeStruct((40, 384), jnp.float32)
    for backend, platform in (("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")):
        f = jax.jit(cv.kernel(_doubling(x.shape), x, backend=backend))
        assert jax.export.export(f, platforms=[platform])(x).platforms == (platform,)


def test_a_partial_block_off_the_tpu_tile_is_refused_on_mosaic_tpu():
    """Mosaic TPU copies (8, 128)-tiled windows: a partial block in an array whose extent is off
    the tile cannot be copied aligned (the real compiler refuses it; the interpreter would not
    notice), so it is refused by name. xla takes it."""
    x = jnp.arange(40 * 300, dtype=jnp.float32).reshape(40, 300)
    with pytest.raises(ValueError, match=r"dimension 1 .* multiple of its tile \(128 for float32"):
        cv.kernel(_doubling(x.shape), x, backend="mosaic_tpu", interpret=True)(x)
    out = cv.kernel(_doubling(x.shape), x, backend="xla")(x)
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))


def test_the_simulator_prices_a_partial_copy_by_what_it_moves():
    """The program's copies of a partial block carry the elements they move; the simulator times
    them by that share of the block (here, with no compute, the copies are the whole time)."""
    spec = pl.BlockSpec(BLOCK, lambda i: (i, 0))
    plain = cv.pipeline.plan(grid=(3,), in_specs=[spec], out_specs=[spec])
    partial = plain.with_array_shapes([(40, 256), (40, 256)])  # the last block: 8 of 16 rows
    copies = [a for a in partial.program().copies() if a.operand == "in[0]"]
    assert [c.elements for c in copies] == [None, None, 8 * 256]
    full = cv.sim.simulate(plain, "v5e", dtype="bf16")
    cut = cv.sim.simulate(partial, "v5e", dtype="bf16")
    assert cut.time_s < full.time_s

    def loads(report):
        return sorted(b.end - b.start for b in report.boxes if b.actor == "copy engine (loads)")

    # the same two whole-block loads, and a third of half the size
    assert loads(cut)[1:] == pytest.approx(loads(full)[:2])
    assert loads(cut)[0] == pytest.approx(loads(full)[0] / 2)
