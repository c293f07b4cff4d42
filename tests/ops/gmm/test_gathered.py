"""cv.gmm with lhs_indices: the product of gathered lhs rows, on every backend that has it.

Every backend is held to a float64 NumPy oracle of `lhs[lhs_indices]` times the groups' weights
(tolerance: tests/tolerance.py, k-long float32 sums). mosaic_tpu gathers the rows in its DMAs and
runs through the Pallas TPU interpreter with race detection on (tests/conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import conveyor as cv
from conveyor.ops.gmm import mosaic_tpu_rows
from tests.ops.gmm.base import assert_close
from tests.ops.gmm.problems import numpy_gmm, operands, skewed_sizes

BACKENDS = ("xla", "reference", "mosaic_tpu")
ROWS, M, K, N = 29, 70, 136, 24  # 70 gathered rows: partial 16-row tiles; k = 128 + 8
TILING = (16, 128, 128)


def TILES_128(m, k, n):
    """128-wide tiles for every op, derivatives included (a fixed tuple tiles only the primal;
    derived ops take their backend's default)."""
    return (128, 128, 128)


def gathered_gmm(backend, *args, **kw):
    if backend == "mosaic_tpu":
        kw.setdefault("interpret", True)
        kw.setdefault("tiling", TILING)
    return cv.gmm(*args, backend=backend, **kw)


def routed(rng, tokens: int, top_k: int, groups: int):
    """An MoE layer's indices: each token picks top_k distinct groups; the assignments sorted by
    group give lhs_indices (each token repeated top_k times) and the group sizes."""
    experts = np.stack([rng.choice(groups, top_k, replace=False) for _ in range(tokens)])
    order = np.argsort(experts.reshape(-1), kind="stable")
    sizes = np.bincount(experts.reshape(-1), minlength=groups).astype(np.int32)
    return (order // top_k).astype(np.int32), sizes


def problem(seed, groups=3, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    lhs, rhs = operands(rng, ROWS, K, N, groups, dtype)
    idx = rng.integers(0, ROWS, M).astype(np.int32)
    sizes = skewed_sizes(rng, M, groups, total=M - 5)  # 5 trailing rows no group owns
    return lhs, rhs, jnp.asarray(idx), sizes


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_gathered_oracle(backend):
    lhs, rhs, idx, sizes = problem(0)
    sizes[1] = 0  # an empty group in the middle
    sizes[0] += M - 5 - sizes.sum()
    out = gathered_gmm(backend, lhs, rhs, jnp.asarray(sizes), lhs_indices=idx)
    assert out.shape == (M, N)
    assert_close(out, numpy_gmm(np.asarray(lhs)[idx], rhs, sizes), K, jnp.float32)
    np.testing.assert_array_equal(out[M - 5 :], 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_routing_repeats_rows(backend):
    rng = np.random.default_rng(1)
    idx, sizes = routed(rng, ROWS, 2, 4)
    lhs, rhs = operands(rng, ROWS, K, N, 4, jnp.float32)
    out = gathered_gmm(backend, lhs, rhs, jnp.asarray(sizes), lhs_indices=jnp.asarray(idx))
    assert_close(out, numpy_gmm(np.asarray(lhs)[idx], rhs, sizes), K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_never_gathered_do_not_leak(backend):
    """NaN in rows no index names, and in rows outside the groups' range: the output is finite,
    and rows outside the groups are exactly existing_out."""
    lhs, rhs, idx, sizes = problem(2)
    lhs = lhs.at[ROWS - 4 :].set(jnp.nan)
    idx = jnp.asarray(np.asarray(idx) % (ROWS - 4))
    ex = jnp.full((M, N), 7.25, jnp.float32)
    out = gathered_gmm(backend, lhs, rhs, jnp.asarray(sizes), lhs_indices=idx, existing_out=ex)
    np.testing.assert_array_equal(out[M - 5 :], 7.25)
    assert_close(out[: M - 5], numpy_gmm(np.asarray(lhs)[idx], rhs, sizes)[: M - 5], K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_16bit_rows(backend, dtype):
    """16-bit rows (two to a sublane on TPU, gathered as a [rows, 1, k] view) in float32 sums."""
    lhs, rhs, idx, sizes = problem(3, dtype=dtype)
    for out_dtype in (jnp.float32, dtype):
        out = gathered_gmm(
            backend, lhs, rhs, jnp.asarray(sizes), lhs_indices=idx, preferred_element_type=out_dtype
        )
        assert out.dtype == out_dtype
        assert_close(out, numpy_gmm(np.asarray(lhs)[idx], rhs, sizes), K, out_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_transpose_rhs(backend):
    rng = np.random.default_rng(4)
    lhs, rhs = operands(rng, ROWS, K, N, 3, jnp.float32, transpose_rhs=True)
    idx = jnp.asarray(rng.integers(0, ROWS, M), jnp.int32)
    sizes = skewed_sizes(rng, M, 3)
    out = gathered_gmm(backend, lhs, rhs, jnp.asarray(sizes), lhs_indices=idx, transpose_rhs=True)
    expect = numpy_gmm(np.asarray(lhs)[idx], rhs, sizes, transpose_rhs=True)
    assert_close(out, expect, K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_offset_shards_reassemble(backend):
    """Expert parallelism: shards of 2 groups chained through existing_out give the whole."""
    lhs, rhs, idx, sizes = problem(5, groups=4)
    gs = jnp.asarray(sizes)
    out = jnp.zeros((M, N), jnp.float32)
    for lo in (0, 2):
        out = gathered_gmm(
            backend, lhs, rhs[lo : lo + 2], gs, lhs_indices=idx, group_offset=lo, existing_out=out
        )
    assert_close(out, numpy_gmm(np.asarray(lhs)[idx], rhs, sizes), K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_traced_indices_are_clamped(backend):
    """Under jit, indices are not checked: each backend clamps them to [0, rows) (documented)."""
    lhs, rhs, idx, sizes = problem(6)
    wild = np.asarray(idx).copy()
    wild[:3] = [-5, ROWS, 10 * ROWS]
    f = jax.jit(lambda gs, i: gathered_gmm(backend, lhs, rhs, gs, lhs_indices=i))
    out = f(jnp.asarray(sizes), jnp.asarray(wild))
    expect = numpy_gmm(np.asarray(lhs)[np.clip(wild, 0, ROWS - 1)], rhs, sizes)
    assert_close(out, expect, K, jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_autodiff_of_the_gather(backend):
    """d lhs scatter-adds into the gathered rows (a row gathered twice gets both), d rhs and
    d existing_out as gmm's; against autodiff of the reference gmm of `lhs[idx]`."""
    rng = np.random.default_rng(7)
    idx, sizes = routed(rng, ROWS, 2, 4)
    lhs, rhs = operands(rng, ROWS, K, N, 4, jnp.float32)
    idx, gs = jnp.asarray(idx), jnp.asarray(sizes)
    ex = jnp.asarray(rng.standard_normal((2 * ROWS, N)), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((2 * ROWS, N)), jnp.float32)

    def loss(l, r, e):
        out = gathered_gmm(backend, l, r[1:3], gs, lhs_indices=idx, group_offset=1, existing_out=e)
        return jnp.vdot(out, ct)

    def ref_loss(l, r, e):
        out = cv.gmm(l[idx], r[1:3], gs, group_offset=1, existing_out=e, backend="reference")
        return jnp.vdot(out, ct)

    got = jax.grad(loss, argnums=(0, 1, 2))(lhs, rhs, ex)
    want = jax.grad(ref_loss, argnums=(0, 1, 2))(lhs, rhs, ex)
    for g, w in zip(got, want):
        assert_close(g, w, max(2 * ROWS, K, N), jnp.float32)
    assert np.abs(np.asarray(got[0])).min(axis=1).max() > 0  # every token received gradient


@pytest.mark.parametrize("spare", [0, 9], ids=["permutation", "some rows"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_unique_indices_set_lhs_gradient_rows_to_the_same_values(backend, spare, dtype):
    """unique_indices=True: lhs's gradient rows are rounded to lhs's dtype by the per-row product
    itself and set (gathered through the inverse when the indices name every row of lhs), where
    without it they are added into a float32 buffer and rounded after: the same values, bit for
    bit (one term a row), rows past the groups and rows nobody names 0."""
    rng = np.random.default_rng(22)
    m, rows = 40, 40 + spare
    lhs, rhs = operands(rng, rows, K, N, 3, dtype)
    idx = jnp.asarray(rng.permutation(rows)[:m], jnp.int32)
    gs = jnp.asarray(skewed_sizes(rng, m, 3, total=m - 5))  # 5 rows no group owns
    ct = jnp.asarray(rng.standard_normal((m, N)), dtype)

    def grad(unique):
        def loss(l):
            out = gathered_gmm(backend, l, rhs, gs, lhs_indices=idx, unique_indices=unique)
            return jnp.vdot(out.astype(jnp.float32), ct.astype(jnp.float32))

        return np.asarray(jax.grad(loss)(lhs))

    added, stored = grad(False), grad(True)
    np.testing.assert_array_equal(stored, added)
    named = np.zeros(rows, bool)
    named[np.asarray(idx[: m - 5])] = True
    np.testing.assert_array_equal(stored[~named], 0.0)
    assert np.abs(stored[named]).min(axis=1).max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_transpose_rhs_weight_gradient_gathers_in_the_kernel(backend):
    """With transpose_rhs, d rhs[g] = ct[rows of g]^T @ lhs[idx[rows of g]]: the gathered rows
    are the tgmm's rhs side (mosaic_tpu gathers them in its loads, the jaxpr holds no gather)."""
    lhs, rhs, idx, sizes = problem(20)
    rhs_t = jnp.swapaxes(rhs, 1, 2)
    gs = jnp.asarray(sizes)
    ct = jnp.asarray(np.random.default_rng(21).standard_normal((M, N)), jnp.float32)

    def loss(r):
        out = gathered_gmm(backend, lhs, r, gs, lhs_indices=idx, transpose_rhs=True)
        return jnp.vdot(out, ct)

    def ref_loss(r):
        return jnp.vdot(cv.gmm(lhs[idx], r, gs, transpose_rhs=True, backend="reference"), ct)

    assert_close(jax.grad(loss)(rhs_t), jax.grad(ref_loss)(rhs_t), M, jnp.float32)
    if backend == "mosaic_tpu":
        eqns = {e.primitive.name: e.params for e in jax.make_jaxpr(jax.grad(loss))(rhs_t).eqns}
        assert eqns["conveyor_gathered_tgmm"]["gathered_side"] == "rhs"
        assert "gather" not in eqns


# xla only: mosaic_tpu's derivatives are plain gmm/tgmm kernels, and vmap is the same lax.map
# on every backend
@pytest.mark.parametrize("backend", ["xla"])
def test_forward_over_reverse_and_vmap(backend):
    lhs, rhs, idx, sizes = problem(8)
    gs = jnp.asarray(sizes)
    tangent = jnp.asarray(np.random.default_rng(9).standard_normal(lhs.shape), jnp.float32)

    def hvp(run):
        g = jax.grad(lambda l: jnp.sum(jnp.tanh(run(l))))
        return jax.jvp(g, (lhs,), (tangent,))[1]

    got = hvp(lambda l: gathered_gmm(backend, l, rhs, gs, lhs_indices=idx))
    want = hvp(lambda l: cv.gmm(l[idx], rhs, gs, backend="reference"))
    assert_close(got, want, K * N, jnp.float32)
    both = jnp.stack([idx, idx[::-1]])
    out = jax.vmap(lambda i: gathered_gmm(backend, lhs, rhs, gs, lhs_indices=i))(both)
    for b in range(2):
        expect = numpy_gmm(np.asarray(lhs)[np.asarray(both[b])], rhs, sizes)
        assert_close(out[b], expect, K, jnp.float32)


@pytest.mark.parametrize("backend", ["xla"])
def test_weight_gradient_differentiates_again(backend):
    """The weight gradient (tgmm of the gathered rows) has its own derivatives: forward over
    reverse and reverse over reverse in the weights and the tokens, against the gather's."""
    lhs, rhs, idx, sizes = problem(12)
    gs = jnp.asarray(sizes)
    tangent = jnp.asarray(np.random.default_rng(13).standard_normal(rhs.shape), jnp.float32)

    def derivatives(run):
        g = jax.grad(lambda l, r: jnp.sum(jnp.tanh(run(l, r))), argnums=1)
        hvp = jax.jvp(lambda r: g(lhs, r), (rhs,), (tangent,))[1]
        mixed = jax.grad(lambda l: jnp.sum(g(l, rhs) * tangent))(lhs)
        return hvp, mixed

    got = derivatives(lambda l, r: gathered_gmm(backend, l, r, gs, lhs_indices=idx))
    want = derivatives(lambda l, r: cv.gmm(l[idx], r, gs, backend="reference"))
    for g, w in zip(got, want):
        assert_close(g, w, M * N, jnp.float32)


@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_mosaic_tpu_weight_gradient_gathers_race_free_in_both_dma_modes(mode):
    """The weight gradient's kernel gathers the visit's rows (one k tile each, k = 300: three
    tiles) while the previous visit runs, into the other slot; the race detector on, in both
    DMA modes."""
    rng = np.random.default_rng(14)
    idx, sizes = routed(rng, ROWS, 2, 3)
    lhs, rhs = operands(rng, ROWS, 300, N, 3, jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((2 * ROWS, N)), jnp.bfloat16)
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)

    def loss(r):
        out = cv.gmm(
            lhs,
            r,
            jnp.asarray(sizes),
            lhs_indices=jnp.asarray(idx),
            backend="mosaic_tpu",
            interpret=ip,
            tiling=TILES_128,  # the gradient's tgmm: three 128-row k tiles of the gathered rows
        )
        return jnp.vdot(out.astype(jnp.float32), ct.astype(jnp.float32))

    got = jax.grad(loss)(rhs)
    gathered = np.asarray(lhs, np.float64)[idx]
    want, start = [], 0
    for size in sizes:
        want.append(
            gathered[start : start + size].T @ np.asarray(ct, np.float64)[start : start + size]
        )
        start += size
    # bf16 operands, float32 sums over a group's rows, then rounded to bf16 (the weights' dtype)
    assert_close(got, np.stack(want), 2 * ROWS, jnp.bfloat16)


def test_inside_shard_map_each_device_gathers_its_own():
    """Two devices, each with its own tokens and indices into them (an expert-parallel layer)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    rng = np.random.default_rng(10)
    lhs, rhs = operands(rng, 2 * ROWS, K, N, 3, jnp.float32)
    idx = np.concatenate([rng.integers(0, ROWS, M) for _ in range(2)]).astype(np.int32)
    sizes = np.concatenate([skewed_sizes(rng, M, 3) for _ in range(2)]).astype(np.int32)

    def local(l, r, s, i):
        return cv.gmm(l, r, s, lhs_indices=i, backend="xla")

    f = jax.shard_map(local, mesh=mesh, in_specs=(P("x"), P(), P("x"), P("x")), out_specs=P("x"))
    out = f(lhs, rhs, jnp.asarray(sizes), jnp.asarray(idx))
    for d in range(2):
        rows = np.asarray(lhs)[d * ROWS : (d + 1) * ROWS][idx[d * M : (d + 1) * M]]
        expect = numpy_gmm(rows, rhs, sizes[3 * d : 3 * d + 3])
        assert_close(out[d * M : (d + 1) * M], expect, K, jnp.float32)


@pytest.mark.parametrize("whole_rows", [True, False], ids=["whole-k rows", "k-tile rows"])
@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_mosaic_tpu_gather_race_free_in_both_dma_modes(mode, whole_rows, monkeypatch):
    """The race detector on, in both DMA execution modes: a unit's rows (whole rows of k, or one
    k tile of them when whole rows do not fit the slots' budget), fetched while the previous unit
    runs into the other slot, are never read while in flight."""
    if not whole_rows:
        monkeypatch.setattr(mosaic_tpu_rows, "GATHER_SLOTS_BYTES", 0)
    rng = np.random.default_rng(11)
    idx, sizes = routed(rng, ROWS, 2, 3)
    lhs, rhs = operands(rng, ROWS, 300, N, 3, jnp.bfloat16)  # 3 k tiles: prefetch across k
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    out = cv.gmm(
        lhs,
        rhs,
        jnp.asarray(sizes),
        lhs_indices=jnp.asarray(idx),
        backend="mosaic_tpu",
        interpret=ip,
        tiling=TILING,
    )
    assert_close(out, numpy_gmm(np.asarray(lhs)[idx], rhs, sizes), 300, jnp.float32)


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_indices_are_refused_by_name():
    lhs, rhs, idx, sizes = problem(12)
    gs = jnp.asarray(sizes)
    with pytest.raises(ValueError, match=r"rows in \[0, 29\) .*got lhs_indices\[4\]=29"):
        cv.gmm(lhs, rhs, gs, lhs_indices=idx.at[4].set(ROWS))
    with pytest.raises(ValueError, match=r"lhs_indices\[0\]=-1"):
        cv.gmm(lhs, rhs, gs, lhs_indices=idx.at[0].set(-1))
    with pytest.raises(TypeError, match="lhs_indices: expected an integer"):
        cv.gmm(lhs, rhs, gs, lhs_indices=idx.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"lhs_indices: expected 1 dimensions"):
        cv.gmm(lhs, rhs, gs, lhs_indices=idx[:, None])
    with pytest.raises(ValueError, match="group_sizes: expected a total of at most m=3 rows"):
        cv.gmm(lhs, rhs, gs, lhs_indices=idx[:3])
    with pytest.raises(ValueError, match=r"existing_out: expected shape \(70, 24\)"):
        cv.gmm(lhs, rhs, gs, lhs_indices=idx, existing_out=jnp.zeros((ROWS, N)))
    with pytest.raises(ValueError, match="lhs: expected at least one row"):
        cv.gmm(lhs[:0], rhs, gs, lhs_indices=idx)
    with pytest.raises(ValueError, match="lhs_indices: unique_indices=True promises no index tw"):
        cv.gmm(lhs, rhs, gs, lhs_indices=idx.at[1].set(idx[0]), unique_indices=True)
    with pytest.raises(ValueError, match="unique_indices: applies to lhs_indices, none given"):
        cv.gmm(jnp.zeros((M, K)), rhs, gs, unique_indices=True)
    with pytest.raises(TypeError, match="unique_indices: expected a bool, got 1"):
        cv.gmm(lhs, rhs, gs, lhs_indices=idx, unique_indices=1)


def test_mosaic_gpu_gathers_in_xla_then_runs_its_kernel():
    """mosaic_gpu has no row gather in its kernel yet: the rows are gathered by XLA, then its gmm
    runs (Mosaic GPU interpreter), bfloat16 operands in float32 sums."""
    lhs, rhs, idx, sizes = problem(13, dtype=jnp.bfloat16)
    out = cv.gmm(
        lhs, rhs, jnp.asarray(sizes), lhs_indices=idx, backend="mosaic_gpu", interpret=True
    )
    assert_close(out, numpy_gmm(np.asarray(lhs)[idx], rhs, sizes), K, jnp.float32)


def test_explicit_axes_mesh_is_refused_outside_shard_map():
    lhs, rhs, idx, sizes = problem(14)
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        put = lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, P()))
        with pytest.raises(NotImplementedError, match="lhs_indices on a mesh with Explicit axes"):
            jax.jit(lambda *a: cv.gmm(*a[:3], lhs_indices=a[3]))(
                put(lhs), put(rhs), put(jnp.asarray(sizes)), put(idx)
            )


def test_row_moving_kernels_export_for_tpu_from_a_cpu_host():
    """jax.export for TPU with no TPU in view (a CPU CI host): the gathered gmm, gmm_scatter_add
    and their gradients lower. Their kernels divide traced ints with lax.div / lax.rem
    (`conveyor.ints`): jnp's `//` lowers through `sign`, whose Mosaic rule asks for the TPU's
    generation ("Unsupported TPU device kind: cpu")."""
    bf16 = jnp.bfloat16
    x, w = jax.ShapeDtypeStruct((256, 256), bf16), jax.ShapeDtypeStruct((4, 256, 256), bf16)
    s, i = jax.ShapeDtypeStruct((4,), jnp.int32), jax.ShapeDtypeStruct((256,), jnp.int32)

    def gathered(x, w, s, i):
        return cv.gmm(x, w, s, lhs_indices=i, backend="mosaic_tpu")

    def scatter(x, w, s, i):
        return cv.gmm_scatter_add(x, w, s, i, num_out_rows=256, backend="mosaic_tpu")

    def grads(op):
        def fn(x, w, s, i):
            loss = lambda x, w: op(x, w, s, i).astype(jnp.float32).sum()  # noqa: E731
            return jax.grad(loss, argnums=(0, 1))(x, w)

        return fn

    for fn in (gathered, scatter, grads(gathered), grads(scatter)):
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(x, w, s, i)
        assert "tpu_custom_call" in exported.mlir_module()
