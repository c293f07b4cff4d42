"""Group bounds against a plain-Python definition, for every offset a traced group_offset can
take."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conveyor.ops.gmm.metadata import group_bounds, local_group_bounds


def python_local_bounds(sizes, offset, num_groups, m):
    """The documented rule: negative sizes count as 0, the running total is clipped at m, and
    local groups outside [0, len(sizes)) are empty (start == end == 0)."""
    starts, ends, total = [], [], 0
    for s in sizes:
        start = total
        total = min(total + max(int(s), 0), m)
        starts.append(start)
        ends.append(total)
    out_starts, out_ends = [], []
    for i in range(num_groups):
        g = offset + i
        inside = 0 <= g < len(sizes)
        out_starts.append(starts[g] if inside else 0)
        out_ends.append(ends[g] if inside else 0)
    return out_starts, out_ends


@pytest.mark.parametrize("rows_past_groups", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_local_group_bounds_every_offset_traced(seed, rows_past_groups):
    rng = np.random.default_rng(seed)
    total_groups = int(rng.integers(1, 9))
    num_groups = int(rng.integers(1, total_groups + 1))
    # Negative sizes and a running total past m exercise the normalisation.
    sizes = rng.integers(-3, 12, size=total_groups).astype(np.int32)
    total_rows = int(sizes.clip(0).sum())
    # Either m cuts the groups short, or rows past the last group belong to no group.
    m = total_rows + 3 if rows_past_groups else int(rng.integers(1, max(2, total_rows + 1)))
    bounds = jax.jit(lambda s, o: local_group_bounds(s, o, num_groups, m))
    for offset in range(-num_groups - 2, total_groups + 3):
        starts, ends = bounds(jnp.asarray(sizes), jnp.int32(offset))
        want_starts, want_ends = python_local_bounds(sizes, offset, num_groups, m)
        # An empty group may sit at any row: only its emptiness matters to the kernels.
        got = [(int(a), int(b)) if b > a else None for a, b in zip(starts, ends)]
        want = [(a, b) if b > a else None for a, b in zip(want_starts, want_ends)]
        assert got == want, (sizes.tolist(), m, num_groups, offset)
        assert all(0 <= int(a) <= int(b) <= m for a, b in zip(starts, ends))


def test_group_bounds_all_groups():
    sizes = jnp.asarray([3, -1, 0, 5, 4], jnp.int32)
    starts, ends = group_bounds(sizes, 10)
    want_starts, want_ends = python_local_bounds(np.asarray(sizes), 0, 5, 10)
    assert starts.tolist() == want_starts and ends.tolist() == want_ends
