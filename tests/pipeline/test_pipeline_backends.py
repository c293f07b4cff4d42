"""One table of pipelined kernels, run on every backend and checked against jnp.

xla runs natively; mosaic_tpu and mosaic_gpu run through their Pallas interpreters with the race
detector on (a reported race raises). Outputs start poisoned (NaN) on both, so a block the pipeline
fails to write back shows up as NaN.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret, gpu_interpreter_always
from tests.tolerance import sum_tolerance, matmul_tolerance

RNG = np.random.default_rng(123)
BACKENDS = ["xla", "mosaic_tpu", "mosaic_gpu"]


def arr(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def run(kernel_body, out_shape, *args, backend="xla", dma_mode="on_wait", gpu_interpreter=False):
    """`gpu_interpreter`: mosaic_gpu through its interpreter on every platform (a body only the
    interpreter runs: `gpu_interpreter_always`)."""
    interpret = {
        "xla": False,
        "mosaic_tpu": pltpu.InterpretParams(detect_races=True, dma_execution_mode=dma_mode),
        "mosaic_gpu": (gpu_interpreter_always if gpu_interpreter else gpu_interpret)(
            detect_races=True
        ),
    }[backend]
    return jax.jit(cv.kernel(kernel_body, out_shape, backend=backend, interpret=interpret))(*args)


@pytest.mark.parametrize("mcs, delay", [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1), (50, 0)])
def test_elementwise_add_1d_grid(backend, mcs, delay):
    x, y = arr(64, 128), arr(64, 128)

    def k(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob):
            ob[...] = xb[...] + yb[...]

        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
        cv.emit_pipeline(
            body,
            grid=(8,),
            in_specs=[spec, spec],
            out_specs=[spec],
            max_concurrent_steps=mcs,
            delay_release=delay,
        )(x_ref, y_ref, o_ref)

    np.testing.assert_array_equal(
        run(k, jax.ShapeDtypeStruct(x.shape, x.dtype), x, y, backend=backend), x + y
    )


@pytest.mark.parametrize(
    "mcs, dma_mode", [(1, "on_wait"), (2, "on_wait"), (3, "on_wait"), (2, "eager")]
)
def test_tiled_matmul_accumulates_in_resident_output(backend, mcs, dma_mode):
    x, y = arr(32, 384), arr(384, 256)

    def k(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob):
            _, _, kk = idx
            ob[...] = jnp.where(kk == 0, 0.0, ob[...]) + xb[...] @ yb[...]

        cv.emit_pipeline(
            body,
            grid=(2, 2, 3),
            in_specs=[
                cv.BlockSpec((16, 128), lambda i, j, k: (i, k)),
                cv.BlockSpec((128, 128), lambda i, j, k: (k, j)),
            ],
            out_specs=[cv.BlockSpec((16, 128), lambda i, j, k: (i, j))],
            max_concurrent_steps=mcs,
        )(x_ref, y_ref, o_ref)

    if backend == "mosaic_gpu" and mcs == 3:
        # 3 slots of a 128x128 f32 block and the rest: 237616 B, over sm_90's 232448 B. The GPU
        # interpreter would run it; Conveyor refuses it as the real compile would.
        with pytest.raises(ValueError, match="needs 237616 B of shared memory"):
            run(
                k,
                jax.ShapeDtypeStruct((32, 256), jnp.float32),
                x,
                y,
                backend=backend,
                dma_mode=dma_mode,
            )
        return
    out = run(
        k,
        jax.ShapeDtypeStruct((32, 256), jnp.float32),
        x,
        y,
        backend=backend,
        dma_mode=dma_mode,
        gpu_interpreter=True,  # a float32 jnp matmul: Mosaic GPU lowers none (see test_dot.py)
    )
    # another summation order: tests/tolerance.py
    np.testing.assert_allclose(out, x @ y, rtol=0, atol=matmul_tolerance(x, y))


def test_invariant_input_and_output_bias_and_block_sum(backend):
    """An invariant input (a bias row) and an invariant output accumulated over the steps (the sum
    of x's row blocks: elementwise, which Mosaic GPU lowers; a column sum it did not)."""
    x, b = arr(64, 128), arr(1, 128)

    def k(x_ref, b_ref, o_ref, s_ref):
        def body(idx, xb, bb, ob, sb):
            (i,) = idx
            x = xb[...]  # loaded once: two loads of xb left Mosaic GPU without a layout for them
            ob[...] = x + bb[...]

            @pl.when(i == 0)
            def _():
                sb[...] = jnp.zeros_like(sb)

            sb[...] = sb[...] + x

        cv.emit_pipeline(
            body,
            grid=(4,),
            in_specs=[
                cv.BlockSpec((16, 128), lambda i: (i, 0)),
                cv.BlockSpec((1, 128), lambda i: (0, 0)),
            ],
            out_specs=[
                cv.BlockSpec((16, 128), lambda i: (i, 0)),
                cv.BlockSpec((16, 128), lambda i: (0, 0)),
            ],
            max_concurrent_steps=2,
        )(x_ref, b_ref, o_ref, s_ref)

    out, block_sum = run(
        k,
        (
            jax.ShapeDtypeStruct((64, 128), jnp.float32),
            jax.ShapeDtypeStruct((16, 128), jnp.float32),
        ),
        x,
        b,
        backend=backend,
    )
    np.testing.assert_allclose(out, x + b, rtol=1e-6)
    np.testing.assert_allclose(block_sum, x.reshape(4, 16, 128).sum(0), rtol=1e-5, atol=1e-5)


def test_3d_grid_with_squeezed_dim_and_carry(backend):
    x = arr(4, 32, 256)

    def k(x_ref, o_ref, t_ref):
        def body(idx, xb, ob, carry):
            ob[...] = xb[...] * 2
            return carry + jnp.sum(xb[...])

        total = cv.emit_pipeline(
            body,
            grid=(4, 2, 2),
            in_specs=[cv.BlockSpec((None, 16, 128), lambda b, i, j: (b, i, j))],
            out_specs=[cv.BlockSpec((None, 16, 128), lambda b, i, j: (b, i, j))],
            init_carry=jnp.float32(0),
        )(x_ref, o_ref)

        # The final carry comes back; global refs are written through pipelines (HBM on TPU).
        def store(idx, tb):
            tb[...] = jnp.full(tb.shape, total)

        cv.emit_pipeline(store, grid=(1,), out_specs=[cv.BlockSpec((8, 128), lambda i: (0, 0))])(
            t_ref
        )

    out, total = run(
        k,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((8, 128), jnp.float32)),
        x,
        backend=backend,
    )
    np.testing.assert_array_equal(out, x * 2)
    # An f32 sum of x.size terms in another order than jnp.sum's (tests/tolerance.py); the partial
    # sums reach the largest magnitude of a running sum of x (the total itself nearly cancels).
    exact = np.asarray(x, np.float64)
    bound = sum_tolerance(x.size, np.abs(np.cumsum(exact.ravel())).max())
    np.testing.assert_allclose(total, np.full((8, 128), exact.sum()), rtol=0, atol=bound)


def test_bad_input_errors():
    x = arr(30, 8)
    spec = cv.BlockSpec((8, 8), lambda i: (i, 0))

    def not_dividing(x_ref, o_ref):
        cv.emit_pipeline(
            lambda idx, a, b: b.__setitem__(..., a[...] + 1.0),
            grid=(4,),
            in_specs=[spec],
            out_specs=[spec],
        )(x_ref, o_ref)

    # Not an error any more: the last of 4 blocks of 8 rows is partial (6 rows; see
    # test_partial_blocks.py).
    out = run(not_dividing, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x) + 1.0)

    def wrong_count(x_ref, o_ref):
        cv.emit_pipeline(lambda idx, a, b: None, grid=(4,), in_specs=[spec], out_specs=[spec])(
            x_ref
        )

    with pytest.raises(ValueError, match=r"expected 1 input refs and 1 output refs"):
        run(wrong_count, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    with pytest.raises(RuntimeError, match="inside a kernel body"):
        cv.emit_pipeline(lambda idx, a: None, grid=(1,), in_specs=[spec])(x)


def test_unwritten_output_is_poisoned_not_zero(backend):
    x = arr(16, 128)

    def k(x_ref, o_ref):
        def body(idx, xb, ob):
            (i,) = idx

            @pl.when(i == 0)  # step 1 never writes its block
            def _():
                ob[...] = xb[...]

        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
        cv.emit_pipeline(body, grid=(2,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

    out = run(k, jax.ShapeDtypeStruct(x.shape, x.dtype), x, backend=backend)
    np.testing.assert_array_equal(out[:8], x[:8])
    assert np.isnan(np.asarray(out[8:])).all()


@pytest.mark.parametrize("backend_name, platform", [("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")])
def test_pipeline_exports_for_hardware(backend_name, platform):
    x = arr(256, 128)

    def k(x_ref, o_ref):
        def body(idx, xb, ob):
            ob[...] = xb[...] * 2.0 + 1.0

        spec = cv.BlockSpec((64, 128), lambda i: (i, 0))
        cv.emit_pipeline(
            body, grid=(4,), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2
        )(x_ref, o_ref)

    fn = jax.jit(cv.kernel(k, jax.ShapeDtypeStruct(x.shape, x.dtype), backend=backend_name))
    exported = jax.export.export(fn, platforms=[platform])(x)
    assert exported.platforms == (platform,)
    assert ("tpu_custom_call" if platform == "tpu" else "mosaic_gpu") in exported.mlir_module()


def test_a_kernel_function_can_be_traced_more_than_once(backend):
    def k(x_ref, o_ref):
        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
        cv.emit_pipeline(
            lambda idx, xb, ob: ob.__setitem__(..., xb[...] + 1),
            grid=(x_ref.shape[0] // 8,),
            in_specs=[spec],
            out_specs=[spec],
        )(x_ref, o_ref)

    interpret = {"xla": False, "mosaic_tpu": True, "mosaic_gpu": True}[backend]
    fn = jax.jit(
        cv.kernel(
            k, jax.ShapeDtypeStruct((16, 128), jnp.float32), backend=backend, interpret=interpret
        )
    )
    for scale in (1.0, 2.0):  # one launcher, traced twice (jit retraces on the weak-typed scalar)
        x = arr(16, 128) * scale
        np.testing.assert_array_equal(fn(x), x + 1)
        jax.clear_caches()


def test_kernel_grid_runs_every_point_with_its_program_id(backend):
    """cv.kernel(grid=...) runs the body per point; each point pipelines over its own slab."""
    x = jnp.asarray(RNG.standard_normal((4, 3, 16, 128)), jnp.float32)

    def k(x_ref, o_ref):
        i, j = cv.program_id(0), cv.program_id(1)

        def body(idx, xb, ob):
            ob[...] = xb[...] * 2 + (i * 10 + j).astype(jnp.float32)

        spec = cv.BlockSpec((None, None, 8, 128), lambda s: (i, j, s, 0))
        cv.emit_pipeline(
            body, grid=(2,), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2
        )(x_ref, o_ref)

    interpret = {
        "xla": False,
        "mosaic_tpu": pltpu.InterpretParams(detect_races=True),
        "mosaic_gpu": gpu_interpret(detect_races=True),
    }[backend]
    out = jax.jit(
        cv.kernel(
            k,
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            backend=backend,
            interpret=interpret,
            grid=(4, 3),
        )
    )(x)
    expect = x * 2 + (jnp.arange(4)[:, None] * 10 + jnp.arange(3)[None])[:, :, None, None].astype(
        jnp.float32
    )
    np.testing.assert_array_equal(out, expect)


def test_kernel_grid_and_program_id_errors():
    shape = jax.ShapeDtypeStruct((8,), jnp.float32)
    with pytest.raises(ValueError, match="grid must be up to 3 positive ints"):
        cv.kernel(lambda x, o: None, shape, grid=(0,))
    with pytest.raises(ValueError, match=r"cv.program_id: axis must be in \[0, 1\)"):
        cv.kernel(lambda x, o: cv.program_id(1), shape, grid=(2,))(jnp.zeros(8))


def test_tpu_block_tiling_is_checked_before_the_compiler_refuses_it():
    x = arr(32, 256)

    def k(x_ref, o_ref):
        spec = cv.BlockSpec((8, 64), lambda i, j: (i, j))
        cv.emit_pipeline(lambda idx, a, b: None, grid=(4, 4), in_specs=[spec], out_specs=[spec])(
            x_ref, o_ref
        )

    with pytest.raises(
        ValueError,
        match=r"dimension 1 is 64, expected a multiple of 128 or the whole dimension \(256\)",
    ):
        run(k, jax.ShapeDtypeStruct(x.shape, x.dtype), x, backend="mosaic_tpu")
    xb = x.astype(jnp.bfloat16)

    def k16(x_ref, o_ref):
        spec = cv.BlockSpec((8, 128), lambda i: (i, 0))
        cv.emit_pipeline(lambda idx, a, b: None, grid=(4,), in_specs=[spec], out_specs=[spec])(
            x_ref, o_ref
        )

    with pytest.raises(ValueError, match="expected a multiple of 16"):
        run(k16, jax.ShapeDtypeStruct((32, 128), jnp.bfloat16), xb[:, :128], backend="mosaic_tpu")
