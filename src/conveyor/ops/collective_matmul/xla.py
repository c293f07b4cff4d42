"""XLA backend of the collective matmuls: a ppermute ring under shard_map, following the ring plan.

Design notes: docs/internals/collective-matmul.md, section `ops/collective_matmul/xla.py`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from conveyor.dtypes import accumulation_dtype
from conveyor.plans.ring import RingPlan


def _shift(x, axis_name, size, direction):
    """Send `x` to the right (d -> d + 1) or left (d -> d - 1) neighbour."""
    step = 1 if direction == "right" else -1
    return lax.ppermute(x, axis_name, [(d, (d + step) % size) for d in range(size)])


def _dot(a, b, out_dtype):
    acc = accumulation_dtype(out_dtype)
    return jnp.dot(a, b, preferred_element_type=acc)


def _per_platform(run, lhs, rhs, **config):
    """`run(lhs, rhs, merge=..., **config)`: merged dots when lowered for CPU, one per ring step
    elsewhere."""
    return lax.platform_dependent(
        lhs,
        rhs,
        cpu=lambda l, r: run(l, r, merge=True, **config),
        default=lambda l, r: run(l, r, merge=False, **config),
    )


def all_gather_matmul_xla(lhs, rhs, **config):
    """Keyword config: axis_name, size, gather_dim, plan (RingPlan), out_dtype."""
    return _per_platform(_all_gather_matmul, lhs, rhs, **config)


def _all_gather_matmul(
    lhs, rhs, *, axis_name, size, gather_dim, plan: RingPlan, out_dtype, merge: bool
):
    me = lax.axis_index(axis_name)
    if gather_dim == 1:
        kd = lhs.shape[1]

        def contribute(acc, shard, offset):
            w = lax.dynamic_slice_in_dim(rhs, ((me + offset) % size) * kd, kd, 0)
            part = _dot(shard, w, out_dtype)
            return part if acc is None else acc + part
    else:
        mb = lhs.shape[0]

        def contribute(acc, shard, offset):
            if acc is None:
                acc = jnp.zeros(
                    (size * mb, rhs.shape[1]), _dot(shard[:1], rhs[:, :1], out_dtype).dtype
                )
            return lax.dynamic_update_slice_in_dim(
                acc, _dot(shard, rhs, out_dtype), ((me + offset) % size) * mb, 0
            )

    held = {d: lhs for d in plan.directions}  # step 0: every stream holds the local shard
    acc = None
    arrived = []  # (shard, offset) in ring order
    for records in plan.steps():
        # Issue the transfers for the next step first, then compute on what is here.
        nxt = {
            r.direction: _shift(held[r.direction], axis_name, size, r.direction)
            for r in records
            if r.sends
        }
        for r in records:
            if not r.computes:
                continue
            if merge:
                arrived.append((held[r.direction], r.source))
            else:
                acc = contribute(acc, held[r.direction], r.source)
        held = nxt
    if merge:
        acc = _merged(arrived, rhs, me, size, gather_dim, out_dtype)
    return acc.astype(out_dtype)


def _merged(arrived, rhs, me, size, gather_dim, out_dtype):
    """All steps' products as one dot: shards side by side against their K-blocks (gather_dim=1),
    or stacked rows placed at their source's row block (gather_dim=0)."""
    if gather_dim == 1:
        kd = arrived[0][0].shape[1]
        a = jnp.concatenate([s for s, _ in arrived], axis=1)
        w = jnp.concatenate(
            [lax.dynamic_slice_in_dim(rhs, ((me + off) % size) * kd, kd, 0) for _, off in arrived],
            0,
        )
        return _dot(a, w, out_dtype)
    mb = arrived[0][0].shape[0]
    prod = _dot(jnp.concatenate([s for s, _ in arrived], axis=0), rhs, out_dtype)
    out = jnp.zeros((size * mb, rhs.shape[1]), prod.dtype)
    for j, (_, off) in enumerate(arrived):
        out = lax.dynamic_update_slice_in_dim(
            out, prod[j * mb : (j + 1) * mb], ((me + off) % size) * mb, 0
        )
    return out


def matmul_reduce_scatter_xla(lhs, rhs, **config):
    """Keyword config: axis_name, size, scatter_dim, plan (RingPlan), out_dtype."""
    return _per_platform(_matmul_reduce_scatter, lhs, rhs, **config)


def _matmul_reduce_scatter(
    lhs, rhs, *, axis_name, size, scatter_dim, plan: RingPlan, out_dtype, merge: bool
):
    me = lax.axis_index(axis_name)
    other = 1 - scatter_dim
    n_other = (lhs.shape[0], rhs.shape[1])[other]
    halves = [(0, n_other)]
    # Two directions halve the bytes per link on hardware; on CPU (merge) they only double the
    # number of synchronous permutes, so the CPU lowering sends everything one way.
    if plan.bidirectional and n_other >= 2 and size > 1 and not merge:
        h = n_other // 2
        halves = [(0, h), (h, n_other - h)]
    directions = ["right", "left"][: len(halves)]
    blk = (lhs.shape[0] if scatter_dim == 0 else rhs.shape[1]) // size

    def partial(block, lo, width):
        """This device's partial sum for output block `block`, columns/rows [lo, lo + width) of the
        other dim."""
        if scatter_dim == 0:
            a = lax.dynamic_slice_in_dim(lhs, block * blk, blk, 0)
            return _dot(a, rhs[:, lo : lo + width], out_dtype)
        b = lax.dynamic_slice_in_dim(rhs, block * blk, blk, 1)
        return _dot(lhs[lo : lo + width], b, out_dtype)

    results = []
    for (lo, width), direction in zip(halves, directions):
        if merge:  # every step's partial from one dot, then the ring of accumulators
            full = (
                _dot(lhs, rhs[:, lo : lo + width], out_dtype)
                if scatter_dim == 0
                else _dot(lhs[lo : lo + width], rhs, out_dtype)
            )
            parts = [
                lax.dynamic_slice_in_dim(
                    full, ((me + plan.scatter_block(t, direction)) % size) * blk, blk, scatter_dim
                )
                for t in range(size)
            ]
        else:
            parts = None
        acc = (
            parts[0]
            if merge
            else partial((me + plan.scatter_block(0, direction)) % size, lo, width)
        )
        for t in range(1, size):
            incoming = _shift(acc, axis_name, size, direction)
            acc = incoming + (
                parts[t]
                if merge
                else partial((me + plan.scatter_block(t, direction)) % size, lo, width)
            )
        results.append(acc)
    out = results[0] if len(results) == 1 else jnp.concatenate(results, axis=other)
    return out.astype(out_dtype)
