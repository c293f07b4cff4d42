"""Event programs: a plan's whole schedule as pure data, per actor, in issue order.

Design notes: docs/internals/plans.md, section `plans/program.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

Counter = tuple[Any, ...]  # e.g. ("produced", "in[0]", 1): a barrier of input in[0], slot 1
Slot = tuple[Any, ...]  # e.g. ("in[0]", 1), or ("hbm", "out[0]", 3) for a block in global memory


@dataclasses.dataclass(frozen=True)
class Copy:
    """Issue an asynchronous copy that may land at any moment until it completes. On completion it
    adds 1 to each counter in `signals`. `queue` names what carries it ("loads", "stores",
    "link right", "link left"). `operand` names whose block it moves, so the simulator can size
    it (`elements` when it moves only part of one)."""

    name: str
    writes: tuple[Slot, ...]
    reads: tuple[Slot, ...] = ()
    signals: tuple[Counter, ...] = ()
    queue: str = "loads"
    operand: str | None = None
    # Elements moved when fewer than the operand's block (a partial or bounded window); None: the
    # whole block.
    elements: int | None = None
    at: int | None = None  # the grid step it is issued in (see `Program`)
    step: int | None = None  # a pipeline's copy: the grid step whose block it moves


@dataclasses.dataclass(frozen=True)
class Wait:
    """Block until `counter` >= `amount`; then subtract `amount` if `consume` (a semaphore), or
    leave the counter (a barrier phase, a copy's completion)."""

    counter: Counter
    amount: int = 1
    consume: bool = False
    what: str = ""
    at: int | None = None  # the grid step it is issued in (see `Program`)


@dataclasses.dataclass(frozen=True)
class Signal:
    """Add `amount` to `counter`: a barrier arrival, a semaphore signal, a credit grant."""

    counter: Counter
    amount: int = 1
    what: str = ""
    at: int | None = None  # the grid step it is issued in (see `Program`)


@dataclasses.dataclass(frozen=True)
class Read:
    """Begin (`end=False`) or end a read of `slot` by this actor; `tag` names it in reports."""

    slot: Slot
    tag: str
    end: bool = False


@dataclasses.dataclass(frozen=True)
class Write:
    """The actor writes `slot` (the body filling an output block)."""

    slot: Slot
    tag: str


@dataclasses.dataclass(frozen=True)
class Compute:
    """The body's work at grid step `step` (ring: the chunk matmul of a ring step). It costs time in
    the simulator. The checker skips it: the Reads and Writes around it are what it checks.
    `stream` names which of a step's computations it is (a ring direction), and `work` what it does
    ("body"; a ring: "matmul" or a reduce-scatter's "accumulate"), for the timing."""

    step: int
    tag: str
    stream: str = ""
    work: str = "body"


Action = Copy | Wait | Signal | Read | Write | Compute


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
    """Per actor, its actions in order. `subject` says what the program is, in reports."""

    subject: str
    actors: tuple[tuple[str, tuple[Action, ...]], ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.actors)

    def __getitem__(self, actor: str) -> tuple[Action, ...]:
        for name, actions in self.actors:
            if name == actor:
                return actions
        raise KeyError(f"{self.subject}: no actor {actor!r} (actors: {', '.join(self.names)})")

    def copies(self) -> tuple[Copy, ...]:
        """Every copy of every actor, in actor order then issue order."""
        return tuple(a for _, actions in self.actors for a in actions if isinstance(a, Copy))


def program(subject: str, actors: dict[str, list[Action]]) -> Program:
    """A Program from a dict of actor -> actions (in the dict's order)."""
    return Program(
        subject=subject, actors=tuple((name, tuple(acts)) for name, acts in actors.items())
    )


def check_in_flight_steps(in_flight_steps: int) -> None:
    """`in_flight_steps` (how many steps a body's asynchronous reads outlive it) is an int >= 0."""
    if (
        isinstance(in_flight_steps, bool)
        or not isinstance(in_flight_steps, int)
        or in_flight_steps < 0
    ):
        raise ValueError(f"in_flight_steps: expected an int >= 0, got {in_flight_steps!r}")
