"""tgmm on mosaic_gpu, and gradients through both mosaic_gpu kernels: run by the Mosaic GPU
interpreter (race detection on) against float64 numpy oracles on bfloat16 inputs, and exported for
cuda at MoE sizes (the compile checks shared memory and wgmma shapes; the interpreter does not).

About 1 s per kernel call under the interpreter, so the shapes are small: m=200 is not a multiple
of the 64-row reduction block, k=128 is one output row tile, n=128 one column tile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv
from tests.ops.gmm.base import assert_close, tolerance
from tests.ops.gmm.problems import numpy_gmm, numpy_tgmm, operands, skewed_sizes
from tests.platform import gpu_interpret, gpu_interpreter_always

M, K, N = 200, 128, 128


def _tgmm(*args, **kw):
    return cv.tgmm(*args, backend="mosaic_gpu", interpret=gpu_interpret(detect_races=True), **kw)


def _gmm(*args, **kw):
    return cv.gmm(*args, backend="mosaic_gpu", interpret=gpu_interpret(detect_races=True), **kw)


def _bf16(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


def _f64(x):
    return np.asarray(x, np.float64)


@pytest.mark.parametrize(
    "sizes",
    [[0, 70, 0, 100], [60, 90, 0], [10, 20, 150, 20]],
    ids=["empty-first-and-middle", "empty-last", "two-groups-inside-one-block"],
)
def test_tgmm_matches_the_reference_and_empty_groups_are_exact_zeros(sizes):
    rng = np.random.default_rng(4706)
    used = sum(sizes)
    # Rows no group owns hold NaN and inf: masking by multiplication would turn them into NaN.
    x = _bf16(rng, (K, M)).at[:, used:].set(jnp.nan)
    y = _bf16(rng, (M, N)).at[used:].set(jnp.inf)
    out = jax.jit(lambda a, b, s: _tgmm(a, b, s))(x, y, jnp.asarray(sizes, jnp.int32))
    for i in np.flatnonzero(np.asarray(sizes) == 0):
        np.testing.assert_array_equal(out[i], 0.0)
    assert_close(out, numpy_tgmm(x[:, :used], y[:used], np.asarray(sizes)), M, jnp.float32)


def test_tgmm_group_offset_num_actual_groups_existing_out_and_16bit_output():
    rng = np.random.default_rng(21)
    sizes = skewed_sizes(rng, M, 4, total=M - 9)
    x, y = _bf16(rng, (K, M)), _bf16(rng, (M, N))
    ex = _bf16(rng, (2, K, N))
    out = _tgmm(
        x,
        y,
        jnp.asarray(sizes),
        group_offset=1,
        num_actual_groups=2,
        existing_out=ex,
        preferred_element_type=jnp.bfloat16,
    )
    assert out.dtype == jnp.bfloat16 and out.shape == (2, K, N)
    prod = numpy_tgmm(x, y, sizes, num_groups=2, offset=1)
    want = prod + _f64(ex)
    # existing_out is added after the kernel: the product is rounded to bfloat16 once more before
    # the sum (the documented rule), up to half an ulp of the product beyond one rounding of the
    # sum.
    bound = tolerance(want, M, jnp.bfloat16) + 0.5 * float(jnp.finfo(jnp.bfloat16).eps) * np.abs(
        prod
    )
    assert (np.abs(_f64(out) - want) <= bound).all()


def test_tgmm_traced_sizes_reuse_one_compilation():
    rng = np.random.default_rng(22)
    x, y = _bf16(rng, (K, M)), _bf16(rng, (M, N))
    f = jax.jit(lambda a, b, s: _tgmm(a, b, s))
    for sizes in ([64, 64, 72], [0, 199, 1], [0, 0, 0]):
        out = f(x, y, jnp.asarray(sizes, jnp.int32))
        assert_close(out, numpy_tgmm(x, y, np.asarray(sizes)), M, jnp.float32)
    assert f._cache_size() == 1


def test_gmm_gradients_run_both_gpu_kernels():
    """Reverse mode of gmm: d lhs is gmm(ct, rhs^T), d rhs is tgmm(lhs^T, ct), both on
    mosaic_gpu."""
    rng = np.random.default_rng(23)
    sizes = skewed_sizes(rng, M, 3, total=M - 7)
    lhs, rhs = operands(rng, M, K, N, 3, jnp.bfloat16)
    ct = _bf16(rng, (M, N))
    gs = jnp.asarray(sizes)

    def loss(l, r):
        return jnp.vdot(
            _gmm(l, r, gs, preferred_element_type=jnp.bfloat16).astype(jnp.float32),
            ct.astype(jnp.float32),
        )

    d_lhs, d_rhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    assert d_lhs.dtype == d_rhs.dtype == jnp.bfloat16
    assert_close(d_lhs, numpy_gmm(ct, rhs, sizes, transpose_rhs=True), N, jnp.bfloat16)
    np.testing.assert_array_equal(d_lhs[M - 7 :], 0.0)  # rows of no group: exactly 0
    assert_close(d_rhs, numpy_tgmm(lhs.T, ct, sizes), M, jnp.bfloat16)


def test_a_float32_cotangent_is_rounded_to_the_operand_dtype():
    """The documented rule (mosaic_gpu.wgmma_operands): gmm's default float32 output sends a float32
    cotangent back; the kernels multiply it rounded to the 16-bit operands' dtype."""
    rng = np.random.default_rng(24)
    sizes = skewed_sizes(rng, M, 2)
    lhs, rhs = operands(rng, M, K, N, 2, jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
    gs = jnp.asarray(sizes)
    d_lhs, d_rhs = jax.grad(lambda l, r: jnp.vdot(_gmm(l, r, gs), ct), argnums=(0, 1))(lhs, rhs)
    ct16 = ct.astype(jnp.bfloat16)
    assert_close(d_lhs, numpy_gmm(ct16, rhs, sizes, transpose_rhs=True), N, jnp.bfloat16)
    assert_close(d_rhs, numpy_tgmm(lhs.T, ct16, sizes), M, jnp.bfloat16)


def test_tgmm_gradients_run_gmm_with_transposed_weights():
    rng = np.random.default_rng(25)
    sizes = skewed_sizes(rng, M, 2)
    x, y = _bf16(rng, (K, M)), _bf16(rng, (M, N))
    ct = _bf16(rng, (2, K, N))
    gs = jnp.asarray(sizes)

    def loss(a, b):
        return jnp.vdot(
            _tgmm(a, b, gs, preferred_element_type=jnp.bfloat16).astype(jnp.float32),
            ct.astype(jnp.float32),
        )

    d_x, d_y = jax.grad(loss, argnums=(0, 1))(x, y)
    # d x[:, rows_i] = ct[i] @ y[rows_i]^T and d y[rows_i] = x[:, rows_i]^T @ ct[i]
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    want_x, want_y = np.zeros((K, M)), np.zeros((M, N))
    for i in range(2):
        s, e = bounds[i], bounds[i + 1]
        want_x[:, s:e] = _f64(ct[i]) @ _f64(y[s:e]).T
        want_y[s:e] = _f64(x[:, s:e]).T @ _f64(ct[i])
    assert_close(d_x, want_x, N, jnp.bfloat16)
    assert_close(d_y, want_y, K, jnp.bfloat16)


@pytest.mark.parametrize("groups", [8, 64, 256])
def test_tgmm_exports_for_cuda_at_moe_sizes(groups):
    """Mixtral-like m=8192 tokens, k=4096, n=14336 in bf16: the default tn=256 (split by columns
    between the compute warpgroups), with a float32 output too (the pipeline takes the slots that
    fit beside the staging buffer), and tn=128 (split by rows)."""
    m, k, n = 8192, 4096, 14336
    args = (
        jax.ShapeDtypeStruct((k, m), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
    )
    for tiling, out_dtype in (
        (None, jnp.bfloat16),
        ((64, 128, 256), jnp.float32),
        ((64, 128, 128), jnp.bfloat16),
    ):
        f = jax.jit(
            lambda a, b, s: cv.tgmm(
                a, b, s, backend="mosaic_gpu", tiling=tiling, preferred_element_type=out_dtype
            )
        )
        assert jax.export.export(f, platforms=["cuda"])(*args).platforms == ("cuda",)


@pytest.mark.parametrize(
    "k, n, sizes",
    [(96, 64, [0, 70, 0, 100]), (200, 192, [10, 20, 150, 20])],
    ids=["k96-n64", "k200-n192"],
)
def test_tgmm_with_k_past_the_row_tile_and_64_column_tiles_matches_the_reference(k, n, sizes):
    """k=96 and k=200 end inside a 128-row output tile (lhs gets zero rows; only rows below k are
    stored, in power-of-two chunks); n=64 and n=192 run with tn=64, whose boundary rhs blocks
    compute thread 0 masks whole. Rows no group owns hold NaN and inf."""
    rng = np.random.default_rng(4707)
    used = sum(sizes)
    x = _bf16(rng, (k, M)).at[:, used:].set(jnp.nan)
    y = _bf16(rng, (M, n)).at[used:].set(jnp.inf)
    out = _tgmm(x, y, jnp.asarray(sizes, jnp.int32))
    assert out.shape == (len(sizes), k, n)
    for i in np.flatnonzero(np.asarray(sizes) == 0):
        np.testing.assert_array_equal(out[i], 0.0)
    assert_close(out, numpy_tgmm(x[:, :used], y[:used], np.asarray(sizes)), M, jnp.float32)


@pytest.mark.parametrize("k", [128, 200])
def test_tgmm_column_split_tiles_match_the_reference(k):
    """n=512 runs with the default tn=256: each compute warpgroup owns all 128 output rows and 128
    columns of a tile and stores them in two 64-row parts (with k=200, the last tile's second
    part stores 8 rows, as the rows below k). Two column tiles; empty groups; NaN and inf in the
    rows no group owns."""
    n, sizes = 512, [0, 70, 0, 100]
    rng = np.random.default_rng(4708)
    used = sum(sizes)
    x = _bf16(rng, (k, M)).at[:, used:].set(jnp.nan)
    y = _bf16(rng, (M, n)).at[used:].set(jnp.inf)
    out = _tgmm(x, y, jnp.asarray(sizes, jnp.int32))
    for i in np.flatnonzero(np.asarray(sizes) == 0):
        np.testing.assert_array_equal(out[i], 0.0)
    assert_close(out, numpy_tgmm(x[:, :used], y[:used], np.asarray(sizes)), M, jnp.float32)


def test_default_tgmm_tiles_narrow_to_64_columns_where_128_do_not_divide():
    from conveyor.ops.gmm.tiling import MOSAIC_GPU

    assert MOSAIC_GPU.tgmm_tiles_for(14336) == (64, 128, 256)
    assert MOSAIC_GPU.tgmm_tiles_for(2880) == (64, 128, 64)
    # none divides: kept, and refused by the kernel
    assert MOSAIC_GPU.tgmm_tiles_for(96) == (
        64,
        128,
        256,
    )


def test_what_the_gpu_tgmm_cannot_do_is_refused_by_name():
    x, y = jnp.zeros((128, 128), jnp.bfloat16), jnp.zeros((128, 256), jnp.bfloat16)
    gs = jnp.asarray([64, 64], jnp.int32)
    with pytest.raises(
        NotImplementedError, match="mosaic_gpu tgmm: wgmma takes bfloat16 or float16"
    ):
        cv.tgmm(
            x.astype(jnp.float32), y.astype(jnp.float32), gs, backend="mosaic_gpu", interpret=True
        )
    with pytest.raises(ValueError, match="tiling: mosaic_gpu tgmm reduces tm=64 rows per step"):
        cv.tgmm(x, y, gs, backend="mosaic_gpu", interpret=True, tiling=(128, 128, 128))
    with pytest.raises(ValueError, match="tiling: mosaic_gpu tgmm uses tk=128"):
        cv.tgmm(x, y, gs, backend="mosaic_gpu", interpret=True, tiling=(64, 64, 128))
    with pytest.raises(ValueError, match="tn to divide n=256, be a multiple of 64"):
        cv.tgmm(x, y, gs, backend="mosaic_gpu", interpret=True, tiling=(64, 128, 32))
    # Above 128 columns each compute warpgroup takes half: whole 128-byte swizzled rows.
    with pytest.raises(
        ValueError, match="tn to divide n=384, be a multiple of 128 and at most 256, got tn=192"
    ):
        cv.tgmm(
            x,
            jnp.zeros((128, 384), jnp.bfloat16),
            gs,
            backend="mosaic_gpu",
            interpret=True,
            tiling=(64, 128, 192),
        )


@pytest.mark.parametrize(
    "k, n, groups", [(4096, 14336, 8), (2880, 2880, 128)], ids=["mixtral", "gpt-oss"]
)
def test_the_backward_pass_exports_for_cuda_at_moe_sizes(k, n, groups):
    """jax.grad of a bf16 gmm with m=8192 tokens: the transposed-weight gmm (d lhs) and the tgmm
    (d rhs) compile as two Mosaic GPU kernels. Mixtral-like k=4096, n=14336, G=8; gpt-oss-like
    hidden size 2880 with 128 experts, where the forward and d lhs gmm run tn=64 and the tgmm a
    last output row tile that passes k (2880 = 22.5 * 128) and tn=64."""
    m = 8192

    def loss(x, w, s, ct):
        out = cv.gmm(x, w, s, backend="mosaic_gpu", preferred_element_type=jnp.bfloat16)
        return jnp.vdot(out.astype(jnp.float32), ct)

    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1))), platforms=["cuda"])(
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups, k, n), jnp.bfloat16),
        jax.ShapeDtypeStruct((groups,), jnp.int32),
        jax.ShapeDtypeStruct((m, n), jnp.float32),
    )
    assert exported.mlir_module().count("custom_call @mosaic_gpu") == 2, (
        "d lhs and d rhs: one Mosaic GPU kernel each"
    )


def test_simulator_replays_the_copies_each_thread_block_issues():
    """cv.sim.simulate_tgmm on GPU replays this kernel's thread blocks (`gpu_blocks`): a block per
    (group, k tile, n tile), each fetching the row blocks its group touches. The copies the kernel
    issues (recorded while it runs) are those blocks' planned copies; an empty group's blocks
    fetch nothing."""
    import collections

    from conveyor.ints import cdiv
    from conveyor.ops.gmm import gpu_blocks
    from conveyor.ops.gmm.metadata import count_row_blocks
    from conveyor.pipeline.lowering import record_issued
    from conveyor.plans.program import Copy

    sizes, k, n = [70, 0, 130], 128, 256  # row blocks of 64: [0, 2), none, [1, 4)
    rng = np.random.default_rng(4712)
    x, y = _bf16(rng, (k, sum(sizes))), _bf16(rng, (sum(sizes), n))
    with record_issued() as log:
        # a bfloat16 output, as the simulator prices (the staging buffer sets the slot count)
        out = cv.tgmm(
            x,
            y,
            jnp.asarray(sizes, jnp.int32),
            preferred_element_type=jnp.bfloat16,
            backend="mosaic_gpu",
            # the records are debug callbacks, which Mosaic GPU lowers only in its interpreter
            interpret=gpu_interpreter_always(detect_races=True),
        )
        jax.block_until_ready(out)
    report = cv.sim.simulate_tgmm(sizes, k, n, hardware="h100")
    tm, tk, tn = report.config["tiling"]
    tiles_per_group = cdiv(k, tk) * (n // tn)
    planned = collections.Counter()
    for rows in count_row_blocks(sizes, tm):
        if rows:
            args = gpu_blocks.tgmm_block_pipeline(
                rows, (tm, tk, tn), stages=report.config["stages"]
            )
            for copy in gpu_blocks.block_plan(args, dynamic=True).program().copies():
                planned[copy] += tiles_per_group
    assert count_row_blocks(sizes, tm) == [2, 0, 3]
    assert collections.Counter(a for a in log if isinstance(a, Copy)) == planned
