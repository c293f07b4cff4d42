"""Helpers shared by the plan's executors (xla, mosaic_tpu, mosaic_gpu).

Design notes: docs/internals/pipelines.md, section `pipeline/lowering.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from conveyor import _compat
from conveyor.plans import fetch
from conveyor.plans.pipeline import Int, OperandPlan, PipelinePlan

_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "conveyor_lowering_record", default=None
)


def under_vmap(refs: Any) -> bool:
    """Whether any of `refs` is batched by a `jax.vmap` around the pipeline call."""
    return any(isinstance(leaf, _compat.BatchTracer) for leaf in jax.tree_util.tree_leaves(refs))


def when(cond: Any, fn: Callable[[], None], otherwise: Callable[[], None] | None = None) -> None:
    """Run `fn` under `cond` (else `otherwise`, if given): decided at trace time when `cond` is
    concrete, else as a branch of the kernel."""
    cond = fetch.concrete(cond)
    if isinstance(cond, bool):
        if cond or otherwise is not None:
            (fn if cond else otherwise)()
    elif otherwise is None:
        pl.when(cond)(fn)
    else:
        lax.cond(cond, fn, otherwise)


def predicated(issue: Callable[[Int, Int], None]) -> fetch.Fetch:
    """The plan's fetch callback (step, slot, go) for an executor whose `issue(step, slot)` starts
    one copy: issued under `go` (`when`)."""
    return lambda t, slot, go: when(go, lambda: issue(t, slot))


def fetch_prologue(p: PipelinePlan, op: OperandPlan, issue) -> fetch.Cursor:
    """`fetch.prologue` with `issue(step, slot)` predicated and traced scans in a while loop."""
    return fetch.prologue(p, op, predicated(issue), lax.while_loop)


def fetch_after_step(p: PipelinePlan, op: OperandPlan, cursor, s, issue) -> fetch.Cursor:
    """`fetch.after_step` with `issue(step, slot)` predicated and traced scans in a while loop."""
    return fetch.after_step(p, op, cursor, s, predicated(issue), lax.while_loop)


@contextlib.contextmanager
def record_issued() -> Iterator[list[Any]]:
    """Record, while the kernel runs, what a Mosaic lowering traced in this block issues, as the
    plans' own typed records, built by the plans' constructors:
    - pipelines: their program's actions (`conveyor.plans.pipeline_program`: `fetch`,
      `fetch_wait`, `store`, `store_wait`; a warp-specialized pipeline's barrier waits and
      arrivals, `conveyor.plans.warp`), each with `at`, the grid step during which it is issued
      (-1: the prologue; num_steps: the epilogue). Copies are recorded without `elements`;
    - ring kernels: the `RingOperation`s of `RingPlan.operation_records()`.
    This is for conformance tests against the plans. The records come from unordered debug
    callbacks (Pallas interpreters refuse ordered ones), so their order within one grid step is
    not meaningful. When not recording, `issued` adds nothing to the kernel."""
    log: list[Any] = []
    token = _RECORDING.set(log)
    try:
        yield log
    finally:
        _RECORDING.reset(token)


def issued(make: Callable[..., Any], *labels: Any, **ints: Int) -> None:
    """Report one record the lowering issues (see `record_issued`): `make(*labels, **ints)` with
    the ints, which may be traced, made concrete when the kernel runs."""
    log = _RECORDING.get()
    if log is not None:
        names = tuple(ints)
        jax.debug.callback(
            lambda *values: log.append(make(*labels, **{k: int(v) for k, v in zip(names, values)})),
            *(jnp.asarray(v, jnp.int32) for v in ints.values()),
        )


def block_view(p: PipelinePlan, op: OperandPlan, ref, step, window=None):
    """The global-memory view of `op`'s block at `step`; squeezed dims are indexed by an integer.
    A `pl.BoundedSlice` or partial dimension is its window (a size possibly traced). `window`:
    `p.window(op, step)` as a lowering annotated it (default: computed here)."""
    return _view(op, ref, p.window(op, step) if window is None else window)


def box_view(p: PipelinePlan, op: OperandPlan, ref, step):
    """The view of a whole block at `op`'s offset at `step`, even where the block is partial or
    out of bounds: a TMA copy's box, which zero-fills what it loads from outside the array and
    drops what it stores there (mosaic_gpu). A static offset whose box runs past the array is
    staged as a traced int32 (JAX refuses such a static slice; the TMA copy takes it)."""

    def offset(off, size, extent):
        if isinstance(off, int) and not 0 <= off <= extent - size:
            return lax.add(jnp.int32(off), jnp.int32(0))
        return off

    return _view(
        op,
        ref,
        tuple(
            (offset(off, size, extent), size)
            for off, size, extent in zip(p.offsets(op, step), op.block_dims, ref.shape)
        ),
    )


def first_block_view(op: OperandPlan, ref):
    """The view of block (0, ..., 0): same shape as any block, always in bounds (for DMA waits,
    which only need the size of the copy they wait for; not for bounded windows, whose size
    varies: wait with `block_view` of the step instead)."""
    return _view(op, ref, tuple((0, size) for size in op.block_dims))


def slot_view(p: PipelinePlan, op: OperandPlan, slot_ref, step, window=None):
    """The part of a slot (one block) that `op`'s window at `step` fills: the whole slot, except
    in `pl.BoundedSlice` and partial dimensions, where it is the window's first `size` elements.
    `window` as in `block_view`."""
    if not op.variable_dims:
        return slot_ref
    window = p.window(op, step) if window is None else window
    idx = tuple(
        pl.ds(0, window[d][1]) if d in op.variable_dims else slice(None)
        for d, spec in enumerate(op.block_shape)
        if spec is not None
    )
    return slot_ref.at[idx]


def _view(op: OperandPlan, ref, window):
    idx = tuple(
        off if spec is None else pl.ds(off, size)
        for (off, size), spec in zip(window, op.block_shape)
    )
    return ref.at[idx]


def block_in_bounds(p: PipelinePlan, op: OperandPlan, step: Int, array_shape) -> Any:
    """Whether `op`'s block at `step` lies inside an array of `array_shape` (Python bool when
    everything is static, else a traced bool). A bounded window must also fit its slot: a traced
    size outside [0, block size] makes the block out of bounds. A partial block is in bounds when
    it starts inside the array."""
    ok: Any = True
    for d, ((start, size), extent) in enumerate(zip(p.window(op, step), array_shape)):
        conditions = [start >= 0, start + size <= extent]
        if d in op.bounded_dims:
            conditions += [size >= 0, size <= op.block_dims[d]]
        if d in op.partial_dims:  # its size is what is left of the array: none past the end
            conditions.append(size > 0)
        for inside in conditions:
            ok = (
                ok and inside
                if isinstance(ok, bool) and isinstance(inside, bool)
                else jnp.logical_and(ok, inside)
            )
    return ok


def call_body(body, indices, blocks, carry, has_carry: bool):
    """Run the user's body with the pipeline convention; returns the next carry (or None)."""
    if has_carry:
        return body(indices, *blocks, carry)
    if body(indices, *blocks) is not None:
        raise TypeError("pipeline body returned a value but no init_carry was given")
    return carry


def check_allocations(p: PipelinePlan, needed: dict[str, list], given: Any, sharing: str) -> None:
    """Caller-owned allocations must be the ones this pipeline would allocate: same parts, as many
    of each, slots of the same shape and dtype, other parts (semaphores) of the same shape; e.g.
    another pipeline's with other block shapes or slot counts is refused, naming the first
    difference. `sharing` names who shares them, for the message."""
    if not isinstance(given, dict) or set(given) != set(needed):
        keys = f" with keys {sorted(given)}" if isinstance(given, dict) else ""
        raise ValueError(
            f"allocations: expected the dict of get_allocations(*refs) with keys {sorted(needed)}, "
            f"got {type(given).__name__}{keys}"
        )
    for key, parts in needed.items():
        if len(given[key]) != len(parts):
            raise ValueError(
                f"allocations[{key!r}]: this pipeline needs {len(parts)}, got {len(given[key])} "
                "(allocated for a pipeline with other operands or barriers?)"
            )
    names = [op.name for op in p.inputs + p.outputs]
    for name, need, ref in zip(names, needed["slots"], given["slots"]):
        if tuple(ref.shape) != tuple(need.shape) or jnp.dtype(ref.dtype) != jnp.dtype(need.dtype):
            raise ValueError(
                f"allocations: the slots of {name} are "
                f"{jnp.dtype(ref.dtype).name}{tuple(ref.shape)}, this pipeline needs "
                f"{jnp.dtype(need.dtype).name}{tuple(need.shape)} (slots x block); {sharing} must "
                "share block shapes, dtypes and slot counts"
            )
    for key, parts in needed.items():
        for k, (need, ref) in enumerate(zip(parts, given[key])):
            shape = getattr(need, "shape", None)
            if (
                key != "slots"
                and shape is not None
                and tuple(getattr(ref, "shape", ())) != tuple(shape)
            ):
                raise ValueError(
                    f"allocations[{key!r}][{k}] has shape {tuple(ref.shape)}, this pipeline needs "
                    f"{tuple(shape)}; {sharing} must share operands and slot counts"
                )
