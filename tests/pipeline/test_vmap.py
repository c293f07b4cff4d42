"""jax.vmap over a kernel that contains a pipeline, on every backend, and its hardware exports."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

SPEC = cv.BlockSpec((8, 128), lambda i: (i, 0))


def _kernel(x_ref, y_ref, o_ref):
    def body(idx, xb, yb, ob):
        ob[...] = xb[...] * 2.0 + yb[...]

    cv.emit_pipeline(
        body, grid=(4,), in_specs=[SPEC, SPEC], out_specs=[SPEC], max_concurrent_steps=2
    )(x_ref, y_ref, o_ref)


def _f(backend, interpret=True):
    interpret = (
        {
            "xla": False,
            "mosaic_tpu": pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
            "mosaic_gpu": gpu_interpret(detect_races=True),
        }[backend]
        if interpret
        else False
    )
    return cv.kernel(
        _kernel, jax.ShapeDtypeStruct((32, 128), jnp.float32), backend=backend, interpret=interpret
    )


@pytest.mark.parametrize("backend", ["xla", "mosaic_tpu", "mosaic_gpu"])
def test_vmap_batched_and_broadcast_operands(backend):
    rng = np.random.default_rng(4728)
    x = jnp.asarray(rng.standard_normal((3, 32, 128)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
    np.testing.assert_array_equal(
        jax.jit(jax.vmap(_f(backend), in_axes=(0, None)))(x, y), 2.0 * x + y[None]
    )
    # batched on a non-leading axis, on both operands
    yb = jnp.asarray(rng.standard_normal((32, 3, 128)), jnp.float32)
    out = jax.jit(jax.vmap(_f(backend), in_axes=(0, 1)))(x, yb)
    np.testing.assert_array_equal(out, 2.0 * x + jnp.moveaxis(yb, 1, 0))


def test_nested_vmap_on_xla_and_tpu_interpreter():
    rng = np.random.default_rng(4729)
    x = jnp.asarray(rng.standard_normal((2, 2, 32, 128)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((32, 128)), jnp.float32)
    for backend in ("xla", "mosaic_tpu"):
        f = jax.vmap(jax.vmap(_f(backend), in_axes=(0, None)), in_axes=(0, None))
        np.testing.assert_array_equal(jax.jit(f)(x, y), 2.0 * x + y, err_msg=backend)


@pytest.mark.parametrize("backend, platform", [("mosaic_tpu", "tpu"), ("mosaic_gpu", "cuda")])
def test_vmapped_kernel_exports_for_hardware(backend, platform):
    x = jax.ShapeDtypeStruct((3, 32, 128), jnp.float32)
    y = jax.ShapeDtypeStruct((32, 128), jnp.float32)
    exported = jax.export.export(
        jax.jit(jax.vmap(_f(backend, interpret=False), in_axes=(0, None))), platforms=[platform]
    )(x, y)
    assert exported.platforms == (platform,)
