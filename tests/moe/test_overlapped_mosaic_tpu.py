"""The overlapped exchange as one Mosaic TPU kernel (`overlap="peers"`, backend="mosaic_tpu"):
through the TPU interpreter on simulated devices with its race detector on, against the dense
reference, forward and gradients, in both DMA execution modes (a race can hide in one of them)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from conveyor.moe import expert_parallel
from conveyor.moe.mosaic_tpu import ExpertTiles
from conveyor.pipeline.lowering import record_issued
from conveyor.plans.exchange import ExchangeOperation, exchange_plan
from tests.moe.test_moe_layer import tol
from tests.moe.test_overlapped import (
    assert_gradients_match_the_reference,
    primitive_calls,
    sharded,
)

TOKENS_PER_DEVICE, D, F = 8, 128, 256  # the kernel tiles d and f in 128-lane blocks


def params(devices, seed, experts_per_device=2, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    e = devices * experts_per_device
    n = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2]), dtype)  # noqa: E731
    return dict(
        x=jnp.asarray(rng.standard_normal((devices * TOKENS_PER_DEVICE, D)), dtype),
        router_w=n(D, e).astype(jnp.float32),
        w_gate=n(e, D, F),
        w_up=n(e, D, F),
        w_down=n(e, F, D),
    )


def kernel_layer(devices, top_k, mode):
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    return sharded(devices, top_k, "peers", backend="mosaic_tpu", interpret=ip)


@pytest.mark.parametrize(
    "devices, top_k, mode",
    # 6 devices: two streams, 3 peers from the left and 2 from the right, through two slots each
    # (reused); both DMA modes, a different top-k each; one device, the local chunk alone, is the
    # gradient test's forward pass (other device counts run the same plan in
    # tests/moe/test_overlapped.py)
    [(6, 2, "on_wait"), (6, 3, "eager")],
)
def test_forward_matches_the_dense_reference_and_the_plan(devices, top_k, mode):
    """Conformance too: per device, the operations the kernel reports while the interpreter runs it
    (`record_issued`) are the plan's `operation_records()`, as many times each (the callbacks are
    unordered)."""
    p = params(devices, seed=devices)
    with record_issued() as log:
        y, aux, dropped = jax.jit(kernel_layer(devices, top_k, mode))(p)
        jax.effects_barrier()
    got = collections.Counter(r for r in log if isinstance(r, ExchangeOperation))
    want = collections.Counter(
        {
            r: n * devices
            for r, n in collections.Counter(
                exchange_plan(num_devices=devices).operation_records()
            ).items()
        }
    )
    assert got == want, (sorted(map(str, got - want)), sorted(map(str, want - got)))
    if devices >= 6:  # 3 and 2 peers a stream through 2 slots: slots are reused
        assert {r.operation for r in want} >= {"grant", "await_return"}
    y_ref, aux_ref = cv.moe.moe_ffn_reference(**p, top_k=top_k)
    assert int(dropped) == 0
    # each output row: top_k results of a d -> f -> d SwiGLU, summed in float32
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol(y_ref, D + F))
    np.testing.assert_allclose(aux, aux_ref, rtol=1e-5)


def test_gradients_match_the_dense_reference():
    """Forward in the kernel, backward through the exact exchange's VJP (its forward recomputed
    in XLA), on two devices: a peer's rows travel both ways."""
    devices, top_k = 2, 2
    p = params(devices, seed=13)

    layer = kernel_layer(devices, top_k, "on_wait")
    assert_gradients_match_the_reference(layer, p, top_k, depth=D + F)


def test_each_weights_gradient_is_one_tgmm_not_one_per_peer():
    """The backward pass is the exact exchange's: the experts run once over every received row, so
    each of the three weights' gradients is one gathered tgmm (the per-peer plan's VJP ran one per
    peer, each into a zero-filled weight-sized start, then summed them in XLA)."""
    devices = 4
    p = params(devices, seed=3)
    layer = kernel_layer(devices, 2, "on_wait")
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.sum(layer(p)[0])))(p)
    calls = primitive_calls(jaxpr.jaxpr)
    assert calls["conveyor_gathered_tgmm"] == 3, calls
    assert calls["pallas_call"] == 1  # the forward: the exchange kernel


def test_shapes_the_kernel_cannot_tile_are_refused_by_name():
    p = params(2, seed=0)
    narrow = dict(p, w_gate=p["w_gate"][..., :200], w_up=p["w_up"][..., :200])
    narrow["w_down"] = p["w_down"][:, :200]
    with pytest.raises(NotImplementedError, match=r"f \(the experts' hidden size\).*got 200"):
        jax.jit(kernel_layer(2, 1, "on_wait"))(narrow)
    mixed = dict(p, w_down=p["w_down"].astype(jnp.bfloat16))
    with pytest.raises(NotImplementedError, match=r"w_down: .* x's dtype \(float32\).*bfloat16"):
        jax.jit(kernel_layer(2, 1, "on_wait"))(mixed)


def test_tiles_follow_the_gmm_defaults_and_count_what_libtpu_holds():
    """`tiling.tpu_default` over a chunk of balanced routing; VMEM counted as libtpu 0.0.50.1
    reported it for the bf16 kernel on v5e (Mixtral 12.49 MiB; DeepSeek-like 10.15 MiB at 128
    rows a group, 12.49 at 512: docs/internals/moe.md), never under it."""
    mixtral = ExpertTiles.for_layer(rows=512, groups=1, d=4096, f=14336)
    assert (mixtral.tm, mixtral.d_block, mixtral.f_block) == (256, 1024, 1024)
    assert mixtral.vmem(jnp.bfloat16) == 12.5 * 2**20
    deepseek = ExpertTiles.for_layer(rows=2048, groups=16, d=7168, f=2048)
    assert (deepseek.tm, deepseek.d_block, deepseek.f_block) == (128, 1024, 1024)
    assert deepseek.vmem(jnp.bfloat16) == 10.25 * 2**20
    small = ExpertTiles.for_layer(rows=16, groups=2, d=384, f=256)
    assert (small.tm, small.d_block, small.f_block) == (128, 128, 256)


@pytest.mark.parametrize("overlap", [None, "experts"])
def test_row_kernels_leave_padding_rows_unwritten_and_unread(monkeypatch, overlap):
    """The exact and the expert-staged layers with the row-moving gmm kernels (mosaic_tpu, through
    the interpreter, which fills memory no one wrote with NaN): the results' padding rows are not
    zero-filled (`unwritten_rows="unspecified"`) and nothing reads them, so the output matches the
    dense reference; the receive buffers are sized for the worst case, so padding exists, and
    the exact exchange's starts unfilled (`exchange.unfilled`, NaN here): the kernels' gathers
    read its padding rows into partial tiles and must mask them."""
    nan_filled = lambda shape, dtype: jnp.full(shape, jnp.nan, dtype)  # noqa: E731
    monkeypatch.setattr(expert_parallel, "unfilled", nan_filled)
    devices, top_k = 2, 2
    p = params(devices, seed=17)
    layer = sharded(devices, top_k, overlap, backend="mosaic_tpu", interpret=True)
    y, aux, dropped = jax.jit(layer)(p)
    y_ref, _ = cv.moe.moe_ffn_reference(**p, top_k=top_k)
    assert int(dropped) == 0
    assert np.isfinite(np.asarray(y)).all()
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol(y_ref, D + F))


def test_row_kernels_gradients_never_read_padding_rows():
    """The exact layer's training step with the row-moving gmm kernels (mosaic_tpu, through the
    interpreter: memory no one wrote is NaN): the projections leave the padding rows of their
    outputs unwritten (`unwritten_rows="unspecified"`), and the backward pass multiplies them by
    zero cotangents in the SiLU product's derivative (NaN there); the gradient kernels mask rows
    outside the groups, so every gradient is finite and matches the dense reference's."""
    devices, top_k = 2, 2
    p = params(devices, seed=23)
    tokens = p["x"].shape[0]
    ct = jnp.asarray(np.random.default_rng(24).standard_normal((tokens, D)), jnp.float32)
    layer = sharded(devices, top_k, None, backend="mosaic_tpu", interpret=True)

    def loss(p):
        return jnp.vdot(layer(p)[0], ct)

    def ref_loss(p):
        return jnp.vdot(cv.moe.moe_ffn_reference(**p, top_k=top_k)[0], ct)

    got, want = jax.jit(jax.grad(loss))(p), jax.jit(jax.grad(ref_loss))(p)
    for name in ("x", "w_gate", "w_up", "w_down"):
        assert np.isfinite(np.asarray(got[name])).all(), name
        np.testing.assert_allclose(
            got[name], want[name], rtol=0, atol=tol(want[name], 2 * (D + F) + tokens), err_msg=name
        )
