"""The overlapped expert-parallel exchange: per step, which peer's tokens a device's experts run
on, which chunk is in flight to the next peer, and which results travel home.

Each of D devices holds its own tokens and E / D experts; the tokens bound for each device form one
contiguous chunk (routing sorts them by destination). Instead of one all-to-all, the expert
matmuls and then another all-to-all, the plan walks the ring of peers:
- step 0: the experts run on the local chunk (no exchange) while the chunk for the first peer is
  already in flight;
- step t >= 1: wait for the chunk of the peer at ring offset -t (stream "right": chunks travel to
  higher devices) or +t (stream "left"), run the experts on it while the next peer's chunk is in
  flight, and send the results home to that peer (in flight during the next step).
So every transfer but the first dispatch and the last return hides behind an expert matmul.
Bidirectional: chunks from lower and higher peers arrive on the two links at once, and the layer
finishes in floor(D / 2) + 1 steps, two chunks' matmuls per step (the ring plan's split of peers:
`conveyor.plans.ring`).

Transfers are direct remote copies (a device writes into its peer's receive slot), not hops: on
NVLink every pair has its own path; on a TPU torus the interconnect routes them.

Flow control, per stream and device: `buffering` receive slots (each holds one peer's chunk) and
as many output slots (the results on their way home). A peer writes into a receive slot only with
a credit its owner granted for that use: the slots start free (credits for the first `buffering`
senders, the handshake that replaces a barrier), and the owner grants the next sender of a slot
once its experts have read it. Each receive slot has its own receive semaphore: chunks come from
different senders and may land in any order. An output slot is rewritten only after the results
that used it have landed at home. A device combines once all D - 1 peers' results have landed
(a counter of returns) and leaves once its own copies are done.

`program()` gives this as an event program for the checker and the simulator; `steps()` as
per-step records that the executors follow.
"""

from __future__ import annotations

import dataclasses

from conveyor.plans.program import (
    Action,
    Compute,
    Copy,
    Program,
    Read,
    Signal,
    Wait,
    Write,
    program,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangeStep:
    """What one stream does at one step, on every device alike (offsets are relative to the
    device: offset o names device (d + o) % D)."""

    step: int
    direction: str  # "right": chunks arrive from lower devices; "left": from higher ones
    computes: bool  # the experts run on a chunk at this step
    source: int  # offset of the device whose tokens they run on (0: the local chunk)
    slot: int  # receive (and output) slot of that chunk; -1 for the local chunk
    receives: bool  # first wait for the chunk to land
    dispatches: bool  # before the experts: send the chunk for `dispatch_to` (its next step's)
    dispatch_to: int  # offset of the device the dispatched chunk goes to
    dispatch_slot: int  # the receive slot it lands in on that device
    rewrites_output_of: int | None  # the earlier step whose results must have landed at home
    # before this step's results overwrite its output slot
    grants_to: int | None  # after the experts: a credit for the freed slot to the device at this
    # offset (the next to send into it); None when nobody will
    returns: bool  # after the experts: send the results home to `source`


STREAMS = ("right", "left")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExchangePlan:
    """The overlapped exchange of an expert-parallel layer; build it with `exchange_plan(...)`."""

    num_devices: int
    bidirectional: bool
    buffering: int

    def __post_init__(self):
        for name in ("num_devices", "buffering"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ExchangePlan: {name} must be an int >= 1, got {v!r}")
        if not isinstance(self.bidirectional, bool):
            raise ValueError(
                f"ExchangePlan: bidirectional must be a bool, got {self.bidirectional!r}"
            )

    @property
    def directions(self) -> tuple[str, ...]:
        return STREAMS if self.bidirectional else STREAMS[:1]

    def stream_uses(self, direction: str) -> int:
        """Peers whose chunks arrive on the stream: right covers offsets -1 .. -uses, left +1 ..
        +uses."""
        d = self.num_devices
        if not self.bidirectional:
            return d - 1 if direction == "right" else 0
        half = d // 2
        return half if direction == "right" else (half if d % 2 else half - 1)

    @property
    def num_steps(self) -> int:
        return max(self.stream_uses(s) for s in self.directions) + 1

    def offset(self, step: int, direction: str) -> int:
        """Offset of the peer whose chunk the stream handles at `step`."""
        return -step if direction == "right" else step

    def slot(self, step: int) -> int:
        """Receive and output slot of the chunk used at `step` >= 1."""
        return (step - 1) % self.buffering

    def step_record(self, step: int, direction: str) -> ExchangeStep:
        uses = self.stream_uses(direction)
        b = self.buffering
        active = step <= uses and (step > 0 or direction == "right")
        nxt = step + 1
        return ExchangeStep(
            step=step,
            direction=direction,
            computes=active,
            source=self.offset(step, direction) if active else 0,
            slot=self.slot(step) if 0 < step <= uses else -1,
            receives=0 < step <= uses,
            dispatches=nxt <= uses,
            dispatch_to=-self.offset(nxt, direction) if nxt <= uses else 0,
            dispatch_slot=self.slot(nxt) if nxt <= uses else -1,
            rewrites_output_of=step - b if step - b >= 1 and step <= uses else None,
            grants_to=self.offset(step + b, direction) if 0 < step and step + b <= uses else None,
            returns=0 < step <= uses,
        )

    def steps(self) -> tuple[tuple[ExchangeStep, ...], ...]:
        """Per step, one record per stream (in `directions` order)."""
        return tuple(
            tuple(self.step_record(t, s) for s in self.directions) for t in range(self.num_steps)
        )

    def initial_credits(self, direction: str) -> tuple[int, ...]:
        """Offsets of the devices a device grants a credit on entry (the first senders into its
        `buffering` free slots)."""
        first = range(1, min(self.buffering, self.stream_uses(direction)) + 1)
        return tuple(self.offset(t, direction) for t in first)

    def check_covers_peers(self) -> None:
        """Every device's experts run on every device's chunk exactly once (a plan invariant)."""
        used = sorted(r.source % self.num_devices for rs in self.steps() for r in rs if r.computes)
        assert used == list(range(self.num_devices)), used

    # ---- the event program ----
    def program(self, credits: bool = True) -> Program:
        """One actor per device. `credits=False` drops the credit protocol (senders write into a
        slot whenever they reach their step): with fewer slots than peers, the checker must find
        the race."""
        actors = {f"dev{d}": self._device(d, credits) for d in range(self.num_devices)}
        kind = "bidirectional" if self.bidirectional else "unidirectional"
        subject = (
            f"moe exchange D={self.num_devices} buffering={self.buffering} {kind}"
            f"{'' if credits else ' WITHOUT credits'}"
        )
        return program(subject, actors)

    def _device(self, dev: int, credits: bool) -> list[Action]:
        n = self.num_devices
        at = lambda offset: (dev + offset) % n  # noqa: E731
        back = {"right": "left", "left": "right"}
        acts: list[Action] = []
        if credits:
            for s in self.directions:
                for o in self.initial_credits(s):
                    acts.append(
                        Signal(("credit", s, at(o), dev), what=f"a credit to dev{at(o)} ({s})")
                    )
        for records in self.steps():
            for r in records:  # every stream's dispatch before any matmul: both links busy
                if not r.dispatches:
                    continue
                to = at(r.dispatch_to)
                if credits:
                    acts.append(
                        Wait(
                            ("credit", r.direction, dev, to),
                            consume=True,
                            what=f"a credit from dev{to} ({r.direction})",
                        )
                    )
                acts.append(
                    Copy(
                        f"dev{dev}->dev{to} tokens",
                        writes=(("in", r.direction, to, r.dispatch_slot),),
                        reads=(("tokens", dev, to),),
                        signals=(
                            ("recv", r.direction, to, r.dispatch_slot),
                            ("dispatched", r.direction, dev, r.step + 1),
                        ),
                        queue=f"link {r.direction} dev{dev}",
                        operand="tokens",
                    )
                )
            for r in records:
                if not r.computes:
                    continue
                src = at(r.source)
                tag = f"dev{dev} step {r.step} {r.direction}"
                if r.receives:
                    inp = ("in", r.direction, dev, r.slot)
                    out = ("out", r.direction, dev, r.slot)
                    acts.append(
                        Wait(
                            ("recv", r.direction, dev, r.slot),
                            consume=True,
                            what=f"dev{src}'s tokens in {r.direction} slot {r.slot}",
                        )
                    )
                else:
                    inp, out = ("tokens", dev, dev), ("result", dev, dev)
                if r.rewrites_output_of is not None:
                    acts.append(
                        Wait(
                            ("returned", r.direction, dev, r.rewrites_output_of),
                            what=f"its return of step {r.rewrites_output_of}",
                        )
                    )
                acts += [
                    Read(inp, tag),
                    Compute(r.step, tag, stream=r.direction, work="experts"),
                    Read(inp, tag, end=True),
                    Write(out, tag),
                ]
                if credits and r.grants_to is not None:
                    to = at(r.grants_to)
                    acts.append(
                        Signal(
                            ("credit", r.direction, to, dev),
                            what=f"a credit to dev{to} ({r.direction})",
                        )
                    )
                if r.returns:
                    acts.append(
                        Copy(
                            f"dev{dev}->dev{src} results",
                            writes=(("result", src, dev),),
                            reads=(out,),
                            signals=(("returned", r.direction, dev, r.step), ("home", src)),
                            queue=f"link {back[r.direction]} dev{dev}",
                            operand="results",
                        )
                    )
        acts.append(Wait(("home", dev), n - 1, what=f"the results of its {n - 1} peers"))
        for peer in range(n):  # the combine reads every peer's results
            acts += [
                Read(("result", dev, peer), "combine"),
                Read(("result", dev, peer), "combine", end=True),
            ]
        for records in self.steps():  # leave only once its own copies are done
            for r in records:
                if r.dispatches:
                    acts.append(
                        Wait(
                            ("dispatched", r.direction, dev, r.step + 1),
                            what=f"its dispatch of step {r.step + 1}",
                        )
                    )
                if r.returns:
                    acts.append(
                        Wait(
                            ("returned", r.direction, dev, r.step),
                            what=f"its return of step {r.step}",
                        )
                    )
        return acts


def exchange_plan(
    *, num_devices: int, bidirectional: bool = True, buffering: int = 2
) -> ExchangePlan:
    """The plan for a request: two streams only where they carry different peers (more than 2
    devices), at most one receive slot per peer of a stream (more would never be used).

    One slot where a stream has several peers is refused: every device would wait, before its
    experts run, for a credit that its receiver grants only after its own experts ran (the checker
    shows the deadlock of such a plan built by hand)."""
    if isinstance(buffering, bool) or not isinstance(buffering, int) or buffering < 1:
        raise ValueError(f"buffering: expected an int >= 1, got {buffering!r}")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices: expected an int >= 1, got {num_devices!r}")
    bidi = bool(bidirectional) and num_devices > 2
    plan = ExchangePlan(num_devices=num_devices, bidirectional=bidi, buffering=1)
    most = max([plan.stream_uses(s) for s in plan.directions] + [1])
    if buffering < 2 and most > 1:
        raise ValueError(
            f"buffering: the overlapped exchange needs 2 receive slots per stream when a stream "
            f"has several peers ({most} here: one slot is read while the next peer's chunk lands), "
            f"got {buffering}"
        )
    return dataclasses.replace(plan, buffering=min(buffering, most))
