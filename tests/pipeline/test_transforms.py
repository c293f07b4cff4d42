"""GPU shared-memory layout transforms on pipeline blocks (tiling, swizzle), as a Hopper wgmma
matmul uses them: honoured on mosaic_gpu (interpreter and cuda export), the plain logical block on
xla (the documented rule), refused by name on mosaic_tpu."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

# bf16 blocks 64 columns wide: 128-byte rows, the widest swizzle, in (8, 64) tiles.
LAYOUT = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))


def _matmul(x, y, *, spelling, backend, interpret=False, seen=None):
    m, k = x.shape
    n = y.shape[1]
    if spelling == "conveyor":
        a = cv.BlockSpec((64, 64), lambda i, j, kk: (i, kk), transforms=LAYOUT)
        b = cv.BlockSpec((64, 64), lambda i, j, kk: (kk, j), transforms=LAYOUT)
    else:  # upstream's spelling, as a ported kernel has it
        a = plgpu.BlockSpec((64, 64), lambda i, j, kk: (i, kk), transforms=LAYOUT)
        b = plgpu.BlockSpec((64, 64), lambda i, j, kk: (kk, j), transforms=LAYOUT)

    def kernel(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob):
            if seen is not None:
                seen.append(xb)
            cv.dot(xb, yb, ob, accumulate=idx[2] > 0)

        cv.emit_pipeline(
            body,
            grid=(m // 64, n // 64, k // 64),
            in_specs=[a, b],
            out_specs=[cv.BlockSpec((64, 64), lambda i, j, kk: (i, j))],
            max_concurrent_steps=2,
        )(x_ref, y_ref, o_ref)

    return cv.kernel(
        kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), backend=backend, interpret=interpret
    )


def _inputs():
    rng = np.random.default_rng(4727)
    return (
        jnp.asarray(rng.standard_normal((128, 192)), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((192, 128)), jnp.bfloat16),
    )


@pytest.mark.parametrize("spelling", ["conveyor", "plgpu"])
@pytest.mark.parametrize("backend", ["xla", "mosaic_gpu"])
def test_transformed_blocks_compute_the_same_matmul(backend, spelling):
    x, y = _inputs()
    seen = []
    f = _matmul(
        x,
        y,
        spelling=spelling,
        backend=backend,
        seen=seen,
        interpret=gpu_interpret(detect_races=True) if backend == "mosaic_gpu" else False,
    )
    # bf16 inputs are exact in float64; float32 accumulation of 192 terms of size ~1: << 1e-4.
    np.testing.assert_allclose(
        jax.jit(f)(x, y), np.asarray(x, np.float64) @ np.asarray(y, np.float64), rtol=0, atol=1e-4
    )
    # The body sees the block in its layout on GPU (as upstream's does), the plain block on xla.
    layout = repr(getattr(seen[0], "transforms", ()))
    if backend == "mosaic_gpu":
        assert "swizzle=128" in layout and "tiling=(8, 64)" in layout, layout
    else:
        assert "swizzle" not in layout and tuple(seen[0].shape) == (64, 64)


def test_transformed_pipeline_exports_for_cuda():
    x, y = _inputs()
    exported = jax.export.export(
        jax.jit(_matmul(x, y, spelling="plgpu", backend="mosaic_gpu")), platforms=["cuda"]
    )(x, y)
    assert exported.platforms == ("cuda",)


def test_mosaic_tpu_refuses_transforms_by_name():
    x = jnp.ones((32, 128), jnp.float32)

    def kernel(x_ref, o_ref):
        spec = plgpu.BlockSpec(
            (16, 128), lambda i: (i, 0), transforms=(plgpu.TilingTransform((8, 128)),)
        )
        cv.emit_pipeline(
            lambda idx, xb, ob: None,
            grid=(2,),
            in_specs=[spec],
            out_specs=[cv.BlockSpec((16, 128), lambda i: (i, 0))],
        )(x_ref, o_ref)

    f = cv.kernel(
        kernel,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        backend="mosaic_tpu",
        interpret=pltpu.InterpretParams(),
    )
    with pytest.raises(
        NotImplementedError, match=r"block transforms \(in\[0\]\) are Mosaic GPU shared-memory"
    ):
        jax.eval_shape(f, x)


def test_plan_records_transforms():
    p = cv.pipeline.plan(
        grid=(2,),
        in_specs=[
            plgpu.BlockSpec((64, 64), lambda i: (i, 0), transforms=LAYOUT),
            cv.BlockSpec((64, 64), lambda i: (i, 0)),
        ],
    )
    assert p.inputs[0].transforms == LAYOUT and p.inputs[1].transforms == ()
