"""Mosaic TPU's default gmm/tgmm tiles (`tiling.tpu_default`): the rule, and that the kernels and
the simulator both take it."""

import pytest

import conveyor as cv
from conveyor.ops.gmm.tiling import tpu_default


@pytest.mark.fast
@pytest.mark.parametrize(
    "m, groups, tm",
    [
        (8192, 8, 256),  # Mixtral's 1024 rows a group: capped at 256
        (16384, 64, 256),  # 256 a group
        (16384, 128, 128),  # 128 a group
        (1000, 64, 128),  # 15 a group (decode-like): never below 128
        (1600, 8, 128),  # 200 a group: rounded down to a power of two
        (100, 0, 128),  # no groups: the smallest tile
    ],
)
def test_rows_per_tile_follow_the_mean_group(m, groups, tm):
    assert tpu_default(m, 4096, 4096, groups)[0] == tm


@pytest.mark.fast
def test_k_and_n_tiles_are_the_widest_that_divide():
    assert tpu_default(8192, 4096, 14336, 8)[1:] == (1024, 1024)
    assert tpu_default(8192, 7168, 2048, 8)[1:] == (1024, 1024)
    assert tpu_default(8192, 2880, 1536, 8)[1:] == (1024, 512)  # 2880: none divides; 1536: 512
    assert tpu_default(8192, 384, 640, 8)[1:] == (128, 128)


@pytest.mark.fast
def test_the_simulator_prices_the_kernels_default():
    """simulate_gmm/tgmm on TPU hardware without a tiling take the kernel's default, clamped as
    the kernel clamps it."""
    for fn in (cv.sim.simulate_gmm, cv.sim.simulate_tgmm):
        assert fn([1024] * 8, 4096, 14336, hardware="v5e").config["tiling"] == [256, 1024, 1024]
        assert fn([128] * 64, 4096, 2048, hardware="v5e").config["tiling"] == [128, 1024, 1024]
        assert fn([40] * 4, 256, 384, hardware="v5e").config["tiling"] == [128, 256, 128]


@pytest.mark.fast
def test_the_working_set_counts_mosaics_copy_of_a_large_left_operand():
    """libtpu's compile reports a relayout copy of the matmul's left operand beside the buffers
    once it is over 128 x 512 elements (docs/internals/gmm.md): counted at its size."""
    import jax.numpy as jnp

    from conveyor.ops.gmm import tpu_blocks

    bf16 = jnp.bfloat16

    def ws(tiles, **kw):
        return tpu_blocks.working_set(*tpu_blocks.gmm_blocks(*tiles), bf16, bf16, **kw) / 2**20

    assert ws((128, 512, 512)) == 2.0  # libtpu: 2.00 MiB, no copy
    assert ws((256, 1024, 1024)) == 8.0 + 0.5  # libtpu: 8.49 (v5e, v5p), 8.60 (v6e)
    # a kernel whose matmul takes a narrower slice of a wide buffer names that slice
    assert ws((256, 1024, 1024), dot_lhs=(128, 512)) == 8.0
