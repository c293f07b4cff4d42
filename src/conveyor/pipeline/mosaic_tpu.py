"""Mosaic TPU lowering of a pipeline plan: VMEM slots, async DMAs and DMA semaphores.

Follows the plan's schedule literally: a prologue fetches the first `lookahead` steps; at step s
the kernel waits for step s's blocks, runs the body on slot s % S, then issues the fetch for step
s + lookahead into the slot step s - delay_release used (issued after the body, so delay_release=0
is safe too). Outputs live in two VMEM slots: a write-back starts when the plan says so, and
before the body writes into the other slot the write-back that last used it is awaited.
Out-of-bounds blocks (`conveyor.pipeline.lowering`): their DMAs are predicated off; an input slot
is zero-filled instead, and nobody waits for a copy that was never started.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor.pipeline.lowering import block_in_bounds, block_view, call_body, first_block_view, issued, when
from conveyor.plans.pipeline import PipelinePlan


def run_pipeline(p: PipelinePlan, body, in_refs, out_refs, init_carry, has_carry: bool):
    transformed = [op.name for op in p.inputs + p.outputs if op.transforms]
    if transformed:
        raise NotImplementedError(f"emit_pipeline on mosaic_tpu: block transforms ({', '.join(transformed)}) are Mosaic "
                                  f"GPU shared-memory layouts; TPU VMEM blocks have their own tiling. Drop them for TPU")
    n_in, n_out = len(p.inputs), len(p.outputs)
    in_slots = max([op.num_slots for op in p.inputs], default=1)
    scratch = [pltpu.VMEM((op.num_slots, *op.ref_shape), r.dtype) for op, r in zip(p.inputs, in_refs)]
    scratch += [pltpu.VMEM((op.num_slots, *op.ref_shape), r.dtype) for op, r in zip(p.outputs, out_refs)]
    scratch += [pltpu.SemaphoreType.DMA((max(n_in, 1), in_slots)), pltpu.SemaphoreType.DMA((max(n_out, 1), 2))]
    n = p.num_steps

    def scoped(*args):
        in_bufs, out_bufs = args[:n_in], args[n_in:n_in + n_out]
        in_sems, out_sems = args[n_in + n_out:]

        def in_bounds(ops, refs, k, step):
            return block_in_bounds(p, ops[k], step, refs[k].shape)

        def start_fetch(i, step, at):
            op, slot = p.inputs[i], p.slot(p.inputs[i], step)

            def copy():
                issued(at, "fetch", op, slot, step)
                pltpu.make_async_copy(block_view(p, op, in_refs[i], step), in_bufs[i].at[slot],
                                      in_sems.at[i, slot]).start()

            def zero_fill():
                in_bufs[i].at[slot][...] = jnp.zeros(op.ref_shape, in_bufs[i].dtype)
            when(in_bounds(p.inputs, in_refs, i, step), copy, otherwise=zero_fill)

        def wait_fetch(i, step):
            op, slot = p.inputs[i], p.slot(p.inputs[i], step)

            def wait():
                issued(step, "wait_fetch", op, slot, step)
                pltpu.make_async_copy(first_block_view(op, in_refs[i]), in_bufs[i].at[slot], in_sems.at[i, slot]).wait()
            when(in_bounds(p.inputs, in_refs, i, step), wait)

        def writeback(j, slot, step=None):
            """The write-back DMA of output j's `slot` to its block at `step` (None: a descriptor to wait on)."""
            op = p.outputs[j]
            dst = first_block_view(op, out_refs[j]) if step is None else block_view(p, op, out_refs[j], step)
            return pltpu.make_async_copy(out_bufs[j].at[slot], dst, out_sems.at[j, slot])

        def start_writeback(j, slot, step):
            issued(step, "writeback", p.outputs[j], slot, step)
            writeback(j, slot, step).start()

        def wait_writeback(j, slot, at):
            issued(at, "wait_writeback", p.outputs[j], slot)
            writeback(j, slot).wait()

        for i, op in enumerate(p.inputs):  # prologue (a dynamic grid may have fewer steps)
            for t in p.prologue_steps(op):
                when(p.before_end(t), lambda i=i, t=t: start_fetch(i, t, -1))

        def step(s, state):
            wb_counts, started, carry = state
            for i, op in enumerate(p.inputs):
                if op.invariant:
                    when(s == 0, lambda i=i: wait_fetch(i, 0))
                else:
                    wait_fetch(i, s)
            in_blocks = [in_bufs[i].at[p.slot(op, s)] for i, op in enumerate(p.inputs)]
            out_blocks = [out_bufs[j].at[p.output_slot(op, wb_counts[j])] for j, op in enumerate(p.outputs)]
            carry = call_body(body, p.grid_indices(s), (*in_blocks, *out_blocks), carry, has_carry)
            new_counts, new_started = [], []
            for j, op in enumerate(p.outputs):
                w, slot = wb_counts[j], p.output_slot(op, wb_counts[j])
                wb = jnp.asarray(p.writes_back(op, s))
                inside = jnp.logical_and(wb, in_bounds(p.outputs, out_refs, j, s))
                when(inside, lambda j=j, slot=slot: start_writeback(j, slot, s))
                if op.num_slots == 1:
                    # the body writes this same slot next: wait for the write-back at once
                    when(inside, lambda j=j, slot=slot: wait_writeback(j, slot, s))
                    new_started.append(started[j])  # nothing left in flight for the epilogue
                else:
                    # the slot used next was last written back by write-back w - 1: wait for it, if it ran
                    when(jnp.logical_and(wb, jnp.logical_and(w >= 1, started[j])),
                         lambda j=j, slot=slot: wait_writeback(j, 1 - slot, s))
                    new_started.append(jnp.where(wb, inside, started[j]))
                new_counts.append(w + wb.astype(jnp.int32))
            for i, op in enumerate(p.inputs):  # each input fetches its own lookahead ahead
                if not op.invariant:
                    t = p.fetch_step(op, s)
                    when(t < n, lambda i=i, t=t: start_fetch(i, jnp.minimum(t, n - 1), s))
            return tuple(new_counts), tuple(new_started), carry

        counts0 = tuple(jnp.int32(0) for _ in p.outputs)
        started0 = tuple(jnp.bool_(False) for _ in p.outputs)
        counts, started, carry = lax.fori_loop(0, n, step, (counts0, started0, init_carry))
        for j, op in enumerate(p.outputs):  # epilogue: the last write-back may still be in flight
            when(started[j], lambda j=j, op=op: wait_writeback(j, p.output_slot(op, counts[j] - 1), n))
        return carry

    return pl.run_scoped(scoped, *scratch)
