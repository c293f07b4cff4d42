"""Group bounds against a plain-Python definition, for every offset a traced group_offset can
take."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conveyor as cv
from conveyor.ops.gmm.metadata import count_visits, group_bounds, local_group_bounds, max_visits


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


def python_visits(sizes, m, tm, visit_empty_groups):
    """The documented schedule: per group in order, one visit per `tm`-row tile its rows touch;
    with `visit_empty_groups`, an empty group's one visit of the tile its (empty) range starts
    in, clamped to the last tile."""
    starts, ends = python_local_bounds(sizes, 0, len(sizes), m)
    last_tile = max(-(-m // tm) - 1, 0)
    visits = []
    for g, (lo, hi) in enumerate(zip(starts, ends)):
        if hi > lo:
            visits += [(g, t) for t in range(lo // tm, (hi - 1) // tm + 1)]
        elif visit_empty_groups:
            visits.append((g, min(lo // tm, last_tile)))
    return visits


@pytest.mark.parametrize("visit_empty_groups", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_visit_schedule_against_the_python_definition(seed, visit_empty_groups):
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 9))
    tm = int(rng.choice([8, 16, 128]))
    # empty groups anywhere (a third of them), rows past the groups or none
    sizes = np.where(rng.random(groups) < 1 / 3, 0, rng.integers(1, 3 * tm, groups))
    m = int(sizes.sum()) + int(rng.choice([0, 5])) or 1
    meta = cv.make_group_metadata(
        jnp.asarray(sizes, jnp.int32), m, tm, visit_empty_groups=visit_empty_groups
    )
    visits = int(meta.num_visits)
    got = list(zip(meta.group_ids[:visits].tolist(), meta.tile_ids[:visits].tolist()))
    assert got == python_visits(sizes, m, tm, visit_empty_groups), (sizes.tolist(), m, tm)
    assert visits == count_visits(sizes, tm, m, visit_empty_groups=visit_empty_groups)
    assert visits <= len(meta.group_ids) == max_visits(m, tm, groups)
    # past the real visits, the last one repeats (a kernel reading them touches no new memory)
    last = got[-1] if got else (0, 0)
    padding = zip(meta.group_ids[visits:].tolist(), meta.tile_ids[visits:].tolist())
    assert set(padding) <= {last}


def test_the_visit_bound_holds_when_every_group_is_empty():
    meta = cv.make_group_metadata(jnp.zeros((5,), jnp.int32), 3, 128, visit_empty_groups=True)
    assert int(meta.num_visits) == 5 == len(meta.group_ids)
    assert meta.tile_ids.tolist() == [0] * 5 and meta.group_ids.tolist() == list(range(5))


def test_visiting_empty_groups_needs_a_row():
    with pytest.raises(ValueError, match="visit_empty_groups: needs m >= 1"):
        cv.make_group_metadata(jnp.zeros((2,), jnp.int32), 0, 128, visit_empty_groups=True)
