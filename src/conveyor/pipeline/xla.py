"""XLA executor of a pipeline plan: the plan's rules with ordinary slicing in a compiled loop.

Inputs are read block by block from the global refs; outputs stay resident as loop-carried values
while their block index does not change, and are written to the global ref when the plan says so.
There is no real asynchrony on this backend (XLA:CPU runs ops in order): the plan's slots and
fetch-ahead only matter to the Mosaic lowerings, the checker and the simulator, while the values a
body sees are exactly those of the schedule.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from conveyor._compat import call_as_thread, run_state
from conveyor.kernel import poison
from conveyor.pipeline import carry as carry_lib
from conveyor.pipeline.plan import OperandPlan, PipelinePlan
from conveyor.sync import TraceTimeBarrier


def _index(p: PipelinePlan, op: OperandPlan, step):
    return tuple(pl.ds(off, size) for off, size in zip(p.offsets(op, step), op.block_dims))


def _read_block(p, op, gref, step):
    return gref[_index(p, op, step)].reshape(op.ref_shape)


def run_pipeline(p: PipelinePlan, body, in_refs, out_refs, init_carry, has_carry: bool):
    """Run `body(indices, *in_block_refs, *out_block_refs[, carry])` over the plan's steps."""
    out_dtypes = [r.dtype for r in out_refs]

    def step(s, state):
        resident, carry = state
        blocks = [_read_block(p, op, ref, s) for op, ref in zip(p.inputs, in_refs)]
        indices = p.grid_indices(s)
        carry_leaves, carry_tree = jax.tree_util.tree_flatten(carry)
        n_blocks = len(blocks) + len(resident)

        def stateful(refs):
            block_refs, carry_refs = refs[:n_blocks], refs[n_blocks:]
            if has_carry:
                current = jax.tree_util.tree_unflatten(carry_tree, [r[...] for r in carry_refs])
                new = body(indices, *block_refs, current)
                new_leaves, new_tree = jax.tree_util.tree_flatten(new)
                if new_tree != carry_tree:
                    raise TypeError(f"pipeline body must return a carry with the structure of init_carry "
                                    f"({carry_tree}), got {new_tree}")
                for r, v in zip(carry_refs, new_leaves):
                    r[...] = jnp.asarray(v, r.dtype)
            elif body(indices, *block_refs) is not None:
                raise TypeError("pipeline body returned a value but no init_carry was given")

        final = run_state(stateful)((*blocks, *resident, *carry_leaves))
        new_carry = jax.tree_util.tree_unflatten(carry_tree, list(final[n_blocks:]))
        outs = list(final[len(blocks):n_blocks])
        next_resident = []
        for op, ref, val, dt in zip(p.outputs, out_refs, outs, out_dtypes):
            wb = p.writes_back(op, s)
            idx = _index(p, op, s)
            shaped = val.reshape(op.block_dims)
            ref[idx] = jnp.where(wb, shaped, ref[idx])
            # After a write-back the block moves to a fresh (uninitialized) slot.
            next_resident.append(jnp.where(wb, poison(op.ref_shape, dt), val))
        return tuple(next_resident), new_carry

    resident0 = tuple(poison(op.ref_shape, r.dtype) for op, r in zip(p.outputs, out_refs))
    init_carry = jax.tree_util.tree_map(jnp.asarray, init_carry)
    _, carry = lax.fori_loop(0, p.num_steps, step, (resident0, init_carry))
    return carry if has_carry else None


def run_warp_specialized(wp, body, in_refs, out_refs, carry_coroutine, thread_index: int):
    """The warp-specialized pipeline on xla.

    `cv.kernel` traces its threads one after the other; the pipeline runs once, in the leader's
    trace, and at every step runs the body for each compute thread in turn on the same blocks
    (each traced with its own `lax.axis_index(wg_axis)`), so compute threads share output blocks
    exactly as on GPU. The memory thread has nothing to do: reads are synchronous here.
    """
    if thread_index != wp.leader:
        return None
    p = wp.pipeline
    threads = wp.compute_threads

    def as_thread(c, fn):
        return call_as_thread(fn, wp.wg_axis, wp.num_threads, c)

    gens, inits = [], []
    for c in threads:
        gen, init = carry_lib.start(carry_coroutine, lambda fn, c=c: as_thread(c, fn))
        gens.append(gen)
        inits.append(init)
    has_carry = carry_coroutine is not None
    n_blocks = len(p.inputs) + len(p.outputs)

    def every_thread(indices, *args):
        blocks, carries = args[:n_blocks], (args[n_blocks] if has_carry else [None] * len(threads))
        new = []
        for c, carry in zip(threads, carries):
            barriers = [TraceTimeBarrier(op.name) for op in p.inputs] if wp.manual_consumed_barriers else []
            extra = (carry,) if has_carry else ()
            new.append(as_thread(c, lambda: body(indices, *blocks, *barriers, *extra)))
            for b in barriers:
                if b.arrivals == 0:
                    raise ValueError(f"manual_consumed_barriers=True but the body never arrives on the consumed "
                                     f"barrier of {b.name} (call cv.barrier_arrive on it): the memory thread would "
                                     f"wait forever before refilling that slot")
            if not has_carry and new[-1] is not None:
                raise TypeError("pipeline body returned a value but no carry_coroutine was given")
        return tuple(new) if has_carry else None

    finals = run_pipeline(p, every_thread, in_refs, out_refs, tuple(inits) if has_carry else None, has_carry)
    for c, gen, final in zip(threads, gens, finals if has_carry else [None] * len(threads)):
        carry_lib.finish(gen, final, lambda fn, c=c: as_thread(c, fn))
