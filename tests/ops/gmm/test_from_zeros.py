"""tgmm whose sums start from zeros (`cv.tgmm` without existing_out, and every weight gradient
of gmm, of the gathered gmm and of gmm_scatter_add): existing_out then gives only the output's
shape, every backend ignores its values, and the mosaic_tpu kernels take no such operand and
write each group's block themselves, an empty group's zeros included.

Each backend is held to a float64 NumPy oracle (tolerance: tests/tolerance.py, m-long float32
sums); existing_out is NaN, so a backend that read it would fail. mosaic_tpu runs in the Pallas
TPU interpreter with race detection on (tests/conftest.py), mosaic_gpu in its interpreter on
bfloat16 operands (wgmma's; the oracle takes the same rounded values).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv
from conveyor.ops.gmm.gathered import bind_gathered_tgmm
from conveyor.ops.gmm.primitives import bind_tgmm
from tests.ops.gmm.base import assert_close
from tests.ops.gmm.problems import numpy_tgmm

BACKENDS = ("xla", "reference", "mosaic_tpu", "mosaic_gpu")
M, K, N = 256, 136, 24  # two 128-row tiles (tgmm's tm is a lane tile), a partial k tile
TILING = (128, 128, 128)
# Empty groups first, in the middle and last; the last empty group starts at the groups' end
# (row 160 of 256: rows past the groups belong to none) or, with all rows used, at row m, past
# the last tile (its one visit reads the last tile instead).
SIZES = ([0, 100, 0, 60, 0], [0, 168, 0, 88, 0], [10, 0, 0, 246, 0], [0, 0, 0, 0, 0])


def _params(backend, num_groups):
    return dict(
        num_groups=num_groups,
        out_dtype=jnp.float32,
        from_zeros=True,
        backend=backend,
        tiling=TILING if backend == "mosaic_tpu" else None,
        interpret=True if backend.startswith("mosaic") else None,
    )


def _normal(rng, shape, backend):
    dtype = jnp.bfloat16 if backend == "mosaic_gpu" else jnp.float32
    return jnp.asarray(rng.standard_normal(shape), dtype)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_tgmm_from_zeros_ignores_existing_out_and_writes_empty_groups_zeros(backend, sizes):
    rng = np.random.default_rng(sum(sizes) + len(sizes))
    x, y = _normal(rng, (K, M), backend), _normal(rng, (M, N), backend)
    g = len(sizes)
    poison = jnp.full((g, K, N), jnp.nan, jnp.float32)
    out = bind_tgmm(
        x, y, jnp.asarray(sizes, jnp.int32), jnp.int32(0), poison, **_params(backend, g)
    )
    assert_close(out, numpy_tgmm(x, y, sizes), M, jnp.float32)
    for i in np.flatnonzero(np.asarray(sizes) == 0):
        np.testing.assert_array_equal(out[i], 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tgmm_from_zeros_on_a_shard_of_the_groups(backend):
    """Local groups 1..3 of 5 (group_offset 1): the empty ones among them are written too."""
    sizes = [20, 0, 130, 0, 30]
    rng = np.random.default_rng(5)
    x, y = _normal(rng, (K, M), backend), _normal(rng, (M, N), backend)
    poison = jnp.full((3, K, N), jnp.nan, jnp.float32)
    out = bind_tgmm(
        x, y, jnp.asarray(sizes, jnp.int32), jnp.int32(1), poison, **_params(backend, 3)
    )
    assert_close(out, numpy_tgmm(x, y, sizes, num_groups=3, offset=1), M, jnp.float32)
    np.testing.assert_array_equal(out[0], 0.0)
    np.testing.assert_array_equal(out[2], 0.0)


@pytest.mark.parametrize("side", ["lhs", "rhs"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gathered_tgmm_from_zeros_ignores_existing_out(backend, side):
    sizes = [0, 140, 0, 116, 0]
    rng = np.random.default_rng(7)
    rows = 29  # the gathered side's own rows; M of them are gathered
    idx = jnp.asarray(rng.integers(0, rows, M), jnp.int32)
    if side == "lhs":  # A = lhs[idx] ([M, K] gathered), B = rhs ([M, N])
        lhs, rhs = _normal(rng, (rows, K), backend), _normal(rng, (M, N), backend)
        a, b = np.asarray(lhs)[np.asarray(idx)], np.asarray(rhs)
    else:  # A = lhs ([M, K]), B = rhs[idx] ([M, N] gathered)
        lhs, rhs = _normal(rng, (M, K), backend), _normal(rng, (rows, N), backend)
        a, b = np.asarray(lhs), np.asarray(rhs)[np.asarray(idx)]
    poison = jnp.full((len(sizes), K, N), jnp.nan, jnp.float32)
    out = bind_gathered_tgmm(
        lhs,
        rhs,
        jnp.asarray(sizes, jnp.int32),
        jnp.int32(0),
        poison,
        idx,
        gathered_side=side,
        **_params(backend, len(sizes)),
    )
    assert_close(out, numpy_tgmm(a.T, b, sizes), M, jnp.float32)
    for i in (0, 2, 4):
        np.testing.assert_array_equal(out[i], 0.0)


def _tpu_kernels(fn, *args) -> dict[str, list[str]]:
    """Per Conveyor kernel in `fn`'s TPU export: its custom calls' lines."""
    text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
    kernels: dict[str, list[str]] = {}
    for line in text.splitlines():
        name = re.search(r'kernel_name = "(conveyor_\w+)"', line)
        if "tpu_custom_call" in line and name:
            kernels.setdefault(name.group(1), []).append(line)
    return kernels


def test_tpu_weight_gradients_take_no_existing_out_operand():
    """The kernels that start from zeros alias nothing (no zero fill to write and read back);
    with an existing_out, tgmm's kernel still takes it, aliased to its output."""
    m, k, n, g = 256, 256, 256, 4
    bf16 = jnp.bfloat16
    sizes = jax.ShapeDtypeStruct((g,), jnp.int32)
    xt, dy = jax.ShapeDtypeStruct((k, m), bf16), jax.ShapeDtypeStruct((m, n), bf16)
    existing = jax.ShapeDtypeStruct((g, k, n), jnp.float32)

    def plain(x, y, s):
        return cv.tgmm(x, y, s, backend="mosaic_tpu")

    def adding(x, y, s, e):
        return cv.tgmm(x, y, s, backend="mosaic_tpu", existing_out=e)

    def weight_grad(x, w, s):
        return jax.grad(lambda w: cv.gmm(x, w, s, backend="mosaic_tpu").sum())(w)

    def gathered_weight_grad(x, w, s, idx):
        def loss(w):
            return cv.gmm(x, w, s, lhs_indices=idx, backend="mosaic_tpu").sum()

        return jax.grad(loss)(w)

    x, w = jax.ShapeDtypeStruct((m, k), bf16), jax.ShapeDtypeStruct((g, k, n), bf16)
    idx = jax.ShapeDtypeStruct((m,), jnp.int32)
    cases = (
        ("conveyor_tgmm", _tpu_kernels(plain, xt, dy, sizes), False),
        ("conveyor_tgmm", _tpu_kernels(weight_grad, x, w, sizes), False),
        ("conveyor_gathered_tgmm", _tpu_kernels(gathered_weight_grad, x, w, sizes, idx), False),
        ("conveyor_tgmm", _tpu_kernels(adding, xt, dy, sizes, existing), True),
    )
    for kernel, kernels, aliased in cases:
        assert len(kernels[kernel]) == 1, (kernel, sorted(kernels))
        assert ("output_operand_aliases" in kernels[kernel][0]) == aliased, kernel
