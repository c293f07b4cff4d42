"""`_compat.layout_keeping_slice_batching`: vmap of dynamic_slice / dynamic_update_slice at
unbatched starts stays the same op, batch dimension in place; the values are JAX's own."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from conveyor._compat import layout_keeping_slice_batching

SHAPE = (6, 5, 7)  # one example's operand; batched below along some axis with 3 examples


def _primitives(fn, *args):
    return {e.primitive.name for e in jax.make_jaxpr(fn)(*args).eqns}


def _batched(rng, shape, axis):
    return jnp.asarray(np.moveaxis(rng.integers(-9, 10, (3, *shape)), 0, axis), jnp.float32)


@pytest.mark.parametrize("operand_axis", [0, 1, 3])
@pytest.mark.parametrize("starts_batched", [False, True])
def test_dynamic_slice(operand_axis, starts_batched):
    rng = np.random.default_rng()
    x = _batched(rng, SHAPE, operand_axis)
    # Start 4 in a dimension of 5 with size 3 is clamped to 2: the rule must clamp the same way.
    starts = jnp.asarray([[1, 4, 2], [0, 0, 5], [5, 2, 0]] if starts_batched else [[1, 4, 2]] * 3, jnp.int32)

    def f(x, s):
        return lax.dynamic_slice(x, (s[0], s[1], s[2]), (3, 3, 2))
    vm = jax.vmap(f, in_axes=(operand_axis, 0 if starts_batched else None), out_axes=0)
    s_arg = starts if starts_batched else starts[0]
    want = vm(x, s_arg)
    with layout_keeping_slice_batching():
        got = vm(x, s_arg)
        prims = _primitives(vm, x, s_arg)
    np.testing.assert_array_equal(got, want)
    if not starts_batched:
        assert "gather" not in prims and "dynamic_slice" in prims, prims


@pytest.mark.parametrize("operand_axis", [0, 2])
@pytest.mark.parametrize("update_axis", [None, 0, 1])
@pytest.mark.parametrize("starts_batched", [False, True])
def test_dynamic_update_slice(operand_axis, update_axis, starts_batched):
    rng = np.random.default_rng()
    x = _batched(rng, SHAPE, operand_axis)
    u = (jnp.asarray(rng.integers(-9, 10, (3, 4, 2)), jnp.float32) if update_axis is None
         else _batched(rng, (3, 4, 2), update_axis))
    starts = jnp.asarray([[4, 3, 6], [0, 1, 0], [2, 0, 3]] if starts_batched else [[4, 3, 6]] * 3, jnp.int32)

    def f(x, u, s):
        return lax.dynamic_update_slice(x, u, (s[0], s[1], s[2]))  # clamped: 4 -> 3, 3 -> 1, 6 -> 5
    vm = jax.vmap(f, in_axes=(operand_axis, update_axis, 0 if starts_batched else None), out_axes=operand_axis)
    s_arg = starts if starts_batched else starts[0]
    want = vm(x, u, s_arg)
    with layout_keeping_slice_batching():
        got = vm(x, u, s_arg)
        prims = _primitives(vm, x, u, s_arg)
    np.testing.assert_array_equal(got, want)
    if not starts_batched:
        assert "scatter" not in prims and "dynamic_update_slice" in prims, prims
        if update_axis in (None, operand_axis):
            assert "transpose" not in prims, prims  # the operand keeps its layout


def test_nested_use_and_restore():
    x = jnp.arange(12.0).reshape(3, 4)

    def fresh():  # a new function each time: JAX caches traces by function
        return jax.vmap(lambda r: lax.dynamic_slice(r, (1,), (2,)))
    with layout_keeping_slice_batching():
        with layout_keeping_slice_batching():
            assert "gather" not in _primitives(fresh(), x)
        assert "gather" not in _primitives(fresh(), x)   # still active after the inner block
    assert "gather" in _primitives(fresh(), x)           # JAX's own rule again
