"""XLA backend for gmm/tgmm: group-major loops of exact row windows, so work tracks the real rows.

Design notes: docs/internals/gmm.md, section `ops/gmm/xla.py`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from conveyor.dtypes import accumulation_dtype
from conveyor.ints import cdiv
from conveyor.ops.gmm.metadata import local_group_boundaries

# The smallest row window (a sublane tile); tgmm covers what its full windows leave of a group with
# windows of tm / CHUNKS_PER_TILE rows, the last one masked.
MIN_WINDOW = 8
CHUNKS_PER_TILE = 8
# gmm's largest row window, whatever the number of groups (see `gmm_xla`).
GMM_TM = 512
# tgmm gathers each group's first rows into one batched dot when groups average at most this.
CAPACITY_MAX_AVG = 128


def default_tgmm_tm(m: int, num_groups: int) -> int:
    """tgmm's largest row window for the XLA backend, from the average group size m / G.

    Chosen by measurement (docs/xla-backend-notes.md).
    """
    avg = m // max(num_groups, 1)
    if avg >= 256:
        return 512
    return 256 if avg >= 32 else 128


def compute_dtype(*dtypes):
    """Operand dtype for the dots: the promoted input type."""
    return jnp.result_type(*dtypes)


def _dot(a, b, contract, acc):
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=acc)


# In-range dynamic slices (every start here is clamped or in range by construction), without
# lax's negative-index handling: that is three ops per slice, and a third of the program's text.
def _slice(x, start, size: int, axis: int):
    return lax.dynamic_slice_in_dim(x, start, size, axis, allow_negative_indices=False)


def _update(x, y, start, axis: int):
    return lax.dynamic_update_slice_in_dim(x, y, start, axis, allow_negative_indices=False)


def _index(x, i):
    return lax.dynamic_index_in_dim(x, i, 0, keepdims=False, allow_negative_indices=False)


def _where_rows(mask, x, other, axes: tuple[int, ...]):
    """x where mask (one flag per index along `axes` of x), else `other` (an array like x, or 0):
    jnp.where without its wrapper function and promotion, which cost program text in each op."""
    keep = lax.broadcast_in_dim(mask, x.shape, axes)
    return lax.select(keep, x, lax.full_like(x, 0) if isinstance(other, int) else other)


def chunk_rows(tm: int, m: int) -> int:
    """tgmm's smallest window, which covers what its larger windows leave of a group:
    tm / CHUNKS_PER_TILE rows, at least MIN_WINDOW (and at most m)."""
    return min(max(MIN_WINDOW, tm // CHUNKS_PER_TILE), m)


def gmm_windows(tm: int, m: int) -> tuple[int, ...]:
    """gmm's window sizes, ascending: tm, tm / 4, tm / 16 and tm / 64 (8, 32, 128 and 512 rows by
    default), each at least MIN_WINDOW and at most m. Measured in `gmm_xla`."""
    return tuple(sorted({min(max(MIN_WINDOW, tm // 4**i), m) for i in range(4)}))


def tgmm_windows(tm: int, m: int) -> tuple[int, ...]:
    """tgmm's window sizes, ascending: tm, tm / 4 and `chunk_rows` (tm / 8), each at least
    MIN_WINDOW and at most m. Measured in `tgmm_xla`."""
    return tuple(sorted({chunk_rows(tm, m), min(max(MIN_WINDOW, tm // 4), m), min(tm, m)}))


def cover_rows_in_windows(
    start, end, m: int, windows: tuple[int, ...], carry, tile, writable_end=None
):
    """Apply `tile(window_start, size, mask, carry)` over rows [start, end) of an m-row array,
    in windows of the sizes `windows` (ascending): the largest window the rows left fill
    (`mask=None`: every row is ours), else the smallest. That last window is unmasked too when it
    ends at or before `writable_end` (rows past `end` that the caller rewrites later: gmm's next
    groups), and otherwise gets `mask[size]` marking the rows that are ours (shifted back inside
    if it would pass row m).

    For tgmm, where every tile adds a whole [k, n] product into the group's block, each window
    costs a pass over the block, and the rows a window computes beyond the group cost their
    dot: filling windows exactly and masking only the last small one balances the two
    (see `tgmm_xla`).
    """
    offsets = jnp.arange(windows[0], dtype=jnp.int32)

    def last_window(pos, c):
        w = windows[0]
        at = jnp.minimum(pos, m - w)
        rows = at + offsets
        return pos + w, tile(at, w, (rows >= pos) & (rows < end), c)

    def full_window(w):
        return lambda pos, c: (pos + w, tile(pos, w, None, c))

    # Without `writable_end` a smallest window is always the masked one: no unmasked branch for it.
    unmasked = windows if writable_end is not None else windows[1:]
    branches = [last_window] + [full_window(w) for w in unmasked]

    def step(state):
        pos, c = state
        left = end - pos
        # the largest window left fills
        filled = sum((left >= w).astype(jnp.int32) for w in unmasked)
        # else the smallest, into rows rewritten later if it ends there
        if writable_end is not None:
            filled = jnp.maximum(filled, (pos + windows[0] <= writable_end).astype(jnp.int32))
        return lax.switch(filled, branches, pos, c)

    return lax.while_loop(lambda state: state[0] < end, step, (start, carry))[1]


def gmm_xla(
    lhs, rhs, group_sizes, group_offset, existing_out, *, transpose_rhs, out_dtype, tiling, **_
):
    """out[rows of g] = lhs[rows of g] @ rhs[g] for the local groups; other rows keep existing_out.

    One loop over groups; each covers its rows with windows of `gmm_windows` sizes (8, 32, 128
    and 512 rows by default), the largest the rows left fill, and a last smallest window that may
    run into the next groups' rows (they are rewritten when those groups run; only a window past
    the last local row is masked). Measurements:
    docs/xla-backend-notes.md.
    """
    m, _k = lhs.shape
    num_groups = rhs.shape[0]
    tm = min(tiling.tm, m)
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    acc = accumulation_dtype(cdt)
    lhs = lhs.astype(cdt)
    rhs = rhs.astype(cdt)
    bounds = local_group_boundaries(group_sizes, group_offset, num_groups, m)
    contract = ((1,), (1 if transpose_rhs else 0,))
    windows = gmm_windows(tm, m)

    def group(g, out):
        w = _index(rhs, g)

        def tile(s, size, mask, o):
            y = _dot(_slice(lhs, s, size, 0), w, contract, acc).astype(out_dtype)
            if mask is not None:
                y = _where_rows(mask, y, _slice(o, s, size, 0), (0,))
            return _update(o, y, s, 0)

        return cover_rows_in_windows(
            _index(bounds, g), _index(bounds, g + 1), m, windows, out, tile, writable_end=bounds[-1]
        )

    return lax.fori_loop(0, num_groups, group, existing_out.astype(out_dtype))


def tgmm_capacity(m: int, num_groups: int) -> int:
    """Rows per group of tgmm's batched first pass: the average group rounded up to a sublane
    tile when groups are small (m / G <= CAPACITY_MAX_AVG), else 0 (no batched pass).

    Small groups make tgmm output-bound (every group writes a [k, n] block however few its rows),
    and a loop that adds each tile's [k, n] product into its accumulator moves that block several
    times. One batched dot over [G, capacity] gathered rows writes every block once; the rows a
    group has beyond its capacity are added by the tile loop. Measurements:
    docs/xla-backend-notes.md.
    """
    avg = m / max(num_groups, 1)
    if avg > CAPACITY_MAX_AVG:
        return 0
    return min(m, max(MIN_WINDOW, cdiv(int(avg), MIN_WINDOW) * MIN_WINDOW))


def tgmm_xla(
    lhs, rhs, group_sizes, group_offset, existing_out, *, num_groups, out_dtype, tiling, **_
):
    """out[g] = existing_out[g] + lhs[:, rows of g] @ rhs[rows of g] for the local groups.

    A batched pass over the first `tgmm_capacity` rows of every group (when groups are small),
    then one loop over groups covering their remaining rows with windows of lhs columns
    (`tgmm_windows` sizes, `cover_rows_in_windows`): each window is a [k, rows] @ [rows, n] dot
    added into the group's [k, n] accumulator (f32 for 16-bit inputs), cast to `out_dtype` once
    when the group is done. Every window costs a pass over the [k, n] block, so a group's rows are
    covered by few, large windows.
    """
    k, m = lhs.shape
    tm = min(tiling.tm, m)
    cdt = compute_dtype(lhs.dtype, rhs.dtype)
    acc_t = accumulation_dtype(cdt)
    lhs = lhs.astype(cdt)
    rhs = rhs.astype(cdt)
    bounds = local_group_boundaries(group_sizes, group_offset, num_groups, m)
    # `base[g]` is where group g's accumulation starts; the loop carries the [G, k, n] result in
    # out_dtype and rounds each group's block once, when its rows are done (the same rounding as
    # an f32 carry cast at the end: bit-identical outputs). (An f32 carry cost 16-bit
    # outputs two passes over all G blocks: docs/xla-backend-notes.md.)
    # When base is in out_dtype, the carry's own block g holds base[g] (only group g writes it),
    # and the loop reads that: reading base would keep a second [G, k, n] buffer alive (zeros
    # materialised when existing_out is implicit: 1 GiB at G=256 f32; docs/xla-backend-notes.md).
    # Only a base the carry holds rounded (f32 sums, 16-bit out) is read.
    base = existing_out
    capacity = tgmm_capacity(m, num_groups)
    if capacity:
        base = base.astype(acc_t) + _tgmm_first_rows(
            lhs, rhs, bounds[:-1], bounds[1:], capacity, acc_t
        )
    read_base = base.dtype != jnp.dtype(out_dtype)

    def tile(s, size, mask, a):
        x, y = _slice(lhs, s, size, 1), _slice(rhs, s, size, 0)
        if mask is not None:  # zero both sides: non-finite rows of other groups must not leak
            x, y = _where_rows(mask, x, 0, (1,)), _where_rows(mask, y, 0, (0,))
        return a + _dot(x, y, ((1,), (0,)), acc_t)

    # Windows of tm, tm / 4 and tm / 8 rows, filled exactly but for the last (masked). Four
    # power-of-two
    # sizes were a little faster but cost program size (docs/xla-backend-notes.md).
    windows = tgmm_windows(tm, m)

    def group(g, out):
        start, end = _index(bounds, g), _index(bounds, g + 1)
        if capacity:
            start = start + capacity

        def add_rows(out):
            acc = _index(base if read_base else out, g).astype(acc_t)
            acc = cover_rows_in_windows(start, end, m, windows, acc, tile)
            return _update(out, acc.astype(out_dtype)[None], g, 0)

        # Groups without rows left skip the [k, n] read and write.
        return lax.cond(start < end, add_rows, lambda o: o, out)

    return lax.fori_loop(0, num_groups, group, base.astype(out_dtype))


def _tgmm_first_rows(lhs, rhs, starts, ends, capacity: int, acc_t):
    """[G, k, n]: each group's first `capacity` rows in one batched dot (missing rows are zero)."""
    rows = starts[:, None] + jnp.arange(capacity, dtype=jnp.int32)[None, :]  # [G, capacity]
    ours = rows < ends[:, None]  # rows past a group's end (or past m: take clips) are zeroed
    x = _where_rows(ours, jnp.take(lhs.T, rows, axis=0, mode="clip"), 0, (0, 1))  # [G, capacity, k]
    y = _where_rows(ours, jnp.take(rhs, rows, axis=0, mode="clip"), 0, (0, 1))  # [G, capacity, n]
    return lax.dot_general(x, y, (((1,), (1,)), ((0,), (0,))), preferred_element_type=acc_t)
