"""The simulator's timed interpreter: copies queue and land late, signals arrive late, waits block,
and a program that stalls is an error naming who waits on what."""

import pytest

from conveyor.plans.program import Compute, Copy, Signal, Wait, program
from conveyor.sim.timed import Timing, run

TIMING = Timing(
    copy_s=lambda c: 2.0, compute_s=lambda a, actor: 1.0, latency_s=0.5, signal_latency_s=0.25
)


def test_copies_queue_in_issue_order_and_waits_block_until_they_land():
    prog = program(
        "two copies",
        {
            "t": [
                Copy("a", writes=("s0",), signals=(("a",),)),
                Copy("b", writes=("s1",), signals=(("b",),)),
                Wait(("b",)),
                Compute(0, "body"),
            ]
        },
    )
    time, boxes = run(prog, TIMING)
    # a: 0-2, b queued behind it: 2-4, lands at 4.5; the body then runs 1.
    assert time == 5.5
    assert [(b.label, b.start, b.end) for b in boxes if b.kind == "copy"] == [
        ("a", 0.0, 2.0),
        ("b", 2.0, 4.0),
    ]


def test_a_signal_is_seen_after_its_latency_and_consuming_waits_take_it():
    prog = program(
        "handoff",
        {
            "producer": [Compute(0, "work"), Signal(("sem",))],
            "consumer": [Wait(("sem",), consume=True), Compute(0, "use")],
        },
    )
    time, boxes = run(prog, TIMING)
    assert time == 1.0 + 0.25 + 1.0
    assert any(
        b.actor == "consumer" and b.kind == "wait" and (b.start, b.end) == (0.0, 1.25)
        for b in boxes
    )


def test_a_stalled_program_names_who_waits_on_what():
    prog = program("stuck", {"t": [Wait(("never",), what="a copy nobody issued")]})
    with pytest.raises(ValueError, match="stuck deadlocks: t waits a copy nobody issued"):
        run(prog, TIMING)
