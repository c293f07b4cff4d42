"""Mosaic TPU lowering of a pipeline plan: VMEM slots, async DMAs and DMA semaphores.

Follows the plan's schedule literally: a prologue fetches the first `lookahead` steps; at step s
the kernel waits for step s's blocks, runs the body on slot s % S, then issues the fetch for step
s + lookahead into the slot step s - delay_release used (issued after the body, so delay_release=0
is safe too). Outputs live in two VMEM slots: a write-back starts when the plan says so, and
before the body writes into the other slot the write-back that last used it is awaited.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor.pipeline.lowering import block_view, call_body
from conveyor.pipeline.plan import PipelinePlan


def run_pipeline(p: PipelinePlan, body, in_refs, out_refs, init_carry, has_carry: bool):
    n_in, n_out = len(p.inputs), len(p.outputs)
    in_slots = max([op.num_slots for op in p.inputs], default=1)
    scratch = [pltpu.VMEM((op.num_slots, *op.ref_shape), r.dtype) for op, r in zip(p.inputs, in_refs)]
    scratch += [pltpu.VMEM((op.num_slots, *op.ref_shape), r.dtype) for op, r in zip(p.outputs, out_refs)]
    scratch += [pltpu.SemaphoreType.DMA((max(n_in, 1), in_slots)), pltpu.SemaphoreType.DMA((max(n_out, 1), 2))]
    n = p.num_steps

    def scoped(*args):
        in_bufs, out_bufs = args[:n_in], args[n_in:n_in + n_out]
        in_sems, out_sems = args[n_in + n_out:]

        def fetch(i, step):
            op = p.inputs[i]
            slot = p.slot(op, step)
            return pltpu.make_async_copy(block_view(p, op, in_refs[i], step), in_bufs[i].at[slot], in_sems.at[i, slot])

        def writeback(j, step, slot):
            op = p.outputs[j]
            return pltpu.make_async_copy(out_bufs[j].at[slot], block_view(p, op, out_refs[j], step), out_sems.at[j, slot])

        # prologue
        for i, op in enumerate(p.inputs):
            for t in p.prologue_steps(op):
                fetch(i, t).start()

        def step(s, state):
            wb_counts, carry = state
            for i, op in enumerate(p.inputs):
                if op.invariant:
                    @pl.when(s == 0)
                    def _():
                        fetch(i, 0).wait()
                else:
                    fetch(i, s).wait()
            in_blocks = [in_bufs[i].at[p.slot(op, s)] for i, op in enumerate(p.inputs)]
            out_blocks = [out_bufs[j].at[p.output_slot(op, wb_counts[j])] for j, op in enumerate(p.outputs)]
            indices = p.grid_indices(s)
            carry = call_body(body, indices, (*in_blocks, *out_blocks), carry, has_carry)
            new_counts = []
            for j, op in enumerate(p.outputs):
                w = wb_counts[j]
                slot = p.output_slot(op, w)

                @pl.when(p.writes_back(op, s))
                def _():
                    writeback(j, s, slot).start()
                    if op.num_slots > 1:
                        # the slot used next was last written back by write-back w - 1: wait for it
                        @pl.when(w >= 1)
                        def _():
                            writeback(j, s, 1 - slot).wait()

                new_counts.append(w + jnp.where(p.writes_back(op, s), 1, 0).astype(jnp.int32))
            t = p.fetch_at(s)

            @pl.when(t < n)
            def _():
                for i, op in enumerate(p.inputs):
                    if not op.invariant:
                        fetch(i, jnp.minimum(t, n - 1)).start()

            return tuple(new_counts), carry

        counts0 = tuple(jnp.int32(0) for _ in p.outputs)
        counts, carry = lax.fori_loop(0, n, step, (counts0, init_carry))
        # epilogue: the last write-back of every output is still in flight
        for j, op in enumerate(p.outputs):
            writeback(j, n - 1, p.output_slot(op, counts[j] - 1)).wait()
        return carry

    return pl.run_scoped(scoped, *scratch)
