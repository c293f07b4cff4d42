"""Grid arithmetic shared by every plan and by `cv.kernel`: linear steps <-> grid indices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from conveyor.ints import floordiv, mod

Int = Any  # a Python int or a traced int32 scalar


def unravel(step: Int, grid: Sequence[Int]) -> tuple[Int, ...]:
    """Row-major indices of linear `step` in `grid` (Python or traced ints). A dynamic size is
    divided by as at least 1: a grid with an empty dimension runs no step, but lowerings may still
    compute (and then predicate off) the indices of a step that does not exist."""
    idx = []
    for size in reversed(tuple(grid)):
        size = size if isinstance(size, int) else jnp.maximum(size, 1)
        idx.append(mod(step, size))
        step = floordiv(step, size)
    return tuple(reversed(idx))


PARALLEL, ARBITRARY = "parallel", "arbitrary"


def normalize_semantics(
    dimension_semantics: Sequence[Any] | None, rank: int, name: str = "dimension_semantics"
) -> tuple[str, ...] | None:
    """Upstream's dimension semantics as strings, one per grid dimension, "parallel" or
    "arbitrary" (Pallas TPU's `pltpu.PARALLEL` / `pltpu.ARBITRARY` are accepted by value)."""
    if dimension_semantics is None:
        return None
    if isinstance(dimension_semantics, str) or not isinstance(dimension_semantics, Sequence):
        raise ValueError(
            f"{name}: expected a sequence with one entry per grid dimension, got "
            f"{dimension_semantics!r}"
        )
    names = tuple(getattr(d, "value", d) for d in dimension_semantics)
    if len(names) != rank or any(n not in (PARALLEL, ARBITRARY) for n in names):
        raise ValueError(
            f"{name}: expected {rank} of {(PARALLEL, ARBITRARY)} (or pltpu.PARALLEL / "
            f"pltpu.ARBITRARY), one per grid dimension, got {tuple(dimension_semantics)!r}"
        )
    return names


def partition_grid(
    grid: Sequence[Int], semantics: Sequence[str], num_cores: int, core_id: Int
) -> tuple[tuple[Int, ...], tuple[Int, ...]]:
    """Megacore: the part of `grid` that core `core_id` of `num_cores` runs, as (its grid, the
    offset of its indices in the whole grid). Upstream Pallas's rule, so a ported kernel splits
    its work the same way:
    - the first "parallel" dimension whose static size divides evenly is cut in equal parts;
    - else the one dynamic parallel dimension (several are refused) or, without one, the first
      largest static parallel dimension is cut unevenly: the first `size % num_cores` cores get
      one step more.
    Sizes and offsets are Python ints when `core_id` and the cut size are, else int32 scalars.

    Raises:
      ValueError: `semantics` has no "parallel" dimension (nothing may be split), or more than
        one dynamic parallel dimension and no divisible static one.
    """
    grid, semantics = tuple(grid), tuple(semantics)
    offsets: list[Int] = [0] * len(grid)
    if num_cores == 1:
        return grid, tuple(offsets)
    parallel = [d for d, s in enumerate(semantics) if s == PARALLEL]
    if not parallel:
        raise ValueError(
            f"dimension_semantics {semantics}: splitting the grid over {num_cores} cores needs a "
            "'parallel' dimension (one whose steps are independent); mark one parallel"
        )
    divisible = [d for d in parallel if isinstance(grid[d], int) and grid[d] % num_cores == 0]
    if divisible:
        d = divisible[0]
        size = grid[d] // num_cores
        local = list(grid)
        local[d], offsets[d] = size, core_id * size
        return tuple(local), tuple(offsets)
    dynamic = [d for d in parallel if not isinstance(grid[d], int)]
    static = [d for d in parallel if isinstance(grid[d], int)]
    if len(dynamic) > 1:
        raise ValueError(
            f"dimension_semantics {semantics}: cannot split a grid over {num_cores} cores along "
            f"several dynamic parallel dimensions ({dynamic}); mark at most one of them parallel"
        )
    d = dynamic[0] if dynamic and not static else max(static, key=lambda i: (grid[i], -i))
    base, extra = grid[d] // num_cores, grid[d] % num_cores
    if all(isinstance(x, int) for x in (core_id, base, extra)):
        size = base + (1 if core_id < extra else 0)
        offset = core_id * base + min(core_id, extra)
    else:
        core_id = jnp.asarray(core_id, jnp.int32)
        size = (base + jnp.where(core_id < extra, 1, 0)).astype(jnp.int32)
        offset = (core_id * base + jnp.minimum(core_id, extra)).astype(jnp.int32)
    local = list(grid)
    local[d], offsets[d] = size, offset
    return tuple(local), tuple(offsets)
