"""The overlapped expert-parallel exchange (`overlap=True`): the plan's steps run by XLA on
simulated devices, against the dense reference of the whole batch, for rings of odd and even size
(one or two streams), forward and gradients; and its plan checked free of races and deadlocks."""

import collections
import re

import jax
import jax.numpy as jnp
from jax.extend import core as jex
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

import conveyor as cv
from conveyor.moe import expert_parallel
from conveyor.moe.exchange import _send_whole, send_exact
from conveyor.plans.exchange import (
    ExchangePlan,
    StagedExchangePlan,
    exchange_plan,
    staged_exchange_plan,
)
from conveyor.sim.check import check
from tests.moe.test_exchange import _lowered_text
from tests.moe.test_moe_layer import tol

TOKENS_PER_DEVICE, D, F = 8, 16, 24


def params(devices, seed, experts_per_device=2):
    rng = np.random.default_rng(seed)
    e = devices * experts_per_device
    n = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), jnp.float32)
    return dict(
        x=jnp.asarray(rng.standard_normal((devices * TOKENS_PER_DEVICE, D)), jnp.float32),
        router_w=n(D, e),
        w_gate=n(e, D, F),
        w_up=n(e, D, F),
        w_down=n(e, F, D),
    )


def sharded(devices, top_k, overlap="peers", **options):
    mesh = Mesh(np.array(jax.devices()[:devices]), ("expert",))
    specs = dict(
        x=P("expert"), router_w=P(), w_gate=P("expert"), w_up=P("expert"), w_down=P("expert")
    )

    def layer(p):
        y, aux, dropped = cv.moe.moe_ffn_expert_parallel(
            **p, top_k=top_k, axis_name="expert", overlap=overlap, **options
        )
        return y, aux, jax.lax.psum(dropped, "expert")

    return jax.shard_map(layer, mesh=mesh, in_specs=(specs,), out_specs=(P("expert"), P(), P()))


@pytest.mark.parametrize(
    "overlap, devices, top_k, fused",
    [
        ("peers", 8, 2, True),
        ("peers", 3, 3, True),
        ("peers", 2, 1, False),
        ("experts", 8, 2, True),
        ("experts", 3, 3, False),
        ("peers", 1, 2, True),
        ("experts", 1, 2, True),
    ],
)
def test_forward_matches_the_dense_reference(overlap, devices, top_k, fused):
    """peers: 8 devices, two streams, 4 peers from the left and 3 from the right; 3: one peer
    each way; 2: one stream. experts: 2 stages (local experts) of every peer at once. 1 device:
    no exchange, the local chunk only."""
    p = params(devices, seed=devices)
    y, aux, dropped = jax.jit(sharded(devices, top_k, overlap, fuse_permutation=fused))(p)
    y_ref, aux_ref = cv.moe.moe_ffn_reference(**p, top_k=top_k)
    assert int(dropped) == 0
    # each output row: top_k results of a d -> f -> d SwiGLU, summed in float32
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol(y_ref, D + F))
    np.testing.assert_allclose(aux, aux_ref, rtol=1e-5)


@pytest.mark.parametrize("overlap", [None, "experts"])
def test_every_token_to_one_device_fills_its_receive_buffer_exactly(overlap):
    """Every token of every device routes to device 0's two experts (and a third elsewhere,
    top-3): device 0 receives 2 rows a token from each of 3 devices, the most its receive buffer
    holds (`most_received`: min(top_k, local experts) rows a token, not top_k); a stage of the
    expert-staged exchange (one local expert each) receives 1 row a token, its buffer's size."""
    devices, top_k = 3, 3
    p = params(devices, seed=7)
    x = p["x"].at[:, 0].set(10.0)
    router_w = p["router_w"].at[0].set(0.0).at[0, :2].set(5.0)  # experts 0 and 1 on device 0
    p = dict(p, x=x, router_w=router_w)
    assert cv.moe.route(x, router_w, top_k=top_k).experts[:, :2].max() == 1
    y, _, dropped = jax.jit(sharded(devices, top_k, overlap))(p)
    y_ref, _ = cv.moe.moe_ffn_reference(**p, top_k=top_k)
    assert int(dropped) == 0
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol(y_ref, D + F))


@pytest.mark.parametrize("overlap, stages", [("peers", None), ("experts", 2)])
def test_gradients_match_the_dense_reference(overlap, stages):
    """experts: 3 local experts in 2 stages (uneven groups: 2 and 1)."""
    devices, top_k = 4, 2
    p = params(devices, seed=11, experts_per_device=3)
    options = {} if stages is None else dict(overlap_stages=stages)
    assert_gradients_match_the_reference(sharded(devices, top_k, overlap, **options), p, top_k)


def assert_gradients_match_the_reference(layer, p, top_k, depth=D + F):
    """The gradients of sum(sin(y)) + aux through `layer` against the dense reference's; `depth`:
    the d -> f -> d chain's length (forward and backward: twice that, tests/tolerance.py)."""

    def loss(fn):
        def f(p):
            y, aux = fn(p)[:2]
            return jnp.sum(jnp.sin(y)) + aux

        return f

    got = jax.jit(jax.grad(loss(layer)))(p)
    want = jax.grad(loss(lambda p: cv.moe.moe_ffn_reference(**p, top_k=top_k)))(p)
    for name in p:
        np.testing.assert_allclose(
            got[name], want[name], rtol=0, atol=tol(want[name], 2 * depth), err_msg=name
        )


@pytest.mark.parametrize("fused", [True, False])
def test_the_unfilled_receive_buffer_is_written_before_it_is_read(monkeypatch, fused):
    """The exact exchange's receive buffer starts unfilled in forward passes (`exchange.unfilled`:
    no fill pass on TPU and GPU, zeros on CPU); here it starts as NaN, so a padding row that a
    result read would show in the output. 3 devices, top-2: the receive buffer is sized for the
    worst case, so padding exists. Differentiated, the layer zero-fills it (the gradients below
    are taken with NaN still in place for the forward pass)."""
    nan_filled = lambda shape, dtype: jnp.full(shape, jnp.nan, dtype)  # noqa: E731
    monkeypatch.setattr(expert_parallel, "unfilled", nan_filled)
    devices, top_k = 3, 2
    p = params(devices, seed=19)
    layer = sharded(devices, top_k, None, fuse_permutation=fused)
    y = jax.jit(layer)(p)[0]
    y_ref, _ = cv.moe.moe_ffn_reference(**p, top_k=top_k)
    assert np.isfinite(np.asarray(y)).all()
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol(y_ref, D + F))
    assert_gradients_match_the_reference(layer, p, top_k)


def primitive_calls(jaxpr, counts=None) -> collections.Counter:
    """Primitive name -> how many times the program binds it, inside nested programs too."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jex.ClosedJaxpr):
                    primitive_calls(sub.jaxpr, counts)
                elif isinstance(sub, jex.Jaxpr):
                    primitive_calls(sub, counts)
    return counts


def test_the_staged_layer_is_differentiated_as_the_exact_exchange():
    """Its backward pass recomputes the exact exchange (the same function) and runs its VJP: each
    of the three weights' gradients is one gathered tgmm (the plan's own VJP ran one per stage and
    saved every stage's buffers); their values: test_gradients_match_the_dense_reference."""
    devices = 4
    p = params(devices, seed=5)
    layer = sharded(devices, 2, "experts", overlap_stages=2)
    calls = primitive_calls(jax.make_jaxpr(jax.grad(lambda p: jnp.sum(layer(p)[0])))(p).jaxpr)
    assert calls["conveyor_gathered_tgmm"] == 3, calls


def test_forward_mode_through_a_custom_vjp_layer_is_refused():
    """Reverse mode only for the staged layer (and the per-peer TPU kernel): forward mode would
    need the plan's own tangents, which the layer does not define (docs/moe.md)."""
    p = params(2, seed=5)
    layer = sharded(2, 2, "experts")
    tangents = jax.tree.map(jnp.zeros_like, p)
    with pytest.raises(TypeError, match=r"forward-mode autodiff \(jvp\) to a custom_vjp"):
        jax.jit(lambda p: jax.jvp(lambda p: layer(p)[0], (p,), (tangents,)))(p)


@pytest.mark.parametrize("overlap", [None, "peers"])
def test_forward_mode_through_the_other_layers_matches_the_reference(overlap):
    """The exact layer and the per-peer plan on xla keep forward mode: a JVP of the output
    against the dense reference's, random tangents in every parameter."""
    devices, top_k = 2, 2
    p = params(devices, seed=6)
    rng = np.random.default_rng(7)
    tangents = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape), a.dtype), p)
    layer = sharded(devices, top_k, overlap)
    _, got = jax.jit(lambda p, t: jax.jvp(lambda p: layer(p)[0], (p,), (t,)))(p, tangents)
    reference = lambda p: cv.moe.moe_ffn_reference(**p, top_k=top_k)[0]  # noqa: E731
    _, want = jax.jvp(reference, (p,), (tangents,))
    # a tangent is a sum of as many products as the output: the forward chain's tolerance, doubled
    np.testing.assert_allclose(got, want, rtol=0, atol=tol(want, 2 * (D + F)))


def test_overlap_errors_are_named():
    p = params(2, seed=0)
    with pytest.raises(
        ValueError, match=r"overlap: the overlapped exchange is dropless.*capacity_factor=1.5"
    ):
        sharded(2, 1, capacity_factor=1.5)(p)
    with pytest.raises(
        ValueError, match=r"overlap: expected one of \(None, 'peers', 'experts'\), got True"
    ):
        cv.moe.moe_ffn_expert_parallel(**p, top_k=1, axis_name="expert", overlap=True)
    with pytest.raises(
        ValueError,
        match=r"overlap_stages: expected None, or with overlap='experts' an int in \[1, 2\].*got 3",
    ):
        sharded(2, 1, "experts", overlap_stages=3)(p)
    one_each = params(2, seed=0, experts_per_device=1)
    with pytest.raises(
        ValueError, match=r"overlap: 'experts' .* needs at least 2 per device, got 1"
    ):
        sharded(2, 1, "experts")(one_each)


@pytest.mark.parametrize("shift", [1, -2, 3])
def test_the_exact_send_moves_what_the_cpu_send_moves(shift):
    """The TPU/GPU branch (one ragged slice; emulated on CPU) and the CPU branch (a ppermute of the
    whole chunk) agree: the receiver gets the sender's first `size` rows and zeros."""
    devices, rows = 4, 6
    rng = np.random.default_rng(shift % 7)
    sizes = rng.integers(0, rows + 1, devices)
    chunks = rng.standard_normal((devices, rows, 3)).astype(np.float32)
    chunks[np.arange(rows)[None, :] >= sizes[:, None]] = 0  # the senders' padding
    recv = np.roll(sizes, shift)  # device i receives from i - shift
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))

    def run(send):
        def local(c, n, m):
            return send(c[0], n[0], m[0], shift=shift, axis_name="x", devices=devices)[None]

        spec = (P("x"),) * 3
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=P("x")))(
            chunks, jnp.asarray(sizes, jnp.int32), jnp.asarray(recv, jnp.int32)
        )

    want = np.roll(chunks, shift, axis=0)
    np.testing.assert_array_equal(np.asarray(run(_send_whole)), want)
    np.testing.assert_array_equal(np.asarray(run(send_exact)), want)


@pytest.mark.parametrize("overlap, sends", [("peers", 3), ("experts", 2)])
@pytest.mark.parametrize("grad", [False, True])
def test_the_tpu_lowering_sends_only_ragged_slices(overlap, sends, grad):
    """Expert axis of 4 (3 peers, 2 local experts): per peer ("peers") or per stage ("experts"),
    the rows, their expert ids and the results (3 ragged collectives each); backward adds the
    transposes of the rows' and results' (2 each). No dense exchange of rows and no whole-chunk
    ppermute is left."""
    text = _lowered_text("tpu", grad, overlap=overlap)
    assert text.count("custom_call @ragged_all_to_all") == sends * (5 if grad else 3)
    # the only all_to_alls left move offsets (one int per device), which the ragged collective's
    # transpose exchanges
    dense = re.findall(r'"stablehlo.all_to_all"\(.*?\) : \((tensor<[^>]*>)\)', text)
    assert set(dense) <= {"tensor<4xi32>"}, dense
    assert "collective_permute" not in text


@pytest.mark.parametrize("devices", range(1, 10))
@pytest.mark.parametrize("bidirectional", [False, True])
def test_every_device_runs_every_peers_chunk_once(devices, bidirectional):
    plan = exchange_plan(num_devices=devices, bidirectional=bidirectional)
    plan.check_covers_peers()
    # every chunk but the local one is dispatched once and returned once
    records = [r for rs in plan.steps() for r in rs]
    assert sum(r.dispatches for r in records) == devices - 1
    assert sum(r.returns for r in records) == devices - 1


@pytest.mark.parametrize("bidirectional, buffering", [(False, 2), (True, 2), (False, 3)])
def test_the_checker_finds_no_race_or_deadlock(bidirectional, buffering):
    """Exhaustive on 3 devices (2 peers on one stream, or 1 per stream); 5 devices within a
    state and time budget (then random interleavings), to keep the suite fast."""
    plan = exchange_plan(num_devices=3, bidirectional=bidirectional, buffering=buffering)
    report = check(plan)
    assert report.exhaustive and not report.findings, report
    report = check(
        exchange_plan(num_devices=5, bidirectional=bidirectional, buffering=buffering),
        max_states=2_000,
        max_seconds=1,
    )
    assert not report.findings, report


def test_the_checker_finds_the_planted_bugs():
    """Without credits a sender overwrites a slot still to be read (or its landing is taken for
    another's); with one slot every device waits for a credit nobody can grant yet."""
    no_credits = check(
        ExchangePlan(num_devices=4, bidirectional=False, buffering=2),
        credits=False,
        max_states=5_000,
    )
    assert [f.kind for f in no_credits.findings][:1] == ["race"], no_credits
    one_slot = check(
        ExchangePlan(num_devices=4, bidirectional=False, buffering=1), max_states=5_000
    )
    assert one_slot.findings and one_slot.findings[0].kind == "deadlock", one_slot
    assert "waits a credit from dev" in one_slot.findings[0].message


def test_exchange_plan_errors_are_named():
    with pytest.raises(ValueError, match=r"buffering: the overlapped exchange needs 2 .*got 1"):
        exchange_plan(num_devices=4, buffering=1)
    assert exchange_plan(num_devices=3, buffering=1).buffering == 1  # one peer per stream
    with pytest.raises(ValueError, match=r"num_devices: expected an int >= 1, got 0"):
        exchange_plan(num_devices=0)
    with pytest.raises(ValueError, match=r"buffering: expected an int >= 1, got True"):
        exchange_plan(num_devices=4, buffering=True)


def test_the_staged_plan_is_checked():
    """Exhaustive on 2 devices and 3 stages (a slot reused); 3 devices within a budget; without
    credits a peer overwrites a slot still to be read; with one slot, a deadlock."""
    report = check(staged_exchange_plan(num_devices=2, stages=3))
    assert report.exhaustive and not report.findings, report
    report = check(staged_exchange_plan(num_devices=3, stages=3), max_states=2_000, max_seconds=1)
    assert not report.findings, report
    no_credits = check(StagedExchangePlan(num_devices=2, stages=3, buffering=2), credits=False)
    assert no_credits.findings and no_credits.findings[0].kind == "race", no_credits
    one_slot = check(StagedExchangePlan(num_devices=3, stages=3, buffering=1), max_states=5_000)
    assert one_slot.findings and one_slot.findings[0].kind == "deadlock", one_slot
    with pytest.raises(ValueError, match=r"buffering: the staged exchange needs 2 .*got 1"):
        staged_exchange_plan(num_devices=3, stages=3, buffering=1)
    with pytest.raises(ValueError, match=r"stages: expected an int >= 1, got 0"):
        staged_exchange_plan(num_devices=3, stages=0)


@pytest.mark.parametrize("devices, bidirectional", [(8, True), (5, False), (1, True)])
def test_operation_records_cover_every_peer_once(devices, bidirectional):
    """What the kernel reports (tests/moe/test_overlapped_mosaic_tpu.py holds it to this): one
    experts run per peer's chunk and the local one, one dispatch, receive and return per peer, and
    a slot waited for (its earlier return) exactly when a credit freed it."""
    plan = exchange_plan(num_devices=devices, bidirectional=bidirectional)
    ops = collections.Counter(r.operation for r in plan.operation_records())
    peers = devices - 1
    assert ops["experts"] == devices
    assert ops["dispatch"] == ops["receive"] == ops["return"] == peers
    assert (
        ops["grant"]
        == ops["await_return"]
        == sum(max(0, plan.stream_uses(s) - plan.buffering) for s in plan.directions)
    )
