"""Sharding rules of gmm and tgmm under `jax.jit` (GSPMD/Shardy partitioning).

Design notes: docs/internals/gmm.md, section `ops/gmm/partitioning.py`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from conveyor.ops.gmm.metadata import group_bounds, local_row_mask
from conveyor.dtypes import accumulation_dtype


def _axes(entry) -> tuple[str, ...]:
    """Mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_dim(sharding, dim: int) -> tuple[str, ...]:
    spec = getattr(sharding, "spec", None)
    if spec is None or dim >= len(spec):
        return ()
    return _axes(spec[dim])


def _entry(axes: tuple[str, ...]):
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _linear_index(axes: tuple[str, ...], mesh) -> Any:
    """This device's position along the (major-to-minor) mesh axes `axes`."""
    index = jnp.int32(0)
    for a in axes:
        index = index * mesh.shape[a] + lax.axis_index(a)
    return index


def local_group_sizes(group_sizes, row0, rows: int, m: int):
    """The part of every group inside rows [row0, row0 + rows) of an m-row operand, in order.

    Groups are consecutive row ranges (`metadata.group_bounds`), so the local sizes keep the
    groups' order and start at local row 0."""
    starts, ends = group_bounds(group_sizes, m)
    return (jnp.clip(ends - row0, 0, rows) - jnp.clip(starts - row0, 0, rows)).astype(
        group_sizes.dtype
    )


def _disjoint(first: tuple[str, ...], second: tuple[str, ...]) -> tuple[str, ...]:
    """`second` without the axes `first` already uses (an axis shards one dimension only)."""
    return tuple(a for a in second if a not in first)


class Layout(NamedTuple):
    """How one call is partitioned: the mesh axes of its rows and of a sharded contraction (summed
    by a psum), the specs its operands are resharded to, and its output's spec."""

    rows: tuple[str, ...]
    summed: tuple[str, ...]
    in_specs: tuple[P, ...]
    out_spec: P


def _custom_partitioned(fn, layout: Callable[[list], Layout], make_lower: Callable, **rule):
    """`fn` (five operands) under custom_partitioning: each call is resharded to `layout(its
    operand shardings)` and runs `make_lower(layout, m_total)` per device."""

    @custom_partitioning
    def op(lhs, rhs, group_sizes, group_offset, existing_out):
        return fn(lhs, rhs, group_sizes, group_offset, existing_out)

    def partition(mesh, arg_shapes, result_shape):
        lay = layout([a.sharding for a in arg_shapes])
        return (
            mesh,
            make_lower(lay, mesh, arg_shapes),
            NamedSharding(mesh, lay.out_spec),
            tuple(NamedSharding(mesh, s) for s in lay.in_specs),
        )

    def infer(mesh, arg_shapes, result_shape):
        return NamedSharding(mesh, layout([a.sharding for a in arg_shapes]).out_spec)

    op.def_partition(partition, infer_sharding_from_operands=infer, **rule)
    return op


def _local_rows(lay: Layout, mesh, m: int) -> int:
    return m // math.prod(mesh.shape[a] for a in lay.rows)


# ---- gmm ----------------------------------------------------------------------------------------


def _gmm_layout(transpose_rhs: bool, arg_shardings) -> Layout:
    lhs, rhs = arg_shardings[0], arg_shardings[1]
    rows = _spec_dim(lhs, 0)
    contracted = _disjoint(rows, _spec_dim(lhs, 1) or _spec_dim(rhs, 2 if transpose_rhs else 1))
    cols = _disjoint(rows + contracted, _spec_dim(rhs, 1 if transpose_rhs else 2))
    r, c, n = _entry(rows), _entry(contracted), _entry(cols)
    rhs_spec = P(None, n, c) if transpose_rhs else P(None, c, n)
    return Layout(rows, contracted, (P(r, c), rhs_spec, P(), P(), P(r, n)), P(r, n))


@functools.lru_cache(maxsize=256)
def _partitioned_gmm(impl, static: tuple):
    params = dict(static)
    # (its constants stay inside: custom_partitioning takes none)
    fn = jax.jit(functools.partial(impl, **params))
    acc = accumulation_dtype(jnp.dtype(params["out_dtype"]))

    def make_lower(lay: Layout, mesh, arg_shapes):
        m = arg_shapes[0].shape[0]
        local_rows = _local_rows(lay, mesh, m)

        def lower(lhs, rhs, group_sizes, group_offset, existing_out):
            local = local_group_sizes(
                group_sizes, _linear_index(lay.rows, mesh) * local_rows, local_rows, m
            )
            if not lay.summed:
                return fn(lhs, rhs, local, group_offset, existing_out)
            # A sharded contraction: partial products summed over its axes; rows outside the local
            # groups keep existing_out, as the op defines.
            partial_products = impl(
                lhs,
                rhs,
                local,
                group_offset,
                jnp.zeros(existing_out.shape, acc),
                **dict(params, out_dtype=acc),
            )
            total = lax.psum(partial_products, lay.summed).astype(params["out_dtype"])
            if not params["fill_unwritten"]:  # rows outside the groups: any value
                return total
            written = local_row_mask(local, group_offset, rhs.shape[0], local_rows)
            return jnp.where(written[:, None], total, existing_out.astype(params["out_dtype"]))

        return lower

    rhs_rule = "g n k" if params["transpose_rhs"] else "g k n"
    return _custom_partitioned(
        fn,
        functools.partial(_gmm_layout, params["transpose_rhs"]),
        make_lower,
        sharding_rule=f"m k, {rhs_rule}, h, , m n -> m n",
        reduction_factors=("k",),
        need_replication_factors=("g", "h"),
    )


# ---- tgmm ---------------------------------------------------------------------------------------


def _tgmm_layout(arg_shardings) -> Layout:
    lhs, rhs = arg_shardings[0], arg_shardings[1]
    rows = _spec_dim(rhs, 0) or _spec_dim(lhs, 1)
    k_axes = _disjoint(rows, _spec_dim(lhs, 0))
    n_axes = _disjoint(rows + k_axes, _spec_dim(rhs, 1))
    k, n, r = _entry(k_axes), _entry(n_axes), _entry(rows)
    out = P(None, k, n)
    return Layout(rows, rows, (P(k, r), P(r, n), P(), P(), out), out)  # tgmm sums over its rows


@functools.lru_cache(maxsize=256)
def _partitioned_tgmm(impl, static: tuple):
    params = dict(static)
    # (its constants stay inside: custom_partitioning takes none)
    fn = jax.jit(functools.partial(impl, **params))
    acc = accumulation_dtype(jnp.dtype(params["out_dtype"]))

    def make_lower(lay: Layout, mesh, arg_shapes):
        m = arg_shapes[1].shape[0]
        local_rows = _local_rows(lay, mesh, m)

        def lower(lhs, rhs, group_sizes, group_offset, existing_out):
            if not lay.rows:
                return fn(lhs, rhs, group_sizes, group_offset, existing_out)
            local = local_group_sizes(
                group_sizes, _linear_index(lay.rows, mesh) * local_rows, local_rows, m
            )
            partial_sums = impl(
                lhs,
                rhs,
                local,
                group_offset,
                jnp.zeros(existing_out.shape, acc),
                **dict(params, out_dtype=acc),
            )
            total = lax.psum(partial_sums, lay.summed)
            if params.get("from_zeros"):  # existing_out gives only the shape (bind_tgmm)
                return total.astype(params["out_dtype"])
            return (existing_out.astype(acc) + total).astype(params["out_dtype"])

        return lower

    # (in order of appearance)
    return _custom_partitioned(
        fn,
        _tgmm_layout,
        make_lower,
        sharding_rule="k m, m n, h, , g k n -> g k n",
        reduction_factors=("m",),
        need_replication_factors=("h", "g"),
    )


def gmm_out_spec(arg_shardings, params) -> P:
    """The output's PartitionSpec under gmm's rule (its type, on a mesh with Explicit axes)."""
    return _gmm_layout(params["transpose_rhs"], arg_shardings).out_spec


def tgmm_out_spec(arg_shardings, params) -> P:
    """The output's PartitionSpec under tgmm's rule."""
    return _tgmm_layout(arg_shardings).out_spec


def gmm(impl, lhs, rhs, group_sizes, group_offset, existing_out, **params):
    """`impl(...)` lowered with gmm's sharding rule (plain when the kernel is interpreted)."""
    if params.get("interpret"):
        return impl(lhs, rhs, group_sizes, group_offset, existing_out, **params)
    return _partitioned_gmm(impl, tuple(sorted(params.items())))(
        lhs, rhs, group_sizes, group_offset, existing_out
    )


def tgmm(impl, lhs, rhs, group_sizes, group_offset, existing_out, **params):
    """`impl(...)` lowered with tgmm's sharding rule (plain when the kernel is interpreted)."""
    if params.get("interpret"):
        return impl(lhs, rhs, group_sizes, group_offset, existing_out, **params)
    return _partitioned_tgmm(impl, tuple(sorted(params.items())))(
        lhs, rhs, group_sizes, group_offset, existing_out
    )
