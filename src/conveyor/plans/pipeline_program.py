"""A plain pipeline's schedule as an event program, and the actions it is made of.

Design notes: docs/internals/plans.md, section `plans/pipeline_program.py`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from conveyor.plans import fetch as fetch_lib
from conveyor.plans.program import (
    Action,
    Compute,
    Copy,
    Program,
    Read,
    Wait,
    Write,
    check_in_flight_steps,
    program,
)

if TYPE_CHECKING:
    from conveyor.plans.pipeline import OperandPlan, PipelinePlan


def fetch(operand: str, slot: int, step: int, at: int, elements: int | None = None) -> Copy:
    """The copy of input `operand`'s block of grid step `step` into `slot`, issued during step
    `at`. It lands on the counter ("landed", operand, slot, step)."""
    return Copy(
        f"{operand}@step{step}",
        writes=((operand, slot),),
        signals=(("landed", operand, slot, step),),
        operand=operand,
        elements=elements,
        at=at,
        step=step,
    )


def fetch_wait(operand: str, slot: int, step: int, at: int) -> Wait:
    """Wait, during step `at`, for the copy of `operand`'s block of step `step` into `slot`."""
    what = f"copy {operand}@step{step} into slot {slot}"
    return Wait(("landed", operand, slot, step), what=what, at=at)


def store(operand: str, slot: int, step: int, at: int, elements: int | None = None) -> Copy:
    """The write-back of output `operand`'s block of step `step` from `slot`, issued during step
    `at`. It signals the slot's semaphore ("stored", operand, slot)."""
    return Copy(
        f"{operand}@step{step}->hbm",
        writes=(("hbm", operand, step),),
        reads=((operand, slot),),
        signals=(("stored", operand, slot),),
        queue="stores",
        operand=operand,
        elements=elements,
        at=at,
        step=step,
    )


def store_wait(operand: str, slot: int, at: int) -> Wait:
    """Wait, during step `at`, for the write-back in flight from `operand`'s `slot` (a semaphore per
    slot: at most one write-back per slot is in flight, and each is awaited once)."""
    return Wait(
        ("stored", operand, slot), consume=True, what=f"write-back of {operand} slot {slot}", at=at
    )


def body_actions(
    p: PipelinePlan,
    step: int,
    tag: str,
    writebacks: dict[str, int],
    open_reads: dict[int, list[Read]],
    in_flight_steps: int,
    in_slots: dict[str, int] | None = None,
) -> list[Action]:
    """The body of `step`: it reads its input slots (`in_slots` per input, else the every-step
    rule's), computes and writes its output slots (per output, the slot of its write-back count so
    far). The reads of step `step - in_flight_steps` end here; `open_reads` keeps the ones still
    open."""
    reads = [
        Read((op.name, p.slot(op, step) if in_slots is None else in_slots[op.name]), tag)
        for op in p.inputs
    ]
    acts: list[Action] = [*reads, Compute(step, tag)]
    acts += [Write((op.name, p.output_slot(op, writebacks[op.name])), tag) for op in p.outputs]
    open_reads[step] = reads
    return acts + [
        dataclasses.replace(r, end=True) for r in open_reads.pop(step - in_flight_steps, [])
    ]


def _moved(p: PipelinePlan, op: OperandPlan, step: int) -> int | None:
    """Elements a copy of `op`'s block at `step` moves when its window is smaller than the block
    (None: the whole block)."""
    if not op.variable_dims:
        return None
    elements = math.prod(int(size) for _, size in p.window(op, step))
    return None if elements == math.prod(op.block_dims) else elements


def pipeline_program(p: PipelinePlan, in_flight_steps: int = 0) -> Program:
    """The schedule of a static pipeline as a program with one actor, "thread".

    Before step 0: the prologue's fetches. Per step: wait for the inputs' copies (of the inputs
    whose block changes); the body; the write-backs, each followed by the wait for the write-back
    that last used the output's other slot (the one the body writes next; at once with one slot);
    the next fetches. After the last step: the waits for the write-backs still in flight.
    With `in_flight_steps` = k, the body leaves asynchronous work reading its input slots (e.g.
    an un-awaited matmul), and the reads of step s end during step s + k."""
    p.require_static("the pipeline's program")
    check_in_flight_steps(in_flight_steps)
    acts: list[Action] = []
    n = p.num_steps

    def fetcher(at: int, op: OperandPlan) -> fetch_lib.Fetch:
        def issue(t, slot, go):
            if go:  # concrete here: the plan is static
                acts.append(fetch(op.name, slot, t, at, _moved(p, op, t)))

        return issue

    cursors = {op.name: fetch_lib.prologue(p, op, fetcher(-1, op)) for op in p.inputs}
    reading = {op.name: 0 for op in p.inputs}  # the slot each input's body reads
    writebacks = {op.name: 0 for op in p.outputs}
    open_reads: dict[int, list[Read]] = {}
    in_flight: dict[tuple[str, int], None] = {}  # (output, slot) with a write-back in flight
    for s in range(n):
        for op in p.inputs:
            cursors[op.name], waits, slot = fetch_lib.begin_step(p, op, cursors[op.name], s)
            if waits:
                acts.append(fetch_wait(op.name, slot, s, s))
            # a block the caller prefetched into the slot is read in place: nothing to wait for
            if waits or (op.prefetched and fetch_lib.changes_at(p, op, s)):
                reading[op.name] = slot
        tag = f"body of step {s}"
        acts += body_actions(p, s, tag, writebacks, open_reads, in_flight_steps, dict(reading))
        for op in p.outputs:
            if not p.writes_back(op, s):
                continue
            slot = p.output_slot(op, writebacks[op.name])
            acts.append(store(op.name, slot, s, s, _moved(p, op, s)))
            writebacks[op.name] += 1
            if op.num_slots == 1:  # the body writes this same slot next: wait at once
                acts.append(store_wait(op.name, slot, s))
                continue
            in_flight[(op.name, slot)] = None
            # The body writes the other slot next: its write-back is awaited now, as the
            # lowerings do (at most one write-back per output stays in flight).
            following = (op.name, p.output_slot(op, writebacks[op.name]))
            if following in in_flight and following[1] != slot:
                del in_flight[following]
                acts.append(store_wait(op.name, following[1], s))
        for op in p.inputs:
            cursors[op.name] = fetch_lib.after_step(p, op, cursors[op.name], s, fetcher(s, op))
    acts += [store_wait(name, slot, n) for name, slot in in_flight]
    for reads in open_reads.values():
        acts += [dataclasses.replace(r, end=True) for r in reads]
    in_flight_note = f" body in flight {in_flight_steps} step(s)" if in_flight_steps else ""
    subject = (
        f"pipeline grid={p.grid} max_concurrent_steps={p.max_concurrent_steps} "
        f"delay_release={p.delay_release}{in_flight_note}"
    )
    return program(subject, {"thread": acts})
