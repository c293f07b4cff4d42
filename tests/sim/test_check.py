"""The protocol checker finds the races and deadlocks it should, and passes the plans Conveyor
runs."""

import pytest

import conveyor as cv
from conveyor.cli import main
from conveyor.plans import fetch
from conveyor.plans.pipeline import PipelinePlan
from conveyor.plans.ring import RingPlan
from conveyor.plans.warp import chain_program, WarpSpecializedPlan
from conveyor.sim import check
from conveyor.plans.program import Copy, Read, Signal, Wait, program
from conveyor.sim.check import explore

SPEC = cv.BlockSpec((8, 128), lambda i: (i, 0))
BIAS = cv.BlockSpec((8, 128), lambda i: (0, 0))


def pipeline(grid=5, mcs=2, delay=0, ins=(SPEC, SPEC)):
    return cv.pipeline.plan(
        grid=(grid,),
        in_specs=list(ins),
        out_specs=[SPEC],
        max_concurrent_steps=mcs,
        delay_release=delay,
    )


@pytest.mark.parametrize("mcs, delay", [(1, 0), (2, 0), (3, 0), (2, 1), (3, 1), (3, 2), (9, 0)])
def test_conveyor_pipeline_plans_are_clean(mcs, delay):
    report = check(pipeline(mcs=mcs, delay=delay, ins=(SPEC, BIAS)), in_flight_steps=delay)
    assert report.ok and report.exhaustive, str(report)


def test_matmul_left_in_flight_races_without_delay_release_and_is_clean_with_it():
    report = check(pipeline(mcs=2, delay=0), in_flight_steps=1)
    assert not report.ok
    race = report.findings[0]
    assert (
        race.kind == "race"
        and "refilled while still read" in race.message
        and "in[0]@step2" in race.message
    )
    assert any("issue copy in[0]@step2" in line for line in race.trace)
    assert check(pipeline(mcs=2, delay=1), in_flight_steps=1).ok
    assert not check(pipeline(mcs=3, delay=1), in_flight_steps=2).ok


def test_read_before_copy_completed_and_unsatisfiable_wait():
    procs = {"t": [Copy("a", writes=("slot",), signals=("landed",)), Read("slot", "body")]}
    report = explore(program("missing wait", procs))
    assert [f.kind for f in report.findings] == [
        "race"
    ] and "before copy a into it completed" in report.findings[0].message
    procs = {"p": [Wait("never", what="a signal nobody sends")], "q": [Signal("other")]}
    report = explore(program("deadlock", procs))
    assert (
        report.findings[0].kind == "deadlock"
        and "p waits a signal nobody sends" in report.findings[0].message
    )


@pytest.mark.parametrize("compute, mcs, delay", [(1, 2, 0), (2, 2, 0), (2, 3, 1)])
def test_warp_specialized_plans_are_clean_and_in_flight_bodies_race(compute, mcs, delay):
    wp = WarpSpecializedPlan(
        pipeline=pipeline(grid=4, mcs=mcs, delay=delay), num_compute_wgs=compute
    )
    assert check(wp, in_flight_steps=delay).ok
    if delay == 0:
        assert not check(wp, in_flight_steps=1).ok


SLOW = pytest.mark.slow  # exhaustive interleavings of 4-device rings: seconds each


@pytest.mark.parametrize(
    "d, buffering, bidi",
    [
        (2, 2, False),
        (3, 2, False),
        pytest.param(4, 2, False, marks=SLOW),
        pytest.param(4, 3, False, marks=SLOW),
        pytest.param(4, 2, True, marks=SLOW),
        (3, 3, True),
    ],
)
def test_ring_plans_with_credits_are_clean(d, buffering, bidi):
    for collective in ("gather", "scatter"):
        plan = RingPlan(
            num_devices=d, bidirectional=bidi, buffering=buffering, collective=collective
        )
        report = check(plan, max_states=20_000)  # beyond the budget: random interleavings
        assert report.ok, str(report)


def test_ring_without_credits_races_and_single_buffering_deadlocks():
    report = check(RingPlan(num_devices=4, bidirectional=False, buffering=2), credits=False)
    assert not report.ok and all(f.kind == "race" for f in report.findings)
    assert any(
        "may still be reading it" in f.message or "refilled" in f.message for f in report.findings
    )
    # One receive slot: every device waits for a credit its downstream neighbour can only grant
    # after sending its own shard: the reason the TPU ring kernels refuse buffering=1.
    report = check(RingPlan(num_devices=4, bidirectional=False, buffering=1))
    assert [f.kind for f in report.findings] == ["deadlock"]
    assert "dev0 waits a credit from dev1" in report.findings[0].message


def test_check_accepts_the_pipeline_function_and_refuses_other_things():
    fn = cv.emit_pipeline(lambda *a: None, grid=(3,), in_specs=[SPEC], out_specs=[SPEC])
    assert check(fn).ok
    with pytest.raises(TypeError, match="expected a PipelinePlan"):
        check(3)


def test_cli_exit_codes(capsys):
    assert main(["check", "pipeline", "--grid", "4", "--in-flight", "1"]) == 1
    assert "RACE" in capsys.readouterr().out
    assert (
        main(["check", "pipeline", "--grid", "4", "--in-flight", "1", "--delay-release", "1"]) == 0
    )
    assert (
        main(["check", "pipeline", "--grid", "3", "--warp-specialized", "--compute-threads", "2"])
        == 0
    )
    assert main(["check", "ring", "--devices", "3", "--unidirectional", "--no-credits"]) == 1
    assert main(["check", "ring", "--devices", "3", "--unidirectional"]) == 0


# ---- the checker catches planted schedule bugs (its programs come from the plans' own rules) ----
WS_A = cv.BlockSpec((8, 128), lambda i, k: (i, k))
WS_BIAS = cv.BlockSpec((8, 128), lambda i, k: (0, 0))
WS_OUT = cv.BlockSpec((8, 128), lambda i, k: (i, 0))


def _warp(compute=2, mcs=3, delay=1, manual=False):
    p = cv.pipeline.plan(
        grid=(2, 2),
        in_specs=[WS_A, WS_BIAS, WS_A],
        out_specs=[WS_OUT],
        max_concurrent_steps=mcs,
        delay_release=delay,
    )
    return WarpSpecializedPlan(pipeline=p, num_compute_wgs=compute, manual_consumed_barriers=manual)


@pytest.mark.parametrize(
    "compute, mcs, delay, manual",
    [(1, 2, 0, False), (2, 2, 0, True), (2, 3, 1, False), (2, 3, 1, True), (1, 3, 2, True)],
)
def test_warp_specialized_protocol_is_clean_with_invariant_inputs_and_revisited_outputs(
    compute, mcs, delay, manual
):
    report = check(_warp(compute, mcs, delay, manual), in_flight_steps=delay)
    assert report.ok and report.exhaustive, str(report)


def test_planted_warp_bugs_are_found(monkeypatch):
    # Releasing the current step's slot instead of step s - delay_release's (issue 11's bug 1): slot
    # 0 is never released, and the memory thread waits for it forever, as the GPU did.
    with monkeypatch.context() as m:
        m.setattr(
            WarpSpecializedPlan,
            "released_slot",
            lambda self, s: s % self.pipeline.max_concurrent_steps,
        )
        report = check(_warp(delay=1), in_flight_steps=1)
    assert [f.kind for f in report.findings] == ["deadlock"], str(report)
    assert (
        "memory thread waits consumed barrier shared slot 0 (release of step 0)"
        in report.findings[0].message
    )
    # The memory thread never waits for a release: it overwrites slots still being read.
    with monkeypatch.context() as m:
        m.setattr(WarpSpecializedPlan, "refill_waits", lambda self, t: False)
        report = check(_warp(delay=0, mcs=2))
    assert any("refilled while still read" in f.message for f in report.findings), str(report)


def test_planted_pipeline_and_ring_bugs_are_found(monkeypatch):
    # fetch_step one step too far: step 2's block is never fetched, so its wait never returns.
    with monkeypatch.context() as m:
        m.setattr(PipelinePlan, "fetch_step", lambda self, op, s: s + self.input_lookahead(op) + 1)
        report = check(pipeline(grid=5, mcs=2))
    messages = {f.kind: f.message for f in report.findings}
    assert "thread waits copy in[0]@step2" in messages["deadlock"]
    # The body reads the slot after its block's: it waits for its block in a slot no copy fills
    # (a wait names the slot it waits on, as the lowerings' semaphores and barriers are per slot).
    with monkeypatch.context() as m:
        m.setattr(fetch, "read_slot", lambda op, cursor: cursor.reads % op.num_slots)
        report = check(pipeline(grid=5, mcs=2))
    messages = {f.kind: f.message for f in report.findings}
    assert "thread waits copy in[0]@step0 into slot 1" in messages["deadlock"], str(report)
    # A ring that never grants the credit of a freed slot deadlocks.
    with monkeypatch.context() as m:
        m.setattr(RingPlan, "grants_credit_after", lambda self, t, direction="right": False)
        report = check(RingPlan(num_devices=4, bidirectional=False, buffering=2))
    assert report.findings and all(f.kind == "deadlock" for f in report.findings), str(report)


def _chainable(compute=2, mcs=2, grid=(2, 2), manual=False):
    p = cv.pipeline.plan(
        grid=grid, in_specs=[WS_A, WS_A], out_specs=[WS_OUT], max_concurrent_steps=mcs
    )
    return WarpSpecializedPlan(pipeline=p, num_compute_wgs=compute, manual_consumed_barriers=manual)


@pytest.mark.parametrize(
    "compute, mcs, length, manual", [(1, 2, 2, False), (2, 2, 3, False), (1, 4, 2, True)]
)
def test_chained_warp_pipelines_are_clean(compute, mcs, length, manual):
    """A chain START, STEADY..., STOP: the next pipeline refills slots as the previous one's last
    steps release them, with the barrier phases continuing; no race, no deadlock."""
    chain = [_chainable(compute, mcs, manual=manual) for _ in range(length)]
    report = check(chain)
    assert report.ok and report.exhaustive, str(report)
    memory = chain_program(chain)["memory thread"]
    # Only the first pipeline fetches without waiting: 2 inputs x mcs prologue fetches before any
    # wait.
    first_wait = next(i for i, a in enumerate(memory) if isinstance(a, Wait))
    assert first_wait == 2 * mcs, first_wait


def test_planted_chain_bug_is_found(monkeypatch):
    """A STEADY pipeline that fetches its first blocks without waiting for the previous pipeline's
    last releases overwrites slots still being read."""
    with monkeypatch.context() as m:
        m.setattr(
            WarpSpecializedPlan,
            "refill_waits",
            lambda self, t: t >= self.pipeline.max_concurrent_steps,
        )
        report = check([_chainable(), _chainable()])
    assert any("refilled while still read" in f.message for f in report.findings), str(report)


def test_chain_program_refuses_unchainable_plans():
    with pytest.raises(NotImplementedError, match="divisible by max_concurrent_steps=3"):
        check([_chainable(mcs=3), _chainable(mcs=3)])
    with pytest.raises(ValueError, match="pipeline 1 differs from pipeline 0"):
        check([_chainable(compute=1), _chainable(compute=2)])
    with pytest.raises(TypeError, match="a chain of pipelines"):
        check([_chainable(), "x"])
