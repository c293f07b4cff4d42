"""Independent grid steps of a plain pipeline, run together by the xla executor.

Step by step, a pipeline over a (2048 / 256)^3 matmul grid is 512 small dots in a loop: XLA:CPU
pays a loop iteration and a small-matrix dot per step (1.5x one `jnp.dot` in
`conveyor bench pipeline`). When the plan and the body show that the steps along the grid's
leading axes B are independent, the executor runs, for each step of the remaining axes R (in
order), the body of every B index at once: `jax.vmap` of the body, one level per B axis, so a
block that does not depend on an axis is not copied along it and XLA sees a few large dots.

Independent, decided at trace time (otherwise `xla.run_pipeline` runs step by step):
- the grid is static, the pipeline carries nothing, and no operand has a `pl.BoundedSlice`
  window;
- the body touches no ref but its blocks (no scratch, no unwindowed operand, no ref it closes
  over) and has no other effect (no callback), and it never writes an input block;
- no input is (a view of) the same ref as an output: the body could see its own write-backs;
- per output, the blocks at steps with different B indices are different blocks, found from the
  index maps over the whole grid (maps that depend on traced values are not evaluated: no
  batching). So every output block is visited under one B index, in the same consecutive steps
  as in the grid's order: it starts as a fresh (poisoned) slot and is written back after the
  same steps, and the body sees the same block values in each step;
- the batched output blocks (one per B index) take at most twice the outputs' bytes.
B is the longest run of leading axes for which this holds (of more than one step).
The body's ops are batched one by one, so a dot may be done as a larger XLA dot whose own
summation order differs: results agree to float rounding (exactly on integer-valued data).
Dots of row slices of one block by the same operand (a warp-specialized pipeline's compute
threads, each multiplying its rows) run as one dot (`_compat.eval_merging_dots`): on the 2-core
VM the 2048^3 warp-specialized matmul went from 1.26-1.30x to 1.23-1.24x `jnp.dot`.
The batched blocks keep the array's layout where they can, so XLA copies little around the body:
output buffers interleave each batched grid axis with the block dimension it walks, an input
whose blocks at one step form an in-bounds slab is read as one slice (`SlabRead`), and a partial
read or write of a block stays a slice of the batched buffer
(`_compat.layout_keeping_slice_batching`).
`checked_schedule()` and `batch_independent_steps(False)` turn batching off.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from conveyor._compat import discharge_ref_function, layout_keeping_slice_batching, underlying_ref
from conveyor.kernel import poison
from conveyor.pipeline.lowering import bool_setting
from conveyor.plans.fetch import block_keys
from conveyor.plans.grid import unravel
from conveyor.plans.pipeline import GridPoint, OperandPlan, PipelinePlan

_ENABLED = contextvars.ContextVar("conveyor_batch_independent_steps", default=True)
_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("conveyor_batching_record", default=None)


def batch_independent_steps(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Pipelines traced inside this block run independent grid steps together on xla (the
    default) or not (step by step, e.g. to compare the two). It acts when a pipeline is traced."""
    return bool_setting(_ENABLED, "batch_independent_steps", enabled)


@contextlib.contextmanager
def record_batching() -> Iterator[list[tuple[tuple[int, ...], int]]]:
    """Record, for each plain pipeline the xla executor traces in this block, (grid, number of
    leading grid axes run together); 0 means step by step."""
    log: list[tuple[tuple[int, ...], int]] = []
    token = _RECORD.set(log)
    try:
        yield log
    finally:
        _RECORD.reset(token)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batching:
    """How a pipeline's steps are batched: the leading `axes` run together; `body` is the pure
    body (`discharge_ref_function`); `written[o]` is output o's write-back flag per step, shaped
    (B indices flattened, steps of the remaining axes)."""
    axes: int
    body: Callable
    written: tuple[np.ndarray, ...]
    # Per output: its buffer interleaves grid axis l before block dimension l (`_follows_grid`),
    # and, further, its blocks tile its whole array in the grid's order (stored in one write).
    interleaved: tuple[bool, ...]
    whole_array: tuple[bool, ...]
    # Per input: read as one slab per step of the remaining axes (`SlabRead`), or None (each
    # B index's block read under vmap, a gather).
    slabs: tuple[SlabRead | None, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlabRead:
    """An input whose blocks at the B indices of one step r, together, are one in-bounds slab of
    its array: each block dimension's index is either the same for every B index or one batched
    grid axis's index plus an offset. Read with one dynamic_slice per r, no gather."""
    level_dims: tuple[int | None, ...]  # per batched axis: the block dimension it walks, or None
    starts: np.ndarray                  # [steps of the remaining axes, rank]: the slab's offset
    sizes: tuple[int, ...]


def plan_batching(p: PipelinePlan, body: Callable, in_refs, out_refs, init_carry, has_carry: bool) -> Batching | None:
    """The batching of the module docstring, or None (run step by step); recorded (`record_batching`).
    A carry without leaves (e.g. a warp-specialized pipeline's per-thread Nones) counts as none."""
    found = _find(p, body, in_refs, out_refs, init_carry, has_carry) if _ENABLED.get() else None
    log = _RECORD.get()
    if log is not None and p.is_static:
        log.append((tuple(p.grid), 0 if found is None else found.axes))
    return found


def _find(p: PipelinePlan, body, in_refs, out_refs, init_carry, has_carry: bool) -> Batching | None:
    if (not p.is_static or not p.outputs or jax.tree_util.tree_leaves(init_carry)
            or any(op.bounded_dims or op.invariant for op in p.outputs)
            or any(op.bounded_dims for op in p.inputs)):
        return None
    outputs = {id(underlying_ref(r)) for r in out_refs}
    if any(id(underlying_ref(r)) in outputs for r in in_refs):
        return None
    keys = [block_keys(p, op) for op in p.outputs]  # None: not evaluable here (traced maps, long grids)
    if any(k is None for k in keys):
        return None
    axes = _independent_axes(p, keys)
    if axes == 0 or not _fits(p, axes, out_refs):
        return None
    index_avals = [jax.ShapeDtypeStruct((), jnp.int32)] * len(p.grid)
    block_avals = [jax.ShapeDtypeStruct(op.ref_shape, r.dtype)
                   for op, r in zip(p.inputs + p.outputs, (*in_refs, *out_refs))]
    carry = (init_carry,) if has_carry else ()
    pure = discharge_ref_function(lambda *a: body(tuple(a[:len(p.grid)]), *a[len(p.grid):], *carry),
                                  index_avals, block_avals)
    if pure is None:
        return None
    run, written, tree = pure
    if any(written[:len(p.inputs)]) or tree.num_leaves:
        return None
    lead = math.prod(p.grid[:axes])
    flags = tuple(_writes_back(k).reshape(lead, -1) for k in keys)
    indices = np.stack(np.unravel_index(np.arange(p.num_steps), p.grid), axis=1)  # [steps, grid axes]
    interleaved = tuple(_follows_grid(op, k, indices, axes, lead) for op, k in zip(p.outputs, keys))
    whole = tuple(inter and _tiles(p, op, k, indices, axes, r.shape)
                  for op, k, r, inter in zip(p.outputs, keys, out_refs, interleaved))
    slabs = tuple(_slab_read(p, op, indices, axes, r.shape) for op, r in zip(p.inputs, in_refs))
    return Batching(axes=axes, body=run, written=flags, interleaved=interleaved, whole_array=whole, slabs=slabs)


def _slab_read(p: PipelinePlan, op: OperandPlan, indices: np.ndarray, axes: int,
               shape: tuple[int, ...]) -> SlabRead | None:
    """Input `op`'s `SlabRead`, or None: not plain blocks (squeezed, element or bounded
    dimensions), a map not evaluable here, an index that mixes batched axes, or out of bounds."""
    if op.element_dims or op.bounded_dims or len(op.ref_shape) != len(op.block_shape) or not op.block_shape:
        return None
    keys = block_keys(p, op)
    lead = math.prod(p.grid[:axes])
    level_dims = None if keys is None else _walked_dims(keys, indices, axes, lead)
    if level_dims is None:
        return None
    sizes = list(op.block_dims)
    for l, d in enumerate(level_dims):
        if d is not None:
            sizes[d] *= p.grid[l]
    starts = keys[:len(keys) // lead] * np.asarray(op.block_dims)  # at B index 0, per step r
    if (starts < 0).any() or (starts + np.asarray(sizes) > np.asarray(shape)).any():
        return None
    return SlabRead(level_dims=level_dims, starts=starts.astype(np.int32), sizes=tuple(sizes))


def _independent_axes(p: PipelinePlan, keys: list[np.ndarray]) -> int:
    """The most leading grid axes (spanning more than one step) such that no output block is
    visited under two different indices along them."""
    for axes in range(len(p.grid), 0, -1):
        lead = math.prod(p.grid[:axes])
        if lead < 2:
            break
        prefix = np.arange(p.num_steps) // (p.num_steps // lead)
        if all(_one_prefix_per_block(k, prefix) for k in keys):
            return axes
    return 0


def _one_prefix_per_block(keys: np.ndarray, prefix: np.ndarray) -> bool:
    _, block = np.unique(keys, axis=0, return_inverse=True)
    block = block.reshape(-1)
    lo = np.full(block.max() + 1, np.iinfo(np.int64).max)
    hi = np.full(block.max() + 1, -1)
    np.minimum.at(lo, block, prefix)
    np.maximum.at(hi, block, prefix)
    return bool((lo == hi).all())


def _walked_dims(keys: np.ndarray, indices: np.ndarray, axes: int, lead: int) -> tuple[int | None, ...] | None:
    """Per batched grid axis, the block dimension whose index is that axis's index plus an offset
    fixed at each step of the remaining axes (None: no dimension depends on the axis); None when
    some dimension's index depends on the batched axes in any other way. `keys` [steps, dims];
    `lead`: the number of B indices."""
    by_b = keys.reshape(lead, -1, keys.shape[-1])            # [B index, step r, dim]
    grid_idx = indices[:, :axes].reshape(lead, -1, axes)     # [B index, step r, batched axis]
    level_dims: list[int | None] = [None] * axes
    for d in range(by_b.shape[-1]):
        if (by_b[:, :, d] == by_b[:1, :, d]).all():
            continue  # the same for every B index
        walks = [l for l in range(axes) if level_dims[l] is None
                 and ((by_b[:, :, d] - grid_idx[:, :, l]) == by_b[:1, :, d]).all()]
        if not walks:
            return None
        level_dims[walks[0]] = d
    return tuple(level_dims)


def _follows_grid(op: OperandPlan, keys: np.ndarray, indices: np.ndarray, axes: int, lead: int) -> bool:
    """Output `op`'s buffer can interleave grid axis l before block dimension l: in plain (not
    squeezed, not element-offset) dimensions, batched axis l walks block dimension l."""
    if op.element_dims or len(op.ref_shape) != len(op.block_shape) or len(op.block_shape) < axes:
        return False
    return _walked_dims(keys, indices, axes, lead) == tuple(range(axes))


def _tiles(p: PipelinePlan, op: OperandPlan, keys: np.ndarray, indices: np.ndarray, axes: int,
           shape: tuple[int, ...]) -> bool:
    """The batched blocks are the whole array: block index l is grid index l (l < axes), the other
    block dimensions are whole, and the grid's blocks cover each batched dimension exactly."""
    return (all((keys[:, l] == indices[:, l]).all() and p.grid[l] * op.block_dims[l] == shape[l] for l in range(axes))
            and all((keys[:, d] == 0).all() and op.block_dims[d] == shape[d] for d in range(axes, len(shape))))


def _writes_back(keys: np.ndarray) -> np.ndarray:
    """Per step: the block changes at the next step, or it is the last step (`writes_back`)."""
    changes = np.ones(len(keys), bool)
    changes[:-1] = (keys[1:] != keys[:-1]).any(axis=1)
    return changes


def _fits(p: PipelinePlan, axes: int, out_refs) -> bool:
    lead = math.prod(p.grid[:axes])
    batched = sum(lead * math.prod(op.ref_shape) * jnp.dtype(r.dtype).itemsize for op, r in zip(p.outputs, out_refs))
    whole = sum(math.prod(r.shape) * jnp.dtype(r.dtype).itemsize for r in out_refs)
    return batched <= 2 * whole


def run_batched(p: PipelinePlan, b: Batching, in_refs, out_refs, read_block, store_block) -> None:
    """Run the pipeline as `b` says: for each step r of the remaining axes, the body at every
    B index (vmapped), then, where the plan writes back after (B, r), the block is stored and its
    buffer poisoned (a fresh slot). `read_block` / `store_block` are the xla executor's."""
    lead_grid, rest_grid = p.grid[:b.axes], p.grid[b.axes:]
    lead, rest = math.prod(lead_grid), math.prod(rest_grid)
    n_in = len(p.inputs)
    in_values = [ref[...] for ref in in_refs]  # no step writes them (`_find`)

    def one(indices, slabs, bufs):
        point = GridPoint(indices)
        blocks = [read_block(p, op, value, point) if slab is None else slab
                  for op, value, slab in zip(p.inputs, in_values, slabs)]
        _, finals = b.body(*(jnp.asarray(i, jnp.int32) for i in p.grid_indices(point)), *blocks, *bufs)
        return tuple(finals[n_in:])

    def nest(level, r):
        if level == b.axes:
            return lambda indices, slabs, bufs: one(indices + unravel(r, rest_grid), slabs, bufs)
        inner = nest(level + 1, r)
        # Where each output's buffer holds grid axis `level`: right before block dimension `level`
        # when the block index there follows that axis (the array's own order, which a batched
        # dot writes in place), else in front. A slab holds it before the block dimension it walks.
        axes = tuple(level if inter else 0 for inter in b.interleaved)
        slab_axes = tuple(None if s is None else _slab_axis(s.level_dims, level) for s in b.slabs)
        return lambda indices, slabs, bufs: jax.vmap(
            lambda i, ss, bb: inner(indices + (i,), ss, bb), in_axes=(0, slab_axes, axes), out_axes=axes)(
                jnp.arange(lead_grid[level], dtype=jnp.int32), slabs, bufs)

    def read_slabs(r):
        """Each slab input's blocks at step r of the remaining axes, as [..., G_l, block_d, ...]."""
        out = []
        for value, s in zip(in_values, b.slabs):
            if s is None:
                out.append(None)
                continue
            slab = lax.dynamic_slice(value, tuple(jnp.asarray(s.starts)[r]), s.sizes)
            out.append(slab.reshape(_slab_shape(s, lead_grid)))
        return tuple(out)

    def batched_body(r, bufs):
        return nest(0, r)((), read_slabs(r), bufs)

    def blocks_first(buf, op, inter):
        """A buffer as [B indices flattened, *block]."""
        if inter:
            rank = len(lead_grid)
            buf = jnp.transpose(buf, [2 * l for l in range(rank)] + [2 * l + 1 for l in range(rank)]
                                + list(range(2 * rank, buf.ndim)))
        return buf.reshape(lead, *op.ref_shape)

    def store(r, bufs):
        new = []
        for op, ref, buf, written, inter, whole in zip(p.outputs, out_refs, bufs, b.written, b.interleaved,
                                                      b.whole_array):
            if whole and isinstance(r, int) and written[:, r].all():
                ref[...] = buf.reshape(ref.shape)  # the blocks tile the array in its order
                new.append(poison(buf.shape, buf.dtype))
                continue
            flat, flags = blocks_first(buf, op, inter), jnp.asarray(written)[:, r]

            def put(i, _, op=op, ref=ref, flat=flat, flags=flags):
                point = GridPoint(unravel(i, lead_grid) + unravel(r, rest_grid))
                store_block(p, op, ref, flat[i], point, flags[i])
            lax.fori_loop(0, lead, put, None)
            fresh = flags.reshape(lead_grid)
            for l in range(len(lead_grid)) if inter else ():
                fresh = jnp.expand_dims(fresh, 2 * l + 1)
            fresh = fresh.reshape(fresh.shape + (1,) * (buf.ndim - fresh.ndim))
            new.append(jnp.where(fresh, poison(buf.shape, buf.dtype), buf))
        return tuple(new)

    any_written = np.stack([w.any(axis=0) for w in b.written]).any(axis=0)

    def step(r, bufs):
        bufs = batched_body(r, bufs)
        return lax.cond(jnp.asarray(any_written)[r], lambda bb: store(r, bb), lambda bb: bb, bufs)

    bufs = tuple(poison(_buffer_shape(lead_grid, op.ref_shape, inter), ref.dtype)
                 for op, ref, inter in zip(p.outputs, out_refs, b.interleaved))
    # A body that reads or writes part of a block (`ob[rows, :]`) keeps the buffers' layout:
    # no transposes of the batched blocks around each partial access.
    with layout_keeping_slice_batching():
        if not any_written[:-1].any():
            # Every block is written back after the last step of R (e.g. a reduction axis): no
            # branch in the loop, which would make XLA copy the carried blocks at every step.
            store(rest - 1, lax.fori_loop(0, rest, batched_body, bufs))
        else:
            lax.fori_loop(0, rest, step, bufs)


def _slab_axis(level_dims: tuple[int | None, ...], level: int) -> int | None:
    """Where grid axis `level` sits in a slab once the outer axes are vmapped away: before its
    block dimension, after the grid axes of the inner levels that walk earlier dimensions."""
    d = level_dims[level]
    if d is None:
        return None
    return d + sum(1 for inner in level_dims[level + 1:] if inner is not None and inner < d)


def _slab_shape(s: SlabRead, lead_grid: tuple[int, ...]) -> tuple[int, ...]:
    walked = {d: g for d, g in zip(s.level_dims, lead_grid) if d is not None}
    return tuple(x for d, size in enumerate(s.sizes)
                 for x in ((walked[d], size // walked[d]) if d in walked else (size,)))


def _buffer_shape(lead_grid: tuple[int, ...], block: tuple[int, ...], interleaved: bool) -> tuple[int, ...]:
    if not interleaved:
        return (*lead_grid, *block)
    return tuple(d for pair in zip(lead_grid, block) for d in pair) + block[len(lead_grid):]
