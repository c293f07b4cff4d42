"""The CPU-side GPU lowering check (`make gpu-lowering-check`, tests/cuda_lowering.py) fails on a
kernel body the H200 refused to lower, and passes one it lowers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv
from conveyor import kernel_gpu
from conveyor.mpmd import mosaic_gpu as mpmd_gpu
from tests import cuda_lowering


@pytest.fixture
def lowering(monkeypatch):
    """cuda_lowering's launchers for this test only (monkeypatch restores the originals)."""
    monkeypatch.setattr(kernel_gpu, "launch", kernel_gpu.launch)
    monkeypatch.setattr(mpmd_gpu, "build", mpmd_gpu.build)
    cuda_lowering.install()


def _pipeline(body):
    def kernel(x_ref, w_ref, o_ref):
        spec = cv.BlockSpec((64, 128), lambda i: (i, 0))
        cv.emit_pipeline(
            body,
            grid=(2,),
            in_specs=[spec, cv.BlockSpec((128, 128), lambda i: (0, 0))],
            out_specs=[spec],
        )(x_ref, w_ref, o_ref)

    return cv.kernel(
        kernel, jax.ShapeDtypeStruct((128, 128), jnp.float32), backend="mosaic_gpu", interpret=False
    )


def test_a_body_mosaic_gpu_does_not_lower_fails(lowering):
    x, w = jnp.ones((128, 128), jnp.float32), jnp.ones((128, 128), jnp.float32)
    f32_matmul = _pipeline(lambda idx, xb, wb, ob: ob.__setitem__(..., xb[...] @ wb[...]))
    with pytest.raises(cuda_lowering.CudaLoweringError, match="dot_general"):
        f32_matmul(x, w)


def test_a_body_it_lowers_returns_zeros_and_is_counted(lowering):
    x, w = jnp.ones((128, 128), jnp.float32), jnp.ones((128, 128), jnp.float32)
    cuda_lowering.lowered = 0
    out = _pipeline(lambda idx, xb, wb, ob: ob.__setitem__(..., xb[...] * 2))(x, w)
    np.testing.assert_array_equal(out, 0.0)
    assert cuda_lowering.lowered == 1
