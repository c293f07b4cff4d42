"""gmm/tgmm XLA backend (the CPU default) against the reference."""
import jax.numpy as jnp
import numpy as np

from tests.ops.gmm.base import GmmBackendTests, assert_close
from tests.ops.gmm.problems import numpy_gmm, numpy_tgmm, operands, skewed_sizes

import conveyor as cv


class TestXla(GmmBackendTests):
    backend = "xla"

    def test_many_groups(self):
        """G=256 with many empty groups, m not a multiple of anything."""
        rng = np.random.default_rng(20)
        m, k, n, g = 301, 16, 8, 256
        sizes = skewed_sizes(rng, m, g, alpha=0.3)
        lhs, rhs = operands(rng, m, k, n, g, jnp.float32)
        out = cv.gmm(lhs, rhs, jnp.asarray(sizes))
        assert_close(out, numpy_gmm(lhs, rhs, sizes), k, jnp.float32)
        t = cv.tgmm(lhs.T, out, jnp.asarray(sizes))
        assert_close(t, numpy_tgmm(lhs.T, out, sizes), m, jnp.float32)

    def test_default_backend_on_cpu_is_xla(self):
        rng = np.random.default_rng(21)
        lhs, rhs = operands(rng, 9, 4, 3, 2, jnp.float32)
        sizes = jnp.asarray([4, 5], jnp.int32)
        np.testing.assert_array_equal(cv.gmm(lhs, rhs, sizes), cv.gmm(lhs, rhs, sizes, backend="xla"))

    def test_tiny_m_smaller_than_remainder_tile(self):
        rng = np.random.default_rng(22)
        lhs, rhs = operands(rng, 3, 5, 2, 2, jnp.float32)
        sizes = np.array([1, 1], np.int32)
        out = cv.gmm(lhs, rhs, jnp.asarray(sizes))
        assert_close(out, numpy_gmm(lhs, rhs, sizes), 5, jnp.float32)
        np.testing.assert_array_equal(out[2], 0.0)
