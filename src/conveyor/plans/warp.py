"""The warp-specialized pipeline plan: the pipeline schedule split by role, with its barrier protocol.

One memory thread issues every input fetch; `num_compute_wgs` compute threads run the body. The
protocol, per input slot (all rules work on Python ints and traced int32 scalars):

- produced[slot]: the memory thread's copy into the slot arrives on it; every compute thread
  waits on it before reading the slot.
- consumed[slot] (num_compute_wgs arrivals): after step s each compute thread arrives on the
  slot step s - delay_release used (`released_slot`); the memory thread waits on it before
  refilling that slot for step s + lookahead (`refill_waits`).
- Outputs live in two slots shared by the compute threads. At a write-back every compute thread
  fences its shared-memory writes and arrives on the output barrier (num_compute_wgs arrivals);
  the leader (the first compute thread) first waits until its previous store has finished reading
  its slot, and, once all have arrived, stores the block. So several compute threads may write
  disjoint parts of one output block without racing, and a block stays resident while its index
  does not change (accumulation across a reduction axis works as in `emit_pipeline`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from conveyor.plans.pipeline import Event, Int, PipelinePlan

# A warpgroup thread's register budget: PTX `setmaxnreg` takes multiples of 8 in [24, 256].
MIN_REGISTERS, MAX_REGISTERS = 24, 256
REGISTER_FILE_PER_THREAD = 512  # 64K registers per SM / 128 threads of one warpgroup


@dataclasses.dataclass(frozen=True)
class WarpSpecializedPlan:
    pipeline: PipelinePlan
    wg_axis: str
    num_compute_wgs: int
    memory_thread_idx: int
    memory_registers: int
    manual_consumed_barriers: bool

    @property
    def num_threads(self) -> int:
        return self.num_compute_wgs + 1

    @property
    def compute_threads(self) -> tuple[int, ...]:
        """Thread indices (`lax.axis_index(wg_axis)`) of the compute threads, in order."""
        return tuple(t for t in range(self.num_threads) if t != self.memory_thread_idx)

    @property
    def leader(self) -> int:
        """The compute thread that issues output stores."""
        return self.compute_threads[0]

    @property
    def compute_registers(self) -> int:
        """What is left of the register file after the memory thread, split evenly, rounded down to 8."""
        share = (REGISTER_FILE_PER_THREAD - self.memory_registers) // self.num_compute_wgs
        return max(MIN_REGISTERS, min(MAX_REGISTERS, share // 8 * 8))

    def with_grid(self, grid) -> WarpSpecializedPlan:
        """This plan with concrete grid sizes (see `PipelinePlan.with_grid`)."""
        return dataclasses.replace(self, pipeline=self.pipeline.with_grid(grid))

    def released_slot(self, step: Int) -> Int:
        """The input slot a compute thread releases after `step` (valid when `releases_after(step)`)."""
        p = self.pipeline
        return (step - p.delay_release) % p.max_concurrent_steps

    def releases_after(self, step: Int) -> Any:
        return step >= self.pipeline.delay_release

    def refill_waits(self, fetch_step: Int) -> Any:
        """Whether fetching the blocks of `fetch_step` must first wait for its slot to be consumed."""
        return fetch_step >= self.pipeline.max_concurrent_steps

    def events(self) -> tuple[Event, ...]:
        """The schedule by role: the memory thread's fetches and the compute threads' steps.

        `operand` carries the actor for protocol events ("memory", "compute[t]"); fetch events keep
        the operand name, as in `PipelinePlan.events()`.
        """
        p = self.pipeline
        p.require_static("the warp-specialized pipeline's events")
        n, ev = p.num_steps, []
        for op in p.inputs:
            for t in p.prologue_steps(op):
                ev.append(Event(-1, "fetch", op.name, p.slot(op, t), t))
        for s in range(n):
            t = p.fetch_at(s)
            if t < n:
                if self.refill_waits(t):
                    ev.append(Event(s, "wait_consumed", "memory", t % p.max_concurrent_steps, t - p.max_concurrent_steps))
                for op in p.inputs:
                    if not op.invariant:
                        ev.append(Event(s, "fetch", op.name, p.slot(op, t), t))
        for c in self.compute_threads:
            actor = f"compute[{c}]"
            for s in range(n):
                ev.append(Event(s, "wait_produced", actor, s % p.max_concurrent_steps, s))
                ev.append(Event(s, "compute", actor, None, s))
                if self.releases_after(s):
                    ev.append(Event(s, "arrive_consumed", actor, self.released_slot(s), s - p.delay_release))
        return tuple(ev)


def check_options(*, memory_registers, num_compute_wgs, wg_axis, memory_thread_idx) -> int:
    """Validate the warp-specialization options; returns the memory thread's index."""
    if isinstance(num_compute_wgs, bool) or not isinstance(num_compute_wgs, int) or num_compute_wgs < 1:
        raise ValueError(f"num_compute_wgs: expected an int >= 1, got {num_compute_wgs!r}")
    if not isinstance(wg_axis, str):
        raise ValueError(f"wg_axis: expected the kernel's thread_name (a str), got {wg_axis!r}")
    if (isinstance(memory_registers, bool) or not isinstance(memory_registers, int)
            or not MIN_REGISTERS <= memory_registers <= MAX_REGISTERS or memory_registers % 8):
        raise ValueError(f"memory_registers: expected a multiple of 8 in [{MIN_REGISTERS}, {MAX_REGISTERS}] "
                         f"(PTX setmaxnreg), got {memory_registers!r}")
    if memory_thread_idx is None:
        return num_compute_wgs
    if (isinstance(memory_thread_idx, bool) or not isinstance(memory_thread_idx, int)
            or not 0 <= memory_thread_idx <= num_compute_wgs):
        raise ValueError(f"memory_thread_idx: expected an int in [0, {num_compute_wgs}] (there are "
                         f"{num_compute_wgs + 1} threads), got {memory_thread_idx!r}")
    return memory_thread_idx
