"""Pipelines inside a pipeline's body, and bodies that allocate their own refs (upstream TPU
pipeline tests' shapes). Both once failed on the xla executor's step batching (a
`float32<vmem>` aval reaching broadcast_in_dim; a `jax.empty_ref` in the batched body), which is
gone: these pin the plain step loop (default and checked, see conftest.py) and the TPU
  interpreter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import conveyor as cv

M, N, BM, BN = 64, 4096, 16, 512
BACKENDS = ["xla", "mosaic_tpu"]


def _run(kernel, backend, x):
    interpret = pltpu.InterpretParams(detect_races=True) if backend == "mosaic_tpu" else False
    return jax.jit(
        cv.kernel(
            kernel, jax.ShapeDtypeStruct(x.shape, x.dtype), backend=backend, interpret=interpret
        )
    )(x)


def _x():
    return jnp.asarray(np.random.default_rng(31).standard_normal((M, N)), jnp.float32)


def _inner(x_ref, o_ref):
    def body(jdx, xs, os):
        os[...] = 2.0 * xs[...] + 1.0

    spec = cv.BlockSpec((BM, BN), lambda j: (0, j))
    cv.emit_pipeline(body, grid=(N // BN,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inner_pipeline_over_the_outer_blocks(backend):
    def kernel(x_ref, o_ref):
        spec = cv.BlockSpec((BM, N), lambda i: (i, 0))
        cv.emit_pipeline(
            lambda idx, xb, ob: _inner(xb, ob), grid=(M // BM,), in_specs=[spec], out_specs=[spec]
        )(x_ref, o_ref)

    x = _x()
    np.testing.assert_array_equal(_run(kernel, backend, x), 2.0 * x + 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inner_pipeline_over_views_of_the_kernels_refs(backend):
    """The outer pipeline only paces the rows; each step runs an inner pipeline on
    `ref.at[rows]`."""

    def kernel(x_ref, o_ref):
        def outer(idx, unused_block):
            rows = pl.ds(idx[0] * BM, BM)
            _inner(x_ref.at[rows], o_ref.at[rows])

        cv.emit_pipeline(
            outer, grid=(M // BM,), in_specs=[cv.BlockSpec((BM, N), lambda i: (i, 0))]
        )(x_ref)

    x = _x()
    np.testing.assert_array_equal(_run(kernel, backend, x), 2.0 * x + 1.0)


def test_a_body_may_allocate_its_own_ref_on_xla():
    """jax.empty_ref in the body (upstream spells on-chip scratch so); the Pallas TPU interpreter of
    jax 0.12 cannot discharge it (`No state discharge rule ... io_callback`), so xla only."""

    def kernel(x_ref, o_ref):
        def body(idx, xb, ob):
            tmp = jax.empty_ref(jax.ShapeDtypeStruct(xb.shape, xb.dtype), memory_space=pltpu.VMEM)
            tmp[...] = 2.0 * xb[...]
            ob[...] = tmp[...] + 1.0

        spec = cv.BlockSpec((BM, BN), lambda i: (i, 0))
        cv.emit_pipeline(body, grid=(M // BM,), in_specs=[spec], out_specs=[spec])(x_ref, o_ref)

    x = _x()[:, :BN]
    np.testing.assert_array_equal(_run(kernel, "xla", x), 2.0 * x + 1.0)
