"""The definition of gmm and tgmm: a plain loop over groups, written independently of the kernels.

Slow on purpose (one dense product per group, masked); every other backend is tested against it.
Works in float64 when x64 is enabled. Shares no code with the tiled backends but the
accumulation dtype rule (`conveyor.dtypes.accumulation_dtype`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from conveyor.dtypes import accumulation_dtype


def _row_ranges(group_sizes, m):
    """[start, end) per global group: negatives count as 0, the running total is clipped at m."""
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), m)
    starts = jnp.minimum(jnp.cumsum(sizes) - sizes, m)
    return starts, ends


def _local_masks(group_sizes, group_offset, num_groups, m):
    starts, ends = _row_ranges(group_sizes, m)
    rows = jnp.arange(m)
    masks = []
    for i in range(num_groups):
        gid = group_offset + i
        in_range = (gid >= 0) & (gid < group_sizes.shape[0])
        gid = jnp.clip(gid, 0, group_sizes.shape[0] - 1)
        masks.append(in_range & (rows >= starts[gid]) & (rows < ends[gid]))
    return masks


def gmm_reference(
    lhs, rhs, group_sizes, group_offset, existing_out, *, transpose_rhs, out_dtype, **_
):
    m = lhs.shape[0]
    acc = accumulation_dtype(lhs.dtype, rhs.dtype)
    out = existing_out.astype(out_dtype)
    for i, mask in enumerate(_local_masks(group_sizes, group_offset, rhs.shape[0], m)):
        w = rhs[i].T if transpose_rhs else rhs[i]
        prod = jnp.dot(lhs.astype(acc), w.astype(acc), precision=lax.Precision.HIGHEST)
        out = jnp.where(mask[:, None], prod.astype(out_dtype), out)
    return out


def tgmm_reference(
    lhs, rhs, group_sizes, group_offset, existing_out, *, num_groups, out_dtype, **_
):
    m = lhs.shape[1]
    acc = accumulation_dtype(lhs.dtype, rhs.dtype)
    outs = []
    for i, mask in enumerate(_local_masks(group_sizes, group_offset, num_groups, m)):
        # Zero both operands outside the group so non-finite values elsewhere cannot leak in.
        l = jnp.where(mask[None, :], lhs.astype(acc), 0)
        r = jnp.where(mask[:, None], rhs.astype(acc), 0)
        prod = jnp.dot(l, r, precision=lax.Precision.HIGHEST)
        outs.append((existing_out[i].astype(acc) + prod).astype(out_dtype))
    return jnp.stack(outs) if outs else existing_out.astype(out_dtype)
