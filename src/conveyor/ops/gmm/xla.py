"""XLA backend for gmm/tgmm: group-major loops of exact row tiles, so work tracks the real rows.

For each local group, rows are covered by full tiles of `tm` rows and then by ONE masked window
for the remainder, whose static size is picked from a few buckets with `lax.switch` (multiples of
8 rows for tm <= 128). Each group's weights are read once and stay hot in cache across its tiles,
fewer than `step` rows per group are wasted, and tgmm adds into its [k, n] accumulator once per
tile. Unlike `lax.ragged_dot` on CPU, there is no G-times dense expansion.

Measured pitfalls (2-core CPU, m=4096, k=n=1024): a sequence of small while loops per group (one
per power-of-two remainder) made G=256 up to 25x slower than dense, because XLA copies the
[m, n] carry into each loop; one loop plus one switch per group keeps the carry in place.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from conveyor.ops.gmm.metadata import local_group_bounds

# Smallest remainder window (a sublane tile) and the most switch branches per group. With
# multiples-of-8 windows gmm went from 1.64x to 1.16x dense at G=64 (power-of-two windows wasted
# up to half of each remainder).
MIN_WINDOW = 8
MAX_BUCKETS = 32


def default_tm(m: int, num_groups: int) -> int:
    """Row tile for the XLA backend, from the average group size m / G.

    Measured on the 2-core CPU with cold caches (m=4096, k=n=1024, f32; ratios to one dense dot):
    G=1: tm=256 1.10x, tm=512 0.91x, tm=2048 1.16x; G=8: 1.18x / 1.10x / 1.35x. At G=256
    (16 rows per group) tm=128 was 1.73x against 2.03x for tm=256.
    """
    avg = m // max(num_groups, 1)
    if avg >= 256:
        return 512
    return 256 if avg >= 32 else 128


def compute_dtype(*dtypes):
    """Operand dtype for the dots: the promoted input type."""
    return jnp.result_type(*dtypes)


def accum_dtype(dtype):
    """float32 accumulation for 16-bit floats, the input type otherwise."""
    return jnp.float32 if dtype in (jnp.bfloat16, jnp.float16) else dtype


def window_buckets(tm: int, m: int) -> list[int]:
    """Static window sizes for remainders: multiples of `step` up to tm (all <= m).

    step = max(MIN_WINDOW, tm // MAX_BUCKETS), so a remainder wastes fewer than `step` rows while
    the switch keeps at most MAX_BUCKETS branches.
    """
    step = max(MIN_WINDOW, -(-tm // MAX_BUCKETS))
    sizes = list(range(step, tm, step)) + [tm]
    return sorted({min(x, m) for x in sizes})


def _dot(a, b, contract, acc):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=acc)


def cover_rows(start, end, m: int, tm: int, carry, tile):
    """Apply `tile(window_start, size, mask, carry)` over rows [start, end) of an m-row array.

    Full tiles get `mask=None`; the remainder gets one window of a bucketed static size, shifted to
    stay inside [0, m), with `mask[size]` marking the rows that are really ours.
    """
    nfull = (end - start) // tm
    carry = lax.fori_loop(0, nfull, lambda t, c: tile(start + t * tm, tm, None, c), carry)
    pos = start + nfull * tm
    rem = end - pos
    buckets = window_buckets(tm, m)

    def window(size):
        def run(c):
            w = jnp.minimum(pos, m - size)
            rows = w + jnp.arange(size, dtype=jnp.int32)
            return tile(w, size, (rows >= pos) & (rows < end), c)
        return run

    # branch 0: nothing left; branch i + 1: the smallest bucket >= rem
    which = jnp.where(rem > 0, jnp.searchsorted(jnp.asarray(buckets, jnp.int32), rem) + 1, 0)
    return lax.switch(which, [lambda c: c] + [window(size) for size in buckets], carry)


def gmm_xla(lhs, rhs, group_sizes, group_offset, existing_out, *, transpose_rhs, out_dtype, tiling,
            **_):
    m, _k = lhs.shape
    num_groups = rhs.shape[0]
    tm = min(tiling[0], m)
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    acc = accum_dtype(cdt)
    lhs = lhs.astype(cdt)
    rhs = rhs.astype(cdt)
    starts, ends = local_group_bounds(group_sizes, group_offset, num_groups, m)
    contract = ((1,), (1 if transpose_rhs else 0,))

    def group(g, out):
        w = lax.dynamic_index_in_dim(rhs, g, keepdims=False)

        def tile(s, size, mask, o):
            y = _dot(lax.dynamic_slice_in_dim(lhs, s, size, 0), w, contract, acc).astype(out_dtype)
            if mask is not None:
                y = jnp.where(mask[:, None], y, lax.dynamic_slice_in_dim(o, s, size, 0))
            return lax.dynamic_update_slice_in_dim(o, y, s, 0)

        return cover_rows(starts[g], ends[g], m, tm, out, tile)

    return lax.fori_loop(0, num_groups, group, existing_out.astype(out_dtype))


def tgmm_xla(lhs, rhs, group_sizes, group_offset, existing_out, *, num_groups, out_dtype, tiling,
             **_):
    k, m = lhs.shape
    n = rhs.shape[1]
    tm = min(tiling[0], m)
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    acc_t = accum_dtype(cdt)
    lhs_rows = lhs.astype(cdt).T  # [m, k]: row tiles become contiguous slices
    rhs = rhs.astype(cdt)
    starts, ends = local_group_bounds(group_sizes, group_offset, num_groups, m)
    contract = ((0,), (0,))

    def group(g, out):
        def tile(s, size, mask, a):
            x = lax.dynamic_slice_in_dim(lhs_rows, s, size, 0)
            y = lax.dynamic_slice_in_dim(rhs, s, size, 0)
            if mask is not None:  # zero both sides: non-finite rows of other groups must not leak
                x = jnp.where(mask[:, None], x, 0)
                y = jnp.where(mask[:, None], y, 0)
            return a + _dot(x, y, contract, acc_t)

        total = cover_rows(starts[g], ends[g], m, tm, jnp.zeros((k, n), acc_t), tile)
        prev = lax.dynamic_index_in_dim(existing_out, g, keepdims=False).astype(acc_t)
        return lax.dynamic_update_index_in_dim(out, (prev + total).astype(out_dtype), g, 0)

    return lax.fori_loop(0, num_groups, group, existing_out.astype(out_dtype))
