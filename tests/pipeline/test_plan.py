"""The plan is pure data: its rules and events are checked without tracing."""

import pytest

import conveyor as cv
from conveyor.pipeline import plan
from tests import schedule


def _mm_specs():
    return dict(
        in_specs=[
            cv.BlockSpec((8, 8), lambda i, k: (i, k)),
            cv.BlockSpec((8, 8), lambda i, k: (0, 0)),
        ],
        out_specs=[
            cv.BlockSpec((8, 8), lambda i, k: (i, 0)),
            cv.BlockSpec((1, 8), lambda i, k: (0, 0)),
        ],
    )


def test_invariant_operands_are_single_buffered():
    p = plan(grid=(3, 4), max_concurrent_steps=3, **_mm_specs())
    a, bias = p.inputs
    out, colsum = p.outputs
    assert (a.invariant, a.num_slots) == (False, 3)
    assert (bias.invariant, bias.num_slots) == (True, 1)
    assert (out.invariant, colsum.invariant) == (False, True)


def test_output_resident_until_index_changes():
    p = plan(grid=(3, 4), **_mm_specs())
    out = p.outputs[0]
    assert [p.writes_back(out, s) for s in range(12)] == [s % 4 == 3 for s in range(12)]
    assert [p.writes_back(p.outputs[1], s) for s in range(12)] == [s == 11 for s in range(12)]


def test_fetch_schedule_and_slot_reuse_respect_delay_release():
    p = plan(
        grid=(8,),
        in_specs=[cv.BlockSpec((4,), lambda i: (i,))],
        max_concurrent_steps=3,
        delay_release=1,
    )
    assert p.lookahead == 2
    op = p.inputs[0]
    fetches = {c.step: (c.at, schedule.slot(c)) for c in schedule.fetches(p)}
    for t, (issued, slot) in fetches.items():
        assert slot == t % 3
        if issued >= 0:
            # the slot was last used by step t - 3, which must be delay_release=1 steps before issue
            assert issued == t - 2 and (t - 3) <= issued - 1
    assert sorted(fetches) == list(range(8))
    assert p.slot(op, 5) == 2


@pytest.mark.parametrize("delay, slots", [(0, 2), (1, 2), (2, 3), (3, 4)])
def test_max_concurrent_steps_shrinks_to_the_grid_keeping_delay_release(delay, slots):
    """No more slots than steps, but one more than delay_release; the delay itself is kept (a
    body's manual releases follow it)."""
    p = plan(
        grid=(2,),
        in_specs=[cv.BlockSpec((4,), lambda i: (i,))],
        max_concurrent_steps=5,
        delay_release=delay,
    )
    assert (p.max_concurrent_steps, p.delay_release) == (slots, delay)


def test_grid_indices_row_major():
    p = plan(grid=(2, 3, 2))
    assert [p.grid_indices(s) for s in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert p.grid_indices(11) == (1, 2, 1)


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(grid=(0, 2)),
            r"grid: static sizes must be positive ints, got \(0, 2\) \(a size that may be 0 must "
            r"be dynamic",
        ),
        (dict(grid=(2, 1.5)), r"grid: expected positive ints or integer scalars, got \(2, 1.5\)"),
        (dict(grid=(True,)), r"grid: expected positive ints or integer scalars"),
        (
            dict(grid=(2,), max_concurrent_steps=1, delay_release=1),
            r"must be greater than delay_release=1",
        ),
        (dict(grid=(2,), max_concurrent_steps=0), r"max_concurrent_steps: expected an int >= 1"),
        (dict(grid=(2,), delay_release=-1), r"delay_release: expected an int >= 0"),
    ],
)
def test_bad_plans(kw, match):
    with pytest.raises(ValueError, match=match):
        plan(**kw)


def test_pallas_block_specs_are_accepted():
    from jax.experimental import pallas as pl

    p = plan(grid=(2,), in_specs=[pl.BlockSpec((None, 4), lambda i: (i, 0))])
    assert p.inputs[0].block_shape == (None, 4) and p.inputs[0].ref_shape == (4,)
