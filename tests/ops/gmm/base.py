"""The shared gmm/tgmm test base: every backend answers to these tests against `reference`.

A backend's test file subclasses `GmmBackendTests` and sets `backend` (and may narrow the shapes).
Tolerances come from `tolerance()`: both sides accumulate in float32 (or float64), so they differ
by summation order (~sqrt(k) ulps of the accumulator) plus one rounding of the output dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import conveyor as cv
from tests.tolerance import sum_tolerance
from tests.ops.gmm.problems import numpy_gmm, numpy_tgmm, operands, skewed_sizes


def tolerance(expected, k: int, out_dtype, acc_dtype=jnp.float32):
    """Elementwise bound on |actual - expected| for a k-long f32-accumulated dot rounded to
    out_dtype
    (tests/tolerance.py; the partial sums of these random operands stay within the largest output
    magnitude, at least 1)."""
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    return sum_tolerance(k, scale, acc_dtype=acc_dtype, expected=expected, out_dtype=out_dtype)


def assert_close(actual, expected, k, out_dtype):
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape
    assert np.isfinite(actual).all(), "non-finite values in the result"
    bound = tolerance(expected, k, out_dtype)
    err = np.abs(actual - expected)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (
        f"max excess at {worst}: |{actual[worst]} - {expected[worst]}| > {bound[worst]}"
    )


def size_patterns(m: int, groups: int):
    """Hypothesis strategy of adversarial group-size vectors summing to at most m."""

    def build(seed, pattern, total_frac):
        rng = np.random.default_rng(seed)
        total = int(m * total_frac)
        sizes = skewed_sizes(rng, m, groups, alpha=0.5, total=total)
        if pattern == "first_empty" and groups > 1:
            sizes[1] += sizes[0]
            sizes[0] = 0
        elif pattern == "last_empty" and groups > 1:
            sizes[-2] += sizes[-1]
            sizes[-1] = 0
        elif pattern == "middle_empty" and groups > 2:
            mid = groups // 2
            sizes[mid - 1] += sizes[mid]
            sizes[mid] = 0
        elif pattern == "one_group":
            sizes[:] = 0
            sizes[rng.integers(groups)] = total
        return sizes

    return st.builds(
        build,
        st.integers(0, 2**31 - 1),
        st.sampled_from(["skewed", "first_empty", "last_empty", "middle_empty", "one_group"]),
        st.sampled_from([1.0, 1.0, 0.7]),
    )


class GmmBackendTests:
    backend: str = "xla"
    interpret = False
    # Shapes not divisible by the tiles; subclasses may shrink them.
    m, k, n = 67, 40, 24
    tiling = (16, 128, 128)
    groups = (1, 3, 8)
    half_dtypes = (jnp.bfloat16, jnp.float16)
    grad_dtype = jnp.float32  # the dtype gradients are rounded to (the tolerance of their checks)

    # ---- helpers ----
    def gmm(self, *args, **kw):
        kw.setdefault("tiling", self.tiling)
        return cv.gmm(*args, backend=self.backend, interpret=self.interpret, **kw)

    def tgmm_tiling(self, tiling):
        """The tiling the backend's tgmm accepts for a gmm tiling (mosaic_tpu needs 128-lane tm)."""
        return tiling

    def tgmm(self, *args, **kw):
        kw["tiling"] = self.tgmm_tiling(kw.get("tiling", self.tiling))
        return cv.tgmm(*args, backend=self.backend, interpret=self.interpret, **kw)

    def exact(self, x):
        """Test data as the backend multiplies it exactly: unchanged here; a 16-bit kernel's suite
        rounds it to values its dtype holds, so the float64 oracles see what the kernel sees."""
        return x

    def operands(self, rng, m, k, n, groups, transpose_rhs=False):
        return tuple(
            self.exact(a)
            for a in operands(rng, m, k, n, groups, jnp.float32, transpose_rhs=transpose_rhs)
        )

    def normal(self, rng, shape):
        return self.exact(jnp.asarray(rng.standard_normal(shape), jnp.float32))

    @staticmethod
    def ref_gmm(*args, **kw):
        return cv.gmm(*args, backend="reference", **kw)

    @staticmethod
    def ref_tgmm(*args, **kw):
        return cv.tgmm(*args, backend="reference", **kw)

    # ---- forward ----
    @pytest.mark.parametrize("groups", [1, 3, 8])
    @given(data=st.data())
    def test_gmm_matches_reference(self, groups, data):
        if groups not in self.groups:
            pytest.skip(f"{self.backend} runs G in {self.groups}")
        sizes = data.draw(size_patterns(self.m, groups))
        rng = np.random.default_rng(int(sizes.sum()) * 31 + groups)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, groups)
        out = self.gmm(lhs, rhs, jnp.asarray(sizes))
        assert_close(out, numpy_gmm(lhs, rhs, sizes), self.k, jnp.float32)
        np.testing.assert_array_equal(out[int(sizes.sum()) :], 0.0)

    @pytest.mark.parametrize("groups", [1, 3, 8])
    @given(data=st.data())
    def test_tgmm_matches_reference(self, groups, data):
        if groups not in self.groups:
            pytest.skip(f"{self.backend} runs G in {self.groups}")
        sizes = data.draw(size_patterns(self.m, groups))
        rng = np.random.default_rng(int(sizes.sum()) * 17 + groups)
        x = self.normal(rng, (self.k, self.m))
        y = self.normal(rng, (self.m, self.n))
        out = self.tgmm(x, y, jnp.asarray(sizes))
        assert_close(out, numpy_tgmm(x, y, sizes), self.m, jnp.float32)
        for i in np.flatnonzero(sizes == 0):
            np.testing.assert_array_equal(out[i], 0.0)

    def test_untouched_rows_poisoned_inputs(self):
        """Rows outside groups: exactly existing_out; NaN lhs rows there must not leak anywhere."""
        rng = np.random.default_rng(1)
        a, b = self.m // 3, self.m // 2
        used = a + b  # rows [used, m) belong to no group
        sizes = np.array([0, a, 0, b], np.int32)  # empty first and middle groups
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 4)
        lhs = lhs.at[used:].set(jnp.nan)
        sentinel = jnp.full((self.m, self.n), 7.25, jnp.float32)
        out = self.gmm(lhs, rhs, jnp.asarray(sizes), existing_out=sentinel)
        np.testing.assert_array_equal(out[used:], 7.25)
        assert_close(out[:used], numpy_gmm(lhs[:used], rhs, sizes), self.k, jnp.float32)
        y = self.normal(rng, (self.m, self.n)).at[used:].set(jnp.nan)
        t = self.tgmm(lhs.T, y, jnp.asarray(sizes))
        np.testing.assert_array_equal(t[0], 0.0)
        np.testing.assert_array_equal(t[2], 0.0)
        assert_close(t, numpy_tgmm(lhs[:used].T, y[:used], sizes), self.m, jnp.float32)

    @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
    def test_16bit_inputs_accumulate_in_f32(self, dtype):
        if dtype not in self.half_dtypes:
            pytest.skip(f"{self.backend} refuses {jnp.dtype(dtype).name} (tested separately)")
        rng = np.random.default_rng(2)
        sizes = skewed_sizes(rng, self.m, 3)
        lhs, rhs = operands(rng, self.m, self.k, self.n, 3, dtype)
        for out_dtype in (jnp.float32, dtype):
            out = self.gmm(lhs, rhs, jnp.asarray(sizes), preferred_element_type=out_dtype)
            assert out.dtype == out_dtype
            # Exact products of the 16-bit inputs in float64, rounded once to out_dtype.
            assert_close(out, numpy_gmm(lhs, rhs, sizes), self.k, out_dtype)
        y = jnp.asarray(rng.standard_normal((self.m, self.n)), dtype)
        t = self.tgmm(lhs.T, y, jnp.asarray(sizes))
        assert t.dtype == jnp.float32
        assert_close(t, numpy_tgmm(lhs.T, y, sizes), self.m, jnp.float32)

    def test_transpose_rhs(self):
        rng = np.random.default_rng(3)
        sizes = skewed_sizes(rng, self.m, 3)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 3, transpose_rhs=True)
        out = self.gmm(lhs, rhs, jnp.asarray(sizes), transpose_rhs=True)
        assert_close(out, numpy_gmm(lhs, rhs, sizes, transpose_rhs=True), self.k, jnp.float32)

    @pytest.mark.parametrize("tiling", [(8, 128, 128), (24, 128, 128), (128, 128, 128), None])
    def test_tilings_that_do_not_divide(self, tiling):
        rng = np.random.default_rng(4)
        sizes = skewed_sizes(rng, self.m, 3)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 3)
        out = self.gmm(lhs, rhs, jnp.asarray(sizes), tiling=tiling)
        assert_close(out, numpy_gmm(lhs, rhs, sizes), self.k, jnp.float32)
        y = self.exact(out)
        t = self.tgmm(lhs.T, y, jnp.asarray(sizes), tiling=tiling)
        assert_close(t, numpy_tgmm(lhs.T, y, sizes), self.m, jnp.float32)

    def test_tiling_callable(self):
        seen = []

        def table(m, k, n):
            seen.append((m, k, n))
            return self.tiling

        rng = np.random.default_rng(5)
        sizes = skewed_sizes(rng, self.m, 3)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 3)
        out = self.gmm(lhs, rhs, jnp.asarray(sizes), tiling=table)
        assert_close(out, numpy_gmm(lhs, rhs, sizes), self.k, jnp.float32)
        if self.backend != "reference":
            assert (self.m, self.k, self.n) in seen

    def test_group_offset_shards_reassemble(self):
        """Expert parallelism: shards of 2 groups chained through existing_out give the full
        result."""
        rng = np.random.default_rng(6)
        groups, per_shard = 6, 2
        sizes = skewed_sizes(rng, self.m, groups, total=self.m - 5)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, groups)
        gs = jnp.asarray(sizes)
        out = jnp.zeros((self.m, self.n), jnp.float32)
        parts = []
        for shard in range(groups // per_shard):
            lo = shard * per_shard
            out = self.gmm(
                lhs, rhs[lo : lo + per_shard], gs, group_offset=jnp.int32(lo), existing_out=out
            )
            parts.append(
                self.tgmm(lhs.T, self.exact(out), gs, group_offset=lo, num_actual_groups=per_shard)
            )
        assert_close(out, numpy_gmm(lhs, rhs, sizes), self.k, jnp.float32)
        np.testing.assert_array_equal(out[self.m - 5 :], 0.0)
        # Each shard's tgmm saw the output so far: its own groups' rows were final by then.
        assert_close(
            jnp.concatenate(parts), numpy_tgmm(lhs.T, self.exact(out), sizes), self.m, jnp.float32
        )

    def test_jit_traced_sizes_and_offset(self):
        rng = np.random.default_rng(7)
        sizes = skewed_sizes(rng, self.m, 4)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 4)
        f = jax.jit(lambda gs, off: self.gmm(lhs, rhs[:2], gs, group_offset=off))
        for off in (0, 2):
            out = f(jnp.asarray(sizes), jnp.int32(off))
            expect = numpy_gmm(lhs, rhs[:2], sizes, offset=off)
            assert_close(out, expect, self.k, jnp.float32)

    def test_traced_sizes_clip_at_m(self):
        """Documented behaviour for traced sizes: negatives count as 0, the total is clipped at
        m."""
        rng = np.random.default_rng(8)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 3)
        bad = jnp.asarray([self.m - 10, -4, 30], jnp.int32)  # sum > m, one negative
        out = jax.jit(lambda gs: self.gmm(lhs, rhs, gs))(bad)
        clipped = np.array([self.m - 10, 0, 10])
        assert_close(out, numpy_gmm(lhs, rhs, clipped), self.k, jnp.float32)
        y = self.exact(out)
        t = jax.jit(lambda gs: self.tgmm(lhs.T, y, gs))(bad)
        assert_close(t, numpy_tgmm(lhs.T, y, clipped), self.m, jnp.float32)

    # ---- autodiff ----
    def test_gradients_match_reference_autodiff(self):
        rng = np.random.default_rng(9)
        sizes = skewed_sizes(rng, self.m, 4, total=self.m - 3)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 4)
        ex = self.normal(rng, (self.m, self.n))
        ct = self.normal(rng, (self.m, self.n))
        gs = jnp.asarray(sizes)

        def loss(fn):
            return lambda l, r, e: jnp.vdot(fn(l, r[1:3], gs, group_offset=1, existing_out=e), ct)

        got = jax.grad(loss(self.gmm), argnums=(0, 1, 2))(lhs, rhs, ex)
        want = jax.grad(loss(self.ref_gmm), argnums=(0, 1, 2))(lhs, rhs, ex)
        for g, w in zip(got, want):
            assert_close(g, w, max(self.m, self.k, self.n), self.grad_dtype)
        # existing_out's gradient is the cotangent on the rows it passes through, 0 elsewhere.
        lo, hi = int(sizes[:1].sum()), int(sizes[:3].sum())
        np.testing.assert_array_equal(got[2][lo:hi], 0.0)
        np.testing.assert_array_equal(got[2][:lo], ct[:lo])

    def test_tgmm_gradients_and_second_order(self):
        rng = np.random.default_rng(10)
        sizes = skewed_sizes(rng, self.m, 3)
        gs = jnp.asarray(sizes)
        x = self.normal(rng, (self.k, self.m))
        y = self.normal(rng, (self.m, self.n))
        ex = self.normal(rng, (3, self.k, self.n))

        def loss(fn):
            return lambda a, b, e: jnp.sum(jnp.sin(fn(a, b, gs, existing_out=e)))

        got = jax.grad(loss(self.tgmm), argnums=(0, 1, 2))(x, y, ex)
        want = jax.grad(loss(self.ref_tgmm), argnums=(0, 1, 2))(x, y, ex)
        for g, w in zip(got, want):
            assert_close(g, w, self.m, jnp.float32)
        # second order: gradient of a gradient norm
        hess = lambda fn: jax.grad(lambda a: jnp.sum(jax.grad(loss(fn))(a, y, ex) ** 2))(x)
        assert_close(hess(self.tgmm), hess(self.ref_tgmm), self.m * self.n, jnp.float32)

    def test_forward_over_reverse(self):
        rng = np.random.default_rng(11)
        sizes = skewed_sizes(rng, self.m, 3)
        gs = jnp.asarray(sizes)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 3)
        tangent = self.normal(rng, lhs.shape)

        def hvp(fn):
            g = jax.grad(lambda l: jnp.sum(jnp.tanh(fn(l, rhs, gs))))
            return jax.jvp(g, (lhs,), (tangent,))[1]

        assert_close(hvp(self.gmm), hvp(self.ref_gmm), self.k * self.n, jnp.float32)

    def test_vmap_is_a_loop_over_the_batch(self):
        rng = np.random.default_rng(12)
        sizes = np.stack([skewed_sizes(rng, self.m, 3) for _ in range(2)])
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 3)
        out = jax.vmap(lambda gs: self.gmm(lhs, rhs, gs))(jnp.asarray(sizes))
        for b in range(2):
            assert_close(out[b], numpy_gmm(lhs, rhs, sizes[b]), self.k, jnp.float32)
