"""gmm/tgmm Mosaic TPU kernel: run through the Pallas TPU interpreter on CPU, and exported for TPU.

The interpreter costs milliseconds per grid step, so this backend runs the shared suite on small
shapes with G in (1, 3) plus a few kernel-specific checks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.ops.gmm.base import GmmBackendTests, assert_close
from tests.ops.gmm.problems import numpy_gmm, numpy_tgmm, operands


class TestMosaicTpuInterpreter(GmmBackendTests):
    backend = "mosaic_tpu"
    interpret = True
    m, k, n = 40, 136, 24  # k = 128 + 8: exercises the in-kernel k-remainder mask
    tiling = (16, 128, 128)
    groups = (3,)
    half_dtypes = (jnp.bfloat16,)

    def tgmm_tiling(self, tiling):
        # tgmm's grouped dim is a lane dimension of its lhs block on TPU: tm must be 128-aligned.
        return None if tiling is None else (max(128, tiling[0] // 128 * 128),) + tuple(tiling[1:])


def test_race_detector_finds_nothing():
    rng = np.random.default_rng(40)
    sizes = np.array([5, 0, 20, 7], np.int32)
    lhs, rhs = operands(rng, 40, 136, 24, 4, jnp.float32)
    params = pltpu.InterpretParams(detect_races=True)
    out = cv.gmm(
        lhs, rhs, jnp.asarray(sizes), backend="mosaic_tpu", interpret=params, tiling=(16, 128, 128)
    )
    assert_close(out, numpy_gmm(lhs, rhs, sizes), 136, jnp.float32)
    t = cv.tgmm(
        lhs.T,
        out,
        jnp.asarray(sizes),
        backend="mosaic_tpu",
        interpret=params,
        tiling=(128, 128, 128),
    )
    assert_close(t, numpy_tgmm(lhs.T, out, sizes), 40, jnp.float32)


def test_misaligned_tiles_are_refused_clearly():
    lhs, rhs = operands(np.random.default_rng(41), 40, 300, 24, 2, jnp.float32)
    with pytest.raises(
        ValueError,
        match=r"gmm needs tk to be a multiple of 128 for float32 \(or >= k=300\), got tk=100",
    ):
        cv.gmm(
            lhs,
            rhs,
            jnp.asarray([20, 20]),
            backend="mosaic_tpu",
            interpret=True,
            tiling=(8, 100, 128),
        )
    with pytest.raises(ValueError, match=r"needs tm to be a multiple of 8"):
        cv.gmm(
            lhs,
            rhs,
            jnp.asarray([20, 20]),
            backend="mosaic_tpu",
            interpret=True,
            tiling=(12, 128, 128),
        )
    with pytest.raises(ValueError, match=r"tgmm needs tm to be a multiple of 128"):
        cv.tgmm(
            lhs.T,
            lhs,
            jnp.asarray([20, 20]),
            backend="mosaic_tpu",
            interpret=True,
            tiling=(16, 128, 128),
        )


def test_float16_is_refused_not_miscomputed():
    lhs, rhs = operands(np.random.default_rng(42), 16, 8, 8, 1, jnp.float16)
    with pytest.raises(NotImplementedError, match="float32 and bfloat16"):
        cv.gmm(lhs, rhs, jnp.asarray([16]), backend="mosaic_tpu", interpret=True)


@pytest.mark.parametrize("op", ["gmm", "tgmm"])
def test_exports_for_tpu(op):
    m, k, n, g = 512, 1024, 768, 8
    gs = jax.ShapeDtypeStruct((g,), jnp.int32)
    if op == "gmm":
        fn = lambda l, r, s: cv.gmm(l, r, s, backend="mosaic_tpu")
        args = (
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
            gs,
        )
    else:
        fn = lambda l, r, s: cv.tgmm(l, r, s, backend="mosaic_tpu")
        args = (
            jax.ShapeDtypeStruct((k, m), jnp.bfloat16),
            jax.ShapeDtypeStruct((m, n), jnp.bfloat16),
            gs,
        )
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*args)
    text = exported.mlir_module()
    assert "tpu_custom_call" in text
    assert exported.platforms == ("tpu",)
    assert len(exported.serialize()) > 0
