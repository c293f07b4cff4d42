"""`jax.vmap` of an `emit_pipeline` call inside a kernel, over refs with a batch dimension (as
upstream's pipeline tests do): xla batches it; on the Mosaic backends JAX has no batching rule
for `pl.run_scoped` (the pipeline's on-chip slots), so it is refused by name with the ways
around it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

BATCH, ROWS, COLS = 3, 32, 256


def _inner(x_ref, o_ref):
    cv.emit_pipeline(
        lambda idx, xb, ob: ob.__setitem__(..., xb[...] * 2.0 + idx[0]),
        grid=(ROWS // 8,),
        in_specs=[pl.BlockSpec((8, COLS), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((8, COLS), lambda i: (i, 0))],
    )(x_ref, o_ref)


def _batched(backend, interpret):
    x = jnp.arange(BATCH * ROWS * COLS, dtype=jnp.float32).reshape(BATCH, ROWS, COLS)
    f = cv.kernel(
        lambda x_ref, o_ref: jax.vmap(_inner)(x_ref, o_ref),
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        backend=backend,
        interpret=interpret,
    )
    return jax.jit(f), x


def test_vmap_of_a_pipeline_inside_an_xla_kernel(xla_executor):
    f, x = _batched("xla", False)
    if xla_executor == "checked":
        # the checked executor's predicated copies are lax.conds with state effects, which
        # jax.vmap does not batch: refused by name
        with pytest.raises(NotImplementedError, match="under jax.vmap in the checked executor"):
            f(x)
        return
    block_row = (np.arange(ROWS) // 8)[None, :, None]  # the body adds its grid index
    np.testing.assert_array_equal(np.asarray(f(x)), 2 * np.asarray(x) + block_row)


@pytest.mark.parametrize(
    "backend, interpret",
    [("mosaic_tpu", pltpu.InterpretParams()), ("mosaic_gpu", gpu_interpret())],
)
def test_vmap_of_a_pipeline_inside_a_mosaic_kernel_is_refused_by_name(backend, interpret):
    f, x = _batched(backend, interpret)
    with pytest.raises(
        NotImplementedError, match=rf"emit_pipeline under jax.vmap inside a {backend} kernel"
    ):
        f(x)
