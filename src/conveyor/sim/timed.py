"""The simulator's interpreter: run an event program (conveyor.plans.program) on a timing model.

Design notes: docs/internals/simulator.md, section `sim/timed.py`.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable

from conveyor.plans.program import Compute, Copy, Program, Signal, Wait
from conveyor.sim.report import Box


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """What each action costs (seconds)."""

    copy_s: Callable[[Copy], float]
    compute_s: Callable[[Compute, str], float]
    latency_s: float = 0.0  # from a copy's transfer end to its landing
    issue_s: float = 0.0  # the issuing actor's time per copy
    signal_latency_s: float = 0.0  # from a Signal to its visibility


def run(prog: Program, timing: Timing) -> tuple[float, list[Box]]:
    """Run `prog`; returns the time the last actor or copy finishes, and the timeline's boxes."""
    names = prog.names
    actions = [acts for _, acts in prog.actors]
    pc = [0] * len(names)
    clock = [0.0] * len(names)
    blocked_since: list[float | None] = [None] * len(names)
    counters: dict = {}
    queue_free: dict[str, float] = {}
    pending: list = []  # (time, seq, counters to add 1 to (or amount), amount)
    boxes: list[Box] = []
    seq = 0

    def post(time: float, keys, amount: int = 1) -> None:
        nonlocal seq
        heapq.heappush(pending, (time, seq, tuple(keys), amount))
        seq += 1

    def try_wait(w: Wait) -> bool:
        if counters.get(w.counter, 0) < w.amount:
            return False
        if w.consume:
            counters[w.counter] -= w.amount
        return True

    def step(i: int) -> None:
        """Run actor i's next action at its clock (it may block on a Wait)."""
        a = actions[i][pc[i]]
        if isinstance(a, Wait):
            if not try_wait(a):
                blocked_since[i] = clock[i]
                return
        elif isinstance(a, Copy):
            issued = clock[i] + timing.issue_s
            if timing.issue_s:
                boxes.append(Box(names[i], "copy", f"issue {a.name}", clock[i], issued))
            clock[i] = issued
            start = max(issued, queue_free.get(a.queue, 0.0))
            end = start + timing.copy_s(a)
            queue_free[a.queue] = end
            row = a.queue if a.queue.startswith("link") else f"copy engine ({a.queue})"
            boxes.append(
                Box(row, "link" if a.queue.startswith("link") else "copy", a.name, start, end)
            )
            post(end + timing.latency_s, a.signals)
        elif isinstance(a, Signal):
            post(clock[i] + timing.signal_latency_s, (a.counter,), a.amount)
        elif isinstance(a, Compute):
            dur = timing.compute_s(a, names[i])
            label = f"step {a.step} {a.stream}" if a.stream else f"step {a.step}"
            boxes.append(Box(names[i], "compute", label, clock[i], clock[i] + dur))
            clock[i] += dur
        pc[i] += 1

    def wake(time: float) -> None:
        for i, since in enumerate(blocked_since):
            if since is not None and try_wait(actions[i][pc[i]]):
                boxes.append(Box(names[i], "wait", actions[i][pc[i]].what or "wait", since, time))
                clock[i] = max(clock[i], time)
                blocked_since[i] = None
                pc[i] += 1

    while True:
        runnable = [
            i for i in range(len(names)) if pc[i] < len(actions[i]) and blocked_since[i] is None
        ]
        next_actor = min(runnable, key=lambda i: clock[i], default=None)
        if pending and (next_actor is None or pending[0][0] <= clock[next_actor]):
            time, _, keys, amount = heapq.heappop(pending)
            for key in keys:
                counters[key] = counters.get(key, 0) + amount
            wake(time)
        elif next_actor is not None:
            step(next_actor)
        else:
            break
    stuck = [
        f"{names[i]} waits {actions[i][pc[i]].what or actions[i][pc[i]].counter}"
        for i in range(len(names))
        if pc[i] < len(actions[i])
    ]
    if stuck:
        raise ValueError(
            f"simulate: {prog.subject} deadlocks: "
            + "; ".join(stuck)
            + " (cv.sim.check shows a trace)"
        )
    return max(clock + list(queue_free.values()) + [0.0]), boxes
