"""Mosaic GPU lowering of a pipeline plan: SMEM slots filled by TMA copies, tracked by mbarriers.

Inputs: one SMEM buffer of `num_slots` blocks and one barrier per slot; the prologue issues the
first `lookahead` copies, step s waits on its slot's barrier, runs the body, then issues the copy
for step s + lookahead into the slot step s - delay_release used. Outputs: two SMEM slots; at a
write-back the block is fenced (`commit_smem`) and stored by TMA. Stores of one step form one bulk
group; after committing it we wait until at most that group is in flight, so the slot the next
step writes (last stored two write-backs ago, at an earlier step) is free again.
The interpreter does not support predicated SMEM->GMEM copies (shared FACTS), so write-backs are
branches (`pl.when`) around unpredicated copies.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from conveyor.pipeline.lowering import block_view, call_body
from conveyor.pipeline.plan import PipelinePlan


def run_pipeline(p: PipelinePlan, body, in_refs, out_refs, init_carry, has_carry: bool):
    n_in, n_out = len(p.inputs), len(p.outputs)
    n = p.num_steps
    scratch = [plgpu.SMEM((op.num_slots, *op.ref_shape), r.dtype) for op, r in zip(p.inputs, in_refs)]
    scratch += [plgpu.SMEM((op.num_slots, *op.ref_shape), r.dtype) for op, r in zip(p.outputs, out_refs)]
    scratch += [plgpu.Barrier(num_barriers=op.num_slots) for op in p.inputs]

    def scoped(*args):
        in_bufs = args[:n_in]
        out_bufs = args[n_in:n_in + n_out]
        barriers = args[n_in + n_out:]

        def fetch(i, step):
            op = p.inputs[i]
            slot = p.slot(op, step)
            plgpu.copy_gmem_to_smem(block_view(p, op, in_refs[i], step), in_bufs[i].at[slot], barriers[i].at[slot])

        for i, op in enumerate(p.inputs):
            for t in p.prologue_steps(op):
                fetch(i, t)

        def step(s, state):
            wb_counts, carry = state
            for i, op in enumerate(p.inputs):
                if op.invariant:
                    @pl.when(s == 0)
                    def _():
                        plgpu.barrier_wait(barriers[i].at[0])
                else:
                    plgpu.barrier_wait(barriers[i].at[p.slot(op, s)])
            in_blocks = [in_bufs[i].at[p.slot(op, s)] for i, op in enumerate(p.inputs)]
            out_blocks = [out_bufs[j].at[p.output_slot(op, wb_counts[j])] for j, op in enumerate(p.outputs)]
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
                    plgpu.copy_smem_to_gmem(out_bufs[j].at[p.output_slot(op, w)], block_view(p, op, out_refs[j], s),
                                            commit_group=False)

                new_counts.append(w + jnp.where(wb, 1, 0).astype(jnp.int32))
            if n_out:
                plgpu.commit_smem_to_gmem_group()
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            t = p.fetch_at(s)

            @pl.when(t < n)
            def _():
                for i, op in enumerate(p.inputs):
                    if not op.invariant:
                        fetch(i, jnp.minimum(t, n - 1))

            return tuple(new_counts), carry

        counts0 = tuple(jnp.int32(0) for _ in p.outputs)
        _, carry = lax.fori_loop(0, n, step, (counts0, init_carry))
        if n_out:
            plgpu.wait_smem_to_gmem(0)
        return carry

    return pl.run_scoped(scoped, *scratch)
