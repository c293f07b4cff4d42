"""cv.gmm_scatter_add: grouped matmul rows added, weighted, into the output rows they name.

Every backend is held to a float64 NumPy oracle (the plain gmm's product, weighted and summed
into its rows); tolerance: tests/tolerance.py for k-long float32 sums, over the largest partial
sum, with top_k terms added per row. mosaic_tpu adds the rows by DMA in its epilogue and runs
through the Pallas TPU interpreter with race detection on (tests/conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from conveyor.ops.gmm import mosaic_tpu_rows, tiling
from tests.ops.gmm.base import assert_close
from tests.ops.gmm.problems import numpy_gmm, operands
from tests.ops.gmm.test_gathered import routed

BACKENDS = ("xla", "reference", "mosaic_tpu")
TOKENS, TOP_K, GROUPS, K, N = 29, 2, 4, 136, 24
M = TOKENS * TOP_K  # 58 rows: partial 16-row tiles
TILING = (16, 128, 128)


def scatter_add(backend, *args, **kw):
    if backend == "mosaic_tpu":
        kw.setdefault("interpret", True)
        kw.setdefault("tiling", TILING)
    return cv.gmm_scatter_add(*args, backend=backend, **kw)


def oracle(lhs, rhs, sizes, idx, weights, num_rows, transpose_rhs=False, offset=0):
    prod = numpy_gmm(lhs, rhs, sizes, transpose_rhs=transpose_rhs, offset=offset)
    out = np.zeros((num_rows, prod.shape[1]))
    np.add.at(out, np.asarray(idx), np.asarray(weights, np.float64)[:, None] * prod)
    return out


def problem(seed, dtype=jnp.float32, transpose_rhs=False):
    rng = np.random.default_rng(seed)
    idx, sizes = routed(rng, TOKENS, TOP_K, GROUPS)
    lhs, rhs = operands(rng, M, K, N, GROUPS, dtype, transpose_rhs=transpose_rhs)
    weights = jnp.asarray(rng.random(M), jnp.float32)
    return lhs, rhs, sizes, jnp.asarray(idx), weights


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_oracle(backend):
    lhs, rhs, sizes, idx, w = problem(0)
    out = scatter_add(
        backend, lhs, rhs, jnp.asarray(sizes), idx, num_out_rows=TOKENS, row_weights=w
    )
    assert out.shape == (TOKENS, N) and out.dtype == jnp.float32
    assert_close(out, oracle(lhs, rhs, sizes, idx, w, TOKENS), TOP_K * K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_no_group_add_nothing(backend):
    """Rows past the groups (NaN here) add nothing; output rows nobody names are exactly 0."""
    lhs, rhs, sizes, idx, w = problem(1)
    sizes = sizes.copy()
    sizes[-1] -= 6  # the last 6 rows belong to no group
    lhs = lhs.at[M - 6 :].set(jnp.nan)
    num_rows = TOKENS + 3  # three output rows no index names
    out = scatter_add(
        backend, lhs, rhs, jnp.asarray(sizes), idx, num_out_rows=num_rows, row_weights=w
    )
    expect = oracle(lhs[: M - 6], rhs, sizes, idx[: M - 6], w[: M - 6], num_rows)
    assert_close(out, expect, TOP_K * K, jnp.float32)
    np.testing.assert_array_equal(out[TOKENS:], 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_16bit_operands_and_output(backend):
    lhs, rhs, sizes, idx, w = problem(2, dtype=jnp.bfloat16)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        out = scatter_add(
            backend,
            lhs,
            rhs,
            jnp.asarray(sizes),
            idx,
            num_out_rows=TOKENS,
            row_weights=w,
            preferred_element_type=out_dtype,
        )
        assert out.dtype == out_dtype
        assert_close(out, oracle(lhs, rhs, sizes, idx, w, TOKENS), TOP_K * K, out_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transpose_rhs_and_default_weights(backend):
    lhs, rhs, sizes, idx, _ = problem(3, transpose_rhs=True)
    out = scatter_add(
        backend, lhs, rhs, jnp.asarray(sizes), idx, num_out_rows=TOKENS, transpose_rhs=True
    )
    ones = np.ones(M)
    expect = oracle(lhs, rhs, sizes, idx, ones, TOKENS, transpose_rhs=True)
    assert_close(out, expect, TOP_K * K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_offset_shards_sum_to_the_whole(backend):
    """Expert parallelism: each shard adds its own groups' rows; the shards' outputs sum."""
    lhs, rhs, sizes, idx, w = problem(4)
    gs = jnp.asarray(sizes)
    parts = [
        scatter_add(
            backend,
            lhs,
            rhs[lo : lo + 2],
            gs,
            idx,
            num_out_rows=TOKENS,
            row_weights=w,
            group_offset=lo,
        )
        for lo in (0, 2)
    ]
    assert_close(parts[0] + parts[1], oracle(lhs, rhs, sizes, idx, w, TOKENS), 2 * K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeats_within_a_group_are_summed(backend):
    """One group naming an output row several times (not an MoE routing, but allowed): every
    contribution counts. mosaic_tpu notices at run time and takes the unfused path."""
    lhs, rhs, sizes, idx, w = problem(5)
    many = jnp.asarray(np.asarray(idx) % 3)  # rows 0-2 named by many rows of each group
    f = jax.jit(
        lambda i: scatter_add(
            backend, lhs, rhs, jnp.asarray(sizes), i, num_out_rows=TOKENS, row_weights=w
        )
    )
    for i in (many, idx):
        assert_close(f(i), oracle(lhs, rhs, sizes, i, w, TOKENS), M * K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_indices_are_clamped(backend):
    lhs, rhs, sizes, idx, w = problem(6)
    wild = np.asarray(idx).copy()
    wild[[0, 5]] = [-3, 4 * TOKENS]
    f = jax.jit(
        lambda i: scatter_add(
            backend, lhs, rhs, jnp.asarray(sizes), i, num_out_rows=TOKENS, row_weights=w
        )
    )
    expect = oracle(lhs, rhs, sizes, np.clip(wild, 0, TOKENS - 1), w, TOKENS)
    assert_close(f(jnp.asarray(wild)), expect, M * K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_autodiff_of_the_unfused_op(backend):
    """d lhs, d rhs and d row_weights against autodiff of the reference gmm followed by a
    scatter-add, with a local shard of groups (rows of other groups get no gradient)."""
    lhs, rhs, sizes, idx, w = problem(7)
    gs = jnp.asarray(sizes)
    ct = jnp.asarray(np.random.default_rng(8).standard_normal((TOKENS, N)), jnp.float32)

    def loss(l, r, ww):
        out = scatter_add(
            backend, l, r[1:3], gs, idx, num_out_rows=TOKENS, row_weights=ww, group_offset=1
        )
        return jnp.vdot(out, ct)

    def ref_loss(l, r, ww):
        prod = cv.gmm(l, r[1:3], gs, group_offset=1, backend="reference")
        return jnp.vdot(jnp.zeros((TOKENS, N)).at[idx].add(ww[:, None] * prod), ct)

    got = jax.grad(loss, argnums=(0, 1, 2))(lhs, rhs, w)
    want = jax.grad(ref_loss, argnums=(0, 1, 2))(lhs, rhs, w)
    for g, wv in zip(got, want):
        assert_close(g, wv, max(M, K, N) * K, jnp.float32)
    lo = int(sizes[0])
    np.testing.assert_array_equal(got[0][:lo], 0.0)  # group 0 is not local
    assert np.abs(np.asarray(got[2][lo : lo + int(sizes[1])])).min() > 0


# xla only: mosaic_tpu's derivatives are plain gmm/tgmm kernels, and vmap is the same lax.map
# on every backend
@pytest.mark.parametrize("backend", ["xla"])
def test_forward_over_reverse_and_vmap(backend):
    lhs, rhs, sizes, idx, w = problem(9)
    gs = jnp.asarray(sizes)
    tangent = jnp.asarray(np.random.default_rng(10).standard_normal(w.shape), jnp.float32)

    def hvp(run):
        g = jax.grad(lambda ww: jnp.sum(jnp.tanh(run(ww))))
        return jax.jvp(g, (w,), (tangent,))[1]

    run = lambda ww: scatter_add(backend, lhs, rhs, gs, idx, num_out_rows=TOKENS, row_weights=ww)
    ref = lambda ww: scatter_add(
        "reference", lhs, rhs, gs, idx, num_out_rows=TOKENS, row_weights=ww
    )
    assert_close(hvp(run), hvp(ref), M * K * N, jnp.float32)
    both = jnp.stack([w, 2 * w])
    out = jax.vmap(run)(both)
    for b in range(2):
        assert_close(out[b], oracle(lhs, rhs, sizes, idx, both[b], TOKENS), TOP_K * K, jnp.float32)


def unique_problem(seed, spare, dtype=jnp.float32):
    """A problem whose last 6 rows (NaN) belong to no group and whose indices name distinct rows
    of M + spare output rows, with `run(backend, **options)` computing it; `named`: the output
    rows a row of a group names."""
    lhs, rhs, sizes, _, w = problem(seed, dtype=dtype)
    lhs = lhs.at[M - 6 :].set(jnp.nan)
    sizes = sizes.copy()
    sizes[-1] -= 6
    num_rows = M + spare
    idx = jnp.asarray(np.random.default_rng(seed).permutation(num_rows)[:M], jnp.int32)
    named = np.zeros(num_rows, bool)
    named[np.asarray(idx[: M - 6])] = True

    def run(backend, **options):
        return scatter_add(
            backend,
            lhs,
            rhs,
            jnp.asarray(sizes),
            idx,
            num_out_rows=num_rows,
            row_weights=w,
            preferred_element_type=dtype,
            **options,
        )

    return run, (lhs, rhs, sizes, idx, w, num_rows), named


@pytest.mark.parametrize(
    "backend, dtype, spare",
    [(b, jnp.float32, 5) for b in BACKENDS]
    + [("mosaic_tpu", jnp.bfloat16, 5)]
    + [(b, jnp.float32, 0) for b in ("xla", "reference")],
)
def test_unique_indices_store_the_same_rows(backend, dtype, spare, monkeypatch):
    """unique_indices=True (results back to the rows they came from: a permutation of some output
    rows, as cv.moe's experts use it) gives exactly the values of adding into zeros (one float32
    term a row, rounded once to the output dtype), rows past the groups add nothing and rows
    nobody names are 0. mosaic_tpu runs its storing epilogue, race detector on, without the
    run-time check for repeats; 16-bit rows leave it in the output's dtype ([tm, 1, tn] views).
    With no `spare` output rows the indices are a permutation of lhs's rows, which the XLA path
    gathers through its inverse."""
    solve, (lhs, rhs, sizes, idx, w, num_rows), named = unique_problem(14, spare, dtype)
    run = lambda unique: solve(backend, unique_indices=unique)  # noqa: E731
    added = run(False)
    if backend == "mosaic_tpu":  # the kernel alone: no run-time check, no fallback beside it
        from conveyor.ops.gmm import scattered

        def checked(*a):
            raise AssertionError("unique_indices=True still checks for repeats")

        monkeypatch.setattr(scattered, "repeats_within_a_group", checked)
    stored = run(True)
    assert stored.dtype == dtype
    np.testing.assert_array_equal(stored, added)
    expect = oracle(lhs[: M - 6], rhs, sizes, idx[: M - 6], w[: M - 6], num_rows)
    assert_close(stored, expect, K, dtype)
    np.testing.assert_array_equal(np.asarray(stored)[~named], 0.0)


def test_unwritten_rows_unspecified_spares_mosaic_tpu_the_zero_fill():
    """unwritten_rows="unspecified": the named rows as with "zero"; mosaic_tpu's output is no
    longer a zero-filled buffer, so the rows nobody names hold what the interpreter fills
    unwritten memory with (NaN); the other backends may keep them 0."""
    solve, _, named = unique_problem(16, 2)
    run = lambda backend, rows: solve(backend, unique_indices=True, unwritten_rows=rows)  # noqa: E731
    for backend in BACKENDS:
        zero, unspecified = run(backend, "zero"), run(backend, "unspecified")
        np.testing.assert_array_equal(np.asarray(unspecified)[named], np.asarray(zero)[named])
        np.testing.assert_array_equal(np.asarray(zero)[~named], 0.0)
        if backend == "mosaic_tpu":
            assert np.isnan(np.asarray(unspecified)[~named]).all()


@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_mosaic_tpu_epilogue_race_free_in_both_dma_modes(mode):
    """The race detector on in both DMA modes: a visit's row reads, its adds and its writes,
    and the next visits' reads of the same rows, are ordered by their waits."""
    lhs, rhs, sizes, idx, w = problem(11, dtype=jnp.bfloat16)
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    out = cv.gmm_scatter_add(
        lhs,
        rhs,
        jnp.asarray(sizes),
        idx,
        num_out_rows=TOKENS,
        row_weights=w,
        backend="mosaic_tpu",
        interpret=ip,
        tiling=TILING,
    )
    assert_close(out, oracle(lhs, rhs, sizes, idx, w, TOKENS), TOP_K * K, jnp.float32)


@pytest.mark.parametrize(
    "mode, side, dtype",
    # each mode, side and dtype at least once (a bf16 cotangent, packed, in both modes)
    [
        ("eager", "rhs", jnp.float32),
        ("on_wait", "rhs", jnp.bfloat16),
        ("eager", "lhs", jnp.bfloat16),
    ],
    ids=["eager-rhs-f32", "on_wait-rhs-bf16", "eager-lhs-bf16"],
)
def test_mosaic_tpu_weight_gradient_kernel_gathers_weighted_rows_race_free(mode, side, dtype):
    """The kernel of the weights' gradient (rhs: `lhs[rows]^T @ (w ct[idx])[rows]` per group;
    lhs: transpose_rhs's `(w ct[idx])[rows]^T @ lhs[rows]`) gathers and weights the cotangent's
    rows in its loads: 300 gathered columns (three 128-wide tiles, the last partial; a bf16
    cotangent travels packed), the race detector on; against a float64 oracle."""
    rng = np.random.default_rng(15)
    idx, sizes = routed(rng, TOKENS, TOP_K, GROUPS)
    tokens = jnp.asarray(rng.standard_normal((M, K)), dtype)
    ct = jnp.asarray(rng.standard_normal((TOKENS, 300)), dtype)
    w = jnp.asarray(rng.random(M), jnp.float32)
    a, b = (tokens, ct) if side == "rhs" else (ct, tokens)
    out_shape = (GROUPS, a.shape[1], b.shape[1])
    got = mosaic_tpu_rows.gathered_tgmm_mosaic_tpu(
        a,
        b,
        jnp.asarray(sizes),
        jnp.int32(0),
        jnp.zeros(out_shape, jnp.float32),
        jnp.asarray(idx),
        w,
        gathered_side=side,
        num_groups=GROUPS,
        out_dtype=jnp.float32,
        tiling=tiling.Tile(tm=128, tk=128, tn=128),
        interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode),
    )
    # the kernel's operand: w * ct[idx] in float32, rounded to the cotangent's dtype
    rows = (w[:, None] * ct.astype(jnp.float32)[jnp.asarray(idx)]).astype(dtype)
    rows, tokens = np.asarray(rows, np.float64), np.asarray(tokens, np.float64)
    a, b = (tokens, rows) if side == "rhs" else (rows, tokens)
    want, start = [], 0
    for size in sizes:
        want.append(a[start : start + size].T @ b[start : start + size])
        start += size
    # float32 sums of products of `dtype` values over a group's rows
    assert_close(got, np.stack(want), M, jnp.float32)


def test_weight_gradient_runs_the_gathering_kernel_on_tpu():
    """On mosaic_tpu the weights' gradient is one gathered tgmm over the cotangent (weighted in
    the kernel): no [m, n] gathered copy of it is made in XLA."""
    lhs, rhs, sizes, idx, w = problem(16, dtype=jnp.bfloat16)

    def loss(r):
        out = cv.gmm_scatter_add(
            lhs,
            r,
            jnp.asarray(sizes),
            idx,
            num_out_rows=TOKENS,
            row_weights=w,
            backend="mosaic_tpu",
            interpret=True,
        )
        return jnp.sum(out)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(rhs).jaxpr
    names = {eqn.primitive.name: eqn.params for eqn in jaxpr.eqns}
    params = names["conveyor_gathered_tgmm"]
    assert (params["gathered_side"], params["weighted"]) == ("rhs", True)
    assert "gather" not in names and "conveyor_tgmm" not in names


@pytest.mark.parametrize("backend", ["xla"])
def test_weight_gradient_differentiates_again(backend):
    """The weights' gradient (a tgmm of gathered, weighted cotangent rows) has its own
    derivatives: forward over reverse in the weights, reverse over reverse into the tokens and
    the row weights, against the unfused op's."""
    lhs, rhs, sizes, idx, w = problem(17)
    gs = jnp.asarray(sizes)
    tangent = jnp.asarray(np.random.default_rng(18).standard_normal(rhs.shape), jnp.float32)

    def derivatives(run):
        g = jax.grad(lambda l, r, ww: jnp.sum(jnp.tanh(run(l, r, ww))), argnums=1)
        hvp = jax.jvp(lambda r: g(lhs, r, w), (rhs,), (tangent,))[1]
        mixed = jax.grad(lambda l, ww: jnp.sum(g(l, rhs, ww) * tangent), argnums=(0, 1))(lhs, w)
        return hvp, *mixed

    def fused(l, r, ww):
        return scatter_add(backend, l, r, gs, idx, num_out_rows=TOKENS, row_weights=ww)

    def unfused(l, r, ww):
        prod = cv.gmm(l, r, gs, backend="reference")
        return jnp.zeros((TOKENS, N)).at[idx].add(ww[:, None] * prod)

    for got, want in zip(derivatives(fused), derivatives(unfused)):
        assert_close(got, want, M * K * N, jnp.float32)


@pytest.mark.parametrize("unique", [False, True])
def test_mosaic_gpu_writes_the_product_then_scatter_adds(unique):
    """The kernel leaves the product's rows past the groups unwritten (the interpreter fills them
    with NaN): they add nothing, and output rows no index names are exactly 0."""
    lhs, rhs, sizes, idx, w = problem(12, dtype=jnp.bfloat16)
    sizes = sizes.copy()
    sizes[-1] -= 6  # the last 6 rows belong to no group
    if unique:  # a permutation: every row to its own output row, gathered through its inverse
        idx = jnp.asarray(np.random.default_rng(12).permutation(M))
    num_rows = M if unique else TOKENS + 3  # three output rows no index names
    out = cv.gmm_scatter_add(
        lhs,
        rhs,
        jnp.asarray(sizes),
        idx,
        num_out_rows=num_rows,
        row_weights=w,
        unique_indices=unique,
        backend="mosaic_gpu",
        interpret=True,
    )
    expect = oracle(lhs[: M - 6], rhs, sizes, idx[: M - 6], w[: M - 6], num_rows)
    assert_close(out, expect, TOP_K * K, jnp.float32)
    unnamed = np.ones(num_rows, bool)
    unnamed[np.asarray(idx[: M - 6])] = False
    assert unnamed.sum() == (6 if unique else 3)
    np.testing.assert_array_equal(np.asarray(out)[unnamed], 0.0)


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_arguments_are_refused_by_name():
    lhs, rhs, sizes, idx, w = problem(13)
    gs = jnp.asarray(sizes)
    run = lambda **kw: cv.gmm_scatter_add(
        kw.pop("lhs", lhs), rhs, gs, kw.pop("idx", idx), **{"num_out_rows": TOKENS, **kw}
    )
    with pytest.raises(ValueError, match=r"out_indices: expected rows in \[0, 29\).*=29"):
        run(idx=idx.at[3].set(TOKENS))
    with pytest.raises(TypeError, match="out_indices: expected an integer"):
        run(idx=idx.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"out_indices: expected one index per lhs row \(58\)"):
        run(idx=idx[:-1])
    with pytest.raises(ValueError, match="num_out_rows: expected a static int >= 1, got 0"):
        run(num_out_rows=0)
    with pytest.raises(TypeError, match="num_out_rows: expected a static int"):
        run(num_out_rows=jnp.int32(TOKENS))
    with pytest.raises(ValueError, match=r"row_weights: expected shape \(58,\)"):
        run(row_weights=w[:3])
    with pytest.raises(TypeError, match="row_weights: expected dtype float"):
        run(row_weights=jnp.ones(M, jnp.int32))
    with pytest.raises(ValueError, match="rhs: contraction size must match lhs's k=135"):
        run(lhs=lhs[:, :-1])
    with pytest.raises(ValueError, match="out_indices: unique_indices=True promises no index twi"):
        run(unique_indices=True)  # top-2 routing: each token's row is named twice
    with pytest.raises(TypeError, match="unique_indices: expected a bool, got 1"):
        run(unique_indices=1)
    with pytest.raises(ValueError, match="unwritten_rows: expected 'zero' or 'unspecified', go"):
        run(unwritten_rows="nan")
    with pytest.raises(ValueError, match="unwritten_rows: 'unspecified' needs unique_indices=T"):
        run(unwritten_rows="unspecified")
