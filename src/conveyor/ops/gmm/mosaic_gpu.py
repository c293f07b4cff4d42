"""Mosaic GPU backend for gmm: Conveyor's warp-specialized pipeline feeding wgmma, one output
tile per thread block, over the tile schedule of `make_group_metadata`.

Design notes: docs/internals/gmm.md, section `ops/gmm/mosaic_gpu.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import conveyor as cv
from conveyor._compat import gpu_kernel_takes_cost_estimate
from conveyor.cost import matmul_cost
from conveyor.ints import cdiv, floordiv, mod
from conveyor.ops.gmm.gpu_blocks import gmm_block_pipeline, gmm_grid
from conveyor.ops.gmm.metadata import make_group_metadata
from conveyor.kernel_gpu import smem_bytes
from conveyor.ops.gmm.tiling import MOSAIC_GPU, Tile
from conveyor.pipeline.mosaic_gpu import SMEM_BUDGET_BYTES

GPU_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
COMPUTE_THREADS = MOSAIC_GPU.compute_threads
ROWS_PER_THREAD = 64  # one wgmma M per compute warpgroup
TM = COMPUTE_THREADS * ROWS_PER_THREAD
DELAY_RELEASE = MOSAIC_GPU.delay_release  # a step's wgmma stays in flight while the next is issued


def stages_that_fit(*, block_bytes: int, staging) -> int:
    """Up to `MOSAIC_GPU.stages` pipeline slots of `block_bytes` (one step's operand blocks), as
    many as fit beside the kernel's output staging buffer (`GpuKernelConfig.stages_that_fit`)."""
    return MOSAIC_GPU.stages_that_fit(
        block_bytes=block_bytes, staging_bytes=smem_bytes([staging]), budget_bytes=SMEM_BUDGET_BYTES
    )


def smem_layout(*minor_elems: int, itemsize: int) -> tuple:
    """The widest swizzle (128, 64 or 32 bytes) whose span divides every operand's minor dimension,
    as (tiling, swizzle) transforms for pipeline blocks; () when none does (plain layout)."""
    for swizzle in (128, 64, 32):
        if all((e * itemsize) % swizzle == 0 for e in minor_elems):
            return (
                plgpu.TilingTransform((8, swizzle // itemsize)),
                plgpu.SwizzleTransform(swizzle),
            )
    return ()


def wgmma_operands(op: str, lhs, rhs):
    """lhs and rhs in the one 16-bit dtype wgmma multiplies (float32 accumulation).

    Documented rule: a float32 operand beside a bfloat16/float16 one is rounded to that dtype (a
    backward pass meets 16-bit weights with a float32 cotangent this way). Anything else (both
    float32, float64, bfloat16 with float16) is refused by name.
    """
    dl, dr = jnp.dtype(lhs.dtype), jnp.dtype(rhs.dtype)
    if dl == dr and dl in GPU_DTYPES:
        return lhs, rhs
    narrow = [d for d in (dl, dr) if d in GPU_DTYPES]
    if len(narrow) == 1 and jnp.dtype(jnp.float32) in (dl, dr):
        return lhs.astype(narrow[0]), rhs.astype(narrow[0])
    raise NotImplementedError(
        f"mosaic_gpu {op}: wgmma takes bfloat16 or float16 operands (a float32 one beside them is "
        f"rounded to their dtype), got lhs {dl} and rhs {dr}; cast them (accumulation stays "
        "float32) or use backend='xla'"
    )


def check_gmm_args(lhs, rhs, tiling: Tile, transpose_rhs, out_dtype) -> tuple[int, int, int]:
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tm, tk, tn = tiling.tm, tiling.tk, tiling.tn
    # A block's minor dimension spans a 32-byte swizzled row at least: tk always (tn=8 with a
    # [tk, tn] block passed the interpreter and failed Mosaic's compile, "No valid tiling found for
    # SMEM reference", jax 0.12.0.1). tn: a staged output row spans 128 bytes (`gmm_min_tn`: a
    # narrower one ran in the interpreter and faulted on an H200, misaligned TMA stores).
    out_itemsize = jnp.dtype(out_dtype).itemsize
    narrowest = {"k": MOSAIC_GPU.min_tile, "n": MOSAIC_GPU.gmm_min_tn(out_itemsize)}
    for name, dim in (("k", k), ("n", n)):
        if dim % narrowest[name]:
            raise ValueError(
                f"{name}: mosaic_gpu gmm needs {name} to be a multiple of {narrowest[name]} (its "
                f"narrowest tile), got {name}={dim}; pad the operands with zeros or use "
                "backend='xla'"
            )
    if tm != TM:
        raise ValueError(
            f"tiling: mosaic_gpu gmm uses tm={TM} (two compute warpgroups of {ROWS_PER_THREAD} "
            f"rows), got tm={tm}"
        )
    if k % tk or (tk * jnp.dtype(lhs.dtype).itemsize) % 32:
        raise ValueError(
            f"tiling: mosaic_gpu gmm needs tk to divide k={k} and span a multiple of 32 bytes, got "
            f"tk={tk}"
        )
    step = MOSAIC_GPU.tn_multiple(tn, narrowest["n"])
    if n % tn or tn % step or tn > MOSAIC_GPU.max_tn:
        raise ValueError(
            f"tiling: mosaic_gpu gmm needs tn to divide n={n}, be a multiple of {step} (whole "
            f"{MOSAIC_GPU.tma_smem_align}-byte rows of {jnp.dtype(out_dtype).name} output) and at "
            f"most {MOSAIC_GPU.max_tn}, got tn={tn}"
        )
    return tm, tk, tn


def wgmma_step(acc, a, b):
    """One reduction step: issue `acc += a @ b` and leave it in flight; wait for the previous
    step's wgmma, whose slot the pipeline then refills (`delay_release=1`)."""
    plgpu.wgmma(acc, a, b)
    plgpu.wgmma_wait(DELAY_RELEASE)
    return acc


def accumulate_then_store(eval_pipeline, acc_shape: tuple[int, int], staging, store) -> None:
    """Run a compute warpgroup's pipeline into a fresh f32 register accumulator of `acc_shape`;
    once every wgmma is done, copy it into `staging` (shared memory, the output dtype) one
    `staging`-sized row part at a time and hand each part to `store(staging, part)` (the kernel's
    TMA epilogue, which waits for its copies before the next part overwrites the buffer)."""
    rows = staging.shape[0]

    def with_acc(acc):
        eval_pipeline(acc)
        plgpu.wgmma_wait(0)
        done = acc[...]
        for part in range(acc_shape[0] // rows):
            staging[...] = done[part * rows : (part + 1) * rows].astype(staging.dtype)
            plgpu.commit_smem()
            store(staging, part)

    pl.run_scoped(with_acc, plgpu.ACC(acc_shape, jnp.float32))


def store_rows(acc_smem, out_gmem, lo, hi, row0, col0, width):
    """TMA-store rows [lo, hi) of a shared-memory block to `out_gmem` rows row0 + [lo, hi) and
    columns col0 + [0, width), in power-of-two chunks (a TMA copy has a static shape; the row
    count is known at run time). Waits for the copies: the block may be rewritten after."""
    row_bytes = width * jnp.dtype(acc_smem.dtype).itemsize
    if row_bytes % MOSAIC_GPU.tma_smem_align:  # the copies start at any row: see tma_smem_align
        raise ValueError(
            f"store_rows: a staged row must span a multiple of {MOSAIC_GPU.tma_smem_align} bytes "
            f"(a TMA copy's shared-memory alignment), got {width} x {acc_smem.dtype} = {row_bytes}"
        )
    start = lo
    size = hi - lo
    chunk = acc_smem.shape[0]
    while chunk >= 1:
        take = (size & chunk) != 0

        @pl.when(take)
        def _(chunk=chunk, start=start):
            plgpu.copy_smem_to_gmem(
                acc_smem.at[pl.ds(start, chunk)],
                out_gmem.at[pl.ds(row0 + start, chunk), pl.ds(col0, width)],
            )

        start = start + jnp.where(take, chunk, 0)
        chunk //= 2
    plgpu.wait_smem_to_gmem(0)


def banded_tile(pid, *, column_tiles: int, visits: int, band: int):
    """(column tile, visit) of thread block `pid` in a 1-D grid that walks the column tiles in
    bands of `band` (a divisor of column_tiles): all visits of a band's column tiles, the band's
    columns fastest, before the next band. Blocks running at once then share a few column tiles of
    weights and a few row tiles of lhs, which stay in L2, instead of each row tile streaming a
    group's whole [k, n] weights (a plain (column tile, visit) grid with columns fastest)."""
    per_band = band * visits
    b, r = floordiv(pid, per_band), mod(pid, per_band)
    return b * band + mod(r, band), floordiv(r, band)


def grid_band(column_tiles: int) -> int:
    """The widest band of column tiles up to `MOSAIC_GPU.grid_band` that divides column_tiles."""
    return max(b for b in range(1, MOSAIC_GPU.grid_band + 1) if column_tiles % b == 0)


def gmm_mosaic_gpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    *,
    transpose_rhs,
    out_dtype,
    tiling,
    interpret,
):
    """`gmm` on Hopper: rows of the local groups computed, the others `existing_out`'s (or, given
    None, left as the output buffer held them)."""
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    lhs, rhs = wgmma_operands("gmm", lhs, rhs)
    tm, tk, tn = check_gmm_args(lhs, rhs, tiling, transpose_rhs, out_dtype)
    meta = make_group_metadata(group_sizes, m, tm, group_offset=group_offset, num_groups=num_groups)
    visits = meta.group_ids.shape[0]
    num_visits = meta.num_visits[None]
    column_tiles = n // tn
    band = grid_band(column_tiles)
    layout = smem_layout(
        tk, *(() if transpose_rhs else (tn,)), itemsize=jnp.dtype(lhs.dtype).itemsize
    )
    split_columns = MOSAIC_GPU.split_columns(tn)
    wg_rows, wg_cols = MOSAIC_GPU.thread_tile(tm, tn)
    staging = plgpu.SMEM(MOSAIC_GPU.staging_shape(tm, tn), out_dtype)
    stages = stages_that_fit(
        block_bytes=(tm * tk + tk * tn) * jnp.dtype(lhs.dtype).itemsize, staging=staging
    )

    def kernel(
        gids_ref,
        tids_ref,
        starts_ref,
        ends_ref,
        nvis_ref,
        lhs_ref,
        rhs_ref,
        *refs,  # [start_ref (aliased to out_ref),] out_ref, acc_smem
    ):
        out_ref, acc_smem = refs[-2:]
        j, v = banded_tile(cv.program_id(0), column_tiles=column_tiles, visits=visits, band=band)
        wg = lax.axis_index("wg")
        # this warpgroup's wg_rows x wg_cols part
        row_off, col_off = MOSAIC_GPU.thread_origin(wg, tm, tn)

        @pl.when(v < nvis_ref[0])
        def _():
            g, tile = gids_ref[v], tids_ref[v]
            lo_g, hi_g = starts_ref[g], ends_ref[g]

            def mma(indices, a_blk, b_blk, acc):
                if split_columns:
                    a = a_blk
                    b = (
                        b_blk.at[pl.ds(col_off, wg_cols)].T
                        if transpose_rhs
                        else b_blk.at[:, pl.ds(col_off, wg_cols)]
                    )
                else:
                    a = a_blk.at[pl.ds(row_off, wg_rows)]
                    b = b_blk.T if transpose_rhs else b_blk
                return wgmma_step(acc, a, b)

            def compute_context(eval_pipeline):
                def store(staged, part):
                    row0 = tile * tm + row_off + part * staged.shape[0]
                    lo = jnp.clip(lo_g - row0, 0, staged.shape[0])
                    hi = jnp.clip(jnp.minimum(hi_g, m) - row0, 0, staged.shape[0])
                    store_rows(
                        staged, out_ref, lo, jnp.maximum(hi, lo), row0, j * tn + col_off, wg_cols
                    )

                accumulate_then_store(eval_pipeline, (wg_rows, wg_cols), acc_smem.at[wg], store)

            cv.emit_pipeline_warp_specialized(
                mma,
                memory_registers=40,
                wg_axis="wg",
                compute_context=compute_context,
                **gmm_block_pipeline(
                    k,
                    (tm, tk, tn),
                    transpose_rhs=transpose_rhs,
                    stages=stages,
                    row_tile=tile,
                    column_tile=j,
                    transforms=layout,
                ),
            )(lhs_ref, rhs_ref.at[g])

    # pipeline blocks divide their arrays: whole row tiles (zero rows, never stored)
    m_pad = cdiv(m, tm) * tm
    if m_pad != m:
        lhs = jnp.pad(lhs, ((0, m_pad - m), (0, 0)))
    # The kernel writes only its groups' rows: the output starts as existing_out, or (None) as
    # whatever the buffer held (the caller masks the other rows; the interpreter fills them with
    # NaN), which saves XLA a pass writing the start.
    out = jax.ShapeDtypeStruct((m, n), out_dtype)
    start = () if existing_out is None else (existing_out.astype(out_dtype),)
    call = cv.kernel(
        kernel,
        out,
        backend="mosaic_gpu",
        interpret=interpret,
        num_threads=COMPUTE_THREADS + 1,
        thread_name="wg",
        grid=gmm_grid(column_tiles, visits),
        scratch_shapes=[staging],
        input_output_aliases={7: 0} if start else {},
        cost_estimate=gpu_cost(matmul_cost(m, k, n, lhs, rhs, out)),
    )
    return call(
        meta.group_ids,
        meta.tile_ids,
        meta.group_starts,
        meta.group_ends,
        num_visits,
        lhs,
        rhs,
        *start,
    )


def gpu_cost(estimate):
    """`estimate` where `plgpu.kernel` takes one (jax >= 0.12), else None: the kernels run the
    same on jax 0.11, costed by XLA at about 0 flops."""
    return estimate if gpu_kernel_takes_cost_estimate() else None


__all__ = [
    "gmm_mosaic_gpu",
    "gpu_cost",
    "check_gmm_args",
    "smem_layout",
    "accumulate_then_store",
    "stages_that_fit",
    "store_rows",
    "wgmma_operands",
    "wgmma_step",
    "banded_tile",
    "grid_band",
]
