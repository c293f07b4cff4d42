"""Mosaic TPU kernels of grouped matmuls that move rows by index: the gathered gmm (lhs rows
fetched by DMA from HBM in the kernel's loads) and the scatter-add gmm (each result row added into
the output row its index names, by DMA, in the epilogue). Their grid, tiles and metadata are gmm's
(`mosaic_tpu`, `tpu_blocks`).

Design notes: docs/internals/gmm.md, section `ops/gmm/mosaic_tpu_rows.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor.ints import cdiv, floordiv, mod
from conveyor.cost import matmul_cost
from conveyor.interpreters import tpu_params
from conveyor.ops.gmm import tpu_blocks
from conveyor.ops.gmm.metadata import make_group_metadata
from conveyor.ops.gmm.mosaic_tpu import (
    SUPPORTED,
    accumulate_product,
    compute_dtype,
    k_mask,
    kernel_vmem_limit,
    pad_to,
    prefetched_metadata,
    tgmm_metadata,
)


def _row_copy(lhs_hbm, buf, sem, slot, r, row, chunk, width, packed):
    """The DMA of k-chunk `chunk` (`width` columns) of one gathered lhs row into row r of the
    slot. 16-bit rows are packed two to a sublane, so they travel as [rows, 1, k] views (a row's
    own tile); 32-bit rows as 1-row slices."""
    cols = pl.ds(chunk * width, width)
    if packed:
        return pltpu.make_async_copy(lhs_hbm.at[row, :, cols], buf.at[slot, r], sem.at[slot])
    return pltpu.make_async_copy(
        lhs_hbm.at[pl.ds(row, 1), cols], buf.at[slot, pl.ds(r, 1)], sem.at[slot]
    )


def _gathered_gmm_kernel(
    group_ids,
    tile_ids,
    starts,
    ends,
    num_visits,
    rows,
    lhs_hbm,
    rhs_ref,
    *refs,
    tm,
    tk,
    k,
    chunk_tiles,
    transpose_rhs,
    packed,
):
    """gmm's kernel with the lhs rows gathered by DMA, one per row per *unit*: a visit's k-chunk
    of `chunk_tiles` k tiles (the whole of k when it fits). A unit's rows are fetched while the
    previous unit runs, into the other of two slots; fetching stays inside one n tile, whose first
    unit fetches its own rows, so the n axis stays parallel. The unit's k steps read their tiles
    from the slot. refs = (ex_ref, out_ref, acc_ref, buf, sem), or without existing_out (rows
    outside the groups: any value) (out_ref, acc_ref, buf, sem)."""
    ex_ref, out_ref, acc_ref, buf, sem = refs if len(refs) == 5 else (None, *refs)
    v, kk = pl.program_id(1), pl.program_id(2)
    nk = pl.num_programs(2)
    chunks = cdiv(nk, chunk_tiles)
    chunk, within = floordiv(kk, chunk_tiles), mod(kk, chunk_tiles)
    unit = v * chunks + chunk
    slot = mod(unit, 2)
    tile = tile_ids[v]
    first_visit = (v == 0) | (tile != tile_ids[jnp.maximum(v - 1, 0)])
    live = v < num_visits[0]
    width = chunk_tiles * tk

    def start(visit, c, s):
        base = tile_ids[visit] * tm

        def one(r, carry):
            _row_copy(lhs_hbm, buf, sem, s, r, rows[base + r], c, width, packed).start()
            return carry

        lax.fori_loop(0, tm, one, 0)

    def wait(s):
        def one(r, carry):
            _row_copy(lhs_hbm, buf, sem, s, r, 0, 0, width, packed).wait()
            return carry

        lax.fori_loop(0, tm, one, 0)

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if ex_ref is not None:

        @pl.when(first_visit & (kk == 0))
        def _():
            out_ref[...] = ex_ref[...]  # rows no visit stores keep existing_out

    unit_starts = live & (within == 0)

    @pl.when(unit_starts & (unit == 0))
    def _():
        start(v, chunk, slot)  # the n tile's first unit: nothing fetched it ahead

    next_v = jnp.where(chunk + 1 < chunks, v, v + 1)

    @pl.when(unit_starts & (next_v < num_visits[0]))
    def _():
        start(next_v, jnp.where(chunk + 1 < chunks, chunk + 1, 0), 1 - slot)

    @pl.when(unit_starts)
    def _():
        wait(slot)

    @pl.when(live)
    def _():
        cols = pl.ds(pl.multiple_of(within * tk, tk), tk)
        x = buf[slot, :, 0, cols] if packed else buf[slot, :, cols]  # k is padded with zeros
        accumulate_product(acc_ref, x, rhs_ref, kk, tk, k, transpose_rhs)

    @pl.when(live & (kk == nk - 1))
    def _():
        g = group_ids[v]
        row_ids = tile * tm + lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (row_ids >= starts[g]) & (row_ids < ends[g])
        out_ref[...] = jnp.where(mine, acc_ref[...].astype(out_ref.dtype), out_ref[...])


# The gathered rows' two VMEM slots hold whole rows of k when they take at most this many bytes
# (k = 7168 bf16 rows of a 128-row tile: 3.5 MiB), else one k tile per DMA.
GATHER_SLOTS_BYTES = 4 << 20


def packed_rows_vmem(tm: int, tk: int, width: int, cdt) -> int:
    """VMEM libtpu holds for the gathered gmm's packed 16-bit row slots ([2, tm, 1, width]) beyond
    their nominal bytes: the slots again (each packed row takes twice its size) and the [tm, tk]
    operand unpacked from them at 16 bytes an element (it replaces the relayout copy a plain
    gmm's operand gets). Compiled on v5e for tm in {128, 256}, tk in {512, 1024}, k in {2048,
    4096}: within +1.8% of libtpu (docs/internals/gmm.md, `ops/gmm/mosaic_tpu_rows.py`)."""
    return 2 * tm * width * jnp.dtype(cdt).itemsize + 16 * tm * tk


def gather_chunk_tiles(tm: int, tk: int, k_tiles: int, itemsize: int) -> int:
    """How many k tiles one gathered-row DMA carries: all of them when two slots of whole rows
    fit `GATHER_SLOTS_BYTES` (one DMA per row per visit and n tile), else one."""
    return k_tiles if 2 * tm * k_tiles * tk * itemsize <= GATHER_SLOTS_BYTES else 1


def _gather_source(lhs, lhs_indices, tm: int, width: int, cdt):
    """What a gathering kernel reads: the row of each gathered row (clamped to lhs; the last row
    tile's spare rows read row 0, never stored), lhs in `cdt` with its columns padded to whole
    `width`-column DMAs (a DMA past a row's end would fail), and whether it is packed (16-bit
    rows travel as [rows, 1, k]: see the design notes)."""
    num_rows = lhs.shape[0]
    rows = jnp.clip(lhs_indices.astype(jnp.int32), 0, num_rows - 1)
    rows = jnp.pad(rows, (0, -lhs_indices.shape[0] % tm))
    lhs = pad_to(lhs.astype(cdt), (1, width))
    packed = jnp.dtype(cdt).itemsize < 4
    if packed:
        lhs = lhs.reshape(num_rows, 1, lhs.shape[1])
    return rows, lhs, packed


def gathered_gmm_mosaic_tpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    lhs_indices,
    *,
    transpose_rhs,
    out_dtype,
    tiling,
    interpret,
):
    """gmm of `lhs[lhs_indices]`, the rows gathered by the kernel's DMAs from lhs in HBM.

    lhs's k is padded with zeros to whole tk tiles (a copy of lhs when it is not one already: a
    DMA past the row's end would fail); 16-bit lhs is viewed as [rows, 1, k] (one copy of lhs
    in XLA's layout change), so that a single row is a whole tile for the DMA."""
    k = lhs.shape[1]
    m = lhs_indices.shape[0]
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    if jnp.dtype(out_dtype) not in SUPPORTED:
        raise NotImplementedError(
            f"mosaic_tpu: output dtype must be float32 or bfloat16, got {jnp.dtype(out_dtype).name}"
        )
    tm, tk, tn = tpu_blocks.gmm_tiles(m, k, n, (tiling.tm, tiling.tk, tiling.tn), cdt)
    meta = make_group_metadata(group_sizes, m, tm, group_offset=group_offset, num_groups=num_groups)
    grid = tpu_blocks.gmm_grid(k, n, tk, tn, meta.group_ids.shape[0])
    _, rhs_map, out_map = tpu_blocks.gmm_index_maps(transpose_rhs)
    chunk_tiles = gather_chunk_tiles(tm, tk, cdiv(k, tk), jnp.dtype(cdt).itemsize)
    rows, lhs, packed = _gather_source(lhs, lhs_indices, tm, chunk_tiles * tk, cdt)
    rhs = rhs.astype(cdt)
    out_shape = (m, n)
    if interpret:  # see gmm_mosaic_tpu: pad the edges the interpreter mishandles
        rhs = pad_to(rhs, (1, tn, 1) if transpose_rhs else (1, 1, tn))
        out_shape = (m + (-m) % tm, n + (-n) % tn)
    out_shape = jax.ShapeDtypeStruct(out_shape, out_dtype)
    _, rhs_block, out_block = tpu_blocks.gmm_blocks(tm, tk, tn, transpose_rhs)
    operands = [rows, lhs, rhs]
    in_specs = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(rhs_block, rhs_map)]
    if existing_out is not None:  # (None: rows outside the groups may hold anything)
        existing_out = existing_out.astype(out_dtype)
        operands.append(pad_to(existing_out, (tm, tn)) if interpret else existing_out)
        in_specs.append(pl.BlockSpec(out_block, out_map))
    width = chunk_tiles * tk
    buf = (2, tm, 1, width) if packed else (2, tm, width)
    call = pl.pallas_call(
        functools.partial(
            _gathered_gmm_kernel,
            tm=tm,
            tk=tk,
            k=k,
            chunk_tiles=chunk_tiles,
            transpose_rhs=transpose_rhs,
            packed=packed,
        ),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec(out_block, out_map),
            scratch_shapes=[
                pltpu.VMEM((tm, tn), jnp.float32),
                pltpu.VMEM(buf, cdt),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        input_output_aliases={} if existing_out is None else {8: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=kernel_vmem_limit(
                "gmm with lhs_indices",
                (tm, width),
                rhs_block,
                out_block,
                cdt,
                out_dtype,
                # packed rows: `packed_rows_vmem` counts the unpacked operand, which stands for
                # the relayout copy, so the operand named here is a single column (never copied)
                dot_lhs=(tm, 1) if packed else (tm, tk),
                extra=packed_rows_vmem(tm, tk, width, cdt) if packed else 0,
                existing_out=existing_out is not None,
            ),
        ),
        cost_estimate=matmul_cost(m, k, n, lhs, rhs, out_shape),
        interpret=tpu_params(interpret),
        name="conveyor_gathered_gmm",
    )
    out = call(*prefetched_metadata(meta), *operands)
    return out[:m, :n]


def _gathered_tgmm_kernel(
    group_ids,
    tile_ids,
    starts,
    ends,
    num_visits,
    rows,
    src_hbm,
    other_ref,
    *refs,
    tm,
    width,
    gathered_side,
    weighted,
    packed,
):
    """tgmm's kernel with one side's tile gathered: the k-tile (gathered lhs) or n-tile (gathered
    rhs) columns of the visit's rows, one DMA per row, fetched while the previous visit runs (into
    the other of two slots; each (k tile, n tile) pair's visits fetch their own first rows, so both
    axes stay parallel), and scaled by the rows' weights when `weighted`."""
    if not weighted:
        refs = (None, *refs)
    if len(refs) == 5:  # no existing_out: the sums start from zeros
        refs = (*refs[:1], None, *refs[1:])
    weight_ref, ex_ref, out_ref, acc_ref, buf, sem = refs
    kk, nn, v = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    chunk = kk if gathered_side == "lhs" else nn
    last = pl.num_programs(2) - 1
    g = group_ids[v]
    first_visit = (v == 0) | (g != group_ids[jnp.maximum(v - 1, 0)])
    last_visit = (v == last) | (g != group_ids[jnp.minimum(v + 1, last)])
    live = v < num_visits[0]
    slot = mod(v, 2)

    def start(visit, s):
        base = tile_ids[visit] * tm

        def one(r, carry):
            _row_copy(src_hbm, buf, sem, s, r, rows[base + r], chunk, width, packed).start()
            return carry

        lax.fori_loop(0, tm, one, 0)

    def wait(s):
        def one(r, carry):
            _row_copy(src_hbm, buf, sem, s, r, 0, 0, width, packed).wait()
            return carry

        lax.fori_loop(0, tm, one, 0)

    @pl.when(first_visit)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(live & (v == 0))
    def _():
        start(v, slot)  # the first visit: nothing fetched it ahead

    @pl.when(live & (v + 1 < num_visits[0]))
    def _():
        start(v + 1, 1 - slot)

    @pl.when(live)
    def _():
        wait(slot)
        lo, hi = starts[g], ends[g]
        gathered = buf[slot, :, 0, :] if packed else buf[slot]  # [tm, width]: the rows' tile
        if weighted:  # in float32, rounded to the operand's dtype (as XLA's gather path does)
            scaled = gathered.astype(jnp.float32) * weight_ref[...]
            gathered = scaled.astype(gathered.dtype)
        x, y = (gathered, other_ref[...]) if gathered_side == "lhs" else (other_ref[...], gathered)
        row_ids = tile_ids[v] * tm + lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mine = (row_ids >= lo) & (row_ids < hi)
        x = jnp.where(mine, x, jnp.zeros_like(x))
        y = jnp.where(mine, y, jnp.zeros_like(y))
        acc_ref[...] += lax.dot_general(
            x, y, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    @pl.when(last_visit)
    def _():
        total = acc_ref[...] if ex_ref is None else ex_ref[...].astype(jnp.float32) + acc_ref[...]
        out_ref[...] = total.astype(out_ref.dtype)


def gathered_tgmm_mosaic_tpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    indices,
    weights=None,
    *,
    gathered_side="lhs",
    num_groups,
    out_dtype,
    tiling,
    interpret,
):
    """[G, k, n]: per group, `A[rows]^T @ B[rows]` plus existing_out (None: from zeros, as in
    `tgmm_mosaic_tpu`), where one side's rows are gathered by the kernel's DMAs from HBM (and
    scaled by `weights` unless None): with
    `gathered_side="lhs"` A = lhs[indices] and B = rhs ([m, n]); with "rhs" A = lhs ([m, k]) and
    B = rhs[indices]. The weight gradients of the gathered gmm and of gmm_scatter_add without a
    gathered copy of the tokens. The gathered operand's columns are padded to whole tiles;
    16-bit rows travel as [rows, 1, width] (see the design notes)."""
    m, k, n = indices.shape[0], lhs.shape[1], rhs.shape[1]
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    if jnp.dtype(out_dtype) not in SUPPORTED:
        raise NotImplementedError(
            f"mosaic_tpu: output dtype must be float32 or bfloat16, got {jnp.dtype(out_dtype).name}"
        )
    tm, tk, tn = tpu_blocks.tgmm_tiles(m, k, n, (tiling.tm, tiling.tk, tiling.tn), cdt)
    _, rhs_block, out_block = tpu_blocks.tgmm_blocks(tm, tk, tn)
    from_zeros = existing_out is None
    meta = tgmm_metadata(group_sizes, m, tm, group_offset, num_groups, from_zeros)
    grid = tpu_blocks.tgmm_grid(k, n, tk, tn, meta.group_ids.shape[0])
    _, rhs_map, out_map = tpu_blocks.tgmm_index_maps()
    if gathered_side == "lhs":
        width, other, other_block, other_map = tk, rhs, rhs_block, rhs_map
        rows, src, packed = _gather_source(lhs, indices, tm, tk, cdt)
    else:
        width, other, other_block = tn, lhs, (tm, tk)
        rows, src, packed = _gather_source(rhs, indices, tm, tn, cdt)

        def other_map(i, j, v, group_ids, tile_ids, *_):
            return tile_ids[v], i

    other = other.astype(cdt)
    out_shape = (num_groups, k, n)
    if interpret:  # see gmm_mosaic_tpu: pad the edges the interpreter mishandles
        other = pad_to(other, other_block)
        out_shape = (num_groups, k + (-k) % tk, n + (-n) % tn)
    operands = [rows, src, other]
    in_specs = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(other_block, other_map)]
    if weights is not None:
        operands.append(jnp.pad(weights.astype(jnp.float32), (0, -m % tm))[:, None])
        in_specs.append(pl.BlockSpec((tm, 1), lambda i, j, v, _, tile_ids, *__: (tile_ids[v], 0)))
    if not from_zeros:
        existing_out = existing_out.astype(out_dtype)
        operands.append(pad_to(existing_out, (1, tk, tn)) if interpret else existing_out)
        in_specs.append(pl.BlockSpec(out_block, out_map))
    out_shape = jax.ShapeDtypeStruct(out_shape, out_dtype)
    buf = (2, tm, 1, width) if packed else (2, tm, width)
    call = pl.pallas_call(
        functools.partial(
            _gathered_tgmm_kernel,
            tm=tm,
            width=width,
            gathered_side=gathered_side,
            weighted=weights is not None,
            packed=packed,
        ),
        out_shape=out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=grid,
            in_specs=in_specs,
            out_specs=pl.BlockSpec(out_block, out_map),
            scratch_shapes=[
                pltpu.VMEM((tk, tn), jnp.float32),
                pltpu.VMEM(buf, cdt),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        input_output_aliases={} if from_zeros else {5 + len(operands) - 1: 0},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=kernel_vmem_limit(
                "tgmm of gathered rows",
                (tm, width),
                other_block,
                out_block,
                cdt,
                out_dtype,
                # packed rows: their slots again and the operand unpacked from them, as in the
                # gathered gmm (which then stands for a gathered lhs's relayout copy)
                dot_lhs=(tm, 1) if packed and gathered_side == "lhs" else (tm, tk),
                extra=packed_rows_vmem(tm, width, width, cdt) if packed else 0,
                existing_out=not from_zeros,
            ),
        ),
        cost_estimate=matmul_cost(k, m, n, lhs, rhs, out_shape),
        interpret=tpu_params(interpret),
        name="conveyor_gathered_tgmm",
    )
    out = call(*prefetched_metadata(meta), *operands)
    return out[:, :k, :n]


def _scatter_gmm_kernel(
    group_ids,
    tile_ids,
    starts,
    ends,
    num_visits,
    out_rows,
    lhs_ref,
    rhs_ref,
    weight_ref,
    *refs,  # [y_init (aliased to y_hbm),] y_hbm, acc_ref, rows_buf, sem
    tm,
    tk,
    tn,
    k,
    transpose_rhs,
    store,
):
    """gmm's kernel whose epilogue adds the visit's weighted rows into the output rows their
    indices name: it reads those rows by DMA, adds, and writes them back, waiting for the writes
    before the next visit (which may name the same rows). Rows of one visit are one group's,
    whose indices are distinct (the caller routes repeats elsewhere), so they never collide.
    With `store` (no index twice in the whole call) the rows are written without being read, in
    the output's dtype; 16-bit rows travel as [tm, 1, tn] views (a row's own tile, as the gathered
    kernel's loads)."""
    y_hbm, acc_ref, rows_buf, sem = refs[-4:]
    j, v, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    nk = pl.num_programs(2)
    live = v < num_visits[0]

    @pl.when(kk == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(live)
    def _():
        x = k_mask(lhs_ref[...], kk, tk, k, 1)
        accumulate_product(acc_ref, x, rhs_ref, kk, tk, k, transpose_rhs)

    @pl.when(live & (kk == nk - 1))
    def _():
        g = group_ids[v]
        base = tile_ids[v] * tm
        lo = jnp.maximum(starts[g] - base, 0)
        hi = jnp.minimum(ends[g] - base, tm)

        packed = len(y_hbm.shape) == 3

        def copy(r, into_vmem):
            if packed:
                hbm = y_hbm.at[out_rows[base + r], :, pl.ds(j * tn, tn)]
                vmem = rows_buf.at[r]
            else:
                hbm = y_hbm.at[pl.ds(out_rows[base + r], 1), pl.ds(j * tn, tn)]
                vmem = rows_buf.at[pl.ds(r, 1)]
            if into_vmem:
                return pltpu.make_async_copy(hbm, vmem, sem.at[0])
            return pltpu.make_async_copy(vmem, hbm, sem.at[1])

        def each_row(fn):
            lax.fori_loop(lo, hi, lambda r, c: (fn(r), c)[1], 0)

        if store:  # only the rows [lo, hi) leave the buffer: the others need no mask
            value = (acc_ref[...] * weight_ref[...]).astype(rows_buf.dtype)
            rows_buf[...] = value.reshape(rows_buf.shape)
        else:
            each_row(lambda r: copy(r, True).start())
            each_row(lambda r: copy(r, True).wait())
            rows = base + lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
            mine = (rows >= starts[g]) & (rows < ends[g])
            added = rows_buf[...] + acc_ref[...] * weight_ref[...]
            rows_buf[...] = jnp.where(mine, added, rows_buf[...])
        each_row(lambda r: copy(r, False).start())
        each_row(lambda r: copy(r, False).wait())


def scatter_gmm_mosaic_tpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    out_indices,
    row_weights,
    *,
    num_rows,
    transpose_rhs,
    tiling,
    interpret,
    store=False,
    zero_unwritten=True,
    out_dtype=jnp.float32,
):
    """float32 [num_rows, n]: `row_weights[i] * (lhs[i] @ rhs[group(i)])` added into row
    `out_indices[i]`, for the rows of the local groups, in the kernel's epilogue (no [m, n]
    product is written). Indices must be distinct within each group (see the kernel); with
    `store`, distinct in the whole call: each row is written, not added to, rounded once to
    `out_dtype` (the dtype of the result; float32 without `store`). With `store` and not
    `zero_unwritten` the output starts as its buffer held it (no zero-filled input aliased to
    it): rows no index of a local group names are unspecified."""
    if not (zero_unwritten or store):
        raise ValueError("zero_unwritten=False needs store=True: added-into rows are read first")
    m, k = lhs.shape
    num_groups = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    tm, tk, tn = tpu_blocks.gmm_tiles(m, k, n, (tiling.tm, tiling.tk, tiling.tn), cdt)
    meta = make_group_metadata(group_sizes, m, tm, group_offset=group_offset, num_groups=num_groups)
    grid = tpu_blocks.gmm_grid(k, n, tk, tn, meta.group_ids.shape[0])
    lhs_map, rhs_map, _ = tpu_blocks.gmm_index_maps(transpose_rhs)
    rows = jnp.clip(out_indices.astype(jnp.int32), 0, num_rows - 1)
    rows = jnp.pad(rows, (0, -m % tm))  # the last tile's spare rows: never in a visit's range
    weights = jnp.pad(row_weights.astype(jnp.float32), (0, -m % tm))[:, None]
    lhs, rhs = lhs.astype(cdt), rhs.astype(cdt)
    if interpret:  # see gmm_mosaic_tpu: pad the edges the interpreter mishandles
        lhs = pad_to(lhs, (tm, 1))
        rhs = pad_to(rhs, (1, tn, 1) if transpose_rhs else (1, 1, tn))
    # whole column tiles, so that every DMA stays inside the rows; the padding is sliced off
    y_dtype = jnp.dtype(out_dtype if store else jnp.float32)
    packed = y_dtype.itemsize < 4
    y_shape = (num_rows, 1, cdiv(n, tn) * tn) if packed else (num_rows, cdiv(n, tn) * tn)
    y = (jnp.zeros(y_shape, y_dtype),) if zero_unwritten else ()
    lhs_block, rhs_block, out_block = tpu_blocks.gmm_blocks(tm, tk, tn, transpose_rhs)
    call = pl.pallas_call(
        functools.partial(
            _scatter_gmm_kernel,
            tm=tm,
            tk=tk,
            tn=tn,
            k=k,
            transpose_rhs=transpose_rhs,
            store=store,
        ),
        out_shape=jax.ShapeDtypeStruct(y_shape, y_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=grid,
            in_specs=[
                pl.BlockSpec(lhs_block, lhs_map),
                pl.BlockSpec(rhs_block, rhs_map),
                pl.BlockSpec((tm, 1), lambda j, v, kk, group_ids, tile_ids, *_: (tile_ids[v], 0)),
                *[pl.BlockSpec(memory_space=pl.ANY) for _ in y],
            ],
            out_specs=pl.BlockSpec(memory_space=pl.ANY),
            scratch_shapes=[
                pltpu.VMEM((tm, tn), jnp.float32),
                pltpu.VMEM((tm, 1, tn) if packed else (tm, tn), y_dtype),
                pltpu.SemaphoreType.DMA((2,)),
            ],
        ),
        input_output_aliases={9: 0} if y else {},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=kernel_vmem_limit(
                "gmm_scatter_add", lhs_block, rhs_block, out_block, cdt, jnp.float32
            ),
        ),
        cost_estimate=matmul_cost(m, k, n, lhs, rhs, jax.ShapeDtypeStruct(y_shape, y_dtype)),
        interpret=tpu_params(interpret),
        name="conveyor_scatter_gmm",
    )
    out = call(
        *prefetched_metadata(meta),
        rows,
        lhs,
        rhs,
        weights,
        *y,
    )
    return out.reshape(num_rows, -1)[:, :n]
