"""Public grouped matmul: `gmm` and `tgmm` (validation, backend choice; autodiff in primitives)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from conveyor import backends
from conveyor.ops.gmm import backend_impls, tiling as tiling_lib
from conveyor.ops.gmm.gathered import bind_gathered_gmm
from conveyor.ops.gmm.primitives import bind_gmm, bind_tgmm
from conveyor.ops.gmm.scattered import bind_scatter_gmm

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float64)


def _check_array(x, name: str, ndim: int, shape_doc: str):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name}: expected an array of shape {shape_doc}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(
            f"{name}: expected {ndim} dimensions {shape_doc}, got shape {tuple(x.shape)}"
        )


def _check_float(x, name: str):
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in _FLOATS]:
        raise TypeError(
            f"{name}: expected dtype float32, bfloat16, float16 or float64, got {x.dtype}"
        )


def _check_out_dtype(dt):
    try:
        dt = jnp.dtype(dt)
    except TypeError as e:
        raise TypeError(f"preferred_element_type: expected a floating dtype, got {dt!r}") from e
    if dt not in [jnp.dtype(d) for d in _FLOATS]:
        raise TypeError(
            f"preferred_element_type: expected float32, bfloat16, float16 or float64, got {dt}"
        )
    return dt


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_group_sizes(group_sizes, m: int):
    _check_array(group_sizes, "group_sizes", 1, "[num_groups]")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"group_sizes: expected an integer (int32) array, got dtype {group_sizes.dtype}"
        )
    if group_sizes.shape[0] == 0:
        raise ValueError("group_sizes: expected at least one group, got shape (0,)")
    if _is_concrete(group_sizes):
        sizes = np.asarray(group_sizes)
        if (sizes < 0).any():
            raise ValueError(f"group_sizes: expected non-negative sizes, got {sizes.tolist()}")
        if int(sizes.sum()) > m:
            raise ValueError(
                f"group_sizes: expected a total of at most m={m} rows, got sum={int(sizes.sum())}"
            )
    return group_sizes.astype(jnp.int32)


def _check_indices(indices, name: str, num_rows: int, rows_doc: str):
    """`indices` is a 1-d integer array of rows in [0, num_rows) (checked when concrete)."""
    _check_array(indices, name, 1, "[m]")
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{name}: expected an integer (int32) array, got dtype {indices.dtype}")
    if _is_concrete(indices) and indices.shape[0]:
        idx = np.asarray(indices)
        bad = (idx < 0) | (idx >= num_rows)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"{name}: expected rows in [0, {num_rows}) ({rows_doc}), got "
                f"{name}[{i}]={int(idx[i])} ({int(bad.sum())} out of range)"
            )
    return indices


def _check_unique(indices, unique_indices, name: str = "out_indices") -> None:
    """`unique_indices` is a bool; with True, concrete `indices` hold no index twice."""
    if not isinstance(unique_indices, bool):
        raise TypeError(f"unique_indices: expected a bool, got {unique_indices!r}")
    if not unique_indices or not _is_concrete(indices):
        return  # traced: the caller's promise (documented)
    values, counts = np.unique(np.asarray(indices), return_counts=True)
    if (counts > 1).any():
        first = int(values[counts > 1][0])
        raise ValueError(
            f"{name}: unique_indices=True promises no index twice, got row {first} "
            f"{int(counts[counts > 1][0])} times; pass unique_indices=False to add repeats"
        )


def _check_lhs_indices(lhs_indices, num_rows: int) -> int:
    """`lhs_indices` is a 1-d integer array naming rows of lhs; returns its length (m)."""
    if num_rows == 0:
        raise ValueError("lhs: expected at least one row to gather from, got shape (0, k)")
    return _check_indices(lhs_indices, "lhs_indices", num_rows, "lhs.shape[0]").shape[0]


def _check_group_offset(group_offset, total_groups: int, local_groups: int):
    if group_offset is None:
        return jnp.zeros((), jnp.int32)
    if not hasattr(group_offset, "shape"):
        if isinstance(group_offset, bool) or not isinstance(group_offset, (int, np.integer)):
            raise TypeError(f"group_offset: expected an integer scalar, got {group_offset!r}")
        group_offset = jnp.asarray(group_offset, jnp.int32)
    if group_offset.shape not in ((), (1,)):
        raise ValueError(
            "group_offset: expected a scalar (shape () or (1,)), got shape "
            f"{tuple(group_offset.shape)}"
        )
    if not jnp.issubdtype(group_offset.dtype, jnp.integer):
        raise TypeError(f"group_offset: expected an integer scalar, got dtype {group_offset.dtype}")
    group_offset = jnp.reshape(group_offset, ()).astype(jnp.int32)
    if _is_concrete(group_offset):
        off = int(group_offset)
        if off < 0 or off + local_groups > total_groups:
            raise ValueError(
                f"group_offset: expected 0 <= group_offset and group_offset + {local_groups} local "
                f"groups <= {total_groups} groups in group_sizes, got {off}"
            )
    return group_offset


_REGISTRIES = {
    "gmm": backend_impls.GMM,
    "tgmm": backend_impls.TGMM,
    "gathered": backend_impls.GATHERED_GMM,
    "scatter": backend_impls.SCATTER_GMM,
}


def _choose_backend(backend, interpret, op="gmm"):
    if backend is None and interpret:
        # interpret without a backend: the TPU kernel, as before mosaic_gpu existed
        backend = "mosaic_tpu"
    if backend is None:
        return backends.AUTO  # chosen per platform when lowered (see conveyor.backends)
    return _REGISTRIES[op].get(backend).name


def _interpret_param(interpret, backend, op="gmm"):
    if not interpret:
        return None
    if not _REGISTRIES[op].get(backend).interprets:
        raise ValueError(
            "interpret: only the mosaic_tpu and mosaic_gpu backends have an interpreter, got "
            f"backend={backend!r}"
        )
    return interpret


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=jnp.float32,
    tiling: tiling_lib.Tiling = None,
    group_offset: jax.Array | int | None = None,
    existing_out: jax.Array | None = None,
    transpose_rhs: bool = False,
    lhs_indices: jax.Array | None = None,
    unique_indices: bool = False,
    unwritten_rows: str = "zero",
    backend: str | None = None,
    interpret=False,
) -> jax.Array:
    """Grouped matmul: each group of rows of `lhs` times its own weight matrix.

    Rows of `lhs` are sorted by group: group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])).
    With G = rhs.shape[0] local groups, local group i is global group `group_offset + i`; its
    rows of the output are `lhs[rows] @ rhs[i]`. **Every other row is exactly `existing_out`'s row
    when given, else exactly 0** (rows past sum(group_sizes), and rows of groups outside the shard).

    Args:
      lhs: [m, k] float array, rows sorted by group.
      rhs: [G, k, n] weights ([G, n, k] with `transpose_rhs=True`).
      group_sizes: int32 [G_total] rows per group; G_total == G unless `group_offset` is given.
      preferred_element_type: output dtype. 16-bit inputs accumulate in float32.
      tiling: None (per-backend default), a (tm, tk, tn) tuple, or a callable (m, k, n) ->
        tuple | None. Any m, k, n works with any tiling: tiles larger than a dimension are clamped
        and partial tiles are masked. The xla backend uses tm (row tile) only; mosaic_tpu uses all
        three (tk, tn must be multiples of 128 or cover the whole dimension). A tuple applies to
        this call only; the ops its derivatives run use the default. A callable is asked at the
        call for every ordering of (m, k, n), the shapes of the ops its derivatives run too.
      group_offset: scalar int, first global group of this shard (expert parallelism); may be
        traced.
      existing_out: [m, n] values for the rows this call does not compute (chain shards through it).
      transpose_rhs: rhs is [G, n, k] and used transposed.
      lhs_indices: int [m], optional: row i of the product reads `lhs[lhs_indices[i]]`, so lhs
        may hold its rows in any order and any number ([rows, k]); m = len(lhs_indices) and the
        groups are over these m gathered rows. An index may repeat (top-k routing). mosaic_tpu
        gathers the rows in the kernel's DMAs (no sorted copy of lhs is written); xla,
        reference and mosaic_gpu (no gather in its kernel yet) gather in XLA first. Concrete
        indices outside [0, rows) are refused; traced ones are clamped to that range, and the
        gradient goes to the rows that were read. On a mesh with Explicit axes, call it inside
        shard_map.
      unique_indices: with `lhs_indices`, the caller's promise that no index repeats (rows
        gathered back into expert order, as the expert-parallel layer's): lhs's gradient then
        sets each row rather than adding into a float32 buffer (gathers it, when the indices
        name every row of lhs). Same results. Concrete indices with a repeat are refused.
      unwritten_rows: "zero" (default): rows outside the local groups are exactly
        `existing_out`'s, or 0. "unspecified" (without `existing_out`): they hold anything, which
        spares the Mosaic kernels an output to fill and read back; for a caller that never reads
        them (the expert-parallel layer's padding rows). xla and reference give 0 there; the
        Pallas TPU interpreter gives NaN. Their gradient is 0, as for "zero".
      backend: "xla", "mosaic_tpu", "mosaic_gpu" or "reference"; None picks, when the op is
        lowered, for the platform it is lowered for: mosaic_tpu for TPU, xla for CPU, CUDA and
        ROCm (`conveyor.backends`). mosaic_gpu (Hopper; named explicitly until it has run on a
        GPU) takes 16-bit operands and rounds a float32 one beside them; the README's backend
        table says what each backend takes and what has run on hardware.
      interpret: run a Mosaic backend through its Pallas interpreter: True, or a
        `pltpu.InterpretParams` / `plgpu.InterpretGPUParams` (e.g. with detect_races=True).

    Returns:
      [m, n] array of dtype `preferred_element_type`.

    Traced group sizes (under jit) are not validated: negative sizes count as 0 and the running
    total is clipped at m, so groups that run past row m are truncated. Differentiable to any
    order in lhs, rhs and existing_out (forward and reverse mode); the gradient of existing_out is
    its cotangent on the rows this call does not compute, 0 elsewhere. `vmap` over any argument
    runs one grouped matmul per batch element, sequentially (lax.map).
    """
    _check_array(lhs, "lhs", 2, "[rows, k]" if lhs_indices is not None else "[m, k]")
    _check_array(rhs, "rhs", 3, "[G, n, k]" if transpose_rhs else "[G, k, n]")
    _check_float(lhs, "lhs")
    _check_float(rhs, "rhs")
    out_dtype = _check_out_dtype(preferred_element_type)
    m, k = lhs.shape
    if lhs_indices is not None:
        m = _check_lhs_indices(lhs_indices, lhs.shape[0])
        _check_unique(lhs_indices, unique_indices, "lhs_indices")
    elif unique_indices is not False:
        raise ValueError(
            f"unique_indices: applies to lhs_indices, none given; got {unique_indices!r}"
        )
    num_groups, rk, n = (rhs.shape[0], rhs.shape[2], rhs.shape[1]) if transpose_rhs else rhs.shape
    if rk != k:
        raise ValueError(
            f"rhs: contraction size must match lhs's k={k} "
            f"({'rhs.shape[2]' if transpose_rhs else 'rhs.shape[1]'}), got rhs shape "
            f"{tuple(rhs.shape)} with transpose_rhs={transpose_rhs}"
        )
    group_sizes = _check_group_sizes(group_sizes, m)
    if group_offset is None and group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"group_sizes: expected {num_groups} groups (rhs.shape[0]) when group_offset is not "
            f"given, got {group_sizes.shape[0]}"
        )
    if group_sizes.shape[0] < num_groups:
        raise ValueError(
            f"group_sizes: expected at least rhs.shape[0]={num_groups} groups, got "
            f"{group_sizes.shape[0]}"
        )
    group_offset = _check_group_offset(group_offset, group_sizes.shape[0], num_groups)
    tiling_lib.check_tiling(tiling)
    if unwritten_rows not in ("zero", "unspecified"):
        raise ValueError(
            f"unwritten_rows: expected 'zero' or 'unspecified', got {unwritten_rows!r}"
        )
    if unwritten_rows == "unspecified" and existing_out is not None:
        raise ValueError(
            "unwritten_rows: 'unspecified' leaves the rows existing_out would give; pass one or "
            "the other, got both"
        )
    fill = dict(fill_unwritten=unwritten_rows == "zero")
    if existing_out is None:
        existing_out = jnp.zeros((m, n), out_dtype)  # (its shape only when unspecified)
    else:
        _check_array(existing_out, "existing_out", 2, f"[m, n] = [{m}, {n}]")
        if tuple(existing_out.shape) != (m, n):
            raise ValueError(
                f"existing_out: expected shape {(m, n)}, got {tuple(existing_out.shape)}"
            )
        _check_float(existing_out, "existing_out")
    if lhs_indices is not None:
        backend = _choose_backend(backend, interpret, "gathered")
        return bind_gathered_gmm(
            lhs,
            rhs,
            group_sizes,
            group_offset,
            existing_out,
            lhs_indices.astype(jnp.int32),
            unique_indices=unique_indices,
            transpose_rhs=bool(transpose_rhs),
            out_dtype=out_dtype,
            backend=backend,
            tiling=tiling_lib.as_static(tiling, m, k, n),
            interpret=_interpret_param(interpret, backend, "gathered"),
            **fill,
        )
    backend = _choose_backend(backend, interpret)
    return bind_gmm(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        existing_out,
        transpose_rhs=bool(transpose_rhs),
        out_dtype=out_dtype,
        backend=backend,
        tiling=tiling_lib.as_static(tiling, m, k, n),
        interpret=_interpret_param(interpret, backend),
        **fill,
    )


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=jnp.float32,
    tiling: tiling_lib.Tiling = None,
    group_offset: jax.Array | int | None = None,
    num_actual_groups: int | None = None,
    existing_out: jax.Array | None = None,
    backend: str | None = None,
    interpret=False,
) -> jax.Array:
    """Transposed grouped matmul (the weight gradient of gmm): one [k, n] product per group.

    `out[i] = lhs[:, rows_i] @ rhs[rows_i, :] (+ existing_out[i])` for local group i (global group
    `group_offset + i`), i < num_actual_groups. An empty group gives exact zeros (or
    existing_out[i]).

    Args:
      lhs: [k, m] float array (columns sorted by group).
      rhs: [m, n] float array (rows sorted by group).
      group_sizes: int32 [G_total].
      preferred_element_type: output dtype; 16-bit inputs accumulate in float32.
      tiling: as in `gmm` (tm tiles the grouped dimension m).
      group_offset: scalar int, first global group of this shard; may be traced.
      num_actual_groups: number of local groups computed (static int, default G_total).
      existing_out: [num_actual_groups, k, n], added to the result.
      backend, interpret: as in `gmm`.

    Returns:
      [num_actual_groups, k, n] array of dtype `preferred_element_type`.

    Traced group sizes behave as in `gmm`. Differentiable to any order; `vmap` runs one tgmm per
    batch element, sequentially.
    """
    _check_array(lhs, "lhs", 2, "[k, m]")
    _check_array(rhs, "rhs", 2, "[m, n]")
    _check_float(lhs, "lhs")
    _check_float(rhs, "rhs")
    out_dtype = _check_out_dtype(preferred_element_type)
    k, m = lhs.shape
    if rhs.shape[0] != m:
        raise ValueError(
            f"rhs: expected {m} rows to match lhs's m (lhs.shape[1]), got rhs shape "
            f"{tuple(rhs.shape)}"
        )
    n = rhs.shape[1]
    group_sizes = _check_group_sizes(group_sizes, m)
    total = group_sizes.shape[0]
    if num_actual_groups is None:
        num_actual_groups = total
    if isinstance(num_actual_groups, bool) or not isinstance(num_actual_groups, (int, np.integer)):
        raise TypeError(f"num_actual_groups: expected a static int, got {num_actual_groups!r}")
    num_actual_groups = int(num_actual_groups)
    if not 1 <= num_actual_groups <= total:
        raise ValueError(
            f"num_actual_groups: expected 1 <= num_actual_groups <= {total} (len(group_sizes)), "
            f"got {num_actual_groups}"
        )
    group_offset = _check_group_offset(group_offset, total, num_actual_groups)
    tiling_lib.check_tiling(tiling)
    shape = (num_actual_groups, k, n)
    from_zeros = existing_out is None
    if from_zeros:
        existing_out = jnp.zeros(shape, out_dtype)  # its shape only: see bind_tgmm
    else:
        _check_array(existing_out, "existing_out", 3, f"[num_actual_groups, k, n] = {list(shape)}")
        if tuple(existing_out.shape) != shape:
            raise ValueError(
                f"existing_out: expected shape {shape}, got {tuple(existing_out.shape)}"
            )
        _check_float(existing_out, "existing_out")
    backend = _choose_backend(backend, interpret, "tgmm")
    return bind_tgmm(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        existing_out,
        num_groups=num_actual_groups,
        out_dtype=out_dtype,
        from_zeros=from_zeros,
        backend=backend,
        tiling=tiling_lib.as_static(tiling, m, k, n),
        interpret=_interpret_param(interpret, backend, "tgmm"),
    )


def gmm_scatter_add(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    out_indices: jax.Array,
    *,
    num_out_rows: int,
    row_weights: jax.Array | None = None,
    preferred_element_type=jnp.float32,
    tiling: tiling_lib.Tiling = None,
    group_offset: jax.Array | int | None = None,
    transpose_rhs: bool = False,
    unique_indices: bool = False,
    unwritten_rows: str = "zero",
    backend: str | None = None,
    interpret=False,
) -> jax.Array:
    """Grouped matmul whose result rows are added, weighted, into the output rows they name.

    `out[t] = sum of row_weights[i] * (lhs[i] @ rhs[group(i)])` over the rows i of the local
    groups with `out_indices[i] == t`, summed in float32: an MoE layer's last projection and its
    combine in one op (row i an assignment, t its token, the weight its gate). Output rows no index
    names are 0. The [m, n] product is not written: mosaic_tpu adds each row into its output row
    by DMA in the kernel's epilogue; the other backends compute the product, then scatter-add.

    Args:
      lhs: [m, k] float array, rows sorted by group (as in `gmm`).
      rhs: [G, k, n] weights ([G, n, k] with `transpose_rhs=True`).
      group_sizes: int32 [G_total] rows per group; `group_offset` as in `gmm`.
      out_indices: int [m], the output row of each lhs row; may repeat (a token's top-k
        assignments). Concrete indices outside [0, num_out_rows) are refused; traced ones are
        clamped to that range.
      num_out_rows: the output's row count (static int >= 1).
      row_weights: float [m], each row's weight (default 1); differentiable.
      preferred_element_type: output dtype (the sums are float32, rounded once).
      unique_indices: the caller's promise that `out_indices` holds no index twice (a
        permutation of some output rows, as when results go back to the rows they came from):
        each named row is then written, not added to, and mosaic_tpu skips its run-time check
        for repeats and the unfused computation kept beside the kernel for them. Same results.
        Concrete indices with a repeat are refused; traced ones with a repeat give unspecified
        rows (as `jnp.ndarray.at[...].set(unique_indices=True)`).
      unwritten_rows: "zero" (default): output rows no row of a local group names are 0.
        "unspecified" (with `unique_indices=True` only): they hold whatever the output's buffer
        held, which spares a backend that writes only the named rows (mosaic_tpu) a zero-filled
        output; for a caller that never reads them (the expert-parallel layer's padding rows).
        Other backends may give 0 there; the Pallas interpreter gives NaN.
      tiling, transpose_rhs, backend, interpret: as in `gmm`. mosaic_tpu's epilogue updates the
        rows of one visit together, so where one group names an output row twice it computes
        that call the unfused way (decided at run time, same results).

    Returns:
      [num_out_rows, n] array of dtype `preferred_element_type`.

    Differentiable in lhs, rhs and row_weights, to any order; `vmap` runs one op per batch
    element, sequentially.
    """
    _check_array(lhs, "lhs", 2, "[m, k]")
    _check_array(rhs, "rhs", 3, "[G, n, k]" if transpose_rhs else "[G, k, n]")
    _check_float(lhs, "lhs")
    _check_float(rhs, "rhs")
    out_dtype = _check_out_dtype(preferred_element_type)
    m, k = lhs.shape
    num_groups, rk = rhs.shape[0], rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if rk != k:
        raise ValueError(
            f"rhs: contraction size must match lhs's k={k}, got rhs shape {tuple(rhs.shape)} "
            f"with transpose_rhs={transpose_rhs}"
        )
    if isinstance(num_out_rows, bool) or not isinstance(num_out_rows, (int, np.integer)):
        raise TypeError(f"num_out_rows: expected a static int >= 1, got {num_out_rows!r}")
    if num_out_rows < 1:
        raise ValueError(f"num_out_rows: expected a static int >= 1, got {num_out_rows}")
    out_indices = _check_indices(out_indices, "out_indices", int(num_out_rows), "num_out_rows")
    if out_indices.shape[0] != m:
        raise ValueError(
            f"out_indices: expected one index per lhs row ({m}), got {out_indices.shape[0]}"
        )
    _check_unique(out_indices, unique_indices)
    if unwritten_rows not in ("zero", "unspecified"):
        raise ValueError(
            f"unwritten_rows: expected 'zero' or 'unspecified', got {unwritten_rows!r}"
        )
    if unwritten_rows == "unspecified" and unique_indices is not True:
        raise ValueError(
            "unwritten_rows: 'unspecified' needs unique_indices=True (rows added into are read "
            "first, so they must start at 0)"
        )
    if row_weights is None:
        row_weights = jnp.ones((m,), jnp.float32)
    _check_array(row_weights, "row_weights", 1, f"[m] = [{m}]")
    _check_float(row_weights, "row_weights")
    if row_weights.shape[0] != m:
        raise ValueError(f"row_weights: expected shape ({m},), got {tuple(row_weights.shape)}")
    group_sizes = _check_group_sizes(group_sizes, m)
    if group_offset is None and group_sizes.shape[0] != num_groups:
        raise ValueError(
            f"group_sizes: expected {num_groups} groups (rhs.shape[0]) when group_offset is not "
            f"given, got {group_sizes.shape[0]}"
        )
    group_offset = _check_group_offset(group_offset, group_sizes.shape[0], num_groups)
    tiling_lib.check_tiling(tiling)
    backend = _choose_backend(backend, interpret, "scatter")
    return bind_scatter_gmm(
        lhs,
        rhs,
        group_sizes,
        group_offset,
        out_indices.astype(jnp.int32),
        row_weights,
        num_rows=int(num_out_rows),
        transpose_rhs=bool(transpose_rhs),
        unique_indices=unique_indices,
        zero_unwritten=unwritten_rows == "zero",
        out_dtype=out_dtype,
        backend=backend,
        tiling=tiling_lib.as_static(tiling, m, k, rhs.shape[1] if transpose_rhs else rhs.shape[2]),
        interpret=_interpret_param(interpret, backend, "scatter"),
    )


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision=None,
    preferred_element_type=None,
    group_offset: jax.Array | None = None,
    out_sharding=None,
) -> jax.Array:
    """A drop-in for `jax.lax.ragged_dot` (same signature), computed by `cv.gmm`.

    Same results and output dtype (`preferred_element_type`, else the promoted type; 16-bit
    inputs accumulate in float32 and round once); rows past the last group are 0. Deliberate
    differences:
      - group_offset (a () or (1,) int array) works: rhs holds the local groups from
        group_offset on, other rows are 0 (jax 0.12's lax.ragged_dot raises for it).
      - Negative sizes count as 0 under jit; concrete negative sizes, or sizes summing past m,
        raise a ValueError naming group_sizes.
      - Every `lax.Precision` is accepted: the operands multiply at full precision.
      - out_sharding must be None (the output's sharding follows the operands).
      - Floating inputs only (integer inputs raise a TypeError naming the operand).
    """
    if out_sharding is not None:
        raise ValueError(
            "out_sharding: not supported by cv.ragged_dot (its output sharding follows the "
            f"operands' through gmm's sharding rule); got {out_sharding!r}"
        )
    _check_precision(precision)
    if preferred_element_type is None and hasattr(lhs, "dtype") and hasattr(rhs, "dtype"):
        preferred_element_type = jnp.result_type(lhs.dtype, rhs.dtype)
    return gmm(
        lhs,
        rhs,
        group_sizes,
        preferred_element_type=preferred_element_type,
        group_offset=group_offset,
    )


def _check_precision(precision):
    values = precision if isinstance(precision, (tuple, list)) else (precision,)
    for p in values:
        if p is None or isinstance(p, jax.lax.Precision):
            continue
        try:
            # also accepts the strings lax.dot takes ("highest", "float32", ...)
            jax.lax.Precision(p)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"precision: expected None, a lax.Precision or a pair of them, got {precision!r}"
            ) from e
