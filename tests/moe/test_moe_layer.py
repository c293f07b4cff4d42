"""cv.moe.moe_ffn against its dense reference (every token through every expert, masked by the
router): forward, gradients of every argument, the load-balancing loss, shard_map data
parallelism, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import conveyor as cv
from tests.tolerance import sum_tolerance

TOKENS, D, F, E = 48, 16, 24, 6


def params(seed, experts=E, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    n = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 1 else 1), dtype)
    return dict(
        x=jnp.asarray(rng.standard_normal((TOKENS, D)), dtype),
        router_w=n(D, experts),
        w_gate=n(experts, D, F),
        w_up=n(experts, D, F),
        w_down=n(experts, F, D),
    )


def tol(reference, depth):
    """f32 chains of three dots (lengths D, F and the k gates), both sides f32 with different
    summation orders (tests/tolerance.py), scaled by the largest value (at least 1)."""
    return sum_tolerance(depth, max(1.0, float(np.abs(reference).max())))


@pytest.mark.parametrize(
    "top_k, seed, fused",
    [(1, 0, True), (2, 0, True), (6, 0, True), (1, 1, True), (2, 1, True), (6, 1, True)]
    + [(2, 0, False), (6, 1, False)],
)
def test_forward_matches_dense_reference(top_k, seed, fused):
    """Both token paths: moved by the grouped matmuls (the default, every case) or by XLA around
    them (two cases: the same gmm calls, only the gather and scatter differ)."""
    p = params(seed)
    y, aux = jax.jit(lambda p: cv.moe.moe_ffn(**p, top_k=top_k, fuse_permutation=fused))(p)
    y_ref, aux_ref = cv.moe.moe_ffn_reference(**p, top_k=top_k)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol(y_ref, D + F))
    # (the routing and the loss are shared code: checked against hand values below)
    np.testing.assert_allclose(aux, aux_ref, rtol=1e-6)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_gradients_of_every_argument_match_dense_reference(fused):
    p = params(2)
    ct = jnp.asarray(np.random.default_rng(3).standard_normal((TOKENS, D)), jnp.float32)

    def loss(fn, **kw):
        def f(p):
            y, aux = fn(**p, top_k=2, **kw)
            return jnp.vdot(y, ct) + 0.1 * aux

        return jax.jit(jax.grad(f))

    got = loss(cv.moe.moe_ffn, fuse_permutation=fused)(p)
    want = loss(cv.moe.moe_ffn_reference)(p)
    for name in p:
        np.testing.assert_allclose(
            got[name], want[name], rtol=0, atol=tol(want[name], 2 * (D + F) + TOKENS), err_msg=name
        )
        # a gradient that vanished would pass trivially
        assert np.abs(np.asarray(got[name])).max() > 0, name


def test_load_balancing_loss_is_one_when_balanced_and_grows_with_imbalance():
    experts = jnp.arange(8, dtype=jnp.int32).reshape(8, 1) % 4
    uniform = cv.moe.Routing(experts, jnp.ones((8, 1)), jnp.full((8, 4), 0.25))
    assert float(cv.moe.load_balancing_loss(uniform)) == pytest.approx(1.0)
    skewed = cv.moe.Routing(
        jnp.zeros((8, 1), jnp.int32),
        jnp.ones((8, 1)),
        jnp.tile(jnp.asarray([[0.7, 0.1, 0.1, 0.1]]), (8, 1)),
    )
    assert float(cv.moe.load_balancing_loss(skewed)) == pytest.approx(4 * 0.7)


def test_gates_are_renormalised_over_the_chosen_experts():
    p = params(4)
    r = cv.moe.route(p["x"], p["router_w"], top_k=3)
    np.testing.assert_allclose(jnp.sum(r.gates, axis=-1), 1.0, rtol=1e-6)
    chosen = jnp.take_along_axis(r.probs, r.experts, axis=1)
    np.testing.assert_allclose(r.gates, chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)


def test_data_parallel_inside_shard_map():
    """Tokens sharded over 4 devices, experts replicated: each device runs the layer on its
    tokens (check_vma on); the result equals the unsharded layer's rows."""
    p = params(5)
    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    specs = dict(x=P("dp"), router_w=P(), w_gate=P(), w_up=P(), w_down=P())
    run = jax.jit(
        jax.shard_map(
            lambda p: cv.moe.moe_ffn(**p, top_k=2)[0],
            mesh=mesh,
            in_specs=(specs,),
            out_specs=P("dp"),
        )
    )
    y = run(p)
    y_ref, _ = cv.moe.moe_ffn_reference(**p, top_k=2)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol(y_ref, D + F))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(top_k=0), "top_k: expected an int in \\[1, num_experts=6\\], got 0"),
        (dict(top_k=7), "top_k: expected an int in \\[1, num_experts=6\\], got 7"),
        (dict(top_k=2.0), "top_k"),
        (dict(w_up=jnp.zeros((E, D, F + 1))), "w_up: expected shape \\(6, 16, 24\\)"),
        (dict(router_w=jnp.zeros((D + 1, E))), "router_w: expected shape \\(16, 6\\)"),
        (dict(x=jnp.zeros((TOKENS,))), "x: expected a 2-d array"),
    ],
)
def test_bad_input_is_named(change, match):
    args = dict(params(6), top_k=2)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        cv.moe.moe_ffn(**args)
    with pytest.raises(TypeError, match="fuse_permutation: expected a bool, got 'yes'"):
        cv.moe.moe_ffn(**dict(params(6), top_k=2), fuse_permutation="yes")
