"""cv.dot: one body matmul on every backend (xla, both interpreters), compiled for cuda and tpu,
and the shared-memory budget check of mosaic_gpu pipelines."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

BACKENDS = {
    "xla": dict(backend="xla"),
    "mosaic_tpu": dict(backend="mosaic_tpu", interpret=pltpu.InterpretParams(detect_races=True)),
    "mosaic_gpu": dict(backend="mosaic_gpu", interpret=gpu_interpret(detect_races=True)),
}


def _matmul(x, y, *, bm=64, bk=64, bn=128, accumulate="traced", **kernel_kw):
    """x @ y (float32) through a K-pipeline whose body is one cv.dot; `accumulate` "traced" is the
    usual `kk > 0`, "never" overwrites at every step (so only the last K block counts)."""
    m, k = x.shape
    n = y.shape[1]

    def kernel(x_ref, y_ref, o_ref):
        def body(indices, xb, yb, ob):
            cv.dot(xb, yb, ob, accumulate=indices[2] > 0 if accumulate == "traced" else False)

        cv.emit_pipeline(
            body,
            grid=(m // bm, n // bn, k // bk),
            in_specs=[
                cv.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                cv.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            ],
            out_specs=[cv.BlockSpec((bm, bn), lambda i, j, kk: (i, j))],
            max_concurrent_steps=2,
        )(x_ref, y_ref, o_ref)

    return cv.kernel(kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), **kernel_kw)(x, y)


def _inputs(seed, m=128, k=128, n=128):
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((k, n)), jnp.bfloat16),
    )


# bfloat16 inputs are exact in float64, so the only error is float32 accumulation over k <= 256
# terms of magnitude ~1 (sums of size ~16): a few ulps of 16 (2e-6 each), well under 1e-4.
TOL = 1e-4


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_cv_dot_accumulates_over_the_reduction_axis(backend):
    x, y = _inputs(4714, k=256)
    out = jax.jit(lambda a, b: _matmul(a, b, bk=128, **BACKENDS[backend]))(x, y)
    expect = np.asarray(x, np.float64) @ np.asarray(y, np.float64)
    np.testing.assert_allclose(np.asarray(out), expect, rtol=0, atol=TOL)


@pytest.mark.parametrize("backend", ["xla", "mosaic_gpu"])
def test_cv_dot_without_accumulate_overwrites(backend):
    x, y = _inputs(3)
    out = jax.jit(lambda a, b: _matmul(a, b, accumulate="never", **BACKENDS[backend]))(x, y)
    # the last K block only
    expect = np.asarray(x, np.float64)[:, 64:] @ np.asarray(y, np.float64)[64:]
    np.testing.assert_allclose(np.asarray(out), expect, rtol=0, atol=TOL)


@pytest.mark.parametrize("platform,backend", [("cuda", "mosaic_gpu"), ("tpu", "mosaic_tpu")])
def test_a_cv_dot_pipeline_compiles_for_real_hardware(platform, backend):
    x, y = _inputs(4, m=256, k=512, n=256)
    bk = 64 if backend == "mosaic_gpu" else 128
    exported = jax.export.export(
        jax.jit(lambda a, b: _matmul(a, b, bk=bk, backend=backend)), platforms=[platform]
    )(x, y)
    assert exported.platforms == (platform,)


def _dot_kernel(a_shape, a_dtype, b_shape, acc_dtype=jnp.float32, backend="mosaic_gpu"):
    def kernel(a_ref, b_ref, o_ref):
        cv.dot(a_ref, b_ref, o_ref)

    def run():
        out = jax.ShapeDtypeStruct((a_shape[0], b_shape[1]), acc_dtype)
        return jax.eval_shape(
            cv.kernel(kernel, out, backend=backend, interpret=backend != "xla"),
            jax.ShapeDtypeStruct(a_shape, a_dtype),
            jax.ShapeDtypeStruct(b_shape, a_dtype),
        )

    return run


def test_what_cv_dot_cannot_do_is_a_clear_error():
    with pytest.raises(NotImplementedError, match="wgmma takes bfloat16 or float16 operands"):
        _dot_kernel((64, 64), jnp.float32, (64, 64))()
    with pytest.raises(ValueError, match=r"rows a multiple of 64.*\(m, k, n\) = \(32, 64, 64\)"):
        _dot_kernel((32, 64), jnp.bfloat16, (64, 64))()
    with pytest.raises(ValueError, match="shapes do not chain"):
        _dot_kernel((64, 64), jnp.bfloat16, (32, 64), backend="xla")()
    with pytest.raises(ValueError, match="acc must be float32"):
        _dot_kernel((64, 64), jnp.bfloat16, (64, 64), acc_dtype=jnp.bfloat16, backend="xla")()
    with pytest.raises(RuntimeError, match="inside a kernel body"):
        cv.dot(None, None, None)


def test_a_pipeline_over_the_shared_memory_budget_is_refused_with_its_bytes():
    """2 x (128x128 + 128x128) bf16 input slots + 2 x 128x128 f32 output slots = 262144 B +
    barriers:
    Mosaic's compile refuses it (232448 B on sm_90); the GPU interpreter would run it."""
    x, y = _inputs(5, m=128, k=256, n=128)
    with pytest.raises(
        ValueError,
        match=r"needs 262176 B of shared memory, more than the 232448 B.*"
        r"in\[0\]: 2 slot\(s\) x 32768 B \(bfloat16 \(128, 128\)\)",
    ):
        _matmul(
            x, y, bm=128, bk=128, bn=128, backend="mosaic_gpu", interpret=plgpu.InterpretGPUParams()
        )
    # The same pipeline with half the K block fits, and compiles.
    jax.export.export(
        jax.jit(lambda a, b: _matmul(a, b, bm=128, bk=64, bn=128, backend="mosaic_gpu")),
        platforms=["cuda"],
    )(x, y)
