"""XLA backend for gmm/tgmm: group-major loops of exact row tiles, so work tracks the real rows.

For each local group, rows are covered by full tiles of `tm` rows, then by small masked tiles of
`REMAINDER_ROWS` rows, each multiplied with that group's weights while they are hot in cache.
Extra work is at most REMAINDER_ROWS - 1 rows per group, and each group's weights are read once:
unlike `lax.ragged_dot` on CPU, there is no G-times dense expansion.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.ops.gmm.metadata import local_group_bounds

# Rows of the small tiles that finish each group: 8 is the smallest tile that still keeps the dot
# emitter efficient (measured on the 2-core CPU: tm=128 with 8-row remainders beat 16/32-row ones
# at G=64 and G=256, m=4096, k=n=1024).
REMAINDER_ROWS = 8


def compute_dtype(*dtypes):
    """Operand dtype for the dots: the promoted input type (f32 accumulation for 16-bit floats)."""
    return jnp.result_type(*dtypes)


def accum_dtype(dtype):
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def _dot(a, b, contract, acc):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=acc)


def _row_tiles(start, end, m, tm, tr, carry, full_tile, part_tile):
    """Cover rows [start, end) with full `tm` tiles, then masked `tr` tiles clamped inside [0, m)."""
    nfull = (end - start) // tm
    carry = lax.fori_loop(0, nfull, lambda t, c: full_tile(start + t * tm, c), carry)
    pos = start + nfull * tm

    def part(t, c):
        s = pos + t * tr
        window = jnp.minimum(s, m - tr)  # keep the window inside the array; mask what is not ours
        rows = window + jnp.arange(tr, dtype=jnp.int32)
        mask = (rows >= s) & (rows < end)
        return part_tile(window, mask, c)

    npart = (end - pos + tr - 1) // tr
    return lax.fori_loop(0, npart, part, carry)


def gmm_xla(lhs, rhs, group_sizes, group_offset, existing_out, *, transpose_rhs, out_dtype, tiling,
            **_):
    m, _k = lhs.shape
    num_groups = rhs.shape[0]
    tm = min(tiling[0], m)
    tr = min(REMAINDER_ROWS, m)
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    acc = accum_dtype(cdt)
    lhs = lhs.astype(cdt)
    rhs = rhs.astype(cdt)
    starts, ends = local_group_bounds(group_sizes, group_offset, num_groups, m)
    w_contract = 1 if transpose_rhs else 0

    def group(g, out):
        w = lax.dynamic_index_in_dim(rhs, g, keepdims=False)

        def full_tile(s, o):
            x = lax.dynamic_slice_in_dim(lhs, s, tm, 0)
            y = _dot(x, w, ((1,), (w_contract,)), acc).astype(out_dtype)
            return lax.dynamic_update_slice_in_dim(o, y, s, 0)

        def part_tile(s, mask, o):
            x = lax.dynamic_slice_in_dim(lhs, s, tr, 0)
            y = _dot(x, w, ((1,), (w_contract,)), acc).astype(out_dtype)
            old = lax.dynamic_slice_in_dim(o, s, tr, 0)
            return lax.dynamic_update_slice_in_dim(o, jnp.where(mask[:, None], y, old), s, 0)

        return _row_tiles(starts[g], ends[g], m, tm, tr, out, full_tile, part_tile)

    return lax.fori_loop(0, num_groups, group, existing_out.astype(out_dtype))


def tgmm_xla(lhs, rhs, group_sizes, group_offset, existing_out, *, num_groups, out_dtype, tiling,
             **_):
    k, m = lhs.shape
    n = rhs.shape[1]
    tm = min(tiling[0], m)
    tr = min(REMAINDER_ROWS, m)
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    acc_t = accum_dtype(cdt)
    lhs_rows = lhs.astype(cdt).T  # [m, k]: row tiles become contiguous slices
    rhs = rhs.astype(cdt)
    starts, ends = local_group_bounds(group_sizes, group_offset, num_groups, m)
    contract = ((0,), (0,))

    def group(g, out):
        def full_tile(s, a):
            x = lax.dynamic_slice_in_dim(lhs_rows, s, tm, 0)
            y = lax.dynamic_slice_in_dim(rhs, s, tm, 0)
            return a + _dot(x, y, contract, acc_t)

        def part_tile(s, mask, a):
            x = jnp.where(mask[:, None], lax.dynamic_slice_in_dim(lhs_rows, s, tr, 0), 0)
            y = jnp.where(mask[:, None], lax.dynamic_slice_in_dim(rhs, s, tr, 0), 0)
            return a + _dot(x, y, contract, acc_t)

        total = _row_tiles(starts[g], ends[g], m, tm, tr, jnp.zeros((k, n), acc_t), full_tile, part_tile)
        prev = lax.dynamic_index_in_dim(existing_out, g, keepdims=False).astype(acc_t)
        return lax.dynamic_update_index_in_dim(out, (prev + total).astype(out_dtype), g, 0)

    return lax.fori_loop(0, num_groups, group, existing_out.astype(out_dtype))
