"""What Mosaic GPU's TMA copies ask of a pipeline's arrays, refused by name when the pipeline is
traced (the GPU interpreter accepts these shapes; the cuda compile refuses each with its own
error, `make compile-check` and docs/pipelining.md): rows of whole 16-byte units, and array
dimensions under a block's shared-memory tiling (explicit, or the one Mosaic GPU infers for a
wgmma operand) in whole tiles. Each case has its accepted neighbour, run on the interpreter or
lowered (Conveyor's checks pass; the wgmma neighbours also compiled for H100 by hand, the
elementwise one with an explicit swizzle does not: Mosaic GPU finds no register layout for it)."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import conveyor as cv
from tests.platform import gpu_interpret

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
from pipelined_matmul import matmul, matmul_warp_specialized  # noqa: E402

# mosaic_gpu only: the package conftest's checked xla executor does not apply
pytestmark = pytest.mark.parametrize("backend", ["mosaic_gpu"])


def _doubled(shape, dtype, block, transforms=(), backend="mosaic_gpu"):
    """x * 2 through a plain pipeline on the GPU interpreter."""

    def kernel(x_ref, o_ref):
        def body(idx, xb, ob):
            ob[...] = xb[...] * 2

        spec = cv.BlockSpec(block, lambda i, j: (i, j), transforms=transforms)
        cv.emit_pipeline(
            body,
            grid=(pl.cdiv(shape[0], block[0]), pl.cdiv(shape[1], block[1])),
            in_specs=[spec],
            out_specs=[spec],
        )(x_ref, o_ref)

    return cv.kernel(
        kernel,
        jax.ShapeDtypeStruct(shape, dtype),
        backend=backend,
        interpret=gpu_interpret(detect_races=True),
    )


def test_rows_of_whole_16_byte_units_are_required(backend):
    x = jnp.ones((16, 1001), jnp.float32)  # rows of 4004 bytes
    with pytest.raises(ValueError, match=r"in\[0\].*16 bytes.*\(16, 1001\).*multiple of 4"):
        _doubled(x.shape, x.dtype, (8, 128))(x)
    # 1000 float32 columns (4000 bytes): accepted, and the partial last column block is exact
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 1000)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(_doubled(x.shape, x.dtype, (8, 128))(x)), 2 * x)


def test_an_explicit_tiling_must_cut_the_array_into_whole_tiles(backend):
    layout = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    x = jnp.ones((16, 200), jnp.bfloat16)  # 200 columns > one 64-column tile, not a multiple
    with pytest.raises(ValueError, match=r"in\[0\].*TilingTransform.*dimension 1.*by 64.*256"):
        jax.jit(_doubled(x.shape, x.dtype, (8, 128), layout)).lower(x)
    # accepted: whole tiles. 64-row blocks: Mosaic GPU infers no register layout for an
    # elementwise body on 8-row swizzled blocks ("Failed to infer a possible set of layouts")
    x = jnp.ones((64, 192), jnp.bfloat16)
    jax.jit(_doubled(x.shape, x.dtype, (64, 128), layout)).lower(x)


@pytest.mark.parametrize(
    "fn, m, k, n, bk, bn, message",
    [
        # a (64, 128) bf16 block of x: rows of 256 bytes, 128-byte swizzle, tiles of (8, 64)
        (matmul, 4001, 256, 256, 128, 128, r"in\[0\].*a operand.*dimension 0.*by 8.*4008"),
        (matmul, 256, 4016, 256, 128, 128, r"in\[0\].*dimension 1.*by 64.*4032"),
        # a (64, 32) block: 64-byte rows, tiles of (8, 32)
        (matmul, 256, 4016, 256, 32, 128, r"in\[0\].*dimension 1.*by 32.*4032"),
        (matmul, 512, 512, 520, 128, 128, r"in\[1\].*b operand.*dimension 1.*by 64.*576"),
        (matmul, 512, 512, 200, 128, 16, r"in\[1\].*dimension 1.*by 16.*208"),
        (matmul_warp_specialized, 4001, 256, 256, 64, 128, r"in\[0\].*dimension 0.*by 8"),
    ],
)
def test_wgmma_operands_fit_the_tiling_mosaic_gpu_infers(backend, fn, m, k, n, bk, bn, message):
    """The tiling is what the cuda compile reported for each case (its error names the same
    dimension and tile; checked by hand with the cuda toolchain, not in CI)."""
    x, y = jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)
    call = jax.jit(lambda x, y: fn(x, y, bk=bk, bn=bn, backend=backend, interpret=True))
    with pytest.raises(ValueError, match=message):
        call.lower(x, y)


@pytest.mark.parametrize("m, k, n, bk", [(4000, 256, 256, 128), (256, 4000, 256, 32)])
def test_wgmma_operands_that_fit_are_accepted(backend, m, k, n, bk):
    x, y = jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16)
    call = jax.jit(lambda x, y: matmul(x, y, bk=bk, backend=backend, interpret=True))
    assert call.lower(x, y).out_info.shape == (m, n)


def test_a_wgmma_block_whose_rows_have_no_swizzle_is_refused(backend):
    x, y = jnp.ones((128, 128), jnp.bfloat16), jnp.ones((128, 64), jnp.bfloat16)
    # (128, 8) bf16 blocks of y: rows of 16 bytes (the cuda compile: "No valid tiling found")
    with pytest.raises(ValueError, match=r"b is a block of in\[1\].*\(128, 8\).*16 bytes"):
        jax.jit(lambda x, y: matmul(x, y, bn=8, backend=backend, interpret=True)).lower(x, y)
