"""Upstream BlockSpec fields on pipeline operands. memory_space: the backend's own on-chip memory
is what Conveyor does anyway, so it is accepted; another backend's, or any other space, is
refused. oob_fill_mode: every mode is kept by the zero rule."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret


def _add_one(space):
    spec = pl.BlockSpec((8, 128), lambda i: (i, 0), memory_space=space)  # upstream's spelling

    def kernel(x_ref, o_ref):
        def body(indices, x_block, o_block):
            o_block[...] = x_block[...] + 1.0

        cv.emit_pipeline(body, grid=(4,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

    return kernel


X = jnp.asarray(np.random.default_rng(4901).standard_normal((32, 128)), jnp.float32)
OUT = jax.ShapeDtypeStruct(X.shape, X.dtype)


@pytest.mark.parametrize(
    "backend, space, interpret",
    [
        ("xla", pltpu.VMEM, False),
        ("xla", plgpu.SMEM, False),
        ("mosaic_tpu", pltpu.VMEM, pltpu.InterpretParams(detect_races=True)),
        ("mosaic_gpu", plgpu.SMEM, gpu_interpret(detect_races=True)),
    ],
)
def test_the_backends_own_onchip_memory_is_accepted(backend, space, interpret):
    call = cv.kernel(_add_one(space), OUT, backend=backend, interpret=interpret)
    np.testing.assert_array_equal(call(X), X + 1.0)


def test_another_backends_or_another_space_is_refused():
    with pytest.raises(
        ValueError,
        match=r"in\[0\]: memory_space=.* is mosaic_tpu's on-chip memory; "
        r"this pipeline runs on mosaic_gpu",
    ):
        cv.kernel(_add_one(pltpu.VMEM), OUT, backend="mosaic_gpu", interpret=True)(X)
    with pytest.raises(
        ValueError,
        match=r"memory_space=SMEM is not supported: .*\(pltpu.VMEM on TPU, "
        r"plgpu.SMEM on GPU",
    ):
        cv.kernel(_add_one(pltpu.SMEM), OUT, backend="xla")(X)


@pytest.mark.parametrize("mode", ["ZEROS", "PROMISE_IN_BOUNDS", "UNDEFINED"])
def test_every_oob_fill_mode_is_kept_by_the_zero_rule(mode):
    """A block past the end reads zeros, which keeps each mode's promise (UNDEFINED leaves the
    values open; PROMISE_IN_BOUNDS is the caller's promise, here broken on purpose)."""
    fill = getattr(plgpu.OOBFillMode, mode)
    x_spec = plgpu.BlockSpec((8, 128), lambda i: (i + 1, 0), oob_fill_mode=fill)
    o_spec = plgpu.BlockSpec((8, 128), lambda i: (i, 0))

    def kernel(x_ref, o_ref):
        def body(indices, x_block, o_block):
            o_block[...] = x_block[...] + 1.0

        cv.emit_pipeline(body, grid=(4,), in_specs=[x_spec], out_specs=[o_spec])(x_ref, o_ref)

    out = cv.kernel(kernel, OUT, backend="xla")(X)
    np.testing.assert_array_equal(out[:24], X[8:] + 1.0)
    np.testing.assert_array_equal(out[24:], np.ones((8, 128), np.float32))
