"""A pipelined matmul written once and run on every backend Conveyor has for cv.kernel.

Any m, k, n: the grid is cdiv(size, block) and the last block of a dimension is partial. The K
reduction accumulates in the output block, which stays resident in on-chip memory while
its block index (i, j) does not change; two input slots let the next blocks' copies overlap the
current step's dot on hardware. `cv.dot` is the portable matmul of a body: `jnp.dot` on xla and
TPU, a wgmma on GPU, so the same kernel runs on xla and both interpreters and compiles for cuda
and tpu (bfloat16 inputs, float32 accumulation: wgmma takes 16-bit operands).

    python examples/pipelined_matmul.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv


def matmul(x, y, *, bm=64, bk=128, bn=128, backend=None, interpret=False):
    m, k = x.shape
    _, n = y.shape

    def kernel(x_ref, y_ref, o_ref):
        def body(indices, x_blk, y_blk, o_blk):
            _, _, kk = indices
            cv.dot(x_blk, y_blk, o_blk, accumulate=kk > 0)  # o = (o if kk > 0 else 0) + x @ y

        cv.emit_pipeline(
            body,
            grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
            in_specs=[
                cv.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                cv.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            ],
            out_specs=[cv.BlockSpec((bm, bn), lambda i, j, kk: (i, j))],
            max_concurrent_steps=2,
        )(x_ref, y_ref, o_ref)

    return cv.kernel(
        kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), backend=backend, interpret=interpret
    )(x, y)


def matmul_warp_specialized(
    x, y, *, bm=128, bk=64, bn=128, compute_threads=2, backend=None, interpret=False
):
    """The same matmul with a memory thread feeding `compute_threads` compute threads (GPU style);
    each compute thread owns bm / compute_threads rows of the shared output block."""
    m, k = x.shape
    _, n = y.shape
    rows = bm // compute_threads

    def kernel(x_ref, y_ref, o_ref):
        def body(indices, x_blk, y_blk, o_blk):
            _, _, kk = indices
            mine = pl.ds(lax.axis_index("wg") * rows, rows)
            cv.dot(x_blk.at[mine, :], y_blk, o_blk.at[mine, :], accumulate=kk > 0)

        cv.emit_pipeline_warp_specialized(
            body,
            grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=compute_threads,
            in_specs=[
                cv.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                cv.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            ],
            out_specs=[cv.BlockSpec((bm, bn), lambda i, j, kk: (i, j))],
        )(x_ref, y_ref, o_ref)

    return cv.kernel(
        kernel,
        jax.ShapeDtypeStruct((m, n), jnp.float32),
        backend=backend,
        interpret=interpret,
        num_threads=compute_threads + 1,
        thread_name="wg",
    )(x, y)


def main():
    rng = np.random.default_rng(0)
    # 208 rows: the last 64-row block is partial (16 rows; the copies move what lies inside the
    # array). The compilers still want each array dimension a multiple of its memory tile (16
    # bf16 rows on TPU, 8 on GPU): docs/pipelining.md.
    x = jnp.asarray(rng.standard_normal((208, 512)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((512, 256)), jnp.bfloat16)
    # Against float64 products of the same bfloat16 values: only float32 accumulation error remains
    # (512 terms of size ~1: well under 1e-3).
    expect = np.asarray(x, np.float64) @ np.asarray(y, np.float64)
    runs = {
        "xla": dict(backend="xla"),
        "mosaic_tpu (interpreter, race detection)": dict(
            backend="mosaic_tpu", interpret=pltpu.InterpretParams(detect_races=True)
        ),
        "mosaic_gpu (interpreter, race detection)": dict(
            backend="mosaic_gpu", interpret=plgpu.InterpretGPUParams(detect_races=True)
        ),
    }
    for name, kw in runs.items():
        out = jax.jit(lambda a, b, kw=kw: matmul(a, b, **kw))(x, y)
        err = float(np.abs(np.asarray(out) - expect).max())
        print(f"{name:45s} max |error| vs float64: {err:.2e}")
        assert err < 1e-3, name
    for name, kw in [
        ("warp-specialized xla", dict(backend="xla")),
        (
            "warp-specialized mosaic_gpu (interpreter, race detection)",
            dict(backend="mosaic_gpu", interpret=plgpu.InterpretGPUParams(detect_races=True)),
        ),
    ]:
        out = jax.jit(lambda a, b, kw=kw: matmul_warp_specialized(a, b, **kw))(x, y)
        err = float(np.abs(np.asarray(out) - expect).max())
        print(f"{name:45s} max |error| vs float64: {err:.2e}")
        assert err < 1e-3, name
    # The same kernels compile for a real TPU and a real GPU (sm_90) without either being present.
    for platform, backend, fn in [
        ("tpu", "mosaic_tpu", matmul),
        ("cuda", "mosaic_gpu", matmul),
        ("cuda", "mosaic_gpu", matmul_warp_specialized),
    ]:
        exported = jax.export.export(
            jax.jit(lambda a, b, fn=fn, backend=backend: fn(a, b, backend=backend)),
            platforms=[platform],
        )(x, y)
        print(
            f"{fn.__name__} exported for {exported.platforms}: {len(exported.mlir_module())} "
            "characters"
        )


if __name__ == "__main__":
    main()
