"""Kernels built with cv.emit_pipeline on the xla backend, each against a jnp reference.

Outputs start poisoned (NaN), so a block the pipeline fails to write back shows up as NaN.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv

RNG = np.random.default_rng(123)


def arr(*shape):
    return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


def run(kernel_body, out_shape, *args):
    return jax.jit(cv.kernel(kernel_body, out_shape))(*args)


@pytest.mark.parametrize("mcs, delay", [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1), (50, 0)])
def test_elementwise_add_1d_grid(mcs, delay):
    x, y = arr(64, 32), arr(64, 32)

    def k(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob):
            ob[...] = xb[...] + yb[...]
        spec = cv.BlockSpec((8, 32), lambda i: (i, 0))
        cv.emit_pipeline(body, grid=(8,), in_specs=[spec, spec], out_specs=[spec],
                         max_concurrent_steps=mcs, delay_release=delay)(x_ref, y_ref, o_ref)

    np.testing.assert_array_equal(run(k, jax.ShapeDtypeStruct(x.shape, x.dtype), x, y), x + y)


@pytest.mark.parametrize("mcs", [1, 2, 3])
def test_tiled_matmul_accumulates_in_resident_output(mcs):
    x, y = arr(64, 96), arr(96, 48)

    def k(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob):
            _, _, kk = idx
            ob[...] = jnp.where(kk == 0, 0.0, ob[...]) + xb[...] @ yb[...]
        cv.emit_pipeline(body, grid=(2, 3, 3),
                         in_specs=[cv.BlockSpec((32, 32), lambda i, j, k: (i, k)),
                                   cv.BlockSpec((32, 16), lambda i, j, k: (k, j))],
                         out_specs=[cv.BlockSpec((32, 16), lambda i, j, k: (i, j))],
                         max_concurrent_steps=mcs)(x_ref, y_ref, o_ref)

    out = run(k, jax.ShapeDtypeStruct((64, 48), jnp.float32), x, y)
    np.testing.assert_allclose(out, x @ y, rtol=1e-5, atol=1e-4)


def test_invariant_input_and_output_bias_and_column_sum():
    x, b = arr(64, 16), arr(1, 16)

    def k(x_ref, b_ref, o_ref, s_ref):
        def body(idx, xb, bb, ob, sb):
            (i,) = idx
            ob[...] = xb[...] + bb[...]
            sb[...] = jnp.where(i == 0, 0.0, sb[...]) + jnp.sum(xb[...], axis=0, keepdims=True)
        cv.emit_pipeline(body, grid=(4,),
                         in_specs=[cv.BlockSpec((16, 16), lambda i: (i, 0)), cv.BlockSpec((1, 16), lambda i: (0, 0))],
                         out_specs=[cv.BlockSpec((16, 16), lambda i: (i, 0)), cv.BlockSpec((1, 16), lambda i: (0, 0))],
                         max_concurrent_steps=2)(x_ref, b_ref, o_ref, s_ref)

    out, colsum = run(k, (jax.ShapeDtypeStruct((64, 16), jnp.float32), jax.ShapeDtypeStruct((1, 16), jnp.float32)), x, b)
    np.testing.assert_allclose(out, x + b, rtol=1e-6)
    np.testing.assert_allclose(colsum, x.sum(0, keepdims=True), rtol=1e-5, atol=1e-5)


def test_3d_grid_with_squeezed_dim_and_carry():
    x = arr(4, 32, 16)

    def k(x_ref, o_ref):
        def body(idx, xb, ob, carry):
            ob[...] = xb[...] * 2
            return carry + jnp.sum(xb[...])
        total = cv.emit_pipeline(body, grid=(4, 2, 2),
                                 in_specs=[cv.BlockSpec((None, 16, 8), lambda b, i, j: (b, i, j))],
                                 out_specs=[cv.BlockSpec((None, 16, 8), lambda b, i, j: (b, i, j))],
                                 init_carry=jnp.float32(0))(x_ref, o_ref)
        o_ref[0, 0, 0] = total  # the final carry comes back

    out = run(k, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    expect = (x * 2).at[0, 0, 0].set(jnp.sum(x))
    np.testing.assert_allclose(out, expect, rtol=1e-5)


def test_bad_input_errors():
    x = arr(30, 8)
    spec = cv.BlockSpec((8, 8), lambda i: (i, 0))

    def not_dividing(x_ref, o_ref):
        cv.emit_pipeline(lambda idx, a, b: None, grid=(4,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

    with pytest.raises(ValueError, match=r"in\[0\]: block_shape \(8, 8\) does not divide the array shape \(30, 8\)"):
        run(not_dividing, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    def wrong_count(x_ref, o_ref):
        cv.emit_pipeline(lambda idx, a, b: None, grid=(4,), in_specs=[spec], out_specs=[spec])(x_ref)

    with pytest.raises(ValueError, match=r"expected 1 input refs and 1 output refs"):
        run(wrong_count, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    with pytest.raises(RuntimeError, match="inside a kernel body"):
        cv.emit_pipeline(lambda idx, a: None, grid=(1,), in_specs=[spec])(x)


def test_unwritten_output_is_poisoned_not_zero():
    x = arr(16, 8)

    def k(x_ref, o_ref):
        def body(idx, xb, ob):
            (i,) = idx
            ob[...] = jnp.where(i == 0, xb[...], ob[...])  # step 1 never writes its block
        spec = cv.BlockSpec((8, 8), lambda i: (i, 0))
        cv.emit_pipeline(body, grid=(2,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

    out = run(k, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    np.testing.assert_array_equal(out[:8], x[:8])
    assert np.isnan(np.asarray(out[8:])).all()
