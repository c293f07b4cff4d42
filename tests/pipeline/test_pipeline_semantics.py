"""Pipeline rules every backend follows: bodies that touch other refs, out-of-bounds blocks,
Pallas BlockSpec fields (honoured or refused by name) and exact index-map invariance.

Mosaic backends run through their interpreters with race detection; outputs start poisoned.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv
from tests.platform import gpu_interpret

BACKENDS = ["xla", "mosaic_tpu", "mosaic_gpu"]
# The on-chip scratch type a body allocates with pl.run_scoped on each backend.
SCOPED = {"xla": pl.ANY, "mosaic_tpu": pltpu.VMEM, "mosaic_gpu": plgpu.SMEM}
BLOCK = (8, 128)


def arr(seed, *shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def run(kernel_body, out_shape, *args, backend, scratch_shapes=()):
    interpret = {"xla": False, "mosaic_tpu": pltpu.InterpretParams(detect_races=True),
                 "mosaic_gpu": gpu_interpret(detect_races=True)}[backend]
    return jax.jit(cv.kernel(kernel_body, out_shape, backend=backend, interpret=interpret,
                             scratch_shapes=scratch_shapes))(*args)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def test_body_accumulates_into_kernel_scratch_and_a_scoped_buffer(backend):
    """A reduction written the ordinary way: the body adds each block into refs that are not its
    own block refs (kernel scratch, a buffer scoped around the pipeline), read after the loop."""
    steps = 5
    x = arr(1, steps * BLOCK[0], BLOCK[1])

    def k(x_ref, sum_ref, sq_ref, acc_ref):
        def with_scoped(sq_acc):
            acc_ref[...] = jnp.zeros(BLOCK, jnp.float32)
            sq_acc[...] = jnp.zeros(BLOCK, jnp.float32)

            def body(idx, xb, sum_blk, sq_blk):
                acc_ref[...] += xb[...]
                sq_acc[...] += xb[...] * xb[...]
                sum_blk[...] = acc_ref[...]
                sq_blk[...] = sq_acc[...]
            whole = cv.BlockSpec(BLOCK, lambda i: (0, 0))
            cv.emit_pipeline(body, grid=(steps,), in_specs=[cv.BlockSpec(BLOCK, lambda i: (i, 0))],
                             out_specs=[whole, whole], max_concurrent_steps=2)(x_ref, sum_ref, sq_ref)
        pl.run_scoped(with_scoped, SCOPED[backend](BLOCK, jnp.float32))

    out = jax.ShapeDtypeStruct(BLOCK, jnp.float32)
    got_sum, got_sq = run(k, (out, out), x, backend=backend, scratch_shapes=[out])
    blocks = np.asarray(x, np.float64).reshape(steps, *BLOCK)
    # f32 sums of 5 terms of size O(1): rounding error ~ 5 * 2**-24 * |terms| < 1e-5.
    np.testing.assert_allclose(got_sum, blocks.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_sq, (blocks ** 2).sum(0), rtol=1e-5, atol=1e-5)
