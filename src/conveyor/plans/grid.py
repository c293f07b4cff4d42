"""Grid arithmetic shared by every plan and by `cv.kernel`: linear steps <-> grid indices."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

Int = Any  # a Python int or a traced int32 scalar


def unravel(step: Int, grid: Sequence[Int]) -> tuple[Int, ...]:
    """Row-major indices of linear `step` in `grid` (Python or traced ints). A dynamic size is
    divided by as at least 1: a grid with an empty dimension runs no step, but lowerings may still
    compute (and then predicate off) the indices of a step that does not exist."""
    idx = []
    for size in reversed(tuple(grid)):
        size = size if isinstance(size, int) else jnp.maximum(size, 1)
        idx.append(step % size)
        step = step // size
    return tuple(reversed(idx))
