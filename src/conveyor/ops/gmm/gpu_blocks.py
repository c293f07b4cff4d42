"""The thread blocks of cv.gmm's and cv.tgmm's Mosaic GPU kernels: their grids, and the
warp-specialized pipeline each block runs over its reduction. The kernels
(`ops/gmm/mosaic_gpu.py`, `ops/gmm/mosaic_gpu_tgmm.py`) run them and the simulator
(`cv.sim.simulate_gmm` / `simulate_tgmm` on GPU hardware) replays them: one schedule, priced."""

from __future__ import annotations

from typing import Any

from conveyor.ops.gmm.tiling import MOSAIC_GPU
from conveyor.plans.pipeline import plan as make_plan
from conveyor.plans.specs import BlockSpec
from conveyor.plans.warp import WarpSpecializedPlan


def gmm_grid(column_tiles: int, visits: int) -> tuple[int]:
    """One thread block per (column tile, visit) pair, visits padded to the most that traced group
    sizes can need; a block past the real visits exits at once."""
    return (column_tiles * visits,)


def gmm_block_pipeline(
    k: int,
    tiles: tuple[int, int, int],
    *,
    transpose_rhs: bool,
    stages: int,
    row_tile: Any = 0,
    column_tile: Any = 0,
    transforms: tuple = (),
) -> dict[str, Any]:
    """The `emit_pipeline_warp_specialized` arguments of the block computing output tile
    (`row_tile`, `column_tile`): k // tk steps, each an lhs [tm, tk] block and an rhs [tk, tn]
    block ([tn, tk] transposed), consumed by two compute warpgroups with each step's wgmma left
    in flight (`delay_release`)."""
    tm, tk, tn = tiles
    rhs_block = (tn, tk) if transpose_rhs else (tk, tn)
    return dict(
        grid=(k // tk,),
        num_compute_wgs=MOSAIC_GPU.compute_threads,
        max_concurrent_steps=stages,
        delay_release=MOSAIC_GPU.delay_release,
        in_specs=[
            BlockSpec((tm, tk), lambda kk: (row_tile, kk), transforms=transforms),
            BlockSpec(
                rhs_block,
                (lambda kk: (column_tile, kk)) if transpose_rhs else (lambda kk: (kk, column_tile)),
                transforms=transforms,
            ),
        ],
    )


def tgmm_grid(groups: int, k_tiles: int, n_tiles: int) -> tuple[int, int, int]:
    """One thread block per (group, k tile, n tile) output tile; the group index varies fastest
    (CUDA's x), so blocks launched together belong to different groups."""
    return (groups, k_tiles, n_tiles)


def tgmm_block_pipeline(
    row_blocks: Any,
    tiles: tuple[int, int, int],
    *,
    stages: int,
    first_block: Any = 0,
    k_tile: Any = 0,
    n_tile: Any = 0,
    transforms: tuple = (),
) -> dict[str, Any]:
    """The `emit_pipeline_warp_specialized` arguments of the tgmm block computing output tile
    (`k_tile`, `n_tile`) of one group: a step per `tm`-row block the group's rows touch (from
    `first_block`), each an x [tm, tk] block (the tokens, read transposed) and an rhs [tm, tn]
    block."""
    tm, tk, tn = tiles
    return dict(
        grid=(row_blocks,),
        num_compute_wgs=MOSAIC_GPU.compute_threads,
        max_concurrent_steps=stages,
        delay_release=MOSAIC_GPU.delay_release,
        in_specs=[
            BlockSpec((tm, tk), lambda r: (first_block + r, k_tile), transforms=transforms),
            BlockSpec((tm, tn), lambda r: (first_block + r, n_tile), transforms=transforms),
        ],
    )


def block_plan(args: dict[str, Any], *, dynamic: bool = False) -> WarpSpecializedPlan:
    """The plan of one thread block's pipeline (`gmm_block_pipeline` / `tgmm_block_pipeline` with
    a static grid), as the simulator replays it and the conformance tests hold it against the
    kernels' issued copies. `dynamic`: the kernel's grid is traced (tgmm's row-block count), so
    its slots are not shrunk to a short grid as a static one's are (`plans.pipeline.plan`)."""
    grid = (args["max_concurrent_steps"],) if dynamic else args["grid"]
    pipeline = make_plan(
        grid=grid,
        in_specs=args["in_specs"],
        out_specs=[],
        max_concurrent_steps=args["max_concurrent_steps"],
        delay_release=args["delay_release"],
    )
    return WarpSpecializedPlan(
        pipeline=pipeline.with_grid(args["grid"]) if dynamic else pipeline,
        num_compute_wgs=args["num_compute_wgs"],
    )
