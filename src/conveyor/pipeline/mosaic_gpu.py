"""Mosaic GPU lowering of a pipeline plan: SMEM slots filled by TMA copies, tracked by mbarriers.

Design notes: docs/internals/pipelines.md, section `pipeline/mosaic_gpu.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from conveyor.jaxprs import is_jax_ref
from conveyor.kernel import current_context
from conveyor.kernel_gpu import BARRIER_BYTES, smem_bytes
from conveyor.pipeline import carry as carry_lib, gpu_tiles
from conveyor.pipeline.lowering import (
    box_view,
    call_body,
    check_allocations,
    fetch_after_step,
    fetch_prologue,
    issued,
    when,
)
from conveyor.plans import fetch
from conveyor.plans import pipeline_program as actions
from conveyor.plans import warp
from conveyor.plans.pipeline import PipelinePlan
from conveyor.plans.warp import WarpSpecializedPlan


# What Mosaic GPU lets one thread block allocate on sm_90 (H100/H200): 227 KiB of the SM's 228 KB
# (its export error reads "exceeds available shared memory: smem_bytes=... >
# max_smem_bytes=232448").
SMEM_BUDGET_BYTES = 232448


def check_smem_budget(p: PipelinePlan, scratch, api: str) -> int:
    """The shared memory of a pipeline's scratch (its slots, inputs then outputs, and barriers) plus
    the enclosing cv.kernel's scratch_shapes; a ValueError naming every operand when the sum exceeds
    the budget (the GPU interpreter would run it; the real compile refuses it)."""
    slots = [s for s in scratch if not isinstance(s, plgpu.Barrier)]
    barrier_bytes = smem_bytes([b for b in scratch if isinstance(b, plgpu.Barrier)])
    parts = [
        (
            op,
            buf.shape[0],
            math.prod(buf.shape[1:]) * jnp.dtype(buf.dtype).itemsize,
            jnp.dtype(buf.dtype).name,
        )
        for op, buf in zip(p.inputs + p.outputs, slots)
    ]
    kernel_scratch = current_context(api).scratch_bytes
    total = sum(n * block for _, n, block, _ in parts) + barrier_bytes + kernel_scratch
    if total > SMEM_BUDGET_BYTES:
        detail = "; ".join(
            f"{op.name}: {n} slot(s) x {block} B ({dtype} {op.ref_shape}) = {n * block} B"
            for op, n, block, dtype in parts
        )
        raise ValueError(
            f"{api} on mosaic_gpu needs {total} B of shared memory, more than the "
            f"{SMEM_BUDGET_BYTES} B a thread block may use on sm_90: {detail}; "
            f"{barrier_bytes // BARRIER_BYTES} barrier(s) x {BARRIER_BYTES} B; the kernel's "
            f"scratch_shapes {kernel_scratch} B. Use smaller blocks or fewer slots "
            "(max_concurrent_steps)"
        )
    return total


def _slots(p: PipelinePlan, in_refs, out_refs) -> list:
    """The SMEM slots of every operand (inputs, then outputs), in its block's layout transforms."""
    return [
        plgpu.SMEM((op.num_slots, *op.ref_shape), r.dtype, transforms=op.transforms)
        for op, r in zip(p.inputs + p.outputs, (*in_refs, *out_refs))
    ]


def _fetch(
    p: PipelinePlan, in_refs, in_bufs, produced, i: int, step, at, slot=None, record=actions.fetch
) -> None:
    """The TMA copy of input i's block of `step` into `slot` (default: the every-step rule's),
    issued during grid step `at`; `record` builds the plan's record of it (`record_issued`)."""
    op = p.inputs[i]
    slot = p.slot(op, step) if slot is None else slot
    issued(record, op.name, slot=slot, step=step, at=at)
    plgpu.copy_gmem_to_smem(
        box_view(p, op, in_refs[i], step), in_bufs[i].at[slot], produced[i].at[slot]
    )


def _await_blocks(p: PipelinePlan, s, produced, in_bufs, out_bufs, wb_counts, wait: bool = True):
    """A compute thread of a warp-specialized pipeline: wait until step s's input copies landed
    (unless the body waits itself: `wait=False`); return the input and output slot views of step
    s."""
    for i, op in enumerate(p.inputs if wait else ()):
        if op.invariant:

            @pl.when(s == 0)
            def _():
                issued(warp.produced_wait, op.name, 1, step=0, at=s)
                plgpu.barrier_wait(produced[i].at[0])
        else:
            issued(warp.produced_wait, op.name, op.num_slots, step=s, at=s)
            plgpu.barrier_wait(produced[i].at[p.slot(op, s)])
    in_blocks = [in_bufs[i].at[p.slot(op, s)] for i, op in enumerate(p.inputs)]
    out_blocks = [out_bufs[j].at[p.output_slot(op, wb_counts[j])] for j, op in enumerate(p.outputs)]
    return in_blocks, out_blocks


def run_pipeline(p: PipelinePlan, body, in_refs, out_refs, init_carry, has_carry: bool):
    n_in, n_out = len(p.inputs), len(p.outputs)
    n = p.num_steps
    scratch = _slots(p, in_refs, out_refs)
    scratch += [plgpu.Barrier(num_barriers=op.num_slots) for op in p.inputs]
    check_smem_budget(p, scratch, "emit_pipeline")
    one_slot_outputs = any(op.num_slots == 1 and not op.invariant for op in p.outputs)

    def scoped(*args):
        in_bufs = args[:n_in]
        out_bufs = args[n_in : n_in + n_out]
        barriers = args[n_in + n_out :]
        gpu_tiles.note_untiled_slots(
            current_context("emit_pipeline"), p.inputs + p.outputs, (*in_refs, *out_refs), args
        )

        def fetcher(i, at):
            return lambda t, slot: _fetch(p, in_refs, in_bufs, barriers, i, t, at, slot)

        cursors0 = tuple(
            fetch.as_carry(fetch_prologue(p, op, fetcher(i, -1))) for i, op in enumerate(p.inputs)
        )

        def step(s, state):
            wb_counts, cursors, carry = state
            stepped = [fetch.begin_step(p, op, cur, s) for op, cur in zip(p.inputs, cursors)]
            for i, (op, (_, waits, slot)) in enumerate(zip(p.inputs, stepped)):

                def wait(i=i, op=op, slot=slot):
                    issued(actions.fetch_wait, op.name, slot=slot, step=s, at=s)
                    plgpu.barrier_wait(barriers[i].at[slot])

                when(waits, wait)
            in_blocks = [in_bufs[i].at[slot] for i, (_, _, slot) in enumerate(stepped)]
            out_blocks = [
                out_bufs[j].at[p.output_slot(op, wb_counts[j])] for j, op in enumerate(p.outputs)
            ]
            indices = p.grid_indices(s)
            carry = call_body(body, indices, (*in_blocks, *out_blocks), carry, has_carry)
            if n_out:
                plgpu.commit_smem()  # make the body's SMEM writes visible to the TMA engine
            new_counts = []
            for j, op in enumerate(p.outputs):
                w = wb_counts[j]
                wb = p.writes_back(op, s)

                @pl.when(wb)
                def _():
                    issued(actions.store, op.name, slot=p.output_slot(op, w), step=s, at=s)
                    plgpu.copy_smem_to_gmem(
                        out_bufs[j].at[p.output_slot(op, w)],
                        box_view(p, op, out_refs[j], s),
                        commit_group=False,
                    )

                new_counts.append(w + jnp.where(wb, 1, 0).astype(jnp.int32))
            if n_out:
                plgpu.commit_smem_to_gmem_group()
                # Two-slot outputs: the slot written next was stored a group ago, one group may stay
                # in flight. A one-slot output is written again next step: wait for every store.
                plgpu.wait_smem_to_gmem(0 if one_slot_outputs else 1, wait_read_only=True)
            cursors = tuple(
                fetch.as_carry(fetch_after_step(p, op, cur, s, fetcher(i, s)))
                for i, (op, (cur, _, _)) in enumerate(zip(p.inputs, stepped))
            )
            return tuple(new_counts), cursors, carry

        counts0 = tuple(jnp.int32(0) for _ in p.outputs)
        _, _, carry = lax.fori_loop(0, n, step, (counts0, cursors0, init_carry))
        if n_out:
            plgpu.wait_smem_to_gmem(0)
        return carry

    return pl.run_scoped(scoped, *scratch)


@dataclasses.dataclass(frozen=True)
class _WarpRefs:
    """A warp-specialized pipeline's global operands, its scoped SMEM slots and barriers, and the
    index of the thread running."""

    wp: WarpSpecializedPlan
    in_refs: tuple
    out_refs: tuple
    in_bufs: tuple
    out_bufs: tuple
    produced: tuple  # per input, one barrier per slot: its copy landed
    consumed: tuple  # one shared barrier per slot, or one per input with manual barriers
    out_ready: Any  # every compute thread wrote its part of the step's output blocks
    tid: Any

    @property
    def p(self) -> PipelinePlan:
        return self.wp.pipeline

    def cycling(self) -> list[int]:
        return [i for i, op in enumerate(self.p.inputs) if not op.invariant]

    def wait_before(self) -> dict:
        """The consumed barrier the memory thread waits on before refilling input i's slot, with its
        name in the plan's program: each input's own with manual barriers; otherwise one shared
        barrier, waited before the first (`WarpSpecializedPlan.consumed_barriers`)."""
        cycling = self.cycling()
        if self.wp.manual_consumed_barriers:
            return {i: (self.consumed[i], self.p.inputs[i].name) for i in cycling}
        return {cycling[0]: (self.consumed[0], "shared")} if cycling else {}


def warp_allocations(wp: WarpSpecializedPlan, in_refs, out_refs) -> dict[str, list]:
    """The shared memory a warp-specialized pipeline runs on, as `pl.run_scoped` takes it: its SMEM
    slots (inputs, then outputs), a produced barrier per input, the consumed barriers (one shared,
    or one per input with manual barriers) and the output barrier."""
    p = wp.pipeline
    single = [op.name for op in p.outputs if op.num_slots == 1 and not op.invariant]
    if single:
        raise NotImplementedError(
            f"emit_pipeline_warp_specialized: one-slot outputs ({', '.join(single)}: "
            "pl.Buffered(1)) are not supported on mosaic_gpu; the compute threads would write the "
            "slot while its store reads it. Leave the output at 2 slots"
        )
    cycling = any(not op.invariant for op in p.inputs)
    n_consumed = len(p.inputs) if wp.manual_consumed_barriers else int(cycling)
    allocations = {
        "slots": _slots(p, in_refs, out_refs),
        "produced": [plgpu.Barrier(num_barriers=op.num_slots) for op in p.inputs],
        "consumed": [
            plgpu.Barrier(num_arrivals=wp.num_compute_wgs, num_barriers=p.max_concurrent_steps)
            for _ in range(n_consumed)
        ],
        "out_ready": [plgpu.Barrier(num_arrivals=wp.num_compute_wgs, num_barriers=1)]
        if p.outputs
        else [],
    }
    check_smem_budget(
        p, [b for part in allocations.values() for b in part], "emit_pipeline_warp_specialized"
    )
    return allocations


def _fetch_round(r: _WarpRefs, t, at) -> None:
    """The memory thread's fetches of step t's blocks, each cycling one after waiting, when the plan
    says so, for the release of the slot it refills (`WarpSpecializedPlan.refill_waits`)."""
    p, wp = r.p, r.wp
    S = p.max_concurrent_steps
    wait_before = r.wait_before()
    for i, op in enumerate(p.inputs):
        if op.invariant:
            if isinstance(t, int) and t == 0:
                _fetch(p, r.in_refs, r.in_bufs, r.produced, i, 0, at, record=warp.produce)
            continue
        if i in wait_before:

            def wait(barrier=wait_before[i][0], name=wait_before[i][1]):
                issued(warp.consumed_wait, name, S, wp.num_compute_wgs, step=t - S, at=at)
                plgpu.barrier_wait(barrier.at[t % S])
                # Order the compute threads' reads of the slot (generic proxy) before the TMA
                # write into it (async proxy).
                plgpu.commit_smem()

            when(wp.refill_waits(t), wait)
        _fetch(p, r.in_refs, r.in_bufs, r.produced, i, t, at, record=warp.produce)


def _memory_thread(r: _WarpRefs) -> None:
    """The prologue fetches, then per step: wait for the refilled slot's release, fetch; then drain
    the arrivals nobody waited for, so every barrier ends at a phase boundary. In a chain of
    pipelines only the START fetches a prologue without waiting, and only the STOP drains."""
    p, wp = r.p, r.wp
    n, S = p.num_steps, p.max_concurrent_steps
    plgpu.set_max_registers(wp.memory_registers, action="decrease")
    for t in range(p.lookahead):
        when(p.before_end(t), lambda t=t: _fetch_round(r, t, -1))

    def step(s, _):
        t = p.fetch_at(s)
        when(t < n, lambda: _fetch_round(r, jnp.minimum(t, n - 1), s))

    lax.fori_loop(0, n, step, None)

    def drain_all():
        for b, name in r.wait_before().values():

            def drain(u, _=None, b=b, name=name):
                issued(warp.consumed_wait, name, S, wp.num_compute_wgs, step=u, at=n)
                plgpu.barrier_wait(b.at[u % S])

            if p.is_static:
                for u in range(max(0, n - S), n - p.delay_release):
                    drain(u)
            else:
                lax.fori_loop(jnp.maximum(0, n - S), n - p.delay_release, drain, None)

    when(wp.drains, drain_all)


def _store_outputs(r: _WarpRefs, s, wb_counts) -> tuple:
    """Step s's write-backs: every compute thread fences its SMEM writes and arrives at the output
    barrier; the leader waits for its earlier stores, then stores the blocks. New write-back
    counts."""
    p = r.p
    is_leader = r.tid == r.wp.leader
    wbs = [p.writes_back(op, s) for op in p.outputs]
    any_wb = functools.reduce(jnp.logical_or, wbs)

    @pl.when(any_wb)
    def _():
        plgpu.commit_smem()  # this thread's SMEM writes become visible to the TMA engine

        @pl.when(is_leader)
        def _():  # the slot the other threads write next was stored two write-backs ago
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        issued(warp.output_arrival, step=s, at=s)
        plgpu.barrier_arrive(r.out_ready.at[0])
        plgpu.barrier_wait(r.out_ready.at[0])

        @pl.when(is_leader)
        def _():
            for j, op in enumerate(p.outputs):

                @pl.when(wbs[j])
                def _():
                    slot = p.output_slot(op, wb_counts[j])
                    issued(actions.store, op.name, slot=slot, step=s, at=s)
                    plgpu.copy_smem_to_gmem(
                        r.out_bufs[j].at[p.output_slot(op, wb_counts[j])],
                        box_view(p, op, r.out_refs[j], s),
                        commit_group=False,
                    )

            plgpu.commit_smem_to_gmem_group()

    return tuple(w + jnp.where(wb, 1, 0).astype(jnp.int32) for w, wb in zip(wb_counts, wbs))


def _compute_steps(r: _WarpRefs, body, init, has_carry):
    """A compute thread's loop over the steps; a Ref carry (e.g. a wgmma accumulator) is passed to
    every step as it is instead of travelling through the loop."""
    p, wp = r.p, r.wp
    fixed = init if is_jax_ref(init) else None
    shared_release = bool(r.cycling()) and not wp.manual_consumed_barriers

    def step(s, state):
        wb_counts, carry = state
        carry = fixed if fixed is not None else carry
        in_blocks, out_blocks = _await_blocks(
            p, s, r.produced, r.in_bufs, r.out_bufs, wb_counts, wait=not wp.manual_produced_barriers
        )
        # Upstream's protocol: produced barriers of this step's slots (the body waits on them), then
        # consumed ones of the slot of step s - delay_release, whose arrival the body skips during
        # the first delay_release steps (see the public docstring).
        manual = (
            [r.produced[i].at[p.slot(op, s)] for i, op in enumerate(p.inputs)]
            if wp.manual_produced_barriers
            else []
        )
        manual += (
            [r.consumed[i].at[wp.released_slot(s)] for i in range(len(p.inputs))]
            if wp.manual_consumed_barriers
            else []
        )
        carry = call_body(
            body, p.grid_indices(s), (*in_blocks, *out_blocks, *manual), carry, has_carry
        )
        carry = None if fixed is not None else carry
        if shared_release:

            @pl.when(wp.releases_after(s))
            def _():
                slot, step = wp.released_slot(s), s - p.delay_release
                issued(warp.release, "shared", slot=slot, step=step, at=s)
                plgpu.barrier_arrive(r.consumed[0].at[wp.released_slot(s)])

        return (_store_outputs(r, s, wb_counts) if p.outputs else ()), carry

    counts0 = tuple(jnp.int32(0) for _ in p.outputs)
    _, final = lax.fori_loop(0, p.num_steps, step, (counts0, None if fixed is not None else init))
    if p.outputs:

        @pl.when(r.tid == wp.leader)
        def _():
            plgpu.wait_smem_to_gmem(0)

    return fixed if fixed is not None else final


def run_warp_specialized(
    wp: WarpSpecializedPlan,
    body,
    in_refs,
    out_refs,
    carry_coroutine,
    compute_context=None,
    allocations: dict | None = None,
):
    """The warp-specialized protocol of `conveyor.plans.warp` in Mosaic GPU primitives, on scoped
    shared memory or on the caller's `allocations` (from `warp_allocations`, e.g. shared by a chain
    of pipelines)."""
    p = wp.pipeline
    n_in = len(p.inputs)
    needed = warp_allocations(wp, in_refs, out_refs)

    def scoped(a):
        gpu_tiles.note_untiled_slots(
            current_context("emit_pipeline_warp_specialized"),
            p.inputs + p.outputs,
            (*in_refs, *out_refs),
            a["slots"],
        )
        r = _WarpRefs(
            wp,
            tuple(in_refs),
            tuple(out_refs),
            tuple(a["slots"][:n_in]),
            tuple(a["slots"][n_in:]),
            tuple(a["produced"]),
            tuple(a["consumed"]),
            a["out_ready"][0] if p.outputs else None,
            lax.axis_index(wp.wg_axis),
        )
        pl.when(r.tid == wp.memory_thread_idx)(lambda: _memory_thread(r))

        @pl.when(r.tid != wp.memory_thread_idx)
        def _compute_thread():
            plgpu.set_max_registers(wp.compute_registers, action="increase")
            if compute_context is not None:
                called = []

                def eval_pipeline(carry=None):
                    carry_lib.check_single_call(called)
                    called.append(True)
                    return _compute_steps(r, body, carry, carry is not None)

                compute_context(eval_pipeline)
                carry_lib.check_called(called)
                return
            gen, init = carry_lib.start(carry_coroutine)
            carry_lib.finish(gen, _compute_steps(r, body, init, gen is not None))

    if allocations is not None:
        check_allocations(wp.pipeline, needed, allocations, "chained pipelines")
        scoped(allocations)
        return
    pl.run_scoped(scoped, needed, collective_axes=wp.wg_axis)
