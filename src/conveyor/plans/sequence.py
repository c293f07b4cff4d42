"""Plain pipelines run one after another in one kernel, each on its own allocations, some with
their first copies issued early (`emit_pipeline(...).prefetch`): one event program for the
checker and the simulator.

Design notes: docs/internals/plans.md, section `plans/sequence.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from conveyor.plans.pipeline import PipelinePlan
from conveyor.plans.program import Action, Copy, Program, program


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prefetched:
    """A pipeline of a sequence whose prologue copies are issued just before pipeline `before`
    starts (None: the one before it)."""

    plan: PipelinePlan
    before: int | None = None


def as_sequence(plans: Any) -> list[PipelinePlan | Prefetched] | None:
    """A list of plain pipeline plans (`PipelinePlan`, `Prefetched`, or the functions
    `emit_pipeline` returned) as a sequence; None when it is anything else (e.g. a chain of
    warp-specialized plans)."""
    if not isinstance(plans, (list, tuple)) or not plans:
        return None
    items = [p if isinstance(p, Prefetched) else getattr(p, "plan", p) for p in plans]
    if not all(isinstance(p, (PipelinePlan, Prefetched)) for p in items):
        return None
    return items


def _plan(item: PipelinePlan | Prefetched) -> PipelinePlan:
    return item.plan if isinstance(item, Prefetched) else item


def operand_sizes(items: Sequence[PipelinePlan | Prefetched], itemsize: int) -> dict[str, int]:
    """Bytes of a block of every renamed operand."""
    sizes = {}
    for k, item in enumerate(items):
        for op in _plan(item).inputs + _plan(item).outputs:
            size = itemsize
            for d in op.block_dims:
                size *= d
            sizes[f"p{k}.{op.name}"] = size
    return sizes


def _renamed(action: Action, names: frozenset[str], prefix: str) -> Action:
    """`action` with every operand name in it (slots, counters, copy operands) prefixed, and its
    labels prefixed too."""

    def rename(x: Any) -> Any:
        if isinstance(x, str):
            return prefix + x if x in names else x
        if isinstance(x, tuple):
            return tuple(rename(v) for v in x)
        return x

    changes = {f.name: rename(getattr(action, f.name)) for f in dataclasses.fields(action)}
    for label in ("name", "tag", "what"):
        if label in changes and changes[label]:
            changes[label] = prefix + changes[label]
    return dataclasses.replace(action, **changes)


def sequence_program(
    items: Sequence[PipelinePlan | Prefetched], in_flight_steps: int = 0
) -> Program:
    """One actor running the pipelines in order; a `Prefetched` one's prologue copies move to just
    before the pipeline named by its `before`."""
    items = list(items)
    bodies: list[list[Action]] = []
    early: dict[int, list[Action]] = {}
    for k, item in enumerate(items):
        p = _plan(item)
        p.require_static("a sequence of pipelines")
        names = frozenset(op.name for op in p.inputs + p.outputs)
        actions = [_renamed(a, names, f"p{k}.") for a in p.program(in_flight_steps)["thread"]]
        if isinstance(item, Prefetched):
            before = k - 1 if item.before is None else item.before
            if isinstance(before, bool) or not isinstance(before, int) or not 0 <= before < k:
                raise ValueError(
                    f"Prefetched(before={item.before!r}) of pipeline {k}: expected the index of an "
                    f"earlier pipeline of the sequence (0..{k - 1}); a pipeline prefetches only "
                    "while an earlier one runs"
                )
            prologue = sum(1 for a in actions if isinstance(a, Copy) and a.at == -1)
            if not all(isinstance(a, Copy) and a.at == -1 for a in actions[:prologue]):
                raise AssertionError("a pipeline program starts with its prologue copies")
            early.setdefault(before, []).extend(actions[:prologue])
            actions = actions[prologue:]
        bodies.append(actions)
    acts = [a for k, body in enumerate(bodies) for a in early.get(k, []) + body]
    subject = "sequence of pipelines " + ", ".join(
        f"p{k}{' (prefetched)' if isinstance(item, Prefetched) else ''} grid={_plan(item).grid}"
        for k, item in enumerate(items)
    )
    return program(subject, {"thread": acts})
