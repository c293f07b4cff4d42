"""The implementations of gmm and tgmm (the registries `backend=` names), each with its tiling
resolved.

Design notes: docs/internals/gmm.md, section `ops/gmm/backend_impls.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from conveyor import backends
from conveyor.backends import Implementation, Registry
from conveyor.ops.gmm import reference, tiling as tiling_lib, xla
from conveyor.ops.gmm.metadata import local_row_mask


def _mosaic_tpu():
    from conveyor.ops.gmm import mosaic_tpu  # Pallas import is deferred: it costs ~1 s

    return mosaic_tpu


def _gmm_dims(lhs, rhs, transpose_rhs):
    return (*lhs.shape, rhs.shape[1] if transpose_rhs else rhs.shape[2])


def _tgmm_dims(lhs, rhs):
    k, m = lhs.shape
    return m, k, rhs.shape[1]


# ---- gmm -----------------------------------------------------------------------------------------
# An implementation takes existing_out=None (gmm_p with fill_unwritten=False, and the
# scatter-add's product, below) as "rows outside the local groups: any value"; mosaic_tpu and
# mosaic_gpu leave them unwritten, the others start from zeros.


def _zeros_if_none(existing_out, lhs, rhs, transpose_rhs, out_dtype):
    if existing_out is not None:
        return existing_out
    return jnp.zeros((lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]), out_dtype)


def _gmm_reference(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    *,
    tiling,
    interpret,
    transpose_rhs,
    out_dtype,
):
    return reference.gmm_reference(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        _zeros_if_none(existing_out, lhs, rhs, transpose_rhs, out_dtype),
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
    )


def _gmm_xla(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    *,
    tiling,
    interpret,
    transpose_rhs,
    out_dtype,
):
    existing_out = _zeros_if_none(existing_out, lhs, rhs, transpose_rhs, out_dtype)
    m, k, n = _gmm_dims(lhs, rhs, transpose_rhs)
    t = tiling_lib.resolve(tiling, m, k, n, (xla.GMM_TM, k, n))
    return xla.gmm_xla(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        existing_out,
        tiling=t,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
    )


def _gmm_mosaic_tpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    *,
    tiling,
    interpret,
    transpose_rhs,
    out_dtype,
):
    m, k, n = _gmm_dims(lhs, rhs, transpose_rhs)
    t = tiling_lib.resolve(tiling, m, k, n, tiling_lib.tpu_default(m, k, n, group_sizes.shape[0]))
    return _mosaic_tpu().gmm_mosaic_tpu(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        existing_out,
        tiling=t,
        interpret=interpret,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
    )


def _mosaic_gpu_gmm_tile(tiling, lhs, rhs, transpose_rhs, out_dtype):
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    default = tiling_lib.MOSAIC_GPU.gmm_tiles_for(k, n, out_itemsize=jnp.dtype(out_dtype).itemsize)
    return tiling_lib.resolve(tiling, m, k, n, default)


def _pad_to(x, axis: int, multiple: int):
    """`x` with zeros appended along `axis` up to a multiple of `multiple` (x itself if it is one).
    Works on arrays and on ShapeDtypeStructs (for the checks)."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        shape = list(x.shape)
        shape[axis] += extra
        return jax.ShapeDtypeStruct(tuple(shape), x.dtype)
    return jnp.pad(x, [(0, extra if d == axis else 0) for d in range(x.ndim)])


def _gmm_padded_for_gpu(lhs, rhs, existing_out, transpose_rhs, out_dtype):
    """The mosaic_gpu gmm's operands with k and n padded with zeros to its narrowest tiles (k to a
    32-byte swizzled row, n to a 128-byte output row): zero columns of lhs meet zero rows of rhs,
    so the product is exact, and the padded output columns are dropped."""
    k_unit = tiling_lib.MOSAIC_GPU.min_tile
    n_unit = tiling_lib.MOSAIC_GPU.gmm_min_tn(jnp.dtype(out_dtype).itemsize)
    k_axis, n_axis = (2, 1) if transpose_rhs else (1, 2)
    lhs = _pad_to(lhs, 1, k_unit)
    rhs = _pad_to(_pad_to(rhs, k_axis, k_unit), n_axis, n_unit)
    return lhs, rhs, None if existing_out is None else _pad_to(existing_out, 1, n_unit)


def _gmm_mosaic_gpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    *,
    tiling,
    interpret,
    transpose_rhs,
    out_dtype,
):
    from conveyor.ops.gmm import mosaic_gpu

    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    lhs, rhs, existing_out = _gmm_padded_for_gpu(lhs, rhs, existing_out, transpose_rhs, out_dtype)
    t = _mosaic_gpu_gmm_tile(tiling, lhs, rhs, transpose_rhs, out_dtype)
    out = mosaic_gpu.gmm_mosaic_gpu(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        existing_out,
        tiling=t,
        interpret=interpret,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
    )
    return out if out.shape[1] == n else out[:, :n]


def _shape_of(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _gmm_mosaic_gpu_check(
    lhs, rhs, group_sizes, group_offset, existing_out, *, tiling, transpose_rhs, out_dtype, **_
):
    from conveyor.ops.gmm import mosaic_gpu

    lhs, rhs = mosaic_gpu.wgmma_operands("gmm", lhs, rhs)
    lhs, rhs, existing_out = _gmm_padded_for_gpu(
        _shape_of(lhs), _shape_of(rhs), _shape_of(existing_out), transpose_rhs, out_dtype
    )
    t = _mosaic_gpu_gmm_tile(tiling, lhs, rhs, transpose_rhs, out_dtype)
    try:
        mosaic_gpu.check_gmm_args(lhs, rhs, t, transpose_rhs, out_dtype)
    # the kernel's argument rules, refused by name when it is named explicitly
    except ValueError as e:
        raise NotImplementedError(str(e)) from e


GMM = Registry(
    "gmm",
    (
        Implementation(name="xla", run=_gmm_xla),
        Implementation(name="mosaic_tpu", run=_gmm_mosaic_tpu, interprets=True),
        Implementation(
            name="mosaic_gpu", run=_gmm_mosaic_gpu, check=_gmm_mosaic_gpu_check, interprets=True
        ),
        Implementation(name="reference", run=_gmm_reference),
    ),
)


# ---- gmm with gathered lhs rows (lhs_indices) ---------------------------------------------


def _gathered_then(run):
    """A gathered gmm by gathering the rows in XLA first, then `run` (a plain gmm)."""

    def gathered(lhs, rhs, group_sizes, group_offset, existing_out, lhs_indices, **params):
        rows = jnp.clip(lhs_indices.astype(jnp.int32), 0, lhs.shape[0] - 1)
        return run(
            jnp.take(lhs, rows, axis=0), rhs, group_sizes, group_offset, existing_out, **params
        )

    return gathered


def _gathered_gmm_mosaic_tpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    lhs_indices,
    *,
    tiling,
    interpret,
    transpose_rhs,
    out_dtype,
):
    m, k = lhs_indices.shape[0], lhs.shape[1]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    t = tiling_lib.resolve(tiling, m, k, n, tiling_lib.tpu_default(m, k, n, rhs.shape[0]))
    from conveyor.ops.gmm import mosaic_tpu_rows

    return mosaic_tpu_rows.gathered_gmm_mosaic_tpu(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        existing_out,
        lhs_indices,
        tiling=t,
        interpret=interpret,
        transpose_rhs=transpose_rhs,
        out_dtype=out_dtype,
    )


# mosaic_tpu gathers in the kernel's loads; the others gather in XLA first (a copy of the gathered
# rows): the Mosaic GPU kernel has no row gather yet.
GATHERED_GMM = Registry(
    "gmm with lhs_indices",
    (
        Implementation(name="xla", run=_gathered_then(_gmm_xla)),
        Implementation(name="mosaic_tpu", run=_gathered_gmm_mosaic_tpu, interprets=True),
        Implementation(
            name="mosaic_gpu",
            run=_gathered_then(_gmm_mosaic_gpu),
            check=_gathered_then(_gmm_mosaic_gpu_check),
            interprets=True,
        ),
        Implementation(name="reference", run=_gathered_then(_gmm_reference)),
    ),
)


# ---- gmm whose rows are added into indexed output rows (gmm_scatter_add) ---------------------


def _scatter_then(run):
    """The scatter-add gmm as a plain gmm (`run`, float32 out, given no start: the rows outside the
    local groups are then unspecified, masked here) and an XLA scatter-add."""

    def scattered(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        out_indices,
        row_weights,
        *,
        num_rows,
        out_dtype,
        unique_indices=False,
        zero_unwritten=True,  # False allows any value there: these give 0 anyway
        **p,
    ):
        m = lhs.shape[0]
        prod = run(lhs, rhs, group_sizes, group_offset, None, out_dtype=jnp.float32, **p)
        computed = local_row_mask(group_sizes, group_offset, rhs.shape[0], m)[:, None]
        rows = jnp.clip(out_indices.astype(jnp.int32), 0, num_rows - 1)
        weighted = jnp.where(computed, row_weights.astype(jnp.float32)[:, None] * prod, 0.0)
        return put_rows(weighted, rows, num_rows, unique_indices, out_dtype)

    return scattered


def put_rows(values, rows, num_rows: int, unique: bool, dtype, keep=None):
    """[num_rows, n] of `dtype`: row `rows[i]` gets `values[i]` (float32 unless `unique`), summed
    over repeats in float32 and rounded once; rows nobody names are 0. With `unique` (no index
    twice) each row is rounded and set (the same values: 0 + x is x) without a float32
    [num_rows, n] buffer, and indices naming every row (a permutation) are gathered through their
    inverse: no zero-filled output at all. `keep` (bool[m], optional): only those rows of
    `values` are put, the others (which may hold anything, even NaN) count as 0; the scatters
    drop them by index, the gather selects them away in its own fusion."""
    m, n = values.shape
    if keep is not None:
        rows = jnp.where(keep, rows, num_rows)  # past the end: dropped by the scatters below
    if not unique:
        out = jnp.zeros((num_rows, n), jnp.float32).at[rows].add(values, mode="drop")
        return out.astype(dtype)
    rounded = values.astype(dtype)
    if num_rows == m and keep is None:
        iota = jnp.arange(m, dtype=jnp.int32)
        return rounded[jnp.zeros((m,), jnp.int32).at[rows].set(iota, unique_indices=True)]
    if num_rows == m:  # the inverse permutation, -1 for the rows nobody keeps
        iota = jnp.arange(m, dtype=jnp.int32)
        inverse = jnp.full((m,), -1, jnp.int32).at[rows].set(iota, mode="drop")
        gathered = rounded[jnp.maximum(inverse, 0)]
        return jnp.where((inverse >= 0)[:, None], gathered, jnp.zeros((), dtype))
    out = jnp.zeros((num_rows, n), dtype)
    return out.at[rows].set(rounded, unique_indices=True, mode="drop")


def _scatter_gmm_mosaic_tpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    out_indices,
    row_weights,
    *,
    tiling,
    interpret,
    transpose_rhs,
    num_rows,
    out_dtype,
    unique_indices=False,
    zero_unwritten=True,
):
    from conveyor.ops.gmm import mosaic_tpu_rows
    from conveyor.ops.gmm.scattered import repeats_within_a_group

    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    t = tiling_lib.resolve(tiling, m, k, n, tiling_lib.tpu_default(m, k, n, rhs.shape[0]))
    args = (lhs, rhs, group_sizes, group_offset, out_indices, row_weights)

    def kernel(args):
        out = mosaic_tpu_rows.scatter_gmm_mosaic_tpu(
            *args,
            num_rows=num_rows,
            transpose_rhs=transpose_rhs,
            tiling=t,
            interpret=interpret,
            store=unique_indices,
            zero_unwritten=zero_unwritten,
            out_dtype=out_dtype,
        )
        return out.astype(out_dtype)

    if unique_indices:  # no repeats to route around: the kernel alone, storing its rows
        return kernel(args)

    def unfused(args):
        # a group naming one output row twice: the kernel's row updates would collide
        run = _scatter_then(_gmm_xla)
        return run(
            *args,
            num_rows=num_rows,
            out_dtype=out_dtype,
            tiling=None,
            interpret=None,
            transpose_rhs=transpose_rhs,
        )

    repeats = repeats_within_a_group(group_sizes, group_offset, out_indices, rhs.shape[0], num_rows)
    return jax.lax.cond(repeats, unfused, kernel, args)


def _scatter_check(check):
    """A plain gmm's `check` asked about the product the scatter-add gmm computes first."""

    def scattered(lhs, rhs, group_sizes, group_offset, out_indices, row_weights, **p):
        n = rhs.shape[1] if p["transpose_rhs"] else rhs.shape[2]
        product = jax.ShapeDtypeStruct((lhs.shape[0], n), jnp.float32)
        check(lhs, rhs, group_sizes, group_offset, product, **p)

    return scattered


# mosaic_tpu adds the rows in the kernel's epilogue; the others write the product and scatter-add
# it in XLA.
SCATTER_GMM = Registry(
    "gmm_scatter_add",
    (
        Implementation(name="xla", run=_scatter_then(_gmm_xla)),
        Implementation(name="mosaic_tpu", run=_scatter_gmm_mosaic_tpu, interprets=True),
        Implementation(
            name="mosaic_gpu",
            run=_scatter_then(_gmm_mosaic_gpu),
            check=_scatter_check(_gmm_mosaic_gpu_check),
            interprets=True,
        ),
        Implementation(name="reference", run=_scatter_then(_gmm_reference)),
    ),
)


# ---- tgmm ----------------------------------------------------------------------------------------


def _tgmm_start(existing_out, lhs, rhs, num_groups, out_dtype):
    """tgmm's existing_out, or (None: the sums start from zeros, see `run_tgmm`) zeros."""
    if existing_out is not None:
        return existing_out
    return jnp.zeros((num_groups, lhs.shape[0], rhs.shape[1]), out_dtype)


def _tgmm_reference(
    lhs, rhs, group_sizes, group_offset, existing_out, *, tiling, interpret, num_groups, out_dtype
):
    return reference.tgmm_reference(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        _tgmm_start(existing_out, lhs, rhs, num_groups, out_dtype),
        num_groups=num_groups,
        out_dtype=out_dtype,
    )


def _tgmm_xla(
    lhs, rhs, group_sizes, group_offset, existing_out, *, tiling, interpret, num_groups, out_dtype
):
    m, k, n = _tgmm_dims(lhs, rhs)
    t = tiling_lib.resolve(tiling, m, k, n, (xla.default_tgmm_tm(m, num_groups), k, n))
    return xla.tgmm_xla(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        _tgmm_start(existing_out, lhs, rhs, num_groups, out_dtype),
        tiling=t,
        num_groups=num_groups,
        out_dtype=out_dtype,
    )


def _tgmm_mosaic_tpu(
    lhs, rhs, group_sizes, group_offset, existing_out, *, tiling, interpret, num_groups, out_dtype
):
    m, k, n = _tgmm_dims(lhs, rhs)
    t = tiling_lib.resolve(tiling, m, k, n, tiling_lib.tpu_default(m, k, n, group_sizes.shape[0]))
    return _mosaic_tpu().tgmm_mosaic_tpu(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        existing_out,
        tiling=t,
        interpret=interpret,
        num_groups=num_groups,
        out_dtype=out_dtype,
    )


def _mosaic_gpu_tgmm_tile(tiling, lhs, rhs):
    m, k, n = _tgmm_dims(lhs, rhs)
    return tiling_lib.resolve(tiling, m, k, n, tiling_lib.MOSAIC_GPU.tgmm_tiles_for(n))


def _tgmm_mosaic_gpu(
    lhs, rhs, group_sizes, group_offset, existing_out, *, tiling, interpret, num_groups, out_dtype
):
    from conveyor.ops.gmm import mosaic_gpu_tgmm

    # n padded with zero columns to the kernel's narrowest column tile; their outputs are dropped
    n = rhs.shape[1]
    rhs = _pad_to(rhs, 1, mosaic_gpu_tgmm.MIN_TN)
    if existing_out is not None:  # (None: from zeros; the kernel writes every group's block)
        existing_out = _pad_to(existing_out, 2, mosaic_gpu_tgmm.MIN_TN)
    t = _mosaic_gpu_tgmm_tile(tiling, lhs, rhs)
    out = mosaic_gpu_tgmm.tgmm_mosaic_gpu(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        existing_out,
        tiling=t,
        interpret=interpret,
        num_groups=num_groups,
        out_dtype=out_dtype,
    )
    return out if out.shape[2] == n else out[:, :, :n]


def mosaic_gpu_given_tiles(
    op: str, m: int, k: int, n: int, dtype, tiling: tuple[int, int, int]
) -> tuple[int, int, int]:
    """The (tm, tk, tn) cv.gmm (op "gmm", rhs not transposed, output in `dtype`) or cv.tgmm
    ("tgmm") runs its mosaic_gpu kernel with for `tiling`: resolved and checked as the backends
    above do, after padding k and n to the kernel's narrowest tiles; a tile the kernel refuses
    raises its ValueError. The simulator prices the same tiles (`cv.sim.simulate_gmm`)."""
    from conveyor.ops.gmm import mosaic_gpu, mosaic_gpu_tgmm

    sds = jax.ShapeDtypeStruct
    if op == "gmm":
        lhs, rhs, _ = _gmm_padded_for_gpu(
            sds((m, k), dtype), sds((1, k, n), dtype), None, False, dtype
        )
        return mosaic_gpu.check_gmm_args(
            lhs, rhs, _mosaic_gpu_gmm_tile(tiling, lhs, rhs, False, dtype), False, dtype
        )
    lhs, rhs = sds((k, m), dtype), _pad_to(sds((m, n), dtype), 1, mosaic_gpu_tgmm.MIN_TN)
    return mosaic_gpu_tgmm.check_tgmm_args(lhs, rhs, _mosaic_gpu_tgmm_tile(tiling, lhs, rhs))


def _tgmm_mosaic_gpu_check(lhs, rhs, group_sizes, group_offset, existing_out, *, tiling, **_):
    from conveyor.ops.gmm import mosaic_gpu, mosaic_gpu_tgmm

    lhs, rhs = mosaic_gpu.wgmma_operands("tgmm", lhs, rhs)
    rhs = _pad_to(_shape_of(rhs), 1, mosaic_gpu_tgmm.MIN_TN)
    try:
        mosaic_gpu_tgmm.check_tgmm_args(lhs, rhs, _mosaic_gpu_tgmm_tile(tiling, lhs, rhs))
    except ValueError as e:
        raise NotImplementedError(str(e)) from e


TGMM = Registry(
    "tgmm",
    (
        Implementation(name="xla", run=_tgmm_xla),
        Implementation(name="mosaic_tpu", run=_tgmm_mosaic_tpu, interprets=True),
        Implementation(
            name="mosaic_gpu", run=_tgmm_mosaic_gpu, check=_tgmm_mosaic_gpu_check, interprets=True
        ),
        Implementation(name="reference", run=_tgmm_reference),
    ),
)


# ---- tgmm with one side's rows gathered (the weight gradients of gathered and scatter gmm) ----


def _gathered_tgmm_then(run):
    """The gathered tgmm by gathering (and weighting) the rows in XLA first, then `run` (a plain
    tgmm, which takes its lhs as [k, m])."""

    def gathered(lhs, rhs, group_sizes, group_offset, existing_out, indices, weights, **params):
        side, weighted = params.pop("gathered_side"), params.pop("weighted")
        src = lhs if side == "lhs" else rhs
        rows = jnp.take(src, jnp.clip(indices.astype(jnp.int32), 0, src.shape[0] - 1), axis=0)
        if weighted:  # in float32, rounded to the operand's dtype (as the kernel does)
            rows = (weights.astype(jnp.float32)[:, None] * rows.astype(jnp.float32)).astype(
                src.dtype
            )
        a, b = (rows, rhs) if side == "lhs" else (lhs, rows)
        return run(a.T, b, group_sizes, group_offset, existing_out, **params)

    return gathered


def _gathered_tgmm_mosaic_tpu(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    indices,
    weights,
    *,
    tiling,
    interpret,
    num_groups,
    out_dtype,
    gathered_side,
    weighted,
):
    m, k, n = indices.shape[0], lhs.shape[1], rhs.shape[1]
    t = tiling_lib.resolve(tiling, m, k, n, tiling_lib.tpu_default(m, k, n, num_groups))
    from conveyor.ops.gmm import mosaic_tpu_rows

    return mosaic_tpu_rows.gathered_tgmm_mosaic_tpu(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        existing_out,
        indices,
        weights if weighted else None,
        gathered_side=gathered_side,
        num_groups=num_groups,
        out_dtype=out_dtype,
        tiling=t,
        interpret=interpret,
    )


# mosaic_tpu gathers in the kernel's loads; the others gather in XLA first.
GATHERED_TGMM = Registry(
    "tgmm of gathered rows",
    (
        Implementation(name="xla", run=_gathered_tgmm_then(_tgmm_xla)),
        Implementation(name="mosaic_tpu", run=_gathered_tgmm_mosaic_tpu, interprets=True),
        Implementation(
            name="mosaic_gpu",
            run=_gathered_tgmm_then(_tgmm_mosaic_gpu),
            check=_gathered_tgmm_then(_tgmm_mosaic_gpu_check),
            interprets=True,
        ),
        Implementation(name="reference", run=_gathered_tgmm_then(_tgmm_reference)),
    ),
)


def _run(registry: Registry, backend: str, platform: str, args, params, *, rows: int):
    """`registry`'s implementation named `backend` (or `platform`'s first that takes the args)
    on `args`. A problem of no `rows` runs no kernel (the TPU and GPU kernels need a row tile):
    every backend gives the reference's result, empty or existing_out (or zeros)."""
    if rows == 0:
        impl = registry.get("reference")
    elif backend == backends.AUTO:
        impl = registry.for_platform(platform, *args, **params)
    else:
        impl = registry.get(backend)
    return impl.run(*args, **params)


def run_gmm(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    *,
    backend,
    platform="cpu",
    fill_unwritten=True,
    **params,
):
    """gmm by the named implementation, or (backend="auto") by `platform`'s default order.
    Without `fill_unwritten` (see `primitives.bind_gmm`) the implementation gets
    existing_out=None: rows outside the local groups may hold anything."""
    if not fill_unwritten:
        existing_out = None
    args = (lhs, rhs, group_sizes, group_offset, existing_out)
    return _run(GMM, backend, platform, args, params, rows=lhs.shape[0])


def run_tgmm(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    *,
    backend,
    platform="cpu",
    from_zeros=False,
    **params,
):
    """tgmm by the named implementation, or (backend="auto") by `platform`'s default order. With
    `from_zeros` (see `primitives.bind_tgmm`) the implementation gets existing_out=None: mosaic_tpu
    then writes every group's block itself, the others start from zeros."""
    if from_zeros:
        existing_out = None
    args = (lhs, rhs, group_sizes, group_offset, existing_out)
    return _run(TGMM, backend, platform, args, params, rows=lhs.shape[1])


def run_gathered_gmm(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    lhs_indices,
    *,
    backend,
    platform="cpu",
    unique_indices=False,  # the gradient's concern (gathered.py), not the forward's
    fill_unwritten=True,
    **params,
):
    """gmm of gathered lhs rows by the named implementation, or by `platform`'s default order;
    `fill_unwritten` as `run_gmm`'s."""
    if not fill_unwritten:
        existing_out = None
    args = (lhs, rhs, group_sizes, group_offset, existing_out, lhs_indices)
    return _run(GATHERED_GMM, backend, platform, args, params, rows=lhs_indices.shape[0])


def run_scatter_gmm(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    out_indices,
    row_weights,
    *,
    backend,
    platform="cpu",
    **params,
):
    """gmm_scatter_add by the named implementation, or by `platform`'s default order."""
    args = (lhs, rhs, group_sizes, group_offset, out_indices, row_weights)
    return _run(SCATTER_GMM, backend, platform, args, params, rows=lhs.shape[0])


def run_gathered_tgmm(
    lhs,
    rhs,
    group_sizes,
    group_offset,
    existing_out,
    indices,
    weights,
    *,
    backend,
    platform="cpu",
    from_zeros=False,
    **params,
):
    """tgmm with one side's rows gathered by the named implementation, or by `platform`'s
    default order; `from_zeros` as `run_tgmm`'s."""
    if from_zeros:
        existing_out = None
    args = (lhs, rhs, group_sizes, group_offset, existing_out, indices, weights)
    return _run(GATHERED_TGMM, backend, platform, args, params, rows=indices.shape[0])
