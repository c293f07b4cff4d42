"""Pytree block specs and operands: one argument per operand, each a pytree, on every backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

ROWS = cv.BlockSpec((8, 128), lambda i: (i, 0))
BIAS = cv.BlockSpec((8, 128), lambda i: (0, 0))


def _interpret(backend):
    return {
        "xla": False,
        "mosaic_tpu": pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
        "mosaic_gpu": gpu_interpret(detect_races=True),
    }[backend]


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu", "mosaic_gpu"])
def test_dict_and_nested_tuple_operands(backend):
    rng = np.random.default_rng(4724)
    x, y, b = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((32, 128), (32, 128), (8, 128))
    )

    def kernel(x_ref, y_ref, b_ref, sum_ref, diff_ref):
        def body(idx, params, pair, outs):
            # params: dict of block refs; pair: (x block, (y block,)); outs: {"sum", "diff"}
            xb, (yb,) = pair
            outs["sum"][...] = xb[...] + yb[...] + params["bias"][...]
            outs["diff"][...] = xb[...] - yb[...]

        cv.emit_pipeline(
            body,
            grid=(4,),
            in_specs=[{"bias": BIAS}, (ROWS, (ROWS,))],
            out_specs={"sum": ROWS, "diff": ROWS},
            max_concurrent_steps=2,
        )({"bias": b_ref}, (x_ref, (y_ref,)), {"sum": sum_ref, "diff": diff_ref})

    shape = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    f = cv.kernel(kernel, (shape, shape), backend=backend, interpret=_interpret(backend))
    total, diff = jax.jit(f)(x, y, b)
    np.testing.assert_array_equal(total, x + y + jnp.tile(b, (4, 1)))
    np.testing.assert_array_equal(diff, x - y)


def test_plan_names_leaves_by_path():
    p = cv.pipeline.plan(grid=(4,), in_specs=[{"w": ROWS, "b": BIAS}, ROWS], out_specs=(ROWS,))
    assert [op.name for op in p.inputs] == ["in[0]['b']", "in[0]['w']", "in[1]"]
    assert [op.invariant for op in p.inputs] == [True, False, False]
    with pytest.raises(ValueError, match=r"in\[0\]\['w'\]: index_map returned 1 indices"):
        cv.pipeline.plan(grid=(4,), in_specs=[{"w": cv.BlockSpec((8, 128), lambda i: (i,))}])
    p = cv.pipeline.plan(grid=(4,), in_specs=[(ROWS, None), pl.BlockSpec(memory_space=pl.ANY)])
    assert [op.name for op in p.inputs] == ["in[0][0]"] and p.in_windowed == (True, False, False)
    # the whole array (test_whole_array_specs)
    whole = cv.pipeline.plan(grid=(4,), in_specs=[pl.BlockSpec()])
    assert whole.in_windowed == (True,) and whole.unresolved == ("in[0]",)
    with pytest.raises(ValueError, match=r"in\[0\]: an unwindowed spec .* takes no index_map"):
        cv.pipeline.plan(
            grid=(4,), in_specs=[pl.BlockSpec(None, lambda i: (i, 0), memory_space=pl.ANY)]
        )
    with pytest.raises(
        ValueError, match=r"in\[0\]\['w'\]: BlockSpec\.memory_space=.* is not supported"
    ):
        cv.pipeline.plan(
            grid=(4,),
            in_specs=[{"w": pl.BlockSpec((8, 128), lambda i: (i, 0), memory_space=pltpu.SMEM)}],
        )


def test_refs_must_match_the_spec_structure():
    x = jnp.ones((32, 128), jnp.float32)

    def kernel(x_ref, o_ref):
        cv.emit_pipeline(
            lambda idx, pair, ob: None, grid=(4,), in_specs=[(ROWS, ROWS)], out_specs=[ROWS]
        )(x_ref, o_ref)

    with pytest.raises(
        ValueError,
        match=r"pipeline: in\[0\]: the refs do not have the structure of its block specs",
    ):
        cv.kernel(kernel, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu", "mosaic_gpu"])
@pytest.mark.parametrize(
    "unwindowed", [None, pl.BlockSpec(memory_space=pl.ANY)], ids=["None", "ANY"]
)
def test_unwindowed_operand_reaches_the_body_as_its_whole_ref(backend, unwindowed):
    """The body gets the whole global ref of an unwindowed operand and copies the block it wants
    from it itself (here: row block i of x, so out = x + y again)."""
    rng = np.random.default_rng(4725)
    x, y = (jnp.asarray(rng.standard_normal((32, 128)), jnp.float32) for _ in range(2))
    seen_shapes = []

    def kernel(x_ref, y_ref, o_ref):
        def body(idx, x_whole, yb, ob):
            (i,) = idx
            seen_shapes.append(tuple(x_whole.shape))
            if backend == "xla":
                ob[...] = x_whole[pl.ds(i * 8, 8), :] + yb[...]
            elif backend == "mosaic_tpu":

                def copy(scratch, sem):
                    dma = pltpu.make_async_copy(x_whole.at[pl.ds(i * 8, 8)], scratch, sem)
                    dma.start()
                    dma.wait()
                    ob[...] = scratch[...] + yb[...]

                pl.run_scoped(copy, pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(()))
            else:

                def copy(scratch, barrier):
                    plgpu.copy_gmem_to_smem(x_whole.at[pl.ds(i * 8, 8)], scratch, barrier.at[0])
                    plgpu.barrier_wait(barrier.at[0])
                    ob[...] = scratch[...] + yb[...]

                pl.run_scoped(
                    copy, plgpu.SMEM((8, 128), jnp.float32), plgpu.Barrier(num_barriers=1)
                )

        cv.emit_pipeline(body, grid=(4,), in_specs=[unwindowed, ROWS], out_specs=[ROWS])(
            x_ref, y_ref, o_ref
        )

    f = cv.kernel(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        backend=backend,
        interpret=_interpret(backend),
    )
    np.testing.assert_array_equal(jax.jit(f)(x, y), x + y)
    assert seen_shapes[0] == (32, 128)


def _nested(x_ref, o_ref):
    """An outer pipeline over groups of row blocks, its operands unwindowed; each step runs an inner
    pipeline over the group's blocks of the global refs (upstream's nesting pattern)."""

    def outer(idx, x_whole, o_whole):
        (g,) = idx
        spec = cv.BlockSpec((8, 128), lambda i: (g * 2 + i, 0))

        def inner(jdx, xb, ob):
            ob[...] = xb[...] + g.astype(jnp.float32)

        cv.emit_pipeline(
            inner, grid=(2,), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2
        )(x_whole, o_whole)

    cv.emit_pipeline(outer, grid=(2,), in_specs=[None], out_specs=[None])(x_ref, o_ref)


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu", "mosaic_gpu"])
def test_pipeline_nested_in_a_pipeline(backend):
    x = jnp.asarray(np.random.default_rng(4726).standard_normal((32, 128)), jnp.float32)
    f = cv.kernel(
        _nested,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        backend=backend,
        interpret=_interpret(backend),
    )
    want = np.asarray(x) + np.repeat(np.float32([0.0, 1.0]), 16)[:, None]
    np.testing.assert_array_equal(jax.jit(f)(x), want)


@pytest.mark.parametrize("backend, platform", [("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")])
def test_nested_pipeline_exports_for_hardware(backend, platform):
    shape = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    exported = jax.export.export(
        jax.jit(cv.kernel(_nested, shape, backend=backend)), platforms=[platform]
    )(shape)
    assert exported.platforms == (platform,)
