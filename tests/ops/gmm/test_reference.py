"""The reference itself, against an independent float64 NumPy loop (x64 enabled)."""

import jax
import jax.numpy as jnp
import numpy as np

import conveyor as cv
from tests.ops.gmm.problems import numpy_gmm, numpy_tgmm, skewed_sizes


def test_reference_float64_matches_numpy_exactly_enough():
    with jax.enable_x64(True):
        rng = np.random.default_rng(30)
        m, k, n, g = 37, 11, 6, 4
        sizes = skewed_sizes(rng, m, g, total=30)
        lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float64)
        rhs = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float64)
        out = cv.gmm(
            lhs, rhs, jnp.asarray(sizes), backend="reference", preferred_element_type=jnp.float64
        )
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, numpy_gmm(lhs, rhs, sizes), rtol=1e-13, atol=1e-13)
        t = cv.tgmm(
            lhs.T, out, jnp.asarray(sizes), backend="reference", preferred_element_type=jnp.float64
        )
        np.testing.assert_allclose(t, numpy_tgmm(lhs.T, out, sizes), rtol=1e-13, atol=1e-12)
        # and the xla backend is float64-capable too
        x = cv.gmm(lhs, rhs, jnp.asarray(sizes), backend="xla", preferred_element_type=jnp.float64)
        np.testing.assert_allclose(x, numpy_gmm(lhs, rhs, sizes), rtol=1e-13, atol=1e-13)
