"""The protocol checker: run a plan's event program under every interleaving; report races and
deadlocks.

Design notes: docs/internals/simulator.md, section `sim/check.py`.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

from conveyor.plans.exchange import ExchangePlan, StagedExchangePlan
from conveyor.plans.pipeline import PipelinePlan
from conveyor.plans.program import Action, Compute, Copy, Program, Read, Signal, Wait, Write
from conveyor.plans.ring import RingPlan
from conveyor.plans.sequence import as_sequence, sequence_program
from conveyor.plans.warp import as_chain, chain_program, WarpSpecializedPlan
from conveyor.progress import bar as progress_bar


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str  # "race" | "deadlock"
    message: str
    trace: tuple[str, ...]

    def __str__(self, last: int = 15) -> str:
        skipped = max(0, len(self.trace) - last)
        steps = "\n".join(
            f"    {skipped + i + 1:3d}. {t}" for i, t in enumerate(self.trace[skipped:])
        )
        more = f"    ... ({skipped} earlier steps)\n" if skipped else ""
        return f"{self.kind.upper()}: {self.message}\n  trace:\n{more}{steps}"


@dataclasses.dataclass(frozen=True)
class CheckReport:
    subject: str
    findings: tuple[Finding, ...]
    states: int
    exhaustive: bool
    state_budget_reached: bool = (
        False  # the exhaustive phase hit max_states (then samples were drawn)
    )
    samples: int = 0  # random interleavings replayed after that
    stopped_by_time: float | None = (
        None  # the time budget (s) that cut the search short, if one did
    )

    @property
    def ok(self) -> bool:
        return not self.findings

    def __str__(self) -> str:
        parts = ["every interleaving"] if self.exhaustive else []
        if self.state_budget_reached:
            parts.append(f"state budget reached, then {self.samples} random interleavings")
        if self.stopped_by_time is not None:
            parts.append(
                f"stopped at the {self.stopped_by_time:g} s time budget with what was found so far"
            )
        how = "; ".join(parts)
        head = f"{self.subject}: {self.states} states explored ({how}): "
        if self.ok:
            return head + "no race, no deadlock"
        shown = "\n".join(str(f) for f in self.findings[:3])
        rest = "".join(f"\n{f.kind.upper()}: {f.message}" for f in self.findings[3:])
        return head + f"{len(self.findings)} finding(s)\n" + shown + rest


def _describe(proc: str, a: Action) -> str:
    if isinstance(a, Copy):
        return f"{proc}: issue copy {a.name} (writes {_fmt(a.writes)})"
    if isinstance(a, Wait):
        return f"{proc}: wait {a.what or _fmt((a.counter,))}"
    if isinstance(a, Signal):
        return f"{proc}: signal {a.what or _fmt((a.counter,))}"
    if isinstance(a, Read):
        return f"{proc}: {'end' if a.end else 'begin'} read of {_fmt((a.slot,))} ({a.tag})"
    return f"{proc}: write {_fmt((a.slot,))} ({a.tag})"


def _fmt(keys) -> str:
    return ", ".join("/".join(str(x) for x in k) if isinstance(k, tuple) else str(k) for k in keys)


def _unwind(trace) -> tuple[str, ...]:
    """A trace is a linked list (line, earlier) so that extending it costs O(1); this lists it in
    order."""
    lines = []
    while trace is not None:
        line, trace = trace
        lines.append(line)
    return tuple(reversed(lines))


def explore(
    prog: Program,
    *,
    max_states: int = 200_000,
    samples: int = 2_000,
    seed: int = 0,
    max_seconds: float | None = None,
    progress: bool = False,
) -> CheckReport:
    """Search the interleavings of an event program's actors; exhaustive up to `max_states`, then
    sampled. `Compute` actions are skipped: the reads and writes around them are what is checked.

    `max_seconds` bounds the whole search (both phases); when it runs out the report says so and
    holds what was found so far. `progress` draws a bar on stderr.
    """
    if max_states < 1:
        raise ValueError(f"check: max_states must be >= 1, got {max_states}")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(
            f"check: max_seconds must be > 0 (or None for no time budget), got {max_seconds}"
        )
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    out_of_time = lambda: deadline is not None and time.monotonic() > deadline
    subject = prog.subject
    names = prog.names
    progs = tuple(
        tuple(a for a in actions if not isinstance(a, Compute)) for _, actions in prog.actors
    )
    findings: dict[tuple[str, str], Finding] = {}

    def enabled(state):
        pcs, counters, pending, reads = state
        moves = []
        for i, prog in enumerate(progs):
            if pcs[i] < len(prog):
                a = prog[pcs[i]]
                if isinstance(a, Wait) and dict(counters).get(a.counter, 0) < a.amount:
                    continue
                moves.append(("proc", i))
        moves += [("land", c) for c in sorted(pending, key=lambda c: c.name)]
        return moves

    def apply(state, move, trace):
        """Next state, or a Finding."""
        pcs, counters, pending, reads = state
        counters = dict(counters)
        if move[0] == "land":
            c = move[1]
            for k in c.signals:
                counters[k] = counters.get(k, 0) + 1
            return (pcs, frozenset(counters.items()), pending - {c}, reads), (
                f"copy {c.name} lands",
                trace,
            )
        i = move[1]
        a = progs[i][pcs[i]]
        proc = names[i]
        trace = (_describe(proc, a), trace)
        if isinstance(a, Copy):
            for slot in a.writes:
                for rslot, who, tag in reads:
                    if rslot == slot:
                        return Finding(
                            "race",
                            f"copy {a.name} into {_fmt((slot,))} was issued while {who} still "
                            f"reads it ({tag}): the slot is refilled while still read",
                            _unwind(trace),
                        )
                for other in pending:
                    if slot in other.reads:
                        return Finding(
                            "race",
                            f"copy {a.name} writes {_fmt((slot,))} while copy {other.name} may "
                            "still be reading it",
                            _unwind(trace),
                        )
            for slot in a.reads:
                for other in pending:
                    if slot in other.writes:
                        return Finding(
                            "race",
                            f"copy {a.name} reads {_fmt((slot,))} while copy {other.name} may "
                            "still be landing in it",
                            _unwind(trace),
                        )
            pending = pending | {a}
        elif isinstance(a, Wait):
            if a.consume:
                counters[a.counter] -= a.amount
                if not counters[a.counter]:
                    # a missing counter reads 0: the state stays small and canonical
                    del counters[a.counter]
        elif isinstance(a, Signal):
            counters[a.counter] = counters.get(a.counter, 0) + a.amount
        elif isinstance(a, Read):
            entry = (a.slot, proc, a.tag)
            if a.end:
                reads = reads - {entry}
            else:
                for c in pending:
                    if a.slot in c.writes:
                        return Finding(
                            "race",
                            f"{proc} reads {_fmt((a.slot,))} ({a.tag}) before copy {c.name} into "
                            "it completed",
                            _unwind(trace),
                        )
                reads = reads | {entry}
        elif isinstance(a, Write):
            for c in pending:
                if a.slot in c.reads or a.slot in c.writes:
                    return Finding(
                        "race",
                        f"{proc} writes {_fmt((a.slot,))} ({a.tag}) while copy {c.name} may still "
                        "be using it",
                        _unwind(trace),
                    )
        new_pcs = pcs[:i] + (pcs[i] + 1,) + pcs[i + 1 :]
        return (new_pcs, frozenset(counters.items()), pending, reads), trace

    def stuck(state, trace):
        pcs = state[0]
        waiting = [
            f"{names[i]} waits {_describe(names[i], progs[i][pc]).split(': wait ', 1)[-1]} (step "
            f"{pc + 1} of {len(progs[i])})"
            for i, pc in enumerate(pcs)
            if pc < len(progs[i])
        ]
        return Finding("deadlock", "nothing can move: " + "; ".join(waiting), _unwind(trace))

    def record(f: Finding):
        key = (f.kind, f.message)
        if key not in findings or len(f.trace) < len(findings[key].trace):
            findings[key] = f

    start = (tuple(0 for _ in progs), frozenset(), frozenset(), frozenset())
    seen = set()
    stack = [(start, None)]
    exhaustive, timed_out, sampled = True, False, 0
    bar = progress_bar(max_states, f"check {subject}".strip()[:60], "states", progress)
    while stack:
        state, trace = stack.pop()
        if state in seen:
            continue
        if len(seen) >= max_states:
            exhaustive = False
            break
        seen.add(state)
        if len(seen) % 1024 == 0:
            bar.update(1024)
            if out_of_time():
                exhaustive, timed_out = False, True
                break
        moves = enabled(state)
        if not moves:
            if any(pc < len(p) for pc, p in zip(state[0], progs)):
                record(stuck(state, trace))
            continue
        for move in reversed(moves):
            nxt = apply(state, move, trace)
            if isinstance(nxt, Finding):
                record(nxt)
            else:
                stack.append(nxt)
    bar.close()
    dfs_timed_out = timed_out
    if not exhaustive and not timed_out:
        rng = random.Random(seed)
        bar = progress_bar(samples, "state budget reached; sampling", "samples", progress)
        for _ in range(samples):
            if out_of_time():
                timed_out = True
                break
            sampled += 1
            bar.update(1)
            state, trace = start, None
            while True:
                moves = enabled(state)
                if not moves:
                    if any(pc < len(p) for pc, p in zip(state[0], progs)):
                        record(stuck(state, trace))
                    break
                nxt = apply(state, rng.choice(moves), trace)
                if isinstance(nxt, Finding):
                    record(nxt)
                    break
                state, trace = nxt
        bar.close()
    return CheckReport(
        subject,
        tuple(findings.values()),
        len(seen),
        exhaustive,
        not exhaustive and not dfs_timed_out,
        sampled,
        max_seconds if timed_out else None,
    )


def check(
    plan: Any,
    *,
    in_flight_steps: int = 0,
    credits: bool = True,
    max_states: int = 200_000,
    seed: int = 0,
    max_seconds: float | None = None,
    progress: bool = False,
) -> CheckReport:
    """Check a `PipelinePlan`, a `WarpSpecializedPlan`, a list of warp-specialized plans chained on
    one set of allocations (`pipeline_state`: the first is the START, the last the STOP), a list
    of plain plans run one after another (some `cv.sim.Prefetched`: `conveyor.plans.sequence`) or
    a `RingPlan` (every stream at once) or an `ExchangePlan` / `StagedExchangePlan` (an
    expert-parallel layer's overlapped exchange) for races and deadlocks.

    Args:
      in_flight_steps: pipelines: the body leaves asynchronous work reading its input slots that
        is awaited this many steps later (e.g. 1 for an un-awaited matmul).
      credits: rings and exchanges: model the credit (capacity semaphore) protocol; False models
        one without flow control.
      max_states: states explored exhaustively before switching to random interleavings.
      max_seconds: a time budget for the whole search (None: none); when it runs out the report
        says so and holds the findings so far.
      progress: draw a progress bar on stderr.
    """
    budget = dict(max_states=max_states, seed=seed, max_seconds=max_seconds, progress=progress)
    pipelines = as_sequence(plan)
    if pipelines is not None:
        return explore(sequence_program(pipelines, in_flight_steps), **budget)
    chain = as_chain(plan)
    if chain is not None:
        return explore(chain_program(chain, in_flight_steps), **budget)
    if hasattr(plan, "plan") and not isinstance(
        plan, (PipelinePlan, WarpSpecializedPlan, RingPlan)
    ):
        plan = plan.plan  # the function returned by emit_pipeline(...)
    if isinstance(plan, (PipelinePlan, WarpSpecializedPlan)):
        (plan if isinstance(plan, PipelinePlan) else plan.pipeline).require_static("cv.sim.check")
    if isinstance(plan, (PipelinePlan, WarpSpecializedPlan)):
        return explore(plan.program(in_flight_steps), **budget)
    if isinstance(plan, (RingPlan, ExchangePlan, StagedExchangePlan)):
        return explore(plan.program(credits), **budget)
    raise TypeError(
        "check: expected a PipelinePlan, WarpSpecializedPlan, RingPlan, ExchangePlan or "
        "StagedExchangePlan, got "
        f"{type(plan).__name__}"
    )
