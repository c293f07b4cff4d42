"""gmm/tgmm on native_cpu (Conveyor's AVX-512 or AVX2 kernels through the XLA FFI) against the reference:
the shared suite at shapes that leave partial 14-row and 32-column register tiles and odd
contraction lengths, the bfloat16 path, the build and dispatch rules, and the refusals."""
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv
from conveyor.native import build
from conveyor.ops.gmm import backend_impls, native_cpu
from tests.ops.gmm.base import GmmBackendTests, assert_close
from tests.ops.gmm.problems import numpy_gmm, numpy_tgmm, operands, skewed_sizes

STATUS = build.status()
# Skipped only where the kernels cannot build (no compiler, or a CPU without AVX2 + FMA): see the first test.
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.reason}")


def test_native_kernels_build_where_they_can():
    """Not skipped: on a host with a C++ compiler and AVX2 + FMA (this project's CI has AVX-512 BF16
    too), the kernels must build, for the best instruction set the host has (or the one
    CONVEYOR_NATIVE_ISA names), so a broken build fails here instead of silently falling back to xla."""
    if build.host_should_build():
        assert STATUS.available, STATUS.reason
        assert STATUS.isa == (os.environ.get("CONVEYOR_NATIVE_ISA") or build.host_isas()[0])


OTHER_ISAS = build.host_isas()[1:]


@pytest.mark.skipif(os.environ.get("CONVEYOR_NATIVE_ISA") is not None or not OTHER_ISAS
                    or build.find_compiler() is None,
                    reason="runs the host's other builds from its default suite (each then runs this file itself)")
def test_the_other_builds_pass_this_suite():
    """Each build this host runs besides its best (on an AMX host: the AVX-512 build, whose bfloat16
    products use vdpbf16ps instead of AMX tiles, and the AVX2 build for CPUs without AVX-512 BF16)
    runs this whole file in a fresh process that picks it by CONVEYOR_NATIVE_ISA, all at once."""
    root = pathlib.Path(__file__).resolve().parents[3]
    runs = {isa: subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                                  env=dict(os.environ, CONVEYOR_NATIVE_ISA=isa), cwd=root, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for isa in OTHER_ISAS}
    for isa, run in runs.items():
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, f"{isa}:\n{out[-4000:]}{err[-2000:]}"
        assert " passed" in out and " failed" not in out, f"{isa}:\n{out[-4000:]}"


@needs_native
class TestNativeCpu(GmmBackendTests):
    backend = "native_cpu"
    m, k, n = 67, 41, 70    # 67 rows: tiles of 10 and a 7-row rest; n = 2 x 32 + 6; odd k (bf16 pairs)
    tiling = None
    half_dtypes = (jnp.bfloat16,)

    @pytest.mark.parametrize("tiling", [None])
    def test_tilings_that_do_not_divide(self, tiling):
        super().test_tilings_that_do_not_divide(tiling)

    def test_tiling_callable(self):
        """The register tiles are fixed: a tiling is refused by name (backend=None takes xla then)."""
        rng = np.random.default_rng(5)
        lhs, rhs = self.operands(rng, self.m, self.k, self.n, 3)
        sizes = jnp.asarray(skewed_sizes(rng, self.m, 3))
        for tiling in ((16, 128, 128), lambda m, k, n: None):
            with pytest.raises(NotImplementedError, match="native_cpu.*tiling"):
                self.gmm(lhs, rhs, sizes, tiling=tiling)
        auto = cv.gmm(lhs, rhs, sizes, tiling=(16, 128, 128))
        np.testing.assert_array_equal(auto, cv.gmm(lhs, rhs, sizes, backend="xla", tiling=(16, 128, 128)))


@needs_native
def test_float16_and_float64_are_refused_by_name():
    rng = np.random.default_rng(30)
    lhs, rhs = operands(rng, 12, 8, 4, 2, jnp.float16)
    sizes = jnp.asarray([5, 7], jnp.int32)
    with pytest.raises(NotImplementedError, match="native_cpu.*float16"):
        cv.gmm(lhs, rhs, sizes, backend="native_cpu")
    with pytest.raises(NotImplementedError, match="native_cpu.*preferred_element_type=float16"):
        cv.gmm(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, backend="native_cpu",
               preferred_element_type=jnp.float16)


@needs_native
def test_default_on_cpu_is_native_and_agrees_with_xla():
    """backend=None on CPU runs the AVX-512 build for float32/bfloat16 (same values as xla, up to
    summation order), and xla where native cannot (float16) or where only the AVX2 build loaded."""
    rng = np.random.default_rng(31)
    m, k, n, g = 150, 64, 96, 5
    sizes = jnp.asarray(skewed_sizes(rng, m, g))
    lhs, rhs = operands(rng, m, k, n, g, jnp.float32)
    assert backend_impls.auto_backend("cpu", lambda: False, lambda: True) == "native_cpu"
    default = "native_cpu" if STATUS.isa in native_cpu.DEFAULT_ISAS else "xla"
    assert native_cpu.chosen_by_default(lhs.dtype, rhs.dtype, lhs.dtype, None) == (default == "native_cpu")
    np.testing.assert_array_equal(cv.gmm(lhs, rhs, sizes), cv.gmm(lhs, rhs, sizes, backend=default))
    assert_close(cv.gmm(lhs, rhs, sizes), np.asarray(cv.gmm(lhs, rhs, sizes, backend="xla")), k, jnp.float32)
    h, w = lhs.astype(jnp.float16), rhs.astype(jnp.float16)
    np.testing.assert_array_equal(cv.gmm(h, w, sizes), cv.gmm(h, w, sizes, backend="xla"))


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_larger_shapes_many_groups_and_poisoned_output(dtype):
    """Several column chunks (so both threads work), 40 groups with empty ones, rows past the
    groups kept exactly from a NaN-poisoned existing_out; tgmm adds a random existing_out."""
    rng = np.random.default_rng(32)
    m, k, n, g = 517, 130, 200, 40
    sizes = skewed_sizes(rng, m, g, alpha=0.3, total=m - 9)
    lhs, rhs = operands(rng, m, k, n, g, dtype)
    poison = jnp.full((m, n), jnp.nan, jnp.float32)
    out = cv.gmm(lhs, rhs, jnp.asarray(sizes), existing_out=poison, backend="native_cpu")
    assert np.isnan(np.asarray(out[m - 9:])).all()
    assert_close(out[:m - 9], numpy_gmm(lhs[:m - 9], rhs, sizes), k, jnp.float32)
    y = jnp.asarray(rng.standard_normal((m, n)), dtype)
    ex = jnp.asarray(rng.standard_normal((g, k, n)), jnp.float32)
    t = cv.tgmm(lhs.T, y, jnp.asarray(sizes), existing_out=ex, backend="native_cpu")
    assert_close(t, numpy_tgmm(lhs.T[:, :m - 9], y[:m - 9], sizes) + np.asarray(ex, np.float64), m, jnp.float32)


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_transposed_rhs_whole_and_partial_pack_blocks(dtype):
    """A transposed rhs is packed by 16 x 16 register transposes where a block has 16 whole 32-bit
    units (16 float32 rows, 16 bfloat16 row pairs) of 32 columns, and element by element elsewhere:
    k=130 gives whole blocks and a partial one (bf16: 4 whole pairs and an odd row at the end;
    k=131), n=200 whole panels and an 8-column one. Rows past the groups come back exactly zero."""
    rng = np.random.default_rng(35)
    for m, k, n, g in ((300, 130, 200, 7), (300, 131, 200, 7)):
        sizes = skewed_sizes(rng, m, g, alpha=0.5, total=m - 5)
        lhs, rhs = operands(rng, m, k, n, g, dtype, transpose_rhs=True)
        out = cv.gmm(lhs, rhs, jnp.asarray(sizes), transpose_rhs=True, backend="native_cpu",
                     preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(out[m - 5:], 0.0)
        assert_close(out[:m - 5], numpy_gmm(lhs[:m - 5], rhs, sizes, transpose_rhs=True), k, jnp.float32)


@needs_native
@pytest.mark.parametrize("k", [16, 32, 45, 96, 97])
def test_bfloat16_tiles_read_only_their_rows_and_contraction(k):
    """The AMX build packs A's 16 x 32 tiles, zero past the real rows and past K: groups of 1-33 rows
    give 32-row blocks with 0-16 rows in their second tile, k < 32, = 32, and with a tail; n=88 a last panel of 24
    columns. Rows (gmm) and columns (tgmm) of lhs past the groups are inf, so a load past them turns
    the padding's zero products into NaN. Runs on every build (on the others it is one more shape)."""
    rng = np.random.default_rng(37 + k)
    sizes = np.array([1, 15, 16, 17, 31, 32, 33, 3, 48, 0, 20], np.int32)
    m, n, g = int(sizes.sum()) + 7, 88, len(sizes)
    lhs, rhs = operands(rng, m, k, n, g, jnp.bfloat16)
    lhs = lhs.at[m - 7:].set(jnp.inf)
    out = cv.gmm(lhs, rhs, jnp.asarray(sizes), backend="native_cpu", preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(out[m - 7:], 0.0)
    assert_close(out[:m - 7], numpy_gmm(lhs[:m - 7], rhs, sizes), k, jnp.float32)
    y = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    t = cv.tgmm(lhs.T, y, jnp.asarray(sizes), backend="native_cpu", preferred_element_type=jnp.float32)
    assert_close(t, numpy_tgmm(lhs.T[:, :m - 7], y[:m - 7], sizes), int(sizes.max()), jnp.float32)


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_chunks_of_several_blocks_of_panels(dtype):
    """n=2600 splits into column chunks of 325 or more columns (a pool of up to 8 threads, as with
    the suite's 8 virtual devices): more than one block of 256 (register tiles) and a partial one,
    so a chunk packs several blocks, prefetches the next one and packs each group's rows of lhs once
    for all of them, for a row-major and a transposed rhs (AMX's bfloat16 blocks of 512 columns: one
    or more per chunk); tgmm's row chunks (k=170: several 14-row tiles each) run over 2600-column
    rows of blocks the same way."""
    rng = np.random.default_rng(38)
    m, k, n, g = 150, 170, 2600, 4
    sizes = skewed_sizes(rng, m, g)
    for transpose_rhs in (False, True):
        lhs, rhs = operands(rng, m, k, n, g, dtype, transpose_rhs=transpose_rhs)
        out = cv.gmm(lhs, rhs, jnp.asarray(sizes), transpose_rhs=transpose_rhs, backend="native_cpu")
        assert_close(out, numpy_gmm(lhs, rhs, sizes, transpose_rhs=transpose_rhs), k, jnp.float32)
    y = jnp.asarray(rng.standard_normal((m, n)), dtype)
    t = cv.tgmm(lhs.T, y, jnp.asarray(sizes), backend="native_cpu")
    assert_close(t, numpy_tgmm(lhs.T, y, sizes), m, jnp.float32)


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_products_longer_than_a_k_chunk(dtype):
    """Products longer than 1024 along K run as K chunks added into a float32 C in order: gmm with
    k=2085 (two whole chunks and a 37-step one, odd for bfloat16 pairs), tgmm with one group of 2085
    rows beside small and empty ones, alone and added to a random existing_out. With a bfloat16 C
    the product is not chunked (each chunk's sum would be rounded): checked against the float32
    result rounded once."""
    rng = np.random.default_rng(39)
    m, k, n = 60, 2085, 70
    sizes = np.array([25, 0, 35], np.int32)
    lhs, rhs = operands(rng, m, k, n, len(sizes), dtype)
    out = cv.gmm(lhs, rhs, jnp.asarray(sizes), backend="native_cpu", preferred_element_type=jnp.float32)
    assert_close(out, numpy_gmm(lhs, rhs, sizes), k, jnp.float32)
    rounded = cv.gmm(lhs, rhs, jnp.asarray(sizes), backend="native_cpu", preferred_element_type=jnp.bfloat16)
    assert rounded.dtype == jnp.bfloat16
    assert_close(rounded, numpy_gmm(lhs, rhs, sizes), k, jnp.bfloat16)
    tall = np.array([3, 0, 2085, 12], np.int32)
    rows = int(tall.sum())
    x = jnp.asarray(rng.standard_normal((rows, 40)), dtype)
    y = jnp.asarray(rng.standard_normal((rows, n)), dtype)
    want = numpy_tgmm(x.T, y, tall)
    assert_close(cv.tgmm(x.T, y, jnp.asarray(tall), backend="native_cpu", preferred_element_type=jnp.float32),
                 want, rows, jnp.float32)
    ex = jnp.asarray(rng.standard_normal((len(tall), 40, n)), jnp.float32)
    assert_close(cv.tgmm(x.T, y, jnp.asarray(tall), existing_out=ex, backend="native_cpu"),
                 want + np.asarray(ex, np.float64), rows, jnp.float32)


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_many_small_groups_with_a_float32_result(dtype):
    """gmm over many groups of few rows (at most 64 on average) with a float32 C is split by groups
    where at most 2 threads run at once (the kernel's rule: 8 groups per thread, threads at most one
    per core; CI's machines have 2 cores), each group run over all n columns in K chunks of 1 MiB of
    whole rows of B: n=520 (a partial last panel) and k=1100 make 3 chunks for float32 (480 rows
    each) and 2 for bfloat16 (992). Empty groups, rows past the last group (zeros), and a bfloat16 C
    (split by columns, not chunked) beside it."""
    rng = np.random.default_rng(41)
    sizes = np.array([17, 0, 40, 3, 64, 1, 29, 0, 55, 12, 33, 8, 0, 47, 21, 6, 38, 2, 60, 15], np.int32)
    m, k, n = int(sizes.sum()) + 9, 1100, 520
    lhs, rhs = operands(rng, m, k, n, len(sizes), dtype)
    want = numpy_gmm(lhs[:m - 9], rhs, sizes)
    out = cv.gmm(lhs, rhs, jnp.asarray(sizes), backend="native_cpu", preferred_element_type=jnp.float32)
    np.testing.assert_array_equal(out[m - 9:], 0.0)
    assert_close(out[:m - 9], want, k, jnp.float32)
    rounded = cv.gmm(lhs, rhs, jnp.asarray(sizes), backend="native_cpu", preferred_element_type=jnp.bfloat16)
    assert_close(rounded[:m - 9], want, k, jnp.bfloat16)


@needs_native
def test_large_fresh_outputs_are_written_whole():
    """Fresh outputs of several MiB (which the kernels ask to be backed by 2 MiB pages before writing
    them): tgmm's [6, 512, 520] float32 result, 6.1 MiB, with an empty group (zeros) and a group
    past which nothing is written; gmm's [4100, 520] result with rows past the groups (zeros)."""
    rng = np.random.default_rng(40)
    sizes = np.array([30, 0, 45, 7, 60, 20], np.int32)
    rows = int(sizes.sum())
    x = jnp.asarray(rng.standard_normal((rows, 512)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((rows, 520)), jnp.float32)
    t = cv.tgmm(x.T, y, jnp.asarray(sizes), backend="native_cpu")
    np.testing.assert_array_equal(t[1], 0.0)
    assert_close(t, numpy_tgmm(x.T, y, sizes), int(sizes.max()), jnp.float32)
    m, k, n = 4100, 24, 520
    gsizes = np.array([1500, 0, 2500], np.int32)
    lhs, rhs = operands(rng, m, k, n, len(gsizes), jnp.float32)
    out = cv.gmm(lhs, rhs, jnp.asarray(gsizes), backend="native_cpu")
    np.testing.assert_array_equal(out[4000:], 0.0)
    assert_close(out[:4000], numpy_gmm(lhs[:4000], rhs, gsizes), k, jnp.float32)


@needs_native
def test_bfloat16_subnormals_flush_to_zero_as_xla_does():
    """vdpbf16ps treats subnormal bf16 inputs as zero; XLA:CPU's own bf16 dot does too (measured
    here on jax 0.12), so the two CPU backends agree on them."""
    tiny = jnp.asarray(np.full((4, 2), 1e-39, np.float32)).astype(jnp.bfloat16)   # subnormal
    ones = jnp.ones((1, 2, 3), jnp.bfloat16)
    sizes = jnp.asarray([4], jnp.int32)
    np.testing.assert_array_equal(cv.gmm(tiny, ones, sizes, backend="native_cpu"), 0.0)
    np.testing.assert_array_equal(cv.gmm(tiny, ones, sizes, backend="xla"), 0.0)


@needs_native
def test_export_and_other_platforms_take_other_backends():
    """A kernel compiled on this host must not end up in an exported program: backend=None exports
    xla for CPU; backend="native_cpu" refuses to export or to lower for another platform."""
    rng = np.random.default_rng(33)
    lhs, rhs = operands(rng, 24, 16, 8, 2, jnp.float32)
    sizes = jnp.asarray([10, 14], jnp.int32)
    exported = jax.export.export(jax.jit(lambda a, b, s: cv.gmm(a, b, s)), platforms=["cpu"])(lhs, rhs, sizes)
    assert build.GMM_TARGET not in exported.mlir_module()
    np.testing.assert_array_equal(exported.call(lhs, rhs, sizes), cv.gmm(lhs, rhs, sizes, backend="xla"))
    for platforms in (["cpu"], ["cuda"]):
        with pytest.raises(NotImplementedError, match="native_cpu"):
            jax.export.export(jax.jit(lambda a, b, s: cv.gmm(a, b, s, backend="native_cpu")),
                              platforms=platforms)(lhs, rhs, sizes)


@needs_native
def test_unavailable_backend_names_the_reason(monkeypatch):
    monkeypatch.setattr(build, "status", lambda: build.NativeStatus(available=False, reason="no compiler (test)"))
    lhs, rhs = operands(np.random.default_rng(34), 6, 4, 3, 1, jnp.float32)
    with pytest.raises(NotImplementedError, match="native_cpu.*no compiler \\(test\\)"):
        jax.jit(lambda a, b: cv.gmm(a, b, jnp.asarray([6], jnp.int32), backend="native_cpu"))(lhs, rhs)
    out = jax.jit(lambda a, b: cv.gmm(a, b, jnp.asarray([6], jnp.int32)))(lhs * 1.5, rhs)   # a fresh trace: xla
    assert_close(out, numpy_gmm(lhs * 1.5, rhs, np.array([6])), 4, jnp.float32)


@needs_native
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bfloat16_output_is_the_float32_result_rounded_as_xla_rounds(dtype):
    """A bfloat16 output is the kernel's float32 result rounded to nearest even, bit for bit as XLA's
    convert does (the accumulation is the same; only the store differs), NaN rows included; n=70
    leaves partial register tiles."""
    rng = np.random.default_rng(36)
    m, k, n, g = 90, 33, 70, 4
    sizes = jnp.asarray(skewed_sizes(rng, m, g))
    lhs, rhs = operands(rng, m, k, n, g, dtype)
    lhs = lhs.at[5].set(jnp.nan).at[6].set(jnp.inf) * 37.0   # NaN rows; a wide range of magnitudes
    wide = cv.gmm(lhs, rhs, sizes, backend="native_cpu", preferred_element_type=jnp.float32)
    narrow = cv.gmm(lhs, rhs, sizes, backend="native_cpu", preferred_element_type=jnp.bfloat16)
    assert np.isnan(np.asarray(wide[5], np.float32)).all()
    got, want = np.asarray(narrow), np.asarray(wide.astype(jnp.bfloat16))
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.astype(np.float32)), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def test_avx2_build_is_not_the_default(monkeypatch):
    """An AVX2 build runs when named, and backend=None keeps xla beside it; the AMX and AVX-512 builds
    are the default (see native_cpu.DEFAULT_ISAS)."""
    monkeypatch.setattr(build, "status", lambda: build.NativeStatus(available=True, isa="avx2"))
    assert not native_cpu.chosen_by_default(jnp.float32, jnp.float32, jnp.float32, None)
    for isa in ("amx", "avx512"):
        monkeypatch.setattr(build, "status", lambda isa=isa: build.NativeStatus(available=True, isa=isa))
        assert native_cpu.chosen_by_default(jnp.bfloat16, jnp.bfloat16, jnp.float32, None)
    assert not native_cpu.chosen_by_default(jnp.float16, jnp.float16, jnp.float32, None)


@pytest.mark.skipif(os.environ.get("CONVEYOR_NATIVE_ISA") is not None or len(build.host_isas()) < 2
                    or build.find_compiler() is None, reason="needs a host with two instruction sets and a compiler")
def test_a_failed_build_leaves_the_next_instruction_set(monkeypatch, tmp_path):
    """A compiler that cannot build the best kernels (e.g. no -mamx-bf16 or -mavx512bf16) leaves the
    next build, and the reason is kept where none builds. Registration is stubbed: this process keeps
    its kernels."""
    best, next_best = build.host_isas()[:2]
    real_path, real_compile = build.library_path, build.compile_library

    def compile_or_fail(cxx, out, isa="avx512"):
        if isa == best:
            raise RuntimeError(f"no flags for {best} (test)")
        real_compile(cxx, out, isa)

    monkeypatch.setattr(build, "library_path", lambda cxx, isa="avx512": tmp_path / "none.so" if isa == best
                        else real_path(cxx, isa))
    monkeypatch.setattr(build, "compile_library", compile_or_fail)
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *a, **k: None)
    st = build.status.__wrapped__()
    assert st.available and st.isa == next_best, st
    monkeypatch.setenv("CONVEYOR_NATIVE_ISA", best)
    st = build.status.__wrapped__()
    assert not st.available and f"no flags for {best} (test)" in st.reason
