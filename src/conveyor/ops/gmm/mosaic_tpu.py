"""Mosaic TPU backend for gmm/tgmm: a Pallas TPU kernel driven by scalar-prefetched group metadata.

Design notes: docs/internals/gmm.md, section `ops/gmm/mosaic_tpu.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor.cost import matmul_cost, shape_bytes
from conveyor.interpreters import tpu_params
from conveyor.tpu_vmem import vmem_limit
from conveyor.ops.gmm import tpu_blocks
from conveyor.ops.gmm.metadata import GroupMetadata, make_group_metadata

SUPPORTED = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def compute_dtype(*dts):
    dt = jnp.result_type(*dts)
    if jnp.dtype(dt) not in SUPPORTED:
        raise NotImplementedError(
            f"mosaic_tpu: gmm supports float32 and bfloat16 operands, got {jnp.dtype(dt).name}"
        )
    return dt


def pad_to(x, multiples):
    """Pad trailing edges up to multiples of the block shape (interpreter only, see below)."""
    pads = [(0, (-d) % b) for d, b in zip(x.shape, multiples)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def k_mask(x, kk, tk, k, axis):
    """Zero the entries of a k-block that lie past k (both operands, so garbage cannot leak)."""
    if k % tk == 0:
        return x
    idx = kk * tk + lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.where(idx < k, x, jnp.zeros_like(x))


def accumulate_product(acc_ref, x, rhs_ref, kk, tk: int, k: int, transpose_rhs: bool) -> None:
    """acc += x @ the rhs block (transposed when `transpose_rhs`) in float32, with the rhs
    block's entries past k zeroed (an edge block may hold anything there). x must be zero past k
    already (masked, or padded with zeros)."""
    w = k_mask(rhs_ref[...], kk, tk, k, 1 if transpose_rhs else 0)
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    acc_ref[...] += lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)


def tgmm_metadata(group_sizes, m, tm, group_offset, num_groups, from_zeros: bool) -> GroupMetadata:
    """The tgmm kernels' visits: with `from_zeros` (no existing_out) each empty group's too, so
    that the kernel writes its zeros."""
    return make_group_metadata(
        group_sizes,
        m,
        tm,
        group_offset=group_offset,
        num_groups=num_groups,
        visit_empty_groups=from_zeros,
    )


def prefetched_metadata(meta: GroupMetadata) -> tuple:
    """The gmm/tgmm kernels' first five scalar-prefetch operands: the visits' group and tile ids,
    the groups' row ranges and the visit count."""
    return (
        meta.group_ids,
        meta.tile_ids,
        meta.group_starts,
        meta.group_ends,
        meta.num_visits[None],
    )


def _gmm_kernel(
    group_ids,
    tile_ids,
    starts,
    ends,
    num_visits,
    lhs_ref,
    rhs_ref,
    *refs,
    tm,
    tk,
    k,
    transpose_rhs,
):
    """One visit's product over k, stored into its group's rows of the output block (resident
    over the visits of a row tile). refs = (ex_ref, out_ref, acc_ref), or without existing_out
    (rows outside the groups: any value) (out_ref, acc_ref)."""
    ex_ref, out_ref, acc_ref = refs if len(refs) == 3 else (None, *refs)
    v, kk = pl.program_id(1), pl.program_id(2)
    tile = tile_ids[v]
    first_visit = (v == 0) | (tile != tile_ids[jnp.maximum(v - 1, 0)])

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if ex_ref is not None:

        @pl.when(first_visit & (kk == 0))
        def _():
            out_ref[...] = ex_ref[...]  # rows no visit stores keep existing_out

    @pl.when(v < num_visits[0])
    def _():
        x = k_mask(lhs_ref[...], kk, tk, k, 1)
        accumulate_product(acc_ref, x, rhs_ref, kk, tk, k, transpose_rhs)

    @pl.when((v < num_visits[0]) & (kk == pl.num_programs(2) - 1))
    def _():
        g = group_ids[v]
        rows = tile * tm + lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (rows >= starts[g]) & (rows < ends[g])
        out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), out_ref[...])


def kernel_vmem_limit(
    op: str,
    lhs_block,
    rhs_block,
    out_block,
    cdt,
    out_dtype,
    *,
    dot_lhs=None,
    extra: int = 0,
    existing_out: bool = True,
) -> int | None:
    """`vmem_limit_bytes` for a gmm/tgmm tiling: the working set (`tpu_blocks.working_set`, within
    a few percent of the scoped VMEM libtpu reports; `dot_lhs` and `existing_out` as there) plus
    `extra` bytes the
    kernel's own scratch takes beyond it. Peak adds two float32 products of the output block's
    shape (the dot's value and the sum), which larger tilings need (docs/compile-check.md). A
    tiling whose working set is over the chip's VMEM is refused naming the bytes
    (`tpu_vmem.vmem_limit`)."""
    working = extra + tpu_blocks.working_set(
        lhs_block, rhs_block, out_block, cdt, out_dtype, dot_lhs=dot_lhs, existing_out=existing_out
    )
    product = shape_bytes(tuple(d for d in out_block if d is not None), jnp.float32)
    return vmem_limit(
        f"{op}",
        working=working,
        peak=working + 2 * product,
        remedy=(
            f"pass a smaller tiling (its blocks: lhs {lhs_block}, rhs {rhs_block}, "
            f"out {tuple(out_block)})"
        ),
    )


def gmm_mosaic_tpu(
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
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    if jnp.dtype(out_dtype) not in SUPPORTED:
        raise NotImplementedError(
            f"mosaic_tpu: output dtype must be float32 or bfloat16, got {jnp.dtype(out_dtype).name}"
        )
    tm, tk, tn = tpu_blocks.gmm_tiles(m, k, n, (tiling.tm, tiling.tk, tiling.tn), cdt)
    meta = make_group_metadata(group_sizes, m, tm, group_offset=group_offset, num_groups=num_groups)
    visits = meta.group_ids.shape[0]
    grid = tpu_blocks.gmm_grid(k, n, tk, tn, visits)

    lhs_map, rhs_map, out_map = tpu_blocks.gmm_index_maps(transpose_rhs)
    lhs, rhs = lhs.astype(cdt), rhs.astype(cdt)
    if interpret:
        # jax 0.12's TPU interpreter returns an aliased output padded to whole blocks when its edge
        # blocks are partial (80x256 for 67x130 with 16x128 blocks); pad m and n ourselves there.
        # Real TPUs clip edge blocks, so compiled kernels skip this copy. k stays unpadded: its
        # remainder is masked in the kernel.
        lhs = pad_to(lhs, (tm, 1))
        rhs = pad_to(rhs, (1, tn, 1) if transpose_rhs else (1, 1, tn))
    out_shape = jax.ShapeDtypeStruct(
        (lhs.shape[0], rhs.shape[1 if transpose_rhs else 2]), out_dtype
    )
    lhs_block, rhs_block, out_block = tpu_blocks.gmm_blocks(tm, tk, tn, transpose_rhs)
    operands = [lhs, rhs]
    in_specs = [pl.BlockSpec(lhs_block, lhs_map), pl.BlockSpec(rhs_block, rhs_map)]
    if existing_out is not None:  # (None: rows outside the groups may hold anything)
        existing_out = existing_out.astype(out_dtype)
        operands.append(pad_to(existing_out, (tm, tn)) if interpret else existing_out)
        in_specs.append(pl.BlockSpec(out_block, out_map))
    call = pl.pallas_call(
        functools.partial(_gmm_kernel, tm=tm, tk=tk, k=k, transpose_rhs=transpose_rhs),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec(out_block, out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        input_output_aliases={} if existing_out is None else {7: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=kernel_vmem_limit(
                "gmm",
                lhs_block,
                rhs_block,
                out_block,
                cdt,
                out_dtype,
                existing_out=existing_out is not None,
            ),
        ),
        cost_estimate=matmul_cost(m, k, n, lhs, rhs, out_shape),
        interpret=tpu_params(interpret),
        name="conveyor_gmm",
    )
    out = call(*prefetched_metadata(meta), *operands)
    return out[:m, :n]


def _tgmm_kernel(group_ids, tile_ids, starts, ends, num_visits, lhs_ref, rhs_ref, *refs, tm):
    """One (k tile, n tile) block of every group's [k, n] product, summed over the group's
    visits in the float32 scratch, then written once (plus existing_out's block when the kernel
    takes one, refs = (ex_ref, out_ref, acc_ref); else refs = (out_ref, acc_ref), and an empty
    group's one visit writes its zeros)."""
    ex_ref, out_ref, acc_ref = refs if len(refs) == 3 else (None, *refs)
    v = pl.program_id(2)
    last = pl.num_programs(2) - 1
    g = group_ids[v]
    first_visit = (v == 0) | (g != group_ids[jnp.maximum(v - 1, 0)])
    last_visit = (v == last) | (g != group_ids[jnp.minimum(v + 1, last)])

    @pl.when(first_visit)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(v < num_visits[0])
    def _():
        lo, hi = starts[g], ends[g]
        x, y = lhs_ref[...], rhs_ref[...]
        cols = tile_ids[v] * tm + lax.broadcasted_iota(jnp.int32, x.shape, 1)
        rows = tile_ids[v] * tm + lax.broadcasted_iota(jnp.int32, y.shape, 0)
        x = jnp.where((cols >= lo) & (cols < hi), x, jnp.zeros_like(x))
        y = jnp.where((rows >= lo) & (rows < hi), y, jnp.zeros_like(y))
        acc_ref[...] += jnp.dot(x, y, preferred_element_type=jnp.float32)

    @pl.when(last_visit)
    def _():
        total = acc_ref[...] if ex_ref is None else ex_ref[...].astype(jnp.float32) + acc_ref[...]
        out_ref[...] = total.astype(out_ref.dtype)


def tgmm_mosaic_tpu(
    lhs, rhs, group_sizes, group_offset, existing_out, *, num_groups, out_dtype, tiling, interpret
):
    """[num_groups, k, n]: per local group, `lhs[:, rows] @ rhs[rows]` plus existing_out, or
    (existing_out None) from zeros: then the kernel takes no existing_out, aliases nothing and
    visits each empty group once to write its zeros."""
    k, m = lhs.shape
    n = rhs.shape[1]
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    if jnp.dtype(out_dtype) not in SUPPORTED:
        raise NotImplementedError(
            f"mosaic_tpu: output dtype must be float32 or bfloat16, got {jnp.dtype(out_dtype).name}"
        )
    # The lhs block is (tk, tm): here tm is a lane dimension (multiple of 128) and tk a sublane one.
    tm, tk, tn = tpu_blocks.tgmm_tiles(m, k, n, (tiling.tm, tiling.tk, tiling.tn), cdt)
    lhs_block, rhs_block, out_block = tpu_blocks.tgmm_blocks(tm, tk, tn)
    from_zeros = existing_out is None
    meta = tgmm_metadata(group_sizes, m, tm, group_offset, num_groups, from_zeros)
    visits = meta.group_ids.shape[0]
    grid = tpu_blocks.tgmm_grid(k, n, tk, tn, visits)

    lhs, rhs = lhs.astype(cdt), rhs.astype(cdt)
    if interpret:  # see gmm_mosaic_tpu: pad the edges the interpreter mishandles
        lhs = pad_to(lhs, (tk, tm))
        rhs = pad_to(rhs, (tm, tn))
    out_shape = jax.ShapeDtypeStruct((num_groups, *lhs.shape[:1], rhs.shape[1]), out_dtype)
    operands = [lhs, rhs]
    lhs_map, rhs_map, out_map = tpu_blocks.tgmm_index_maps()
    in_specs = [pl.BlockSpec(lhs_block, lhs_map), pl.BlockSpec(rhs_block, rhs_map)]
    if not from_zeros:
        existing_out = existing_out.astype(out_dtype)
        operands.append(pad_to(existing_out, (1, tk, tn)) if interpret else existing_out)
        in_specs.append(pl.BlockSpec(out_block, out_map))
    call = pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec(out_block, out_map),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        input_output_aliases={} if from_zeros else {7: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=kernel_vmem_limit(
                "tgmm",
                lhs_block,
                rhs_block,
                out_block,
                cdt,
                out_dtype,
                existing_out=not from_zeros,
            ),
        ),
        cost_estimate=matmul_cost(k, m, n, lhs, rhs, out_shape),
        interpret=tpu_params(interpret),
        name="conveyor_tgmm",
    )
    out = call(*prefetched_metadata(meta), *operands)
    return out[:, :k, :n]
