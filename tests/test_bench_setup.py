"""The benchmarks' own set-up: floors compute what they claim (a wrong floor would flatter every
ratio), and every kernel a benchmark builds is one the backend accepts (checked by tracing only)."""
import jax
import numpy as np
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conveyor.bench import pipeline as bench_pipeline

from conveyor.bench.gmm import equal_split_gmm, equal_split_tgmm
from conveyor.bench.pipeline import step_loop_matmul


def test_step_loop_matmul_is_a_matmul():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 32)), rng.standard_normal((32, 48))
    got = step_loop_matmul(64, 32, 48, 16, 8, 16)(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    # f32 accumulation over k=32 of unit normals: a few ulps of values of size ~sqrt(32).
    np.testing.assert_allclose(got, x @ y, rtol=0, atol=1e-4)


def test_equal_split_floors_are_grouped_matmuls():
    rng = np.random.default_rng(1)
    g, rows, k, n = 4, 6, 5, 7
    x, w = rng.standard_normal((g * rows, k)), rng.standard_normal((g, k, n))
    out = equal_split_gmm(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    want = np.concatenate([x[i * rows:(i + 1) * rows] @ w[i] for i in range(g)])
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    y = rng.standard_normal((g * rows, n))
    t = equal_split_tgmm(jnp.asarray(x.T, jnp.float32), jnp.asarray(y, jnp.float32), g)
    want_t = np.stack([x[i * rows:(i + 1) * rows].T @ y[i * rows:(i + 1) * rows] for i in range(g)])
    np.testing.assert_allclose(t, want_t, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name,size,blocks", [c[:3] for c in bench_pipeline.CASES if c[3]])
def test_pipeline_bench_kernels_trace_on_every_backend_they_time(name, size, blocks):
    """A block config over the shared-memory budget made `conveyor bench pipeline` fail at its
    second row (2026-11-24): trace each case's kernels as the benchmark builds them."""
    gpu = plgpu.InterpretGPUParams()
    if name == "add":
        m, n = size
        x = jax.ShapeDtypeStruct((m, n), jnp.float32)
        builds = [bench_pipeline.elementwise_add(m, n, blocks[0], backend="xla")]
        steps = m // blocks[0]
        if steps <= bench_pipeline.INTERPRETER_MAX_STEPS:
            builds.append(bench_pipeline.elementwise_add(m, n, blocks[0], backend="mosaic_gpu", interpret=gpu))
        args = (x, x)
    else:
        m, k, n = size
        build = bench_pipeline.tiled_matmul if name == "matmul" else bench_pipeline.warp_specialized_matmul
        builds = [build(m, k, n, *blocks, backend="xla")]
        steps = (m // blocks[0]) * (n // blocks[2]) * (k // blocks[1])
        if steps <= bench_pipeline.INTERPRETER_MAX_STEPS:
            builds.append(build(m, k, n, *blocks, backend="mosaic_gpu", interpret=gpu))
        args = (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k, n), jnp.float32))
    for f in builds:
        out = jax.eval_shape(f, *args)
        assert out.shape == (args[0].shape[0], args[1].shape[1])
