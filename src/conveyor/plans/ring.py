"""The ring plan of a collective matmul: per grid step and per stream, what every device receives,
multiplies, forwards and frees.

Design notes: docs/internals/plans.md, section `plans/ring.py`.
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

COLLECTIVES = ("gather", "scatter")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingStep:
    """What one stream of the ring does at one grid step, on every device alike.

    A stream is one direction of travel: "right" (to device d + 1, so it arrives from the left)
    or "left". Slots are the stream's receive slots on this device.
    """

    step: int
    direction: str
    slot: int  # the slot holding this step's shard (gather) or accumulator (scatter)
    receives: bool  # first wait for it to land from the upstream neighbour
    computes: bool  # this stream's chunk matmul runs at this step
    source: int  # ring offset of the shard used (gather) or of the block added (scatter)
    sends: bool  # forward the slot downstream (into `send_slot`) once granted a credit
    send_slot: int
    awaits_send_of: int | None  # the step whose send this step waits for (scatter: the previous
    # one, so a hop overlaps this step's partial product)
    grants_credit: bool  # after that wait: one credit upstream for the slot it freed
    stores: bool  # scatter: the accumulator is complete; store it as the output


LANES = 128


def sublanes(itemsize: int) -> int:
    """Rows of one native TPU VMEM tile of elements of `itemsize` bytes (8 for 32-bit, 16 for
    16-bit, ...)."""
    return 8 * max(1, 4 // itemsize)


def _block(dim: int, at_most: int, align: int) -> int:
    """The largest divisor of `dim` that is a multiple of `align` and at most `at_most`; `dim`
    itself when there is none (a whole dimension is always a valid block)."""
    for size in range(min(dim, at_most) // align * align, 0, -align):
        if dim % size == 0:
            return size
    return dim


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingBlocks:
    """The largest VMEM blocks of a ring kernel's inner pipelines (the ring's operands, output
    and slots stay in HBM; each step's matmul and each reduce-scatter accumulate is a pipeline over
    blocks): `rows` x `depth` of the lhs, `depth` x `cols` of the rhs, `rows` x `cols` of the
    float32 output. Each dimension takes the largest divisor of the array's that is at most this
    and a whole number of (sublane, lane) tiles; the whole dimension when none is."""

    rows: int = 512
    cols: int = 512
    depth: int = 512

    def __post_init__(self):
        for name in ("rows", "cols", "depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RingBlocks: {name} must be an int >= 1, got {v!r}")

    def for_matmul(self, rows: int, depth: int, cols: int, itemsize: int) -> tuple[int, int, int]:
        """(rows, cols, depth) blocks of a [rows, depth] @ [depth, cols] product whose lhs elements
        take `itemsize` bytes."""
        return (
            _block(rows, self.rows, sublanes(itemsize)),
            _block(cols, self.cols, LANES),
            _block(depth, self.depth, LANES),
        )

    def for_sum(self, rows: int, cols: int) -> tuple[int, int]:
        """Blocks of a float32 [rows, cols] accumulator (a reduce-scatter's accumulate)."""
        return _block(rows, self.rows, sublanes(4)), _block(cols, self.cols, LANES)


# A step's operations, in order (the same at every step; a record says which ones happen):
#   receive: wait for the slot's shard / accumulator to land;
#   send: wait for a credit, start the copy into the downstream neighbour's slot;
#   compute: gather: the chunk matmul on the slot; scatter: the partial product (no slot access);
#   accumulate: scatter: slot += partial (on TPU a pass over the slot and the partial in HBM);
#   finish_send: wait for the send named by `awaits_send_of`;
#   grant: a credit upstream for the freed slot;
#   store: scatter: the output block from the slot.
GATHER_PHASES = ("receive", "send", "compute", "finish_send", "grant")
SCATTER_PHASES = ("compute", "finish_send", "grant", "receive", "accumulate", "send", "store")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingPlan:
    """A collective matmul's ring. Build it with `ring_plan(...)`, which normalizes the request
    (one direction where two would carry the same shards, at most one slot per device)."""

    num_devices: int
    bidirectional: bool
    buffering: int
    collective: str = (
        "gather"  # "gather": shards travel; "scatter": partial-sum accumulators travel
    )

    def __post_init__(self):
        for name in ("num_devices", "buffering"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RingPlan: {name} must be an int >= 1, got {v!r}")
        if self.collective not in COLLECTIVES:
            raise ValueError(
                f"RingPlan: collective must be one of {COLLECTIVES}, got {self.collective!r}"
            )
        if not isinstance(self.bidirectional, bool):
            raise ValueError(f"RingPlan: bidirectional must be a bool, got {self.bidirectional!r}")

    @property
    def directions(self) -> tuple[str, ...]:
        """The streams: "right", and "left" when bidirectional."""
        return ("right", "left") if self.bidirectional else ("right",)

    @property
    def num_steps(self) -> int:
        """Grid steps of a ring kernel: the local step 0, then one per received shard or
        accumulator."""
        return max(self.stream_uses(d) for d in self.directions) + 1

    # ---- flow control of kernels with `buffering` receive slots per stream ----
    # A stream delivers `uses` shards (or accumulators) to each device, one per step 1..uses,
    # into slot step % buffering (slot 0 holds the local shard).
    def stream_uses(self, direction: str = "right") -> int:
        """Shards a device receives on the stream travelling `direction` (shards move right = they
        arrive from the left)."""
        d = self.num_devices
        if not self.bidirectional:
            return d - 1 if direction == "right" else 0
        if self.collective == "scatter":  # each half of the columns makes the whole trip
            return d - 1
        half = d // 2
        return half if direction == "right" else (half if d % 2 else half - 1)

    def slot(self, step):
        """Receive slot holding the shard used at `step` (step 0: the local shard, slot 0)."""
        return step % self.buffering

    def initial_credits(self, direction: str = "right") -> int:
        """Credits a device grants its upstream neighbour on entry: its free slots that will be
        used.
        Granting them is the handshake that replaces a barrier: nobody writes into a device that is
        not yet in the kernel."""
        return max(min(self.buffering, self.stream_uses(direction) + 1) - 1, 0)

    def sends_at(self, step, direction: str = "right"):
        """Whether a device forwards its current shard downstream after `step`."""
        return step < self.stream_uses(direction)

    def grants_credit_after(self, step, direction: str = "right"):
        """Whether the slot freed after `step` gets a new credit: only if the upstream neighbour
        will send into it again, so every capacity semaphore ends the kernel at zero."""
        return step + self.buffering <= self.stream_uses(direction)

    def credit_balance(self, direction: str = "right") -> int:
        """Credits granted minus credits consumed per device (0 for a plan that ends clean)."""
        steps = range(self.num_devices)
        grants = self.initial_credits(direction) + sum(
            bool(self.grants_credit_after(s, direction)) for s in steps
        )
        uses = sum(bool(self.sends_at(s, direction)) for s in steps)
        return grants - uses

    def scatter_block(self, step: int, direction: str = "right") -> int:
        """Ring offset of the block a device adds into the travelling accumulator at `step`."""
        return -1 - step if direction == "right" else 1 + step

    # ---- per-step records ----
    def phases(self) -> tuple[tuple[str, str], ...]:
        """A step's operations in order, as (operation, direction): each operation for every
        stream before the next operation, so both directions are in flight at once."""
        ops = GATHER_PHASES if self.collective == "gather" else SCATTER_PHASES
        return tuple((op, d) for op in ops for d in self.directions)

    def step_record(self, step: int, direction: str) -> RingStep:
        """The record of stream `direction` at grid step `step`."""
        uses = self.stream_uses(direction)
        active = step <= uses
        sends = bool(self.sends_at(step, direction))
        if self.collective == "gather":
            # the send reads the slot the matmul reads: freed at once
            awaited = step if sends else None
            grants = bool(self.grants_credit_after(step, direction))
            source = (-step if direction == "right" else step) if active else 0
            # one matmul for the local shard
            computes = active and (step > 0 or direction == "right")
        else:
            awaited = step - 1 if step > 0 and self.sends_at(step - 1, direction) else None
            grants = step > 0 and bool(self.grants_credit_after(step - 1, direction))
            source = self.scatter_block(step, direction)
            computes = active
        return RingStep(
            step=step,
            direction=direction,
            slot=self.slot(step),
            receives=0 < step <= uses,
            computes=computes,
            source=source,
            sends=sends,
            send_slot=self.slot(step + 1),
            awaits_send_of=awaited,
            grants_credit=grants,
            stores=self.collective == "scatter" and step == uses,
        )

    def steps(self) -> tuple[tuple[RingStep, ...], ...]:
        """Per grid step, one record per stream (in `directions` order)."""
        return tuple(
            tuple(self.step_record(t, d) for d in self.directions) for t in range(self.num_steps)
        )

    def program(self, credits: bool = True) -> Program:
        """The ring as an event program, one actor per device ("dev{d}"), every stream included.

        Each device runs `phases()` at every step as its records say: it waits for its slot to
        land, forwards it to its downstream neighbour (a remote copy on its own link that signals
        the neighbour's receive semaphore), multiplies, waits for its send and grants a credit
        upstream once the slot is free again. With `credits=False` a device sends as soon as it
        has its shard, as in JAX's example ring kernel whose receive semaphores are reused across
        steps: the checker must find the race."""
        actors = {
            f"dev{dev}": self._device_actions(dev, credits) for dev in range(self.num_devices)
        }
        direction = "bidirectional" if self.bidirectional else "unidirectional"
        subject = (
            f"ring {self.collective} D={self.num_devices} buffering={self.buffering} "
            f"{direction}{'' if credits else ' WITHOUT credits'}"
        )
        return program(subject, actors)

    def operations(self) -> tuple[tuple[str, RingStep], ...]:
        """Every operation a device performs, in order: (operation, record) for each step and each
        of `phases()` that the step's record enables. The program and the kernels' conformance
        tests read this; the kernels decide the same from the table at run time."""
        return tuple(
            (op, r)
            for records in self.steps()
            for op, direction in self.phases()
            for r in records
            if r.direction == direction and _enabled(op, r)
        )

    def operation_records(self) -> tuple[RingOperation, ...]:
        """`operations()` as a kernel reports them (`conveyor.pipeline.lowering.record_issued`):
        per operation its step, stream and the slot named by `SLOT_FIELD`."""
        return tuple(
            RingOperation(
                op,
                r.direction,
                step=r.step,
                slot=self.slot(r.awaits_send_of)
                if SLOT_FIELD[op] == "awaits_slot"
                else getattr(r, SLOT_FIELD[op]),
            )
            for op, r in self.operations()
        )

    def _device_actions(self, dev: int, credits: bool) -> list[Action]:
        d = self.num_devices
        neighbours = {
            "right": ((dev + 1) % d, (dev - 1) % d),
            "left": ((dev - 1) % d, (dev + 1) % d),
        }
        acts: list[Action] = []
        for direction in self.directions:
            down, up = neighbours[direction]
            if self.collective == "gather":
                acts.append(
                    Write((direction, dev, 0), f"dev{dev} copies its shard into {direction} slot 0")
                )
            first = self.initial_credits(direction)
            if credits and first:
                acts.append(
                    Signal(
                        ("credit", direction, up),
                        first,
                        what=f"grant {first} credit(s) to dev{up} ({direction})",
                    )
                )
        for op, r in self.operations():
            acts += self._actions(op, r, dev, neighbours[r.direction], credits)
        return acts

    def _actions(
        self, op: str, r: RingStep, dev: int, neighbours: tuple[int, int], credits: bool
    ) -> list[Action]:
        """One enabled operation of one stream's record as actions of device `dev`."""
        down, up = neighbours
        slot = (r.direction, dev, r.slot)
        tag = f"dev{dev} step {r.step} {r.direction}"
        if op == "receive":
            return [
                Wait(
                    ("recv", r.direction, dev),
                    1,
                    consume=True,
                    what=f"its {r.direction} receive semaphore (step {r.step})",
                )
            ]
        if op == "send":
            waits = (
                [
                    Wait(
                        ("credit", r.direction, dev),
                        1,
                        consume=True,
                        what=f"a credit from dev{down} ({r.direction})",
                    )
                ]
                if credits
                else []
            )
            return waits + [
                Copy(
                    f"dev{dev}->dev{down} {r.direction} #{r.step + 1}",
                    writes=((r.direction, down, r.send_slot),),
                    reads=(slot,),
                    signals=(("recv", r.direction, down), ("sent", r.direction, dev, r.step)),
                    queue=f"link {r.direction} dev{dev}",
                )
            ]
        if op == "compute":
            work = [Compute(r.step, tag, stream=r.direction, work="matmul")]
            return (
                [Read(slot, tag), *work, Read(slot, tag, end=True)]
                if self.collective == "gather"
                else work
            )
        if op == "accumulate":
            return [Compute(r.step, tag, stream=r.direction, work="accumulate"), Write(slot, tag)]
        if op == "finish_send":
            return [
                Wait(
                    ("sent", r.direction, dev, r.awaits_send_of),
                    what=f"its send of step {r.awaits_send_of}",
                )
            ]
        if op == "grant":
            return (
                [Signal(("credit", r.direction, up), what=f"a credit to dev{up} ({r.direction})")]
                if credits
                else []
            )
        assert op == "store", op
        return [Read(slot, tag), Read(slot, tag, end=True)]

    # ---- the table the TPU kernels read ----
    def step_table(self) -> tuple[int, ...]:
        """The records as a flat int32 table: row (step, stream) holds `TABLE_FIELDS` in order;
        `table_index` finds a field. An absent `awaits_send_of` is -1."""
        out = []
        for records in self.steps():
            for r in records:
                awaited = -1 if r.awaits_send_of is None else self.slot(r.awaits_send_of)
                values = dict(dataclasses.asdict(r), awaits_slot=awaited)
                out += [int(values[f]) for f in TABLE_FIELDS]
        return tuple(out)

    def table_index(self, step, direction: str, field: str):
        """Index of `field` of (step, direction) in `step_table()`; `step` may be traced."""
        row = step * len(self.directions) + self.directions.index(direction)
        return row * len(TABLE_FIELDS) + TABLE_FIELDS.index(field)

    def check_covers_ring(self) -> None:
        """Gather: every device's shard is multiplied exactly once (a plan invariant, checked in
        tests)."""
        used = [
            r.source % self.num_devices for records in self.steps() for r in records if r.computes
        ]
        assert sorted(used) == list(range(self.num_devices)), used


# The record flag that enables each operation; finish_send is enabled by `awaits_send_of` not None.
ENABLED_BY = {
    "receive": "receives",
    "send": "sends",
    "compute": "computes",
    "accumulate": "computes",
    "grant": "grants_credit",
    "store": "stores",
}


# The slot each operation is reported with (`RingOperation`): the field of its record that holds
# it ("awaits_slot": the slot of the step whose send it awaits).
SLOT_FIELD = {
    "receive": "slot",
    "send": "send_slot",
    "compute": "slot",
    "accumulate": "slot",
    "finish_send": "awaits_slot",
    "grant": "slot",
    "store": "slot",
}


@dataclasses.dataclass(frozen=True)
class RingOperation:
    """One operation of a ring kernel: `operation` (of `RingPlan.phases()`) of stream `direction`
    at grid step `step`, on `slot` (`SLOT_FIELD`)."""

    operation: str
    direction: str
    step: int
    slot: int


def _enabled(op: str, r: RingStep) -> bool:
    """Whether record `r` performs operation `op` (see `phases()`)."""
    return r.awaits_send_of is not None if op == "finish_send" else bool(getattr(r, ENABLED_BY[op]))


TABLE_FIELDS = (
    "slot",
    "receives",
    "computes",
    "source",
    "sends",
    "send_slot",
    "awaits_slot",
    "grants_credit",
    "stores",
)


def ring_plan(
    *, collective: str, num_devices: int, bidirectional: bool, buffering: int
) -> RingPlan:
    """The plan a ring kernel runs for a request: two directions only where they carry different
    data (gather: more than 2 devices; scatter: more than 1, each direction carrying half the
    columns), and at most `num_devices` receive slots (more would never be used)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective: expected one of {COLLECTIVES}, got {collective!r}")
    bidi = bool(bidirectional) and num_devices > (2 if collective == "gather" else 1)
    return RingPlan(
        num_devices=num_devices,
        bidirectional=bidi,
        buffering=max(1, min(buffering, num_devices)),
        collective=collective,
    )
