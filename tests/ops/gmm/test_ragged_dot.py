"""cv.ragged_dot as a drop-in for jax.lax.ragged_dot: same signature, results and output dtype
on random inputs, and the documented differences (group_offset, negative sizes, out_sharding)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv
from tests.ops.gmm.base import assert_close
from tests.ops.gmm.problems import numpy_gmm, skewed_sizes

M, K, N, G = 96, 40, 24, 5


def operands(seed, dtype=jnp.float32, groups=G, total=M - 7):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((groups, K, N)), dtype)
    sizes = jnp.asarray(skewed_sizes(rng, M, groups, alpha=0.5, total=total), jnp.int32)
    return x, w, sizes


def test_signature_is_lax_ragged_dot_s():
    assert list(inspect.signature(cv.ragged_dot).parameters) == list(
        inspect.signature(jax.lax.ragged_dot).parameters
    )


@pytest.mark.parametrize(
    "lhs_dtype, rhs_dtype, preferred",
    [
        (jnp.float32, jnp.float32, None),
        (jnp.bfloat16, jnp.bfloat16, None),
        (jnp.bfloat16, jnp.float32, None),
        (jnp.bfloat16, jnp.bfloat16, jnp.float32),
        (jnp.float32, jnp.float32, jnp.bfloat16),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_lax_ragged_dot(lhs_dtype, rhs_dtype, preferred, seed):
    x, w, sizes = operands(seed)
    x, w = x.astype(lhs_dtype), w.astype(rhs_dtype)
    ours = jax.jit(lambda *a: cv.ragged_dot(*a, preferred_element_type=preferred))(x, w, sizes)
    theirs = jax.jit(lambda *a: jax.lax.ragged_dot(*a, preferred_element_type=preferred))(
        x, w, sizes
    )
    assert ours.dtype == theirs.dtype
    # Both accumulate the k-long dots in float32 and round once to the output dtype: they differ by
    # summation order plus one rounding each; compared against float64 with the shared bound.
    want = numpy_gmm(x.astype(jnp.float32), w.astype(jnp.float32), np.asarray(sizes))
    assert_close(ours, want, K, ours.dtype)
    assert_close(theirs, want, K, theirs.dtype)


def test_precision_is_accepted_and_bad_values_are_named():
    x, w, sizes = operands(2)
    want = jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST)
    for precision in (None, jax.lax.Precision.DEFAULT, "highest", (jax.lax.Precision.HIGH,) * 2):
        assert_close(cv.ragged_dot(x, w, sizes, precision=precision), want, K, jnp.float32)
    with pytest.raises(ValueError, match="precision"):
        cv.ragged_dot(x, w, sizes, precision="fast-ish")


def test_group_offset_computes_the_local_groups_only():
    x, w, sizes = operands(3)
    local = w[1:3]
    out = jax.jit(lambda x, w, s, o: cv.ragged_dot(x, w, s, group_offset=o))(
        x, local, sizes, jnp.array([1], jnp.int32)
    )
    assert_close(out, numpy_gmm(x, local, np.asarray(sizes), offset=1), K, jnp.float32)


def test_negative_sizes_count_as_zero_under_jit_and_are_refused_when_concrete():
    x, w, _ = operands(4, groups=4)
    sizes = jnp.array([10, -5, 30, 20], jnp.int32)
    out = jax.jit(cv.ragged_dot)(x, w, sizes)
    np.testing.assert_array_equal(out, jax.jit(cv.ragged_dot)(x, w, jnp.maximum(sizes, 0)))
    assert_close(out, numpy_gmm(x, w, [10, 0, 30, 20]), K, jnp.float32)
    with pytest.raises(ValueError, match="group_sizes: expected non-negative"):
        cv.ragged_dot(x, w, sizes)


def test_out_sharding_and_integer_inputs_are_refused_by_name():
    x, w, sizes = operands(5)
    with pytest.raises(ValueError, match="out_sharding"):
        cv.ragged_dot(x, w, sizes, out_sharding=jax.sharding.PartitionSpec())
    with pytest.raises(TypeError, match="lhs"):
        cv.ragged_dot(x.astype(jnp.int8), w.astype(jnp.int8), sizes)


def test_gradients_match_lax_ragged_dot():
    x, w, sizes = operands(6)
    dy = jnp.asarray(np.random.default_rng(7).standard_normal((M, N)), jnp.float32)

    def grads(fn):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(fn(x, w, sizes) * dy), argnums=(0, 1)))(x, w)

    (dx, dw), (rdx, rdw) = grads(cv.ragged_dot), grads(jax.lax.ragged_dot)
    assert_close(dx, rdx, N, jnp.float32)
    assert_close(dw, rdw, M, jnp.float32)
