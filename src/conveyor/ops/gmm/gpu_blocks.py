"""The thread blocks of cv.gmm's Mosaic GPU kernel: its grid, and the warp-specialized pipeline
each block runs over the contraction. The kernel (`ops/gmm/mosaic_gpu.py`) runs them and the
simulator (`cv.sim.simulate_gmm` on GPU hardware) replays them, so both price one schedule."""

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


def gmm_block_plan(
    k: int, tiles: tuple[int, int, int], *, transpose_rhs: bool, stages: int
) -> WarpSpecializedPlan:
    """The plan of one thread block's pipeline (`gmm_block_pipeline`), as the simulator replays
    it and its conformance test holds it against the kernel's issued copies."""
    args = gmm_block_pipeline(k, tiles, transpose_rhs=transpose_rhs, stages=stages)
    return WarpSpecializedPlan(
        pipeline=make_plan(
            grid=args["grid"],
            in_specs=args["in_specs"],
            out_specs=[],
            max_concurrent_steps=args["max_concurrent_steps"],
            delay_release=args["delay_release"],
        ),
        num_compute_wgs=args["num_compute_wgs"],
    )
