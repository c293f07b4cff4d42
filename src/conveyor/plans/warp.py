"""The warp-specialized pipeline plan: the pipeline schedule split by role, with its barrier
protocol.

Design notes: docs/internals/plans.md, section `plans/warp.py`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from conveyor.plans.grid import Int
from conveyor.plans import fetch
from conveyor.plans.pipeline import PipelinePlan
from conveyor.plans.pipeline_program import body_actions, store, store_wait
from conveyor.plans.program import (
    Action,
    check_in_flight_steps,
    Copy,
    Program,
    Read,
    Signal,
    Wait,
    program,
)

# A warpgroup thread's register budget: PTX `setmaxnreg` takes multiples of 8 in [24, 256].
MIN_REGISTERS, MAX_REGISTERS = 24, 256
REGISTER_FILE_PER_THREAD = 512  # 64K registers per SM / 128 threads of one warpgroup


class PipelineState(enum.IntEnum):
    """Where a warp-specialized pipeline stands in a chain of pipelines run back to back on the same
    allocations (upstream's `plgpu.PipelinePipeline`, whose values are the same): START fetches its
    prologue and leaves its last slots in flight; STEADY fetches its first blocks as the previous
    pipeline's last steps release their slots; STOP does that and drains at the end."""

    START = 0
    STEADY = 1
    STOP = 2


def _every_step(p: PipelinePlan) -> PipelinePlan:
    """The pipeline with every input fetched at every step: the compute threads wait on a slot's
    barrier at every step, so no block is reused in place (`conveyor.plans.fetch`). Lookahead
    inputs are refused by name."""
    ahead = [op.name for op in p.inputs if op.fetch_rule == fetch.LOOKAHEAD]
    if ahead:
        raise NotImplementedError(
            f"{', '.join(ahead)}: pl.Buffered(use_lookahead=True) is not supported by "
            "warp-specialized pipelines: their compute threads wait for a copy at every step, so "
            "every step is fetched; drop use_lookahead (cv.emit_pipeline supports it)"
        )
    inputs = tuple(dataclasses.replace(op, fetch_rule=fetch.EVERY_STEP) for op in p.inputs)
    return p if inputs == p.inputs else dataclasses.replace(p, inputs=inputs)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarpSpecializedPlan:
    """A pipeline plan split over one memory thread and `num_compute_wgs` compute threads (the
    warpgroups along the kernel's thread axis `wg_axis`). Validated on construction;
    `memory_thread_idx=None` means the last thread."""

    pipeline: PipelinePlan
    num_compute_wgs: int
    wg_axis: str = "wg"
    memory_thread_idx: int | None = None
    memory_registers: int = 40
    manual_consumed_barriers: bool = False
    # The body waits on each input's produced barrier itself (`cv.wait_produced`), e.g. to start
    # on one input before another has landed; the program still models the wait before the reads.
    manual_produced_barriers: bool = False
    # A chain of pipelines (`PipelineState`, its int value, or a traced int32 scalar): None runs
    # alone.
    pipeline_state: Any = None

    def __post_init__(self):
        idx = check_options(
            memory_registers=self.memory_registers,
            num_compute_wgs=self.num_compute_wgs,
            wg_axis=self.wg_axis,
            memory_thread_idx=self.memory_thread_idx,
        )
        object.__setattr__(self, "memory_thread_idx", idx)
        object.__setattr__(self, "pipeline", _every_step(self.pipeline))
        for option in ("manual_consumed_barriers", "manual_produced_barriers"):
            if not isinstance(getattr(self, option), bool):
                raise ValueError(f"{option}: expected a bool, got {getattr(self, option)!r}")
        fetched_once = [op.name for op in self.pipeline.inputs if op.invariant]
        if self.manual_produced_barriers and fetched_once:
            raise NotImplementedError(
                "manual_produced_barriers=True with index-invariant inputs "
                f"({', '.join(fetched_once)}) is not supported: such a block is fetched once, so "
                "its barrier completes one phase only and a wait at every step would hang. Pass "
                "the block unwindowed, or leave manual_produced_barriers off"
            )
        if self.pipeline_state is not None:
            self._check_chainable(fetched_once)

    def _check_chainable(self, fetched_once: list[str]) -> None:
        """Upstream's conditions for chaining pipelines, on which the barriers' phases line up: a
        static grid whose steps are a multiple of the slots, no delay_release, no invariant input
        (`fetched_once`)."""
        p, state = self.pipeline, self.pipeline_state
        if isinstance(state, bool) or not (
            isinstance(state, int) or getattr(state, "shape", None) == ()
        ):
            raise ValueError(
                "pipeline_state: expected PipelineState.START / STEADY / STOP (or "
                f"plgpu.PipelinePipeline, or an int32 scalar), got {state!r}"
            )
        if isinstance(state, int) and state not in tuple(PipelineState):
            raise ValueError(
                f"pipeline_state: expected 0 (START), 1 (STEADY) or 2 (STOP), got {state!r}"
            )
        where = f"pipeline_state={state!r}"
        if not p.is_static:
            raise NotImplementedError(
                f"{where}: chained pipelines need a static grid, got {p.grid}"
            )
        if p.num_steps % p.max_concurrent_steps:
            raise NotImplementedError(
                f"{where}: chained pipelines need a number of steps (here {p.num_steps}, grid "
                f"{p.grid}) divisible by max_concurrent_steps={p.max_concurrent_steps}, so each "
                "pipeline ends on the last slot"
            )
        if p.delay_release:
            raise NotImplementedError(
                f"{where}: chained pipelines do not support delay_release (got {p.delay_release})"
            )
        if fetched_once:
            raise NotImplementedError(
                f"{where}: chained pipelines need every input to depend on the grid; "
                f"{', '.join(fetched_once)} are index-invariant (the next pipeline would refill "
                "their one slot while this one reads it)"
            )

    @property
    def drains(self) -> Any:
        """Whether the memory thread drains the releases at the end (alone, or the STOP of a
        chain)."""
        return (
            True
            if self.pipeline_state is None
            else _equals(self.pipeline_state, PipelineState.STOP)
        )

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
        """What is left of the register file after the memory thread, split evenly, rounded down to
        8."""
        share = (REGISTER_FILE_PER_THREAD - self.memory_registers) // self.num_compute_wgs
        return max(MIN_REGISTERS, min(MAX_REGISTERS, share // 8 * 8))

    def with_grid(self, grid) -> WarpSpecializedPlan:
        """This plan with concrete grid sizes (see `PipelinePlan.with_grid`)."""
        return dataclasses.replace(self, pipeline=self.pipeline.with_grid(grid))

    def released_slot(self, step: Int) -> Int:
        """The input slot a compute thread releases after `step` (valid when
        `releases_after(step)`)."""
        p = self.pipeline
        return (step - p.delay_release) % p.max_concurrent_steps

    def releases_after(self, step: Int) -> Any:
        return step >= self.pipeline.delay_release

    def refill_waits(self, fetch_step: Int) -> Any:
        """Whether fetching the blocks of `fetch_step` must first wait for its slot to be consumed:
        from the second round of slots on, and always after the first pipeline of a chain (its
        first fetches refill the slots the previous pipeline's last steps read)."""
        later = fetch_step >= self.pipeline.max_concurrent_steps
        if self.pipeline_state is None:
            return later
        first_of_chain = _equals(self.pipeline_state, PipelineState.START)
        if isinstance(later, bool) and isinstance(first_of_chain, bool):
            return later or not first_of_chain
        return jnp.logical_or(later, jnp.logical_not(first_of_chain))

    def consumed_barriers(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """The consumed barriers: the ones a compute thread arrives on after a step, and, per
        cycling input, the one the memory thread waits on before refilling its slot. With manual
        barriers each input has its own (named after it). Otherwise one barrier, "shared", is
        waited on before the first cycling input is refilled, and covers all of them."""
        cycling = [op.name for op in self.pipeline.inputs if not op.invariant]
        if self.manual_consumed_barriers:
            return tuple(op.name for op in self.pipeline.inputs), {name: name for name in cycling}
        return (("shared",), {cycling[0]: "shared"}) if cycling else ((), {})

    def program(self, in_flight_steps: int = 0) -> Program:
        """The protocol the Mosaic GPU lowering runs, as an event program: "memory thread" and one
        actor per compute thread ("compute[t]"); its barriers are described in
        docs/internals/plans.md (section `plans/warp.py`).

        Args:
          in_flight_steps: as in `PipelinePlan.program`. A chain of pipelines: `chain_program`.
        """
        return chain_program([dataclasses.replace(self, pipeline_state=None)], in_flight_steps)

    def _consumed_phase(self, barrier: str, step: int, at: int) -> Wait:
        """Wait until every compute thread released the slot of `step` (counted over the chain) on
        `barrier`."""
        slots = self.pipeline.max_concurrent_steps
        return consumed_wait(barrier, slots, self.num_compute_wgs, step=step, at=at)

    def _memory_actions(self, waited_on: dict[str, str], offset: int) -> list[Action]:
        """The memory thread's part of one pipeline whose steps follow `offset` earlier steps of a
        chain; the same rules as the lowering's (`refill_waits`, `drains`)."""
        p = self.pipeline
        n, slots = p.num_steps, p.max_concurrent_steps

        def fetch_round(t, at):
            acts: list[Action] = []
            for op in p.inputs:
                if op.invariant and t:
                    continue
                if op.name in waited_on and not op.invariant and self.refill_waits(t):
                    acts.append(self._consumed_phase(waited_on[op.name], offset + t - slots, at))
                acts.append(produce(op.name, slot=p.slot(op, t), step=offset + t, at=at))
            return acts

        acts = [a for t in range(min(p.lookahead, n)) for a in fetch_round(t, -1)]
        for s in range(n):
            t = p.fetch_at(s)
            if t < n:
                acts += fetch_round(t, s)
        if self.drains:
            for barrier in waited_on.values():
                acts += [
                    self._consumed_phase(barrier, offset + u, n)
                    for u in range(max(0, n - slots), n - p.delay_release)
                ]
        return acts

    def _compute_actions(
        self,
        thread: int,
        arrived_on: tuple[str, ...],
        in_flight_steps: int,
        offset: int,
        barrier_phase: int,
    ) -> tuple[list[Action], int]:
        """A compute thread's part of one pipeline after `offset` steps of a chain, whose output
        barrier has completed `barrier_phase` phases; returns its actions and the phases after
        it."""
        p = self.pipeline
        leader = thread == self.leader
        acts: list[Action] = []
        open_reads: dict[int, list[Read]] = {}
        writebacks = {op.name: 0 for op in p.outputs}
        stores: list[tuple[str, int]] = []  # the leader's stores not yet awaited: (output, slot)
        for s in range(p.num_steps):
            g = offset + s
            for op in p.inputs:
                if op.invariant and s == 0:
                    acts.append(produced_wait(op.name, 1, step=0, at=s))
                elif not op.invariant:
                    acts.append(produced_wait(op.name, op.num_slots, step=g, at=s))
            tag = f"compute[{thread}] body of step {g}"
            acts += body_actions(p, s, tag, writebacks, open_reads, in_flight_steps)
            if self.releases_after(s):
                slot = self.released_slot(s)
                acts += [release(b, slot=slot, step=g - p.delay_release, at=s) for b in arrived_on]
            stored = [op for op in p.outputs if p.writes_back(op, s)]
            if not stored:
                continue
            if leader:
                acts += [store_wait(name, slot, at=s) for name, slot in stores]
                stores.clear()
            acts.append(output_arrival(step=g, at=s))
            acts.append(
                Wait(
                    ("out_ready",),
                    self.num_compute_wgs * (barrier_phase + 1),
                    what=f"output barrier phase {barrier_phase} (step {g})",
                )
            )
            barrier_phase += 1
            for op in stored:
                if leader:
                    slot = p.output_slot(op, writebacks[op.name])
                    acts.append(store(op.name, slot, g, at=s))
                    stores.append((op.name, slot))
                writebacks[op.name] += 1
        for reads in open_reads.values():
            acts += [dataclasses.replace(r, end=True) for r in reads]
        acts += [store_wait(name, slot, at=p.num_steps) for name, slot in stores]
        return acts, barrier_phase


def produce(operand: str, *, slot: int, step: int, at: int) -> Copy:
    """The memory thread's copy of input `operand`'s block of step `step` into `slot`, issued
    during step `at`; it arrives once on the slot's produced barrier."""
    return Copy(
        f"{operand}@step{step}",
        writes=((operand, slot),),
        signals=(("produced", operand, slot),),
        operand=operand,
        at=at,
        step=step,
    )


def produced_wait(operand: str, slots: int, *, step: int, at: int) -> Wait:
    """A compute thread's wait, during step `at`, for the copy of input `operand`'s block of step
    `step` into its slot (of `slots`): that slot's produced barrier completing its phase."""
    slot = step % slots
    return Wait(
        ("produced", operand, slot),
        step // slots + 1,
        what=f"produced barrier {operand} slot {slot} (step {step})",
        at=at,
    )


def consumed_wait(barrier: str, slots: int, threads: int, *, step: int, at: int) -> Wait:
    """The memory thread's wait, during step `at`, until all `threads` compute threads released
    the slot of `step` (of `slots`) on consumed barrier `barrier`."""
    slot = step % slots
    return Wait(
        ("consumed", barrier, slot),
        threads * (step // slots + 1),
        what=f"consumed barrier {barrier} slot {slot} (release of step {step})",
        at=at,
    )


def release(barrier: str, *, slot: int, step: int, at: int) -> Signal:
    """A compute thread's arrival, during step `at`, on consumed barrier `barrier`: `slot`, which
    step `step` read, may be refilled."""
    return Signal(
        ("consumed", barrier, slot), what=f"release slot {slot} (step {step}) on {barrier}", at=at
    )


def output_arrival(*, step: int, at: int) -> Signal:
    """A compute thread's arrival, during step `at`, on the output barrier before the write-backs
    of step `step`."""
    return Signal(("out_ready",), what=f"output barrier (step {step})", at=at)


def as_chain(plan: Any) -> list[WarpSpecializedPlan] | None:
    """A list or tuple of warp-specialized plans (or of the functions
    `emit_pipeline_warp_specialized`
    returned) as the chain it describes; None for anything else."""
    if not isinstance(plan, (list, tuple)):
        return None
    plans = [getattr(x, "plan", x) for x in plan]
    if not plans or not all(isinstance(x, WarpSpecializedPlan) for x in plans):
        raise TypeError(
            "a chain of pipelines: expected a non-empty list of WarpSpecializedPlans (or the "
            "functions emit_pipeline_warp_specialized returned), got "
            f"{[type(x).__name__ for x in plans]}"
        )
    return plans


def chain_program(plans: Sequence[WarpSpecializedPlan], in_flight_steps: int = 0) -> Program:
    """The event program of warp-specialized pipelines run back to back on one set of allocations
    (`pipeline_state`): the first is the START, the last the STOP, the others STEADY, whatever
    their own `pipeline_state` says (which may be traced). One plan alone is `program()`.
    Operands are matched by position (`in[0]` is the same slots in every pipeline), and barrier
    phases continue from one pipeline to the next."""
    plans = list(plans)
    if not plans:
        raise ValueError("chain_program: expected at least one warp-specialized plan")
    check_in_flight_steps(in_flight_steps)
    for k, wp in enumerate(plans):
        wp.pipeline.require_static(f"pipeline {k} of the chain")
    if len(plans) > 1:  # each plan in its role (this checks upstream's conditions too)
        roles = (
            [PipelineState.START] + [PipelineState.STEADY] * (len(plans) - 2) + [PipelineState.STOP]
        )
        plans = [dataclasses.replace(wp, pipeline_state=role) for wp, role in zip(plans, roles)]
    first = plans[0]

    def shared(wp: WarpSpecializedPlan) -> tuple:
        """What the pipelines of a chain share with their allocations: threads, slots, barriers."""
        return (
            wp.num_compute_wgs,
            wp.memory_thread_idx,
            wp.pipeline.max_concurrent_steps,
            wp.manual_consumed_barriers,
            len(wp.pipeline.inputs),
            len(wp.pipeline.outputs),
        )

    for k, wp in enumerate(plans):
        if shared(wp) != shared(first):
            raise ValueError(
                f"chain_program: pipeline {k} differs from pipeline 0 in its threads, slots, "
                "barriers or number of operands; a chain shares one set of allocations"
            )
    actors: dict[str, list[Action]] = {"memory thread": []}
    phases = {c: 0 for c in first.compute_threads}
    offset = 0
    for k, wp in enumerate(plans):
        arrived_on, waited_on = wp.consumed_barriers()
        actors["memory thread"] += wp._memory_actions(waited_on, offset)
        for c in wp.compute_threads:
            acts, phases[c] = wp._compute_actions(c, arrived_on, in_flight_steps, offset, phases[c])
            actors.setdefault(f"compute[{c}]", []).extend(acts)
        offset += wp.pipeline.num_steps
    p = first.pipeline
    grids = " + ".join(str(wp.pipeline.grid) for wp in plans)
    in_flight = f" body in flight {in_flight_steps} step(s)" if in_flight_steps else ""
    subject = (
        f"warp-specialized ({first.num_compute_wgs} compute) "
        f"pipeline{'s' if len(plans) > 1 else ''} grid={grids if len(plans) > 1 else p.grid} "
        f"max_concurrent_steps={p.max_concurrent_steps} "
        f"delay_release={p.delay_release}{in_flight}"
    )
    return program(subject, actors)


def check_options(*, memory_registers, num_compute_wgs, wg_axis, memory_thread_idx) -> int:
    """Validate the warp-specialization options; returns the memory thread's index."""
    if (
        isinstance(num_compute_wgs, bool)
        or not isinstance(num_compute_wgs, int)
        or num_compute_wgs < 1
    ):
        raise ValueError(f"num_compute_wgs: expected an int >= 1, got {num_compute_wgs!r}")
    if not isinstance(wg_axis, str):
        raise ValueError(f"wg_axis: expected the kernel's thread_name (a str), got {wg_axis!r}")
    if (
        isinstance(memory_registers, bool)
        or not isinstance(memory_registers, int)
        or not MIN_REGISTERS <= memory_registers <= MAX_REGISTERS
        or memory_registers % 8
    ):
        raise ValueError(
            f"memory_registers: expected a multiple of 8 in [{MIN_REGISTERS}, {MAX_REGISTERS}] "
            f"(PTX setmaxnreg), got {memory_registers!r}"
        )
    if memory_thread_idx is None:
        return num_compute_wgs
    if (
        isinstance(memory_thread_idx, bool)
        or not isinstance(memory_thread_idx, int)
        or not 0 <= memory_thread_idx <= num_compute_wgs
    ):
        raise ValueError(
            f"memory_thread_idx: expected an int in [0, {num_compute_wgs}] (there are "
            f"{num_compute_wgs + 1} threads), got {memory_thread_idx!r}"
        )
    return memory_thread_idx


def _equals(x: Any, value: int) -> Any:
    return x == value if isinstance(x, int) else jnp.asarray(x) == value
