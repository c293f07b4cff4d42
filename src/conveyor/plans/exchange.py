"""The overlapped expert-parallel exchange: per step, which peer's tokens a device's experts run
on, which chunk is in flight to the next peer, and which results travel home.

Design notes: docs/internals/plans.md, section `plans/exchange.py`.
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


@dataclasses.dataclass(frozen=True)
class ExchangeOperation:
    """One operation of the exchange kernel: `operation` of stream `direction` at `step`, on
    `slot` (`ExchangePlan.operation_records`)."""

    operation: str
    direction: str
    step: int
    slot: int


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

    def operation_records(self) -> tuple["ExchangeOperation", ...]:
        """What a device's kernel does, in order, as it reports it
        (`conveyor.pipeline.lowering.record_issued`): per step, every stream's dispatch, then per
        stream: wait for the chunk, wait for the return its output slot last held, the experts,
        the credit, the return home. `slot`: the slot involved (-1: the local chunk)."""
        out = []
        for records in self.steps():
            out += [
                ExchangeOperation("dispatch", r.direction, r.step, r.dispatch_slot)
                for r in records
                if r.dispatches
            ]
            for r in records:
                if not r.computes:
                    continue
                ops = [
                    ("receive", r.receives),
                    ("await_return", r.rewrites_output_of is not None),
                    ("experts", True),
                    ("grant", r.grants_to is not None),
                    ("return", r.returns),
                ]
                out += [ExchangeOperation(op, r.direction, r.step, r.slot) for op, on in ops if on]
        return tuple(out)

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


# ---- expert-staged order: one group of local experts per step, every peer at once ----


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagedStep:
    """One step of the expert-staged exchange, on every device alike."""

    step: int  # the stage: the group of local experts whose rows the experts run on
    slot: int  # receive (and output) slot holding every peer's rows of that stage
    dispatches: bool  # before the experts: send every peer its rows of the next stage
    dispatch_slot: int  # the slot they land in on the peers
    rewrites_output_of: int | None  # the stage whose results must be home before the slot is
    # rewritten
    grants: bool  # after the experts: a credit to every peer for the freed slot


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagedExchangePlan:
    """The expert-staged exchange: the local experts split into `stages` groups; at stage s every
    device receives, from every peer at once, the rows bound for group s, runs those experts on
    them (each expert's weights read once per layer, unlike per-peer chunks), and sends the
    results home, while the rows of stage s + 1 are in flight. Slots, credits and semaphores as
    in `ExchangePlan`, per (sender, receiver); a receive slot has one region per sender and its
    semaphore counts the D - 1 landings. Build it with `staged_exchange_plan(...)`."""

    num_devices: int
    stages: int
    buffering: int

    def __post_init__(self):
        for name in ("num_devices", "stages", "buffering"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"StagedExchangePlan: {name} must be an int >= 1, got {v!r}")

    @property
    def num_steps(self) -> int:
        return self.stages

    def step_record(self, step: int) -> StagedStep:
        b = self.buffering
        nxt = step + 1
        return StagedStep(
            step=step,
            slot=step % b,
            dispatches=nxt < self.stages,
            dispatch_slot=nxt % b if nxt < self.stages else -1,
            rewrites_output_of=step - b if step >= b else None,
            grants=step + b < self.stages,
        )

    def steps(self) -> tuple[StagedStep, ...]:
        return tuple(self.step_record(s) for s in range(self.stages))

    def program(self, credits: bool = True) -> Program:
        """One actor per device; `credits=False` drops the credit protocol (see `ExchangePlan`)."""
        actors = {f"dev{d}": self._device(d, credits) for d in range(self.num_devices)}
        subject = (
            f"moe staged exchange D={self.num_devices} stages={self.stages} "
            f"buffering={self.buffering}{'' if credits else ' WITHOUT credits'}"
        )
        return program(subject, actors)

    def _device(self, dev: int, credits: bool) -> list[Action]:
        n = self.num_devices
        peers = [p for p in range(n) if p != dev]
        link = lambda p: "right" if (p - dev) % n <= n // 2 else "left"  # noqa: E731

        def dispatch(stage: int, slot: int) -> list[Action]:
            acts: list[Action] = []
            for p in peers:
                if credits:
                    acts.append(
                        Wait(("credit", dev, p), consume=True, what=f"a credit from dev{p}")
                    )
                acts.append(
                    Copy(
                        f"dev{dev}->dev{p} tokens of stage {stage}",
                        writes=(("in", p, slot, dev),),
                        reads=(("tokens", dev, p, stage),),
                        signals=(("recv", p, slot), ("dispatched", dev, stage)),
                        queue=f"link {link(p)} dev{dev}",
                        operand="tokens",
                    )
                )
            return acts

        acts: list[Action] = []
        if credits:
            for p in peers:
                first = min(self.buffering, self.stages)
                acts.append(Signal(("credit", p, dev), first, what=f"{first} credit(s) to dev{p}"))
        acts += dispatch(0, 0)
        for r in self.steps():
            if r.dispatches:
                acts += dispatch(r.step + 1, r.dispatch_slot)
            tag = f"dev{dev} stage {r.step}"
            ins = [("in", dev, r.slot, p) for p in peers] + [("tokens", dev, dev, r.step)]
            outs = [("out", dev, r.slot, p) for p in peers] + [("result", dev, dev, r.step)]
            if peers:  # a device alone waits for nobody
                acts.append(
                    Wait(
                        ("recv", dev, r.slot),
                        len(peers),
                        consume=True,
                        what=f"its peers' rows of stage {r.step} in slot {r.slot}",
                    )
                )
                if r.rewrites_output_of is not None:
                    acts.append(
                        Wait(
                            ("returned", dev, r.rewrites_output_of),
                            len(peers),
                            what=f"its returns of stage {r.rewrites_output_of}",
                        )
                    )
            acts += [Read(s, tag) for s in ins]
            acts.append(Compute(r.step, tag, work="experts"))
            acts += [Read(s, tag, end=True) for s in ins]
            acts += [Write(s, tag) for s in outs]
            if credits and r.grants:
                acts += [Signal(("credit", p, dev), what=f"a credit to dev{p}") for p in peers]
            for p in peers:
                acts.append(
                    Copy(
                        f"dev{dev}->dev{p} results of stage {r.step}",
                        writes=(("result", p, dev, r.step),),
                        reads=(("out", dev, r.slot, p),),
                        signals=(("returned", dev, r.step), ("home", p)),
                        queue=f"link {link(p)} dev{dev}",
                        operand="results",
                    )
                )
        total = len(peers) * self.stages
        if peers:
            acts.append(Wait(("home", dev), total, what=f"its {total} returned result blocks"))
        for p in range(n):
            for s in range(self.stages):
                acts += [
                    Read(("result", dev, p, s), "combine"),
                    Read(("result", dev, p, s), "combine", end=True),
                ]
        for s in range(self.stages if peers else 0):
            acts.append(
                Wait(("dispatched", dev, s), len(peers), what=f"its dispatches of stage {s}")
            )
            acts.append(Wait(("returned", dev, s), len(peers), what=f"its returns of stage {s}"))
        return acts


# The default number of stages of the expert-staged exchange: at most this many, so that each
# stage's grouped matmuls stay big enough to fill a chip (docs/moe.md has the simulated trade-off).
DEFAULT_MAX_STAGES = 8


def default_stages(local_experts: int) -> int:
    """Stages of the expert-staged exchange when none are given: one per local expert, at most
    `DEFAULT_MAX_STAGES`."""
    return max(1, min(local_experts, DEFAULT_MAX_STAGES))


def staged_exchange_plan(
    *, num_devices: int, stages: int, buffering: int = 2
) -> StagedExchangePlan:
    """The expert-staged plan: at most `stages` receive slots (more would never be used); one slot
    where there are several stages is refused (as in `exchange_plan`: a deadlock)."""
    for name, v in (("num_devices", num_devices), ("stages", stages), ("buffering", buffering)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    if buffering < 2 and stages > 1:
        raise ValueError(
            f"buffering: the staged exchange needs 2 receive slots when there are several stages "
            f"({stages} here: one slot is read while the next stage's rows land), got {buffering}"
        )
    return StagedExchangePlan(
        num_devices=num_devices, stages=stages, buffering=min(buffering, stages)
    )
