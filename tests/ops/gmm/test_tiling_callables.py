"""A tiling callable is asked at the call, for every ordering of (m, k, n) the op and its
derivatives take, and reaches the primitives as a hashable table of its answers: their caches
and jaxprs never hold the user's function, and two callables that answer alike trace alike."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv
from conveyor.ops.gmm.tiling import TilingTable

M, K, N, G = 24, 16, 8, 3


def _operands():
    rng = np.random.default_rng(11)
    lhs = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((G, K, N)), jnp.float32)
    return lhs, rhs, jnp.asarray([10, 0, 14], jnp.int32)


def _tiling_params(jaxpr):
    return [e.params["tiling"] for e in jaxpr.eqns if "tiling" in e.params]


def test_the_callable_is_asked_at_the_call_for_every_ordering():
    seen = []

    def tiles(m, k, n):
        seen.append((m, k, n))
        return (8, k, n)

    lhs, rhs, sizes = _operands()
    loss = lambda a, b: jnp.sum(cv.gmm(a, b, sizes, tiling=tiles, backend="xla") ** 2)
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    assert sorted(seen) == sorted(
        {(M, K, N), (M, N, K), (K, M, N), (K, N, M), (N, M, K), (N, K, M)}
    )
    params = _tiling_params(jaxpr)
    assert params and all(isinstance(t, TilingTable) for t in params)
    # the gradient's ops found their shapes in the table: the values are the callable's
    got = jax.grad(loss, argnums=(0, 1))(lhs, rhs)
    want = jax.grad(lambda a, b: jnp.sum(cv.gmm(a, b, sizes, backend="xla") ** 2), (0, 1))(lhs, rhs)
    for g, w in zip(got, want):  # row tiles change which rows go together, not any sum's order
        np.testing.assert_array_equal(g, w)


def test_two_callables_that_answer_alike_trace_alike():
    lhs, rhs, sizes = _operands()
    trace = lambda f: _tiling_params(
        jax.make_jaxpr(lambda a, b: cv.gmm(a, b, sizes, tiling=f, backend="xla"))(lhs, rhs)
    )
    first, second = trace(lambda m, k, n: (8, k, n)), trace(lambda m, k, n: (8, k, n))
    assert first == second and hash(first[0]) == hash(second[0])


def test_a_shape_missing_from_the_table_is_named():
    table = TilingTable((((M, K, N), (8, K, N)),))
    with pytest.raises(ValueError, match=r"an op of shape \(1, 2, 3\) needs one too"):
        table(1, 2, 3)
