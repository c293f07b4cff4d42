"""Mosaic GPU backend for tgmm (the weight gradient of gmm): one [tk, tn] output tile per thread
block, whose reduction runs over its group's own rows only.

Design notes: docs/internals/gmm.md, section `ops/gmm/mosaic_gpu_tgmm.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import conveyor as cv
from conveyor.ops.gmm.gpu_blocks import tgmm_block_pipeline, tgmm_grid
from conveyor.ops.gmm.metadata import local_group_bounds, row_block_span, shares_its_block
from conveyor.cost import matmul_cost
from conveyor.ints import cdiv
from conveyor.ops.gmm.mosaic_gpu import (
    COMPUTE_THREADS,
    gpu_cost,
    ROWS_PER_THREAD,
    accumulate_then_store,
    smem_layout,
    stages_that_fit,
    store_rows,
    wgmma_operands,
    wgmma_step,
)
from conveyor.ops.gmm.tiling import MOSAIC_GPU, Tile

SWIZZLE = 128  # bytes: the widest shared-memory swizzle
TM = MOSAIC_GPU.tgmm_tiling[0]  # rows reduced per step: 4 slots of blocks fit (see check_tgmm_args)
MIN_TN = MOSAIC_GPU.tgmm_min_tn  # one 128-byte swizzled row of 16-bit rhs columns
TK = COMPUTE_THREADS * ROWS_PER_THREAD  # output rows (of k) per thread block


def check_tgmm_args(lhs, rhs, tiling: Tile) -> tuple[int, int, int]:
    k, m = lhs.shape
    n = rhs.shape[1]
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    if tm != TM:
        raise ValueError(
            f"tiling: mosaic_gpu tgmm reduces tm={TM} rows per step (the size it is built and "
            f"verified for: 4 pipeline slots of a [{TM}, {TK}] x block and a [{TM}, tn] rhs block "
            f"fit in shared memory), got tm={tm}"
        )
    if tk != TK:
        raise ValueError(
            f"tiling: mosaic_gpu tgmm uses tk={TK} (two compute warpgroups of {ROWS_PER_THREAD} "
            f"output rows), got tk={tk}"
        )
    if n % MIN_TN:
        raise ValueError(
            f"n: mosaic_gpu tgmm needs n to be a multiple of {MIN_TN} (its narrowest column tile, "
            f"{SWIZZLE}-byte swizzled rows), got n={n}; pad rhs with zero columns or use "
            "backend='xla'"
        )
    step = MOSAIC_GPU.tn_multiple(tn, MIN_TN)
    if n % tn or tn % step or tn > MOSAIC_GPU.max_tn:
        raise ValueError(
            f"tiling: mosaic_gpu tgmm needs tn to divide n={n}, be a multiple of {step} and at "
            f"most {MOSAIC_GPU.max_tn}, got tn={tn}"
        )
    return tm, tk, tn


def _zero_outside(block, first_row, lo, hi):
    """block[r, :] = 0 where first_row + r is outside [lo, hi), in registers, MIN_TN columns at a
    time: a whole [64, 128] chunk's values and row positions beside the [128, 128] float32
    accumulator overflow the 168 registers a thread has when ptxas drops the register split
    (docs/compile-check.md)."""
    for col in range(0, block.shape[1], MIN_TN):
        chunk = block.at[:, pl.ds(col, MIN_TN)]
        vals = chunk[...]
        rows = lax.broadcasted_iota(jnp.int32, chunk.shape, 0)
        pos = plgpu.layout_cast(rows, plgpu.Layout.WGMMA) + first_row
        chunk[...] = jnp.where((pos >= lo) & (pos < hi), vals, jnp.zeros_like(vals))


def tgmm_mosaic_gpu(
    lhs, rhs, group_sizes, group_offset, existing_out, *, num_groups, out_dtype, tiling, interpret
):
    k, m = lhs.shape
    n = rhs.shape[1]
    lhs, rhs = wgmma_operands("tgmm", lhs, rhs)
    tm, tk, tn = check_tgmm_args(lhs, rhs, tiling)
    # whole output row tiles: x gets zero columns, only rows < k are stored
    k_pad = cdiv(k, tk) * tk
    # The kernel reads lhs as x = lhs.T [m, k] (the tokens, as the caller holds them): a gmm
    # backward
    # passes x.T, and XLA folds the two transposes, so no [k, m] copy of the tokens is made.
    x = lhs.T
    layout = smem_layout(tk, tn, itemsize=jnp.dtype(lhs.dtype).itemsize)  # 128-byte swizzled rows
    starts, ends = local_group_bounds(
        group_sizes, jnp.asarray(group_offset, jnp.int32), num_groups, m
    )
    # Each compute thread masks half of a boundary rhs block's columns when the halves are whole
    # swizzled rows (tn >= 128); a 64-column block is masked whole by thread 0.
    half_n = tn // COMPUTE_THREADS
    split_rhs = half_n >= MIN_TN
    split_columns = MOSAIC_GPU.split_columns(tn)
    wg_rows, wg_cols = MOSAIC_GPU.thread_tile(tk, tn)
    staging = plgpu.SMEM(MOSAIC_GPU.staging_shape(tk, tn), out_dtype)
    stages = stages_that_fit(
        block_bytes=(tk * tm + tm * tn) * jnp.dtype(lhs.dtype).itemsize, staging=staging
    )

    def kernel(starts_ref, ends_ref, x_ref, rhs_ref, out_ref, out_smem, masked):
        i, kb, nb = cv.program_id(0), cv.program_id(1), cv.program_id(2)
        wg = lax.axis_index("wg")
        lo, hi = starts_ref[i], ends_ref[i]
        first_block, blocks = row_block_span(lo, hi, tm)
        # this warpgroup's wg_rows x wg_cols part
        row_off, col_off = MOSAIC_GPU.thread_origin(wg, tk, tn)

        def mma(indices, x_blk, b_blk, acc):
            r = first_block + indices[0]
            row0 = r * tm

            @pl.when(shares_its_block(row0, tm, lo, hi))  # a block shared with a neighbour
            def _():
                _zero_outside(
                    x_blk.at[:, pl.ds(wg * ROWS_PER_THREAD, ROWS_PER_THREAD)], row0, lo, hi
                )
                if split_rhs:
                    _zero_outside(b_blk.at[:, pl.ds(wg * half_n, half_n)], row0, lo, hi)
                else:

                    @pl.when(wg == 0)
                    def _():
                        _zero_outside(b_blk, row0, lo, hi)

                plgpu.commit_smem()
                plgpu.barrier_arrive(masked)  # (jax 0.11 has no barrier_arrive_and_wait)
                plgpu.barrier_wait(masked)  # both operand blocks are masked whole now

            # wgmma reads the x block [tm, tk] transposed from shared memory: the [tk, tm] lhs block
            if split_columns:
                return wgmma_step(acc, x_blk.T, b_blk.at[:, pl.ds(col_off, wg_cols)])
            return wgmma_step(acc, x_blk.at[:, pl.ds(row_off, wg_rows)].T, b_blk)

        def compute_context(eval_pipeline):
            def store(staged, part):
                rows = staged.shape[0]
                row0 = kb * tk + row_off + part * rows
                col0 = nb * tn + col_off
                if k == k_pad:
                    plgpu.copy_smem_to_gmem(
                        staged, out_ref.at[i, pl.ds(row0, rows), pl.ds(col0, wg_cols)]
                    )
                    plgpu.wait_smem_to_gmem(0)
                else:  # the last row tile passes k: store the rows below it
                    store_rows(
                        staged, out_ref.at[i], 0, jnp.clip(k - row0, 0, rows), row0, col0, wg_cols
                    )

            accumulate_then_store(eval_pipeline, (wg_rows, wg_cols), out_smem.at[wg], store)

        cv.emit_pipeline_warp_specialized(
            mma,
            memory_registers=40,
            wg_axis="wg",
            compute_context=compute_context,
            **tgmm_block_pipeline(
                blocks,
                (tm, tk, tn),
                stages=stages,
                first_block=first_block,
                k_tile=kb,
                n_tile=nb,
                transforms=layout,
            ),
        )(x_ref, rhs_ref)

    m_pad = cdiv(m, tm) * tm  # whole row blocks: the padding rows belong to no group
    if m_pad != m or k_pad != k:
        x = jnp.pad(x, ((0, m_pad - m), (0, k_pad - k)))
    if m_pad != m:
        rhs = jnp.pad(rhs, ((0, m_pad - m), (0, 0)))
    scratch = [staging, plgpu.Barrier(num_arrivals=COMPUTE_THREADS)]
    out_struct = jax.ShapeDtypeStruct((num_groups, k, n), out_dtype)
    call = cv.kernel(
        kernel,
        out_struct,
        backend="mosaic_gpu",
        interpret=interpret,
        num_threads=COMPUTE_THREADS + 1,
        thread_name="wg",
        grid=tgmm_grid(num_groups, k_pad // tk, n // tn),
        scratch_shapes=scratch,
        cost_estimate=gpu_cost(matmul_cost(k, m, n, x, rhs, out_struct)),
    )
    computed = call(starts, ends, x, rhs)
    if existing_out is None:  # the sums start from zeros
        return computed
    return existing_out.astype(out_dtype) + computed


__all__ = ["tgmm_mosaic_gpu", "check_tgmm_args"]
