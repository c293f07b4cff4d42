"""Mosaic TPU lowering of a pipeline plan: VMEM slots, async DMAs and DMA semaphores.

Design notes: docs/internals/pipelines.md, section `pipeline/mosaic_tpu.py`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor.plans import pipeline_program as actions
from conveyor.pipeline.lowering import (
    block_in_bounds,
    block_view,
    call_body,
    check_allocations,
    fetch_after_step,
    fetch_prologue,
    first_block_view,
    issued,
    slot_view,
    when,
)
from conveyor.plans import fetch
from conveyor.pipeline.tpu_tiles import tpu_tile
from conveyor.plans.pipeline import OperandPlan, PipelinePlan


@dataclasses.dataclass(frozen=True)
class _Copies:
    """A pipeline's DMAs on TPU: its global operands, its VMEM slots and their semaphores. Blocks
    out of bounds are not copied: an input slot is zero-filled instead, an output block dropped.
    A partial block copies its part inside the array (an input slot is zero-filled first)."""

    p: PipelinePlan
    in_refs: tuple
    out_refs: tuple
    in_bufs: tuple
    out_bufs: tuple
    in_sems: Any  # [input, slot]
    out_sems: Any  # [output, slot]

    def _in_bounds(self, op: OperandPlan, ref, step):
        return block_in_bounds(self.p, op, step, ref.shape)

    def _window(self, op: OperandPlan, ref, step):
        """`op`'s window at `step`, a partial size in the two tiled dimensions marked a multiple
        of the (sublane, 128-lane) tile, as Mosaic needs to prove its copies tile-aligned (the
        array's extents there are multiples of the tile: `pipeline.api` checks it)."""
        window = list(self.p.window(op, step))
        for d in op.partial_dims:
            tile = tpu_tile(ref.dtype, d, len(ref.shape))
            start, size = window[d]
            if tile and not isinstance(size, int):
                window[d] = (start, pl.multiple_of(size, tile))
        return tuple(window)

    def start_fetch(self, i: int, step, slot, at) -> None:
        p, op = self.p, self.p.inputs[i]

        def copy():
            issued(actions.fetch, op.name, slot=slot, step=step, at=at)
            window = self._window(op, self.in_refs[i], step)
            if op.partial_dims:  # a partial block fills part of the slot: the rest reads zeros
                partial = [window[d][1] < op.block_dims[d] for d in op.partial_dims]
                when(functools.reduce(jnp.logical_or, partial), zero_fill)
            pltpu.make_async_copy(
                block_view(p, op, self.in_refs[i], step, window),
                slot_view(p, op, self.in_bufs[i].at[slot], step, window),
                self.in_sems.at[i, slot],
            ).start()

        def zero_fill():
            self.in_bufs[i].at[slot][...] = jnp.zeros(op.ref_shape, self.in_bufs[i].dtype)

        when(self._in_bounds(op, self.in_refs[i], step), copy, otherwise=zero_fill)

    def wait_fetch(self, i: int, step, slot) -> None:
        p, op = self.p, self.p.inputs[i]

        # a wait needs the size of its copy: step's window (every block's, unless bounded)
        def wait():
            issued(actions.fetch_wait, op.name, slot=slot, step=step, at=step)
            window = self._window(op, self.in_refs[i], step)
            src = (
                block_view(p, op, self.in_refs[i], step, window)
                if op.variable_dims
                else first_block_view(op, self.in_refs[i])
            )
            dst = slot_view(p, op, self.in_bufs[i].at[slot], step, window)
            pltpu.make_async_copy(src, dst, self.in_sems.at[i, slot]).wait()

        when(self._in_bounds(op, self.in_refs[i], step), wait)

    def output_in_bounds(self, j: int, step):
        return self._in_bounds(self.p.outputs[j], self.out_refs[j], step)

    def _writeback(self, j: int, slot, step):
        """The write-back DMA of output j's `slot` to its block at `step` (for a wait, only its
        size matters: any block's, unless the window is bounded)."""
        p, op = self.p, self.p.outputs[j]
        window = self._window(op, self.out_refs[j], step)
        return pltpu.make_async_copy(
            slot_view(p, op, self.out_bufs[j].at[slot], step, window),
            block_view(p, op, self.out_refs[j], step, window),
            self.out_sems.at[j, slot],
        )

    def start_writeback(self, j: int, slot, step) -> None:
        issued(actions.store, self.p.outputs[j].name, slot=slot, step=step, at=step)
        self._writeback(j, slot, step).start()

    def wait_writeback(self, j: int, slot, at, step) -> None:
        """Wait for output j's write-back of `slot`, issued at `step`."""
        op = self.p.outputs[j]
        issued(actions.store_wait, op.name, slot=slot, at=at)
        if op.variable_dims:
            self._writeback(j, slot, step).wait()
        else:
            pltpu.make_async_copy(
                self.out_bufs[j].at[slot],
                first_block_view(op, self.out_refs[j]),
                self.out_sems.at[j, slot],
            ).wait()


def _write_back(c: _Copies, s, wb_counts, started, last_steps) -> tuple[tuple, tuple, tuple]:
    """Step s's write-backs, and the wait for each output's other slot: new write-back counts, per
    output whether its last write-back was started (an out-of-bounds block is not), and the step of
    its last write-back (what a wait for it describes)."""
    new_counts, new_started, new_steps = [], [], []
    for j, op in enumerate(c.p.outputs):
        w, slot = wb_counts[j], c.p.output_slot(op, wb_counts[j])
        wb = jnp.asarray(c.p.writes_back(op, s))
        inside = jnp.logical_and(wb, c.output_in_bounds(j, s))
        when(inside, lambda j=j, slot=slot: c.start_writeback(j, slot, s))
        if op.num_slots == 1:
            # the body writes this same slot next: wait for the write-back at once
            when(inside, lambda j=j, slot=slot: c.wait_writeback(j, slot, s, s))
            new_started.append(started[j])  # nothing left in flight for the epilogue
        else:
            # the slot used next was last written back by write-back w - 1: wait for it, if it ran
            when(
                jnp.logical_and(wb, jnp.logical_and(w >= 1, started[j])),
                lambda j=j, slot=slot: c.wait_writeback(j, 1 - slot, s, last_steps[j]),
            )
            new_started.append(jnp.where(wb, inside, started[j]))
        new_counts.append(w + wb.astype(jnp.int32))
        new_steps.append(jnp.where(wb, jnp.asarray(s, jnp.int32), last_steps[j]))
    return tuple(new_counts), tuple(new_started), tuple(new_steps)


def allocations(p: PipelinePlan, in_refs, out_refs) -> dict[str, list]:
    """The VMEM a pipeline runs on, as `pl.run_scoped` takes it: its slots (inputs, then outputs)
    and its DMA semaphores, one per input slot and one per output slot."""
    transformed = [op.name for op in p.inputs + p.outputs if op.transforms]
    if transformed:
        raise NotImplementedError(
            f"emit_pipeline on mosaic_tpu: block transforms ({', '.join(transformed)}) are Mosaic "
            "GPU shared-memory layouts; TPU VMEM blocks have their own tiling. Drop them for TPU"
        )
    in_slots = max([op.num_slots for op in p.inputs], default=1)
    return {
        "slots": [
            pltpu.VMEM((op.num_slots, *op.ref_shape), r.dtype)
            for op, r in zip(p.inputs + p.outputs, (*in_refs, *out_refs))
        ],
        "semaphores": [
            pltpu.SemaphoreType.DMA((max(len(p.inputs), 1), in_slots)),
            pltpu.SemaphoreType.DMA((max(len(p.outputs), 1), 2)),
        ],
    }


def _copies(p: PipelinePlan, in_refs, out_refs, a: dict) -> _Copies:
    n_in = len(p.inputs)
    return _Copies(
        p,
        tuple(in_refs),
        tuple(out_refs),
        tuple(a["slots"][:n_in]),
        tuple(a["slots"][n_in:]),
        *a["semaphores"],
    )


def _fetcher(c: _Copies, i: int, at):
    return lambda t, slot: c.start_fetch(i, t, slot, at)


def prefetch(p: PipelinePlan, in_refs, out_refs, given: dict) -> None:
    """Issue the pipeline's prologue fetches into caller-owned allocations, without waiting: the
    pipeline run later on them with `prefetched=True` waits for these copies instead."""
    check_allocations(p, allocations(p, in_refs, out_refs), given, "a prefetch and its pipeline")
    c = _copies(p, in_refs, out_refs, given)
    for i, op in enumerate(p.inputs):
        fetch_prologue(p, op, _fetcher(c, i, -1))


def run_pipeline(
    p: PipelinePlan,
    body,
    in_refs,
    out_refs,
    init_carry,
    has_carry: bool,
    given: dict | None = None,
    prefetched: bool = False,
):
    """The plan's schedule in Mosaic TPU DMAs: prologue fetches (unless `prefetch` issued them),
    then per step: wait for the inputs, run the body, write back, fetch ahead; then wait for the
    last write-backs. On its own scoped VMEM, or on the caller's `given` allocations."""
    n = p.num_steps
    needed = allocations(p, in_refs, out_refs)
    assert not (p.prefetched_inputs and given is None)  # refused by the API

    def scoped(a):
        c = _copies(p, in_refs, out_refs, a)

        def prologue(i, op):
            # After a prefetch the copies are in flight: only the cursor is computed here.
            return fetch_prologue(
                p, op, (lambda t, slot: None) if prefetched else _fetcher(c, i, -1)
            )

        cursors0 = tuple(fetch.as_carry(prologue(i, op)) for i, op in enumerate(p.inputs))

        def step(s, state):
            wb_counts, started, last_steps, cursors, carry = state
            stepped = [fetch.begin_step(p, op, cur, s) for op, cur in zip(p.inputs, cursors)]
            for i, (_, waits, slot) in enumerate(stepped):
                when(waits, lambda i=i, slot=slot: c.wait_fetch(i, s, slot))
            in_blocks = [c.in_bufs[i].at[slot] for i, (_, _, slot) in enumerate(stepped)]
            out_blocks = [
                c.out_bufs[j].at[p.output_slot(op, wb_counts[j])] for j, op in enumerate(p.outputs)
            ]
            carry = call_body(body, p.grid_indices(s), (*in_blocks, *out_blocks), carry, has_carry)
            wb_counts, started, last_steps = _write_back(c, s, wb_counts, started, last_steps)
            cursors = tuple(
                fetch.as_carry(fetch_after_step(p, op, cur, s, _fetcher(c, i, s)))
                for i, (op, (cur, _, _)) in enumerate(zip(p.inputs, stepped))
            )
            return wb_counts, started, last_steps, cursors, carry

        counts0 = tuple(jnp.int32(0) for _ in p.outputs)
        started0 = tuple(jnp.bool_(False) for _ in p.outputs)
        counts, started, last_steps, _, carry = lax.fori_loop(
            0, n, step, (counts0, started0, counts0, cursors0, init_carry)
        )
        for j, op in enumerate(p.outputs):  # epilogue: the last write-back may still be in flight
            when(
                started[j],
                lambda j=j, op=op: c.wait_writeback(
                    j, p.output_slot(op, counts[j] - 1), n, last_steps[j]
                ),
            )
        return carry

    if given is not None:
        check_allocations(p, needed, given, "pipelines sharing allocations")
        return scoped(given)
    return pl.run_scoped(scoped, needed)
