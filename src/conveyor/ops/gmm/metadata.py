"""Group metadata for grouped matmul: row bounds of each group and the tile visit schedule.

Pure functions of `group_sizes` (concrete or traced): they define how every backend except
`reference` maps groups to rows and tiles.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.ints import cdiv, floordiv


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """Row range [start, end) of every group, after the documented normalisation.

    Negative sizes count as 0 and the running total is clipped at `m`, so groups past row `m`
    are truncated (or empty). Concrete inputs are validated at the API, so this only changes
    traced inputs that would otherwise be out of range.
    """
    ends = group_ends(group_sizes, m)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def group_ends(group_sizes: jax.Array, m: int) -> jax.Array:
    """The end row of every group (see `group_bounds`)."""
    return jnp.minimum(lax.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)


def local_group_boundaries(
    group_sizes: jax.Array, group_offset: jax.Array, num_groups: int, m: int
) -> jax.Array:
    """int32[num_groups + 1]: local group i (global group `group_offset + i`) owns rows
    [b[i], b[i + 1]); out-of-range groups are empty.

    The group ends are padded with `num_groups` empty groups at row 0 before the first group and
    at the last end after the last one, so one clamped slice gives the local boundaries for any
    offset (a few ops, not a gather: this runs in every gmm/tgmm and its derivatives).
    """
    ends = group_ends(group_sizes, m)
    padded = jnp.concatenate(
        [jnp.zeros((num_groups + 1,), jnp.int32), ends, jnp.broadcast_to(ends[-1], (num_groups,))]
    )
    start = lax.clamp(
        jnp.int32(0),
        group_offset.astype(jnp.int32) + num_groups,
        jnp.int32(group_sizes.shape[0] + num_groups),
    )
    return lax.dynamic_slice_in_dim(padded, start, num_groups + 1, allow_negative_indices=False)


def local_group_bounds(
    group_sizes: jax.Array, group_offset: jax.Array, num_groups: int, m: int
) -> tuple[jax.Array, jax.Array]:
    """Row ranges [start, end) of the `num_groups` local groups `group_offset + i`; out-of-range
    groups are empty."""
    bounds = local_group_boundaries(group_sizes, group_offset, num_groups, m)
    return bounds[:-1], bounds[1:]


def local_row_mask(
    group_sizes: jax.Array, group_offset: jax.Array, num_groups: int, m: int
) -> jax.Array:
    """bool[m]: rows that belong to one of the local groups (the rows gmm writes)."""
    starts, ends = local_group_bounds(group_sizes, group_offset, num_groups, m)
    lo = jnp.min(jnp.where(ends > starts, starts, m))
    hi = jnp.max(jnp.where(ends > starts, ends, 0))
    rows = jnp.arange(m, dtype=jnp.int32)
    # Local groups are consecutive, so their rows form one contiguous range.
    return (rows >= lo) & (rows < hi)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupMetadata:
    """The tile visit schedule of a grouped matmul over row tiles of `tm` rows.

    A *visit* is one (row tile, local group) pair whose rows intersect; visits are ordered by group
    and then by tile, so tile ids never decrease and a tile shared by several groups (a group that
    starts mid-tile) is visited once per group. The arrays have a static length `max_visits`
    (= number of tiles + num_groups - 1); entries at or past `num_visits` repeat the last real
    visit so that a kernel reading them touches no new memory.

    Attributes:
      group_starts, group_ends: int32[num_groups], row range of each local group.
      group_ids: int32[max_visits], local group index of each visit.
      tile_ids: int32[max_visits], row tile index of each visit.
      num_visits: int32 scalar, how many visits are real.
    """

    group_starts: jax.Array
    group_ends: jax.Array
    group_ids: jax.Array
    tile_ids: jax.Array
    num_visits: jax.Array


def max_visits(m: int, tm: int, num_groups: int) -> int:
    """Static upper bound on the number of (tile, group) visits; with `visit_empty_groups` too
    (an empty group's one visit takes no tile from the others, and m >= 1 there)."""
    return cdiv(m, tm) + max(num_groups - 1, 0)


def count_visits(
    group_sizes, tm: int, m: int | None = None, *, visit_empty_groups: bool = False
) -> int:
    """How many (row tile, group) visits `make_group_metadata` schedules, from concrete sizes in
    plain Python (for the simulator and cost models): one per tile a group's rows touch, so a group
    that starts mid-tile shares that tile with its predecessor (see `count_row_blocks`), and one
    per empty group with `visit_empty_groups`."""
    counts = count_row_blocks(group_sizes, tm, m)
    return sum(max(c, 1) for c in counts) if visit_empty_groups else sum(counts)


def row_block_span(lo, hi, tm: int):
    """(first, count): the blocks of `tm` rows that intersect rows [lo, hi), count 0 when the range
    is empty. Python ints or traced scalars: the tgmm kernels loop over these blocks of each group,
    and the simulator counts them the same way (`count_row_blocks`)."""
    first = floordiv(lo, tm)
    count = floordiv(hi + tm - 1, tm) - first
    if isinstance(lo, int) and isinstance(hi, int):
        return first, count if hi > lo else 0
    return first, jnp.where(hi > lo, count, 0)


def shares_its_block(row0, tm: int, lo, hi):
    """Whether the `tm`-row block from `row0` holds rows outside a group's [lo, hi) (a block it
    shares with a neighbour, or past the rows): the tgmm GPU kernel zeroes those rows of the
    block's operands before its matmul, and the simulator prices that pass
    (`count_shared_blocks`). Python ints or traced scalars."""
    return (row0 < lo) | (row0 + tm > hi)


def _group_bounds(group_sizes, m: int | None) -> list[tuple[int, int]]:
    """Each group's rows [lo, hi), after the documented normalisation (sizes past m cut)."""
    sizes = [max(int(g), 0) for g in group_sizes]
    m = sum(sizes) if m is None else m
    bounds, start = [], 0
    for size in sizes:
        end = min(start + size, m)
        bounds.append((start, end))
        start = end
    return bounds


def count_shared_blocks(group_sizes, tm: int, m: int | None = None) -> list[int]:
    """Per group, how many of the `tm`-row blocks its rows touch hold rows outside it
    (`shares_its_block`), from concrete sizes as `count_row_blocks` counts the blocks."""
    if tm <= 0:
        raise ValueError(f"tm: expected a positive tile size, got {tm!r}")
    counts = []
    for lo, hi in _group_bounds(group_sizes, m):
        first, count = row_block_span(lo, hi, tm)
        rows0 = [(first + r) * tm for r in range(count)]
        counts.append(sum(bool(shares_its_block(row0, tm, lo, hi)) for row0 in rows0))
    return counts


def count_row_blocks(group_sizes, tm: int, m: int | None = None) -> list[int]:
    """Per group, how many `tm`-row blocks its rows touch (`row_block_span`), from concrete sizes
    after the documented normalisation: a group that starts mid-block shares that block with its
    predecessor, so it can cost one block more than ceil(size / tm)."""
    if tm <= 0:
        raise ValueError(f"tm: expected a positive tile size, got {tm!r}")
    return [row_block_span(lo, hi, tm)[1] for lo, hi in _group_bounds(group_sizes, m)]


def make_group_metadata(
    group_sizes: jax.Array,
    m: int,
    tm: int,
    *,
    group_offset: jax.Array | int = 0,
    num_groups: int | None = None,
    visit_empty_groups: bool = False,
) -> GroupMetadata:
    """Build the tile visit schedule of a grouped matmul.

    Args:
      group_sizes: int32[G_total], rows per group (rows of lhs are sorted by group).
      m: number of rows.
      tm: row tile size (positive).
      group_offset: first global group of this shard (scalar, may be traced).
      num_groups: number of local groups (default: all of `group_sizes`).
      visit_empty_groups: give every empty local group one visit too, of the tile its (empty)
        row range starts in, clamped to the last tile (a kernel that writes each group's output
        block, as tgmm without `existing_out`, writes an empty group's zeros there). Needs m >= 1.

    Returns:
      A `GroupMetadata`; works under `jit` with traced sizes and offset.
    """
    if tm <= 0:
        raise ValueError(f"tm: expected a positive tile size, got {tm!r}")
    if num_groups is None:
        num_groups = group_sizes.shape[0]
    if visit_empty_groups and m < 1:
        raise ValueError(f"visit_empty_groups: needs m >= 1 (a tile to visit), got m={m}")
    starts, ends = local_group_bounds(
        jnp.asarray(group_sizes), jnp.asarray(group_offset, jnp.int32), num_groups, m
    )
    nonempty = ends > starts
    # (an empty group at row m starts past the last tile: its visit reads the last one)
    first_tile = jnp.minimum(starts // tm, max(cdiv(m, tm) - 1, 0))
    last_tile = (jnp.maximum(ends, 1) - 1) // tm
    tiles_per_group = jnp.where(
        nonempty, last_tile - first_tile + 1, 1 if visit_empty_groups else 0
    ).astype(jnp.int32)
    visits_end = jnp.cumsum(tiles_per_group)
    visits_start = visits_end - tiles_per_group
    num_visits = visits_end[-1] if num_groups else jnp.int32(0)
    total = max_visits(m, tm, num_groups)
    v = jnp.arange(total, dtype=jnp.int32)
    # Past the last real visit, repeat it (or visit tile 0 of group 0 when there is none).
    v_real = jnp.minimum(v, jnp.maximum(num_visits - 1, 0))
    group_ids = jnp.searchsorted(visits_end, v_real, side="right").astype(jnp.int32)
    group_ids = jnp.minimum(group_ids, max(num_groups - 1, 0))
    tile_ids = first_tile[group_ids] + v_real - visits_start[group_ids]
    tile_ids = jnp.where(num_visits > 0, tile_ids, 0).astype(jnp.int32)
    return GroupMetadata(
        group_starts=starts,
        group_ends=ends,
        group_ids=group_ids,
        tile_ids=tile_ids,
        num_visits=jnp.asarray(num_visits, jnp.int32),
    )
