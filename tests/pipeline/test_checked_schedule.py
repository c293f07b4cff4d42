"""The xla executor's checked mode follows the plan's slots and fetch schedule; the fast path gives
the same values; and a planted schedule bug fails the checked mode in milliseconds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import conveyor as cv
from conveyor.plans.pipeline import PipelinePlan

B = (8, 128)


def _matmul_like(mcs, delay, no_pipelining=False, buffered=None, checked=None):
    """out[i] = sum_k x[i, k] * w[k] + bias: a revisited output (reduction over k), a cycling input
    (x), one with its own buffer count (w, when `buffered`) and an index-invariant one (bias)."""
    x_spec = cv.BlockSpec(B, lambda i, k: (i, k))
    w_spec = (
        pl.BlockSpec(B, lambda i, k: (k, 0), pipeline_mode=pl.Buffered(buffered))
        if buffered
        else cv.BlockSpec(B, lambda i, k: (k, 0))
    )
    bias_spec = cv.BlockSpec(B, lambda i, k: (0, 0))

    def body(idx, xb, wb, bb, ob):
        @pl.when(idx[1] == 0)
        def _():
            ob[...] = bb[...]

        ob[...] += xb[...] * wb[...]

    def kernel(x, w, bias, o):
        cv.emit_pipeline(
            body,
            grid=(3, 4),
            in_specs=[x_spec, w_spec, bias_spec],
            out_specs=[cv.BlockSpec(B, lambda i, k: (i, 0))],
            max_concurrent_steps=mcs,
            delay_release=delay,
            no_pipelining=no_pipelining,
        )(x, w, bias, o)

    return cv.kernel(
        kernel, jax.ShapeDtypeStruct((3 * B[0], B[1]), jnp.float32), backend="xla", checked=checked
    )


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((3 * B[0], 4 * B[1])).astype(np.float32)
    w = rng.standard_normal((4 * B[0], B[1])).astype(np.float32)
    bias = rng.standard_normal(B).astype(np.float32)
    return x, w, bias


def _reference(x, w, bias):
    # float64: the kernel adds 4 products per element in f32; 1e-5 covers that rounding.
    x, w, bias = (np.asarray(a, np.float64) for a in (x, w, bias))
    out = np.zeros((3 * B[0], B[1]))
    for i in range(3):
        out[i * 8 : (i + 1) * 8] = bias + sum(
            x[i * 8 : (i + 1) * 8, k * 128 : (k + 1) * 128] * w[k * 8 : (k + 1) * 8]
            for k in range(4)
        )
    return out


CONFIGS = [
    dict(mcs=1, delay=0),
    dict(mcs=2, delay=0),
    dict(mcs=3, delay=1),
    dict(mcs=4, delay=2),
    dict(mcs=1, delay=0, no_pipelining=True),
    dict(mcs=2, delay=0, buffered=3),
    dict(mcs=3, delay=1, buffered=2),
]


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_checked_and_fast_paths_agree_with_the_reference(config):
    x, w, bias = _inputs(sum(map(ord, str(config))))
    want = _reference(x, w, bias)
    with cv.pipeline.checked_schedule():
        checked = jax.jit(_matmul_like(**config))(x, w, bias)
    with cv.pipeline.checked_schedule(False):
        fast = jax.jit(_matmul_like(**config))(x, w, bias)
    np.testing.assert_allclose(checked, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(checked, fast)


def test_a_fetch_one_step_off_gives_wrong_values_in_the_checked_mode_only(monkeypatch):
    x, w, bias = _inputs(7)
    want = _reference(x, w, bias)
    monkeypatch.setattr(
        PipelinePlan, "fetch_step", lambda self, op, s: s + self.input_lookahead(op) + 1
    )
    # the fast path does not use fetch_step: it cannot see the bug
    with cv.pipeline.checked_schedule(False):
        np.testing.assert_allclose(
            jax.jit(_matmul_like(mcs=2, delay=0))(x, w, bias), want, rtol=1e-5, atol=1e-5
        )
    with cv.pipeline.checked_schedule():
        got = np.asarray(jax.jit(_matmul_like(mcs=2, delay=0))(x, w, bias))
    assert not np.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_the_mode_named_on_the_kernel_wins_over_the_context(monkeypatch):
    """cv.kernel(checked=...) names the executor: with the same planted bug, checked=True fails
    outside any context and checked=False runs the fast path inside checked_schedule()."""
    x, w, bias = _inputs(9)
    want = _reference(x, w, bias)
    monkeypatch.setattr(
        PipelinePlan, "fetch_step", lambda self, op, s: s + self.input_lookahead(op) + 1
    )
    with cv.pipeline.checked_schedule(False):
        got = np.asarray(jax.jit(_matmul_like(mcs=2, delay=0, checked=True))(x, w, bias))
    assert not np.allclose(got, want, rtol=1e-3, atol=1e-3)
    with cv.pipeline.checked_schedule():
        np.testing.assert_allclose(
            jax.jit(_matmul_like(mcs=2, delay=0, checked=False))(x, w, bias),
            want,
            rtol=1e-5,
            atol=1e-5,
        )
    with pytest.raises(
        ValueError, match="checked is the xla backend's mode, got backend='mosaic_tpu'"
    ):
        cv.kernel(
            lambda o: None,
            jax.ShapeDtypeStruct((8, 128), jnp.float32),
            backend="mosaic_tpu",
            checked=True,
        )
    with pytest.raises(TypeError, match="checked must be True, False or None, got 'yes'"):
        cv.kernel(lambda o: None, jax.ShapeDtypeStruct((8, 128), jnp.float32), checked="yes")


def test_a_prologue_one_fetch_short_reads_poison(monkeypatch):
    x, w, bias = _inputs(8)
    full = PipelinePlan.prologue_steps
    # The prologue forgets the last of its fetches: that step's slot still holds poison (NaN).
    monkeypatch.setattr(
        PipelinePlan,
        "prologue_steps",
        lambda self, op: range(len(full(self, op)) - (0 if op.invariant else 1)),
    )
    with cv.pipeline.checked_schedule():
        got = np.asarray(jax.jit(_matmul_like(mcs=3, delay=0))(x, w, bias))
    assert np.isnan(got).any()


def test_checked_schedule_takes_a_bool():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        with cv.pipeline.checked_schedule("yes"):
            pass
