"""A grouped matmul of no rows runs no kernel (the TPU and GPU kernels need a row tile): every
backend gives the reference's result, an empty output, existing_out, or zeros."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv

BACKENDS = ("xla", "reference", "mosaic_tpu", "mosaic_gpu")
K = N = 128
bf16 = jnp.bfloat16


def _kw(backend):
    return dict(backend=backend, interpret=backend.startswith("mosaic"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_rows_gives_the_defined_empty_results(backend):
    sizes = jnp.zeros((2,), jnp.int32)
    kw = _kw(backend)
    w = jnp.ones((2, K, N), bf16)
    out = cv.gmm(jnp.zeros((0, K), bf16), w, sizes, **kw)
    assert out.shape == (0, N)
    t = cv.tgmm(jnp.zeros((K, 0), bf16), jnp.zeros((0, N), bf16), sizes, **kw)
    np.testing.assert_array_equal(t, np.zeros((2, K, N)))
    sentinel = jnp.full((2, K, N), 3.5, jnp.float32)
    t = cv.tgmm(
        jnp.zeros((K, 0), bf16), jnp.zeros((0, N), bf16), sizes, existing_out=sentinel, **kw
    )
    np.testing.assert_array_equal(t, sentinel)
    none = jnp.zeros((0,), jnp.int32)
    gathered = cv.gmm(jnp.ones((5, K), bf16), w, sizes, lhs_indices=none, **kw)
    assert gathered.shape == (0, N)
    scattered = cv.gmm_scatter_add(jnp.zeros((0, K), bf16), w, sizes, none, num_out_rows=4, **kw)
    np.testing.assert_array_equal(scattered, np.zeros((4, N)))


@pytest.mark.parametrize("backend", ["mosaic_tpu", "mosaic_gpu"])
def test_no_rows_differentiates(backend):
    sizes = jnp.zeros((2,), jnp.int32)

    def loss(w, x):
        return cv.gmm(x, w, sizes, lhs_indices=jnp.zeros((0,), jnp.int32), **_kw(backend)).sum()

    dw, dx = jax.grad(loss, argnums=(0, 1))(jnp.ones((2, K, N), bf16), jnp.ones((5, K), bf16))
    np.testing.assert_array_equal(dw, np.zeros((2, K, N)))
    np.testing.assert_array_equal(dx, np.zeros((5, K)))
