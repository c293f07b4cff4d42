"""The ring plan of a collective matmul: which shard each device holds, sends and uses at each step.

Pure data over ring offsets (relative to the device): every device follows the same plan, so a
device `d` at step `t` works on the shard of device `(d + offset) % D`. Lowerings ask it for the
permutations to issue; `program()` gives a stream's whole protocol to the checker.

All-gather (shards travel, the product accumulates locally):
  unidirectional: step t uses the shard of device d - t (received from the left neighbour).
  bidirectional: step t uses d - t (from the left) and d + t (from the right); the ring finishes
  in floor(D / 2) steps after the local step 0, and for even D the last step has one shard only
  (d + D/2 == d - D/2). Works for odd and even rings.
Reduce-scatter (partial sums travel): the accumulator for block j starts at device j + 1 and moves
right, so at step t device d adds its partial for block d - 1 - t and passes it on; after D - 1
hops it arrives at device j. Bidirectional splits the output columns in two halves that travel in
opposite directions (block d + 1 + t going left).
"""
from __future__ import annotations

import dataclasses

from conveyor.plans.program import Action, Compute, Copy, Program, Read, Signal, Wait, program


@dataclasses.dataclass(frozen=True)
class GatherStep:
    """Shards used at one step: (direction, ring offset of the source device)."""
    uses: tuple[tuple[str, int], ...]   # direction in {"local", "from_left", "from_right"}
    sends: tuple[str, ...]               # directions the held shards travel on after this step


@dataclasses.dataclass(frozen=True)
class RingPlan:
    num_devices: int
    bidirectional: bool
    buffering: int
    collective: str = "gather"   # "gather": shards travel; "scatter": partial-sum accumulators travel

    def gather_steps(self) -> tuple[GatherStep, ...]:
        d = self.num_devices
        if not self.bidirectional:
            return tuple(GatherStep(((("local", 0),) if t == 0 else (("from_left", -t),)),
                                    ("right",) if t < d - 1 else ()) for t in range(d))
        steps = [GatherStep((("local", 0),), ("right", "left") if d > 1 else ())]
        half = d // 2
        for t in range(1, half + 1):
            uses = [("from_left", -t)]
            if d - t != t:           # even ring: the last step's two shards are the same one
                uses.append(("from_right", t))
            more = t < half
            steps.append(GatherStep(tuple(uses), ("right", "left") if more else ()))
        return tuple(steps)

    # ---- flow control of kernels with `buffering` receive slots per stream ----
    # A stream is one direction of travel; it delivers `uses` shards (or accumulators) to each
    # device, one per step 1..uses, into slot step % buffering (slot 0 holds the local shard).
    def stream_uses(self, direction: str = "right") -> int:
        """Shards a device receives on the stream travelling `direction` (shards move right = they
        arrive from the left)."""
        d = self.num_devices
        if not self.bidirectional:
            return d - 1 if direction == "right" else 0
        if self.collective == "scatter":   # each half of the columns makes the whole trip
            return d - 1
        half = d // 2
        return half if direction == "right" else (half if d % 2 else half - 1)

    def slot(self, step):
        """Receive slot holding the shard used at `step` (step 0: the local shard, slot 0)."""
        return step % self.buffering

    def initial_credits(self, direction: str = "right") -> int:
        """Credits a device grants its upstream neighbour on entry: its free slots that will be used.
        Granting them is the handshake that replaces a barrier: nobody writes into a device that is
        not yet in the kernel."""
        return max(min(self.buffering, self.stream_uses(direction) + 1) - 1, 0)

    def sends_at(self, step, direction: str = "right"):
        """Whether a device forwards its current shard downstream after `step`."""
        return step < self.stream_uses(direction)

    def grants_credit_after(self, step, direction: str = "right"):
        """Whether the slot freed after `step` gets a new credit: only if the upstream neighbour will
        send into it again, so every capacity semaphore ends the kernel at zero."""
        return step + self.buffering <= self.stream_uses(direction)

    def credit_balance(self, direction: str = "right") -> int:
        """Credits granted minus credits consumed per device (0 for a plan that ends clean)."""
        steps = range(self.num_devices)
        grants = self.initial_credits(direction) + sum(bool(self.grants_credit_after(s, direction)) for s in steps)
        uses = sum(bool(self.sends_at(s, direction)) for s in steps)
        return grants - uses

    def program(self, direction: str = "right", credits: bool = True) -> Program:
        """One stream of the ring as an event program, one actor per device ("dev{d}").

        Each device receives into slot step % buffering, multiplies with the shard there, forwards
        it to its downstream neighbour (a remote copy that signals the neighbour's receive
        semaphore), and grants a credit upstream once the slot is free again. With
        `credits=False` a device sends as soon as it has its shard, as in JAX's example ring
        kernel whose receive semaphores are reused across steps: the checker must find the race."""
        d = self.num_devices
        link = "link right" if direction == "right" else "link left"
        uses, first_credits = self.stream_uses(direction), self.initial_credits(direction)
        actors = {}
        for dev in range(d):
            down, up = (dev + 1) % d, (dev - 1) % d
            acts: list[Action] = []
            if credits and first_credits:
                acts.append(Signal(("credit", up), first_credits, what=f"grant {first_credits} credit(s) to dev{up}"))
            for t in range(uses + 1):
                slot = (dev, self.slot(t))
                tag = f"dev{dev} multiplies the shard of step {t}"
                if t > 0:
                    acts.append(Wait(("recv", dev), 1, consume=True,
                                     what=f"receive semaphore of dev{dev} (shard of step {t})"))
                acts += [Read(slot, tag), Compute(t, tag), Read(slot, tag, end=True)]
                if self.sends_at(t, direction):
                    if credits:
                        acts.append(Wait(("credit", dev), 1, consume=True, what=f"a credit from dev{down}"))
                    acts.append(Copy(f"dev{dev}->dev{down}#{t + 1}", writes=((down, self.slot(t + 1)),), reads=(slot,),
                                     signals=(("recv", down), ("sent", dev, t)), queue=link))
                    acts.append(Wait(("sent", dev, t), what=f"its send of step {t}"))
                if credits and self.grants_credit_after(t, direction):
                    acts.append(Signal(("credit", up), what=f"a credit to dev{up}"))
            actors[f"dev{dev}"] = acts
        subject = (f"ring {self.collective} {direction} D={d} buffering={self.buffering}"
                   f"{'' if credits else ' WITHOUT credits'}")
        return program(subject, actors)

    def scatter_block(self, step: int, direction: str = "right") -> int:
        """Ring offset of the block a device adds into the travelling accumulator at `step`."""
        return -1 - step if direction == "right" else 1 + step

    @property
    def num_gather_steps(self) -> int:
        return len(self.gather_steps())

    def check_covers_ring(self) -> None:
        """Every source shard is used exactly once (a plan invariant, checked in tests)."""
        used = [off % self.num_devices for s in self.gather_steps() for _, off in s.uses]
        assert sorted(used) == list(range(self.num_devices)), used
