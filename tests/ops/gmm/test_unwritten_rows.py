"""cv.gmm(unwritten_rows="unspecified"): rows outside the local groups may hold anything, so the
Mosaic kernels take no existing_out to fill and read back. The groups' rows are held to a
float64 NumPy oracle (tolerance: tests/tolerance.py, k-long float32 sums) on every backend, with
and without lhs_indices; their gradients equal the filled call's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv
from tests.ops.gmm.base import assert_close
from tests.ops.gmm.problems import numpy_gmm

BACKENDS = ("xla", "reference", "mosaic_tpu", "mosaic_gpu")
M, K, N = 70, 136, 128
SIZES = [0, 30, 0, 25]  # rows 55..69 belong to no group


def _kw(backend):
    kw = dict(backend=backend, interpret=backend.startswith("mosaic"))
    if backend == "mosaic_tpu":
        kw["tiling"] = (16, 128, 128)  # partial row, k tiles
    return kw


def _operands(backend, seed):
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if backend == "mosaic_gpu" else jnp.float32  # wgmma's operands
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((len(SIZES), K, N)), dtype)
    return x, w


@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_group_rows_match_the_oracle(backend, gathered):
    x, w = _operands(backend, 3)
    sizes = jnp.asarray(SIZES, jnp.int32)
    idx = jnp.asarray(np.random.default_rng(4).permutation(M), jnp.int32)
    extra = dict(lhs_indices=idx) if gathered else {}
    out = cv.gmm(x, w, sizes, unwritten_rows="unspecified", **extra, **_kw(backend))
    xs = np.asarray(x)[np.asarray(idx)] if gathered else np.asarray(x)
    used = sum(SIZES)
    assert out.shape == (M, N)
    assert_close(out[:used], numpy_gmm(xs, w, SIZES)[:used], K, jnp.float32)


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu"])
def test_gradients_equal_the_filled_calls(backend):
    """A loss over the groups' rows: the same gradients as with zero-filled rows (rows outside
    the groups get none either way)."""
    x, w = _operands(backend, 5)
    sizes = jnp.asarray(SIZES, jnp.int32)
    idx = jnp.asarray(np.random.default_rng(6).permutation(M), jnp.int32)
    ct = jnp.asarray(np.random.default_rng(7).standard_normal((sum(SIZES), N)), jnp.float32)

    def loss(x, w, rows):
        out = cv.gmm(x, w, sizes, lhs_indices=idx, unwritten_rows=rows, **_kw(backend))
        return jnp.vdot(out[: sum(SIZES)], ct)

    got = jax.grad(loss, argnums=(0, 1))(x, w, "unspecified")
    want = jax.grad(loss, argnums=(0, 1))(x, w, "zero")
    for g, h in zip(got, want):
        np.testing.assert_array_equal(g, h)


def test_bad_unwritten_rows_is_refused_by_name():
    x, w = _operands("xla", 0)
    sizes = jnp.asarray(SIZES, jnp.int32)
    with pytest.raises(ValueError, match="unwritten_rows: expected 'zero' or 'unspecified'"):
        cv.gmm(x, w, sizes, unwritten_rows="garbage")
    with pytest.raises(ValueError, match="unwritten_rows: 'unspecified' leaves the rows"):
        cv.gmm(x, w, sizes, unwritten_rows="unspecified", existing_out=jnp.zeros((M, N)))


def _pallas_calls(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for value in eqn.params.values():  # nested jaxprs (jit, cond, ...)
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's
                if hasattr(sub, "eqns"):
                    yield from _pallas_calls(sub)


@pytest.mark.parametrize("gathered", [False, True])
def test_tpu_kernels_take_no_existing_out_when_unspecified(gathered):
    """The kernels as traced for a TPU (not lowered: the gathered kernel's lowering needs a TPU
    named): with unwritten_rows="unspecified" the pallas_call has no existing_out operand to
    alias to its output."""
    from conveyor.ops.gmm import backend_impls

    bf16 = jnp.bfloat16
    x, w = jnp.zeros((256, 256), bf16), jnp.zeros((4, 256, 256), bf16)
    sizes, idx = jnp.full((4,), 64, jnp.int32), jnp.arange(256, dtype=jnp.int32)
    for rows in ("zero", "unspecified"):
        run = backend_impls.run_gathered_gmm if gathered else backend_impls.run_gmm
        extra = (idx,) if gathered else ()
        params = dict(
            backend="mosaic_tpu",
            tiling=None,
            interpret=None,
            transpose_rhs=False,
            out_dtype=jnp.float32,
            fill_unwritten=rows == "zero",
        )
        ex = jnp.zeros((256, 256), jnp.float32)
        jaxpr = jax.make_jaxpr(lambda *a: run(*a, **params))(x, w, sizes, jnp.int32(0), ex, *extra)
        (call,) = list(_pallas_calls(jaxpr.jaxpr))
        aliases = tuple(call.params["input_output_aliases"])
        assert bool(aliases) == (rows == "zero"), (gathered, rows, aliases)


@pytest.mark.parametrize("unique", [False, True])
def test_gathered_lhs_gradient_rows_outside_the_groups_are_zero(unique):
    """The gathered gmm's and gmm_scatter_add's lhs gradients take the per-row product with its
    rows outside the groups unwritten (NaN in the TPU interpreter) and mask them in the gather or
    scatter that reads it: those rows get exactly 0, the others the xla backend's values."""
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(SIZES), K, N)), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    idx = jnp.asarray(rng.permutation(M), jnp.int32)
    used = sum(SIZES)

    def gathered(backend):
        def loss(x, w):
            out = cv.gmm(x, w, sizes, lhs_indices=idx, unique_indices=unique, **_kw(backend))
            return (out[:used] ** 2).sum()

        return jax.grad(loss, argnums=(0, 1))(x, w)

    def scattered(backend):
        def loss(x, w):
            out = cv.gmm_scatter_add(
                x, w, sizes, idx, num_out_rows=M, unique_indices=unique, **_kw(backend)
            )
            return (out**2).sum()

        return jax.grad(loss, argnums=(0, 1))(x, w)

    for op, outside in ((gathered, np.asarray(idx)[used:]), (scattered, np.arange(used, M))):
        got, want = op("mosaic_tpu"), op("xla")
        for g, h in zip(got, want):
            # float32 on both sides, chains of a K-long and an N-long sum
            assert_close(g, h, K + N, jnp.float32)
        np.testing.assert_array_equal(got[0][outside], 0.0)
