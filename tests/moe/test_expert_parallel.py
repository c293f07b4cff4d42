"""Expert parallelism on a data x expert mesh (2 x 4 simulated devices): tokens sharded over both
axes, experts over `expert`; forward, gradients and the load-balancing loss against the dense
reference of the whole batch, the capacity rule, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import conveyor as cv
from tests.moe.test_moe_layer import tol

TOKENS, D, F, E = 64, 16, 24, 8
MESH_SHAPE = (2, 4)


def mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(MESH_SHAPE), ("data", "expert"))


def params(seed):
    rng = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), jnp.float32)
    return dict(
        x=jnp.asarray(rng.standard_normal((TOKENS, D)), jnp.float32),
        router_w=n(D, E),
        w_gate=n(E, D, F),
        w_up=n(E, D, F),
        w_down=n(E, F, D),
    )


SPECS = dict(
    x=P(("data", "expert")), router_w=P(), w_gate=P("expert"), w_up=P("expert"), w_down=P("expert")
)


def sharded(top_k, capacity_factor=None, fuse_permutation=True):
    def layer(p):
        y, aux, dropped = cv.moe.moe_ffn_expert_parallel(
            **p,
            top_k=top_k,
            axis_name="expert",
            capacity_factor=capacity_factor,
            loss_axes=("data", "expert"),
            fuse_permutation=fuse_permutation,
        )
        return y, aux, jax.lax.psum(dropped, ("data", "expert"))

    return jax.shard_map(
        layer, mesh=mesh(), in_specs=(SPECS,), out_specs=(P(("data", "expert")), P(), P())
    )


@pytest.mark.parametrize("top_k, fused", [(1, True), (2, True), (3, True), (2, False)])
def test_forward_and_loss_match_the_dense_reference_of_the_whole_batch(top_k, fused):
    """Received rows moved into expert order and back by the grouped matmuls, or by XLA."""
    p = params(top_k)
    y, aux, dropped = jax.jit(sharded(top_k, fuse_permutation=fused))(p)
    y_ref, aux_ref = cv.moe.moe_ffn_reference(**p, top_k=top_k)
    assert int(dropped) == 0  # dropless by default
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol(y_ref, D + F))
    np.testing.assert_allclose(aux, aux_ref, rtol=1e-5)


@pytest.mark.parametrize("capacity_factor", [None, MESH_SHAPE[1]])
def test_gradients_match_the_dense_reference(capacity_factor):
    """Both exchanges: the exact one (dropless) and the capacity one with room for every row."""
    p = params(7)
    ct = jnp.asarray(np.random.default_rng(8).standard_normal((TOKENS, D)), jnp.float32)
    layer = sharded(2, capacity_factor)

    def ep_loss(p):
        y, aux, _ = layer(p)
        return jnp.vdot(y, ct) + 0.1 * aux

    def ref_loss(p):
        y, aux = cv.moe.moe_ffn_reference(**p, top_k=2)
        return jnp.vdot(y, ct) + 0.1 * aux

    got, want = jax.jit(jax.grad(ep_loss))(p), jax.jit(jax.grad(ref_loss))(p)
    for name in p:
        np.testing.assert_allclose(
            got[name], want[name], rtol=0, atol=tol(want[name], 2 * (D + F) + TOKENS), err_msg=name
        )
        assert np.abs(np.asarray(got[name])).max() > 0, name


def test_capacity_drops_are_counted_and_contribute_zero():
    """A capacity of 1 row per destination: most assignments are dropped, the count says so, and
    the tokens that lost assignments get different rows than the dropless run."""
    p = params(9)
    y_full, _, none = jax.jit(sharded(2))(p)
    y_cut, _, dropped = jax.jit(sharded(2, capacity_factor=0.01))(p)
    assert int(none) == 0
    local_assignments = TOKENS // 8 * 2  # 8 tokens per device, top_k=2
    # one row per destination: each device keeps at most one assignment per expert-axis device
    assert int(dropped) >= 8 * (local_assignments - MESH_SHAPE[1])
    changed = np.abs(np.asarray(y_cut) - np.asarray(y_full)).max(axis=1) > 1e-6
    assert changed.sum() >= 1  # dropped assignments change their tokens' rows


def test_capacity_factor_and_axis_errors_are_named():
    p = params(10)
    with pytest.raises(
        ValueError, match="capacity_factor: expected None \\(dropless\\) or a number > 0, got -1"
    ):
        jax.jit(sharded(2, capacity_factor=-1))(p)
    bad_axis = jax.shard_map(
        lambda p: cv.moe.moe_ffn_expert_parallel(**p, top_k=2, axis_name="experts")[0],
        mesh=mesh(),
        in_specs=(SPECS,),
        out_specs=P(("data", "expert")),
    )
    with pytest.raises(ValueError, match="axis_name: 'experts' is not an axis"):
        jax.jit(bad_axis)(p)
    uneven = dict(SPECS, w_gate=P(), w_up=P(), w_down=P())  # every device holding all 8 experts
    wrong = jax.shard_map(
        lambda p: cv.moe.moe_ffn_expert_parallel(**p, top_k=2, axis_name="expert")[0],
        mesh=mesh(),
        in_specs=(uneven,),
        out_specs=P(("data", "expert")),
    )
    with pytest.raises(ValueError, match="w_gate: expected num_experts / expert size = 8 / 4"):
        jax.jit(wrong)(p)
