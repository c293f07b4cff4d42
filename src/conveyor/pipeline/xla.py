"""XLA executor of a pipeline plan: the plan's rules with ordinary slicing in a compiled loop.

Design notes: docs/internals/pipelines.md, section `pipeline/xla.py`.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from conveyor.jaxprs import call_as_thread, is_jax_ref
from conveyor.kernel import current_context, poison
from conveyor.pipeline import carry as carry_lib
from conveyor.pipeline.lowering import (
    block_in_bounds,
    call_body,
    fetch_after_step,
    fetch_prologue,
    under_vmap,
    when,
)
from conveyor.plans import fetch
from conveyor.plans.pipeline import OperandPlan, PipelinePlan
from conveyor.sync import TraceTimeBarrier


def _clamped_index(p: PipelinePlan, op: OperandPlan, step, shape):
    """Slices of `op`'s block at `step`, clamped into the array (the caller masks out-of-bounds),
    each at most the array's extent. A window that varies (`OperandPlan.variable_dims`) reads a
    whole block's worth around it (`_shifts` aligns it)."""
    return tuple(
        pl.ds(jnp.clip(off, 0, extent - min(size, extent)), min(size, extent))
        for off, size, extent in zip(p.offsets(op, step), op.block_dims, shape)
    )


def _shifts(p: PipelinePlan, op: OperandPlan, step, shape):
    """Per variable dimension (bounded or partial): (dimension, how far the window starts past
    the clamped read `_clamped_index` makes, the window's size)."""
    window = p.window(op, step)
    return [
        (d, window[d][0] - jnp.clip(window[d][0], 0, shape[d] - min(block, shape[d])), window[d][1])
        for d, block in ((d, op.block_dims[d]) for d in op.variable_dims)
    ]


def _in_window(dims: tuple[int, ...], d: int, start, size):
    """A mask over a block of `dims`: True where dimension d's index is in [start, start + size)."""
    i = lax.broadcasted_iota(jnp.int32, dims, d)
    return jnp.logical_and(i >= start, i < start + size)


def read_block(p: PipelinePlan, op: OperandPlan, gref, step):
    """`op`'s block at `step` as a value of the body's block shape (zeros when out of bounds). A
    bounded window fills the start of its dimension, the rest of the slot is poison; a partial
    block's part past the array reads as zeros."""
    idx = _clamped_index(p, op, step, gref.shape)
    block = gref[idx]
    short = [(0, b - r) for b, r in zip(op.block_dims, block.shape)]
    if any(pad for _, pad in short):  # a block larger than the array: read it all, pad
        block = jnp.pad(block, short)
    for d, shift, size in _shifts(p, op, step, gref.shape):
        block = jnp.roll(block, -shift, axis=d)
        fill = poison if d in op.bounded_dims else (lambda s, t: jnp.zeros(s, t))
        block = jnp.where(
            _in_window(block.shape, d, 0, size), block, fill(block.shape, block.dtype)
        )
    block = block.reshape(op.ref_shape)
    return jnp.where(block_in_bounds(p, op, step, gref.shape), block, jnp.zeros_like(block))


def _load(p: PipelinePlan, op: OperandPlan, gref, buf, step):
    buf[...] = read_block(p, op, gref, step)


def store_block(p: PipelinePlan, op: OperandPlan, gref, value, step, when):
    """Write `value` (a block) to `op`'s block at `step` where `when` holds and the block is in
    bounds; of a bounded window or a partial block, only its part inside the window."""
    idx = _clamped_index(p, op, step, gref.shape)
    write = jnp.logical_and(when, block_in_bounds(p, op, step, gref.shape))
    block = value.reshape(op.block_dims)
    for d, shift, size in _shifts(p, op, step, gref.shape):
        block = jnp.roll(block, shift, axis=d)
        write = jnp.logical_and(write, _in_window(block.shape, d, shift, size))
    inside = tuple(slice(0, r.size) for r in idx)  # a block larger than the array: its start
    block = block[inside]
    write = jnp.broadcast_to(write, op.block_dims)[inside]
    gref[idx] = jnp.where(write, block, gref[idx])


def run_pipeline(p: PipelinePlan, body, in_refs, out_refs, init_carry, has_carry: bool):
    """Run `body(indices, *in_block_refs, *out_block_refs[, carry])` over the plan's steps."""
    p = p.fetching_every_block()
    if current_context("emit_pipeline").checked:
        if under_vmap((in_refs, out_refs)):
            raise NotImplementedError(
                "emit_pipeline under jax.vmap in the checked executor (cv.pipeline."
                "checked_schedule): its predicated slot copies are lax.conds with state effects, "
                "which jax.vmap does not batch; the default xla executor runs it"
            )
        return _run_checked(p, body, in_refs, out_refs, init_carry, has_carry)
    n_in = len(p.inputs)
    # Fresh refs (not pl.run_scoped, whose XLA lowering fails when the body is itself inside a
    # user's run_scoped and touches that buffer).
    bufs = [
        jax.new_ref(poison(op.ref_shape, r.dtype))
        for op, r in zip(p.inputs + p.outputs, (*in_refs, *out_refs))
    ]
    in_bufs, out_bufs = bufs[:n_in], bufs[n_in:]

    def step(s, carry):
        for op, gref, buf in zip(p.inputs, in_refs, in_bufs):
            when(
                fetch.changes_at(p, op, s),
                lambda op=op, gref=gref, buf=buf: _load(p, op, gref, buf, s),
            )
        carry = call_body(body, p.grid_indices(s), (*in_bufs, *out_bufs), carry, has_carry)
        for op, gref, buf in zip(p.outputs, out_refs, out_bufs):
            written = p.writes_back(op, s)
            store_block(p, op, gref, buf[...], s, written)
            # After a write-back the block moves to a fresh (uninitialized) slot.
            buf[...] = jnp.where(written, poison(buf.shape, buf.dtype), buf[...])
        return carry

    carry = lax.fori_loop(0, p.num_steps, step, init_carry)
    return carry if has_carry else None


def _run_checked(p: PipelinePlan, body, in_refs, out_refs, init_carry, has_carry: bool):
    """`run_pipeline` in the checked mode: the plan's slots as buffers, filled and poisoned on its
    schedule."""
    in_slots = [
        jax.new_ref(poison((op.num_slots, *op.ref_shape), r.dtype))
        for op, r in zip(p.inputs, in_refs)
    ]
    out_slots = [
        jax.new_ref(poison((op.num_slots, *op.ref_shape), r.dtype))
        for op, r in zip(p.outputs, out_refs)
    ]
    views = [
        jax.new_ref(poison(op.ref_shape, r.dtype))
        for op, r in zip(p.inputs + p.outputs, (*in_refs, *out_refs))
    ]

    def fetcher(op, gref, slots):
        def fill(t, slot):
            slots[slot] = read_block(p, op, gref, t)

        return fill

    cursors0 = tuple(
        fetch.as_carry(fetch_prologue(p, op, fetcher(op, gref, slots)))
        for op, gref, slots in zip(p.inputs, in_refs, in_slots)
    )
    d = p.delay_release

    def step(s, state):
        counts, cursors, recent, carry = state
        out_at = [p.output_slot(op, c) for op, c in zip(p.outputs, counts)]
        stepped = [fetch.begin_step(p, op, cur, s) for op, cur in zip(p.inputs, cursors)]
        for (_, _, slot), slots, view in zip(stepped, in_slots, views):
            view[...] = slots[slot]
        for slots, at, view in zip(out_slots, out_at, views[len(p.inputs) :]):
            view[...] = slots[at]
        carry = call_body(body, p.grid_indices(s), views, carry, has_carry)
        for (_, _, slot), slots, view in zip(stepped, in_slots, views):
            slots[slot] = view[...]  # the body works on the slot itself on the other backends
        new_counts = []
        for op, gref, slots, at, view, c in zip(
            p.outputs, out_refs, out_slots, out_at, views[len(p.inputs) :], counts
        ):
            written = p.writes_back(op, s)
            store_block(p, op, gref, view[...], s, written)
            # A written-back slot is free: poisoned, it holds nothing a later step may rely on.
            slots[at] = jnp.where(written, poison(view.shape, view.dtype), view[...])
            new_counts.append(c + jnp.where(written, 1, 0).astype(jnp.int32))
        new_cursors, new_recent = [], []
        for op, gref, slots, (cur, _, slot), held in zip(
            p.inputs, in_refs, in_slots, stepped, recent
        ):
            # `held`: the slots of steps s - d .. s - 1. Step r = s - d is done with its block when
            # the block changes after it (or r is the last step): poison that slot, then refill.
            held = (*held, slot)
            if not op.invariant:
                r = s - d
                done = jnp.logical_and(
                    r >= 0,
                    jnp.logical_or(r == p.num_steps - 1, p.block_changes(op, jnp.maximum(r, 0))),
                )
                when(
                    done,
                    lambda op=op, slots=slots, at=held[0]: slots.__setitem__(
                        at, poison(op.ref_shape, slots.dtype)
                    ),
                )
                cur = fetch_after_step(p, op, cur, s, fetcher(op, gref, slots))
            new_cursors.append(fetch.as_carry(cur))
            new_recent.append(held[1:])
        return tuple(new_counts), tuple(new_cursors), tuple(new_recent), carry

    counts0 = tuple(jnp.int32(0) for _ in p.outputs)
    recent0 = tuple((jnp.int32(0),) * d for _ in p.inputs)
    _, _, _, carry = lax.fori_loop(0, p.num_steps, step, (counts0, cursors0, recent0, init_carry))
    return carry if has_carry else None


def _check_manual_barriers(
    produced: list[TraceTimeBarrier], consumed: list[TraceTimeBarrier]
) -> None:
    """A body that never waits on a manual produced barrier, or never arrives on a manual consumed
    one, is an error: on GPU it would read a slot before its copy lands, or hang the memory
    thread."""
    for b in produced:
        if b.waits == 0:
            raise ValueError(
                "manual_produced_barriers=True but the body never waits on the produced barrier "
                f"of {b.name} (call cv.wait_produced on it before reading the block): on GPU it "
                "would read the slot before its copy lands"
            )
    for b in consumed:
        if b.arrivals == 0:
            raise ValueError(
                "manual_consumed_barriers=True but the body never arrives on the consumed barrier "
                f"of {b.name} (call cv.barrier_arrive on it): the memory thread would wait forever "
                "before refilling that slot"
            )


def run_warp_specialized(
    wp, body, in_refs, out_refs, carry_coroutine, thread_index: int, compute_context=None
):
    """The warp-specialized pipeline on xla.

    `cv.kernel` traces its threads one after the other; the pipeline runs once, in the leader's
    trace, and at every step runs the body for each compute thread in turn on the same blocks
    (each traced with its own `lax.axis_index(wg_axis)`), so compute threads share output blocks
    exactly as on GPU. The memory thread has nothing to do: reads are synchronous here.
    Each thread's carry comes from its `carry_coroutine` or its `compute_context`
    (`_nested_contexts`).
    """
    if thread_index != wp.leader:
        return None
    threads = wp.compute_threads

    def as_thread(c, fn):
        return call_as_thread(fn, wp.wg_axis, wp.num_threads, c)

    if compute_context is not None:
        _nested_contexts(wp, body, in_refs, out_refs, compute_context, as_thread)
        return None
    gens, inits = [], []
    for c in threads:
        gen, init = carry_lib.start(carry_coroutine, lambda fn, c=c: as_thread(c, fn))
        gens.append(gen)
        inits.append(init)
    has_carry = carry_coroutine is not None
    finals = _run_threads(
        wp, body, in_refs, out_refs, [(init, has_carry) for init in inits], as_thread
    )
    for c, gen, final in zip(threads, gens, finals):
        carry_lib.finish(gen, final, lambda fn, c=c: as_thread(c, fn))


def _run_threads(wp, body, in_refs, out_refs, carries, as_thread) -> list:
    """The pipeline with every compute thread's body at each step; `carries` holds per compute
    thread (initial carry, whether it has one). Returns the final carries (a Ref carry is handed
    to every step as it is, as on GPU, and is its own final)."""
    p = wp.pipeline
    threads = wp.compute_threads
    n_blocks = len(p.inputs) + len(p.outputs)
    fixed = [c if is_jax_ref(c) else None for c, _ in carries]

    def every_thread(indices, *args):
        blocks, loop_carries = args[:n_blocks], args[n_blocks]
        new = []
        for c, carry, ref, (_, has_carry) in zip(threads, loop_carries, fixed, carries):
            produced = (
                [TraceTimeBarrier(op.name) for op in p.inputs]
                if wp.manual_produced_barriers
                else []
            )
            consumed = (
                [TraceTimeBarrier(op.name) for op in p.inputs]
                if wp.manual_consumed_barriers
                else []
            )
            extra = ((carry if ref is None else ref),) if has_carry else ()

            def call(extra=extra, produced=produced, consumed=consumed, ref=ref):
                out = body(indices, *blocks, *produced, *consumed, *extra)
                # a Ref carry is not returned through the trace
                return None if ref is not None else out

            out = as_thread(c, call)
            _check_manual_barriers(produced, consumed)
            if not has_carry and out is not None:
                raise TypeError(
                    "pipeline body returned a value but the pipeline has no carry (give a "
                    "carry_coroutine, or call eval_pipeline with an initial carry in "
                    "compute_context)"
                )
            new.append(out if has_carry and ref is None else None)
        return tuple(new)

    inits = tuple(None if ref is not None else c for (c, _), ref in zip(carries, fixed))
    finals = run_pipeline(p, every_thread, in_refs, out_refs, inits, True)
    return [final if ref is None else ref for final, ref in zip(finals, fixed)]


def _nested_contexts(wp, body, in_refs, out_refs, compute_context, as_thread) -> None:
    """Upstream's `compute_context` on xla, where one trace runs every compute thread's body.

    Each compute thread's context runs as that thread; its `eval_pipeline(carry)` runs the next
    thread's context inside it, and the innermost runs the pipeline once with every carry. So each
    context's allocations (e.g. `pl.run_scoped`) enclose the pipeline, as on GPU. An outer thread's
    final carry leaves the inner traces as an output of theirs."""
    threads = wp.compute_threads

    def level(k: int, carries: list) -> list:
        """Run the contexts of threads k.. around the pipeline; the finals of threads 0..k-1."""
        if k == len(threads):
            return _run_threads(wp, body, in_refs, out_refs, carries, as_thread)
        called = []

        def eval_pipeline(carry=None):
            carry_lib.check_single_call(called)
            finals = level(k + 1, carries + [(carry, carry is not None)])
            called.append(finals[:k])
            return finals[k]

        def context():
            compute_context(eval_pipeline)
            carry_lib.check_called(called)
            # Outer threads' finals leave this trace as its outputs (a Ref final is its own carry,
            # which the outer thread already holds).
            return [None if is_jax_ref(c) else f for (c, _), f in zip(carries, called[0])]

        outer = as_thread(threads[k], context)
        return [c if is_jax_ref(c) else f for (c, _), f in zip(carries, outer)]

    level(0, [])
