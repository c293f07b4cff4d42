"""The pipeline plan: a pure, immutable description of what happens at every step of a pipeline.

Design notes: docs/internals/plans.md, section `plans/pipeline.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from conveyor import _compat
from conveyor.jaxprs import args_reaching_outputs
from conveyor.plans import fetch as fetch_lib
from conveyor.plans.grid import ARBITRARY, Int, normalize_semantics, partition_grid, unravel
from conveyor.plans.pipeline_program import pipeline_program
from conveyor.plans.program import Program
from conveyor.plans.specs import (
    WHOLE_ARRAY,
    as_block_spec,
    block_dimensions,
    flatten_specs,
    pallas_options,
    PallasOptions,
    zeros_map,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OperandPlan:
    """One pipelined operand: an input or an output, with its buffering decided.

    `transforms` is the block's layout in GPU shared memory (tiling, swizzle): mosaic_gpu allocates
    its slots with them and the body sees the transformed ref, as upstream's does (what a Hopper
    wgmma wants). The rule elsewhere: xla has no on-chip memory, so its body sees the plain logical
    block (the same values); mosaic_tpu refuses them by name (VMEM has its own tiling).
    """

    name: str
    block_shape: tuple[int | None, ...]
    index_map: Callable[..., tuple[Int, ...]]
    invariant: bool  # the index map ignores the grid: fetched / written exactly once
    num_slots: int
    transforms: tuple[Any, ...] = ()
    # Dimensions whose index-map entry is an element offset (`pl.Element(n)`), not a block index.
    element_dims: tuple[int, ...] = ()
    # Dimensions whose index-map entry is `pl.ds(start, size)`, size <= the block's
    # (`pl.BoundedSlice`).
    bounded_dims: tuple[int, ...] = ()
    # A whole-array spec (no block_shape): its block is the whole array, block_shape is () until
    # `PipelinePlan.with_array_shapes` gives it the array's shape.
    whole_array: bool = False
    # Inputs: which steps are fetched, and when (`conveyor.plans.fetch`).
    fetch_rule: str = fetch_lib.ON_CHANGE
    # Inputs: the first `prefetched` fetches (distinct blocks) are in slots 0.. prefetched - 1 when
    # the pipeline starts, put there by the caller (upstream's `pl.Buffered(prefetched_count=...)`,
    # e.g. copied by an earlier kernel or pipeline and awaited): the pipeline neither issues nor
    # awaits them. At most num_slots.
    prefetched: int = 0
    # The array's shape, set (`PipelinePlan.with_array_shapes`) only when a block dimension does
    # not divide it: then the last block of that dimension is partial (`partial_dims`).
    array_shape: tuple[int, ...] | None = None

    @property
    def block_dims(self) -> tuple[int, ...]:
        """Block size per array dimension (squeezed dims count as 1)."""
        return tuple(1 if d is None else d for d in self.block_shape)

    @property
    def partial_dims(self) -> tuple[int, ...]:
        """Block dimensions whose size does not divide the array's: a block there covers what is
        left of the array, from its start up to a whole block (`PipelinePlan.window`)."""
        if self.array_shape is None:
            return ()
        return tuple(
            d
            for d, (b, extent) in enumerate(zip(self.block_dims, self.array_shape))
            if extent % b and d not in self.element_dims + self.bounded_dims
        )

    @property
    def variable_dims(self) -> tuple[int, ...]:
        """Dimensions whose window size varies per step (bounded and partial): a copy there moves
        the window, into the start of the slot."""
        return tuple(sorted(self.bounded_dims + self.partial_dims))

    @property
    def ref_shape(self) -> tuple[int, ...]:
        """Shape of the on-chip block ref the body sees (squeezed dims dropped)."""
        return tuple(d for d in self.block_shape if d is not None)


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """A step given by its grid indices rather than its linear number, for the rules that only
    need the indices (`block_indices`, `window`, `offsets`, `block_key`; not `block_changes` or
    `writes_back`, which look at the next step). The xla executor's batched steps use it: there
    each index is batched along its own axis, which a linear step would mix."""

    indices: tuple[Int, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """The schedule of one pipeline. `grid` holds Python ints and, for a dynamic grid, traced int32
    scalars (known only inside the kernel); then `num_steps` is traced too, and the executors run
    a loop of dynamic length whose prologue fetches are predicated on the steps existing."""

    grid: tuple[Int, ...]
    inputs: tuple[OperandPlan, ...]
    outputs: tuple[OperandPlan, ...]
    max_concurrent_steps: int
    delay_release: int
    # One tree structure per operand as the caller passes it (pytree specs); inputs/outputs above
    # are their flattened leaves, in order.
    in_trees: tuple[Any, ...] = ()
    out_trees: tuple[Any, ...] = ()
    # Per flattened leaf of in_trees / out_trees: planned (True) or passed to the body unwindowed.
    in_windowed: tuple[bool, ...] = ()
    out_windowed: tuple[bool, ...] = ()
    # Megacore: "parallel" / "arbitrary" per grid dimension (None: all arbitrary), and the offset of
    # this plan's grid indices in the whole grid when it is one core's part (`for_core`).
    dimension_semantics: tuple[str, ...] | None = None
    grid_offsets: tuple[Int, ...] = ()

    @property
    def num_steps(self) -> Int:
        return math.prod(self.grid)

    @functools.cached_property
    def block_changes_table(self) -> dict[str, tuple[bool, ...]]:
        """Per operand whose block keys are known here (`conveyor.plans.fetch.block_keys`: a static
        grid), `block_changes` at every step. Computed once per plan."""
        table = {}
        for op in self.inputs + self.outputs:
            keys = None if op.invariant else fetch_lib.block_keys(self, op)
            if keys is not None:
                table[op.name] = (*(keys[1:] != keys[:-1]).any(axis=1).tolist(), False)
        return table

    @functools.cached_property
    def inputs_changing_every_step(self) -> frozenset[str]:
        """The inputs whose block changes at every step of this (static) grid: they need no
        per-step test (`conveyor.plans.fetch.changes_every_step`). Computed once per plan."""
        table = self.block_changes_table
        return frozenset(
            op.name for op in self.inputs if op.name in table and all(table[op.name][:-1])
        )

    @property
    def is_static(self) -> bool:
        """Every grid size (and, for one core's part, every offset) is a Python int."""
        return all(isinstance(g, int) for g in self.grid + self.grid_offsets)

    def for_core(self, core_id: Int, num_cores: int) -> PipelinePlan:
        """The part of this pipeline that core `core_id` of `num_cores` runs (megacore): its
        grid is cut along a parallel dimension (`conveyor.plans.grid.partition_grid`), and its
        grid indices, which the index maps and the body see, are those of the whole grid.
        With Python ints it is a concrete plan the checker and the simulator take."""
        if isinstance(num_cores, bool) or not isinstance(num_cores, int) or num_cores < 1:
            raise ValueError(
                "num_cores: expected a static int >= 1 (the size of the core axis), got "
                f"{num_cores!r}"
            )
        if self.grid_offsets:
            raise ValueError("for_core: this plan is already one core's part of a pipeline")
        if isinstance(core_id, int) and not 0 <= core_id < num_cores:
            raise ValueError(f"core_id: expected an int in [0, {num_cores}), got {core_id}")
        semantics = self.dimension_semantics or (ARBITRARY,) * len(self.grid)
        grid, offsets = partition_grid(self.grid, semantics, num_cores, core_id)
        return dataclasses.replace(self, grid=grid, grid_offsets=offsets)

    @property
    def unresolved(self) -> tuple[str, ...]:
        """The operands with a whole-array spec whose array shape is not known yet."""
        return tuple(
            op.name
            for op in self.inputs + self.outputs
            if op.whole_array and op.block_shape == WHOLE_ARRAY
        )

    def with_array_shapes(self, shapes: Sequence[Sequence[int]]) -> PipelinePlan:
        """This plan with the block of every whole-array spec set to its array's shape, and the
        array's shape recorded where a block does not divide it (partial edge blocks), given one
        shape per planned operand, inputs then outputs, as the pipeline is called with. A plan
        with neither is returned as it is."""
        ops = self.inputs + self.outputs
        if len(shapes) != len(ops):
            raise ValueError(
                f"with_array_shapes: expected {len(ops)} shapes (one per planned operand), got "
                f"{len(shapes)}"
            )
        resolved = []
        for op, shape in zip(ops, shapes):
            shape = tuple(int(d) for d in shape)
            if not op.whole_array and len(shape) == len(op.block_shape):
                partial = dataclasses.replace(op, array_shape=shape)
                op = partial if partial.partial_dims else dataclasses.replace(op, array_shape=None)
            if op.whole_array:
                imap = op.index_map or zeros_map(len(shape))
                if not _is_invariant(imap, self.grid, op.name, len(shape)):
                    raise ValueError(
                        f"{op.name}: a whole-array spec (no block_shape) has one block, so its "
                        "index_map must not depend on the grid"
                    )
                op = dataclasses.replace(op, block_shape=shape, index_map=imap)
            resolved.append(op)
        if all(a == b for a, b in zip(resolved, ops)):
            return self
        n_in = len(self.inputs)
        return dataclasses.replace(
            self, inputs=tuple(resolved[:n_in]), outputs=tuple(resolved[n_in:])
        )

    @property
    def prefetched_inputs(self) -> tuple[str, ...]:
        """The inputs whose first blocks the caller puts in their slots
        (`OperandPlan.prefetched`)."""
        return tuple(op.name for op in self.inputs if op.prefetched)

    def fetching_every_block(self) -> PipelinePlan:
        """This plan with no input prefetched by the caller. The xla executor runs it: there the
        caller has no slots to fill (its allocations are `{}`), so the blocks a TPU caller
        prefetches are read from the input, which must hold the same values (the contract)."""
        if not self.prefetched_inputs:
            return self
        return dataclasses.replace(
            self, inputs=tuple(dataclasses.replace(op, prefetched=0) for op in self.inputs)
        )

    def require_static(self, api: str) -> None:
        """Refuse a dynamic grid where a concrete schedule is needed (checker, simulator, program),
        and whole-array blocks whose shape is not known yet."""
        if self.unresolved:
            raise ValueError(
                f"{api}: {', '.join(self.unresolved)} have whole-array specs (no block_shape), "
                "whose block shape is their array's: give the arrays' shapes with "
                "plan.with_array_shapes([...])"
            )
        if not self.is_static:
            sizes = ", ".join(str(g) if isinstance(g, int) else "<traced>" for g in self.grid)
            raise ValueError(
                f"{api}: the pipeline's grid ({sizes}) has sizes known only when the kernel runs; "
                "check or simulate it at a concrete size: plan.with_grid((...))"
            )

    def with_grid(self, grid: Sequence[int]) -> PipelinePlan:
        """This plan with concrete grid sizes (e.g. a dynamic grid's, for the checker and
        simulator)."""
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
        if len(grid) != len(self.grid) or any(
            isinstance(g, bool) or not isinstance(g, int) or g < 0 for g in grid
        ):
            raise ValueError(
                f"grid: expected {len(self.grid)} ints >= 0 (one per grid dimension), got {grid!r}"
            )
        return dataclasses.replace(self, grid=grid)

    def before_end(self, step: Int) -> Any:
        """Whether grid step `step` exists (a Python bool when both are static)."""
        return step < self.num_steps

    @property
    def lookahead(self) -> int:
        """How many fetches per input are in flight: max_concurrent_steps - delay_release."""
        return self.max_concurrent_steps - self.delay_release

    # ---- rules: valid on Python ints and on traced int32 scalars ----
    def grid_indices(self, step: Int | GridPoint) -> tuple[Int, ...]:
        """Row-major grid indices of a linear step (in the whole grid: offset for one core's part).
        A `GridPoint` gives its indices as they are (then offset the same way)."""
        indices = step.indices if isinstance(step, GridPoint) else unravel(step, self.grid)
        if not self.grid_offsets:
            return indices
        return tuple(i + o for i, o in zip(indices, self.grid_offsets))

    def block_indices(self, op: OperandPlan, step: Int) -> tuple[Any, ...]:
        """What `op`'s index map returns at `step`: a block index per dimension, an element offset
        for `pl.Element` dimensions, a `pl.ds(start, size)` for `pl.BoundedSlice` ones."""
        out = self.block_indices_of(op.index_map, step)
        if len(out) != len(op.block_shape):
            raise ValueError(
                f"{op.name}: index_map returned {len(out)} indices for a {len(op.block_shape)}-d "
                f"block_shape {op.block_shape}"
            )
        for d, entry in enumerate(out):
            _check_entry(op.name, d, entry, op.bounded_dims, op.block_dims[d])
            if d in op.bounded_dims:
                _check_bounded(op, d, entry)
        return out

    def block_indices_of(self, index_map: Callable, step: Int) -> tuple[Int, ...]:
        """`index_map` at `step`'s grid indices, as a tuple."""
        out = index_map(*self.grid_indices(step))
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def window(self, op: OperandPlan, step: Int) -> tuple[tuple[Int, Int], ...]:
        """(element offset, size) per array dimension of the operand's block at `step`: the size
        is the block's, except in a `pl.BoundedSlice` dimension, where the index map gives it
        (possibly traced), and in a partial dimension (`OperandPlan.partial_dims`), where it is
        what is left of the array from the offset, between 0 and a block; the slot always holds
        a whole block."""
        out = []
        partial = op.partial_dims
        for d, (i, size) in enumerate(zip(self.block_indices(op, step), op.block_dims)):
            if d in op.bounded_dims:
                out.append((i.start, i.size))
            elif d in partial:
                start, left = i * size, op.array_shape[d] - i * size
                filled = (
                    min(max(left, 0), size) if isinstance(left, int) else jnp.clip(left, 0, size)
                )
                out.append((start, filled))
            else:
                out.append((i if d in op.element_dims else i * size, size))
        return tuple(out)

    def offsets(self, op: OperandPlan, step: Int) -> tuple[Int, ...]:
        """Element offsets of the operand's block at `step`."""
        return tuple(off for off, _ in self.window(op, step))

    def block_key(self, op: OperandPlan, step: Int) -> tuple[Int, ...]:
        """What identifies `op`'s block at `step`: its index-map entries, a bounded window's as
        (start, size). Equal keys at two steps: the same block (no new fetch, no write-back)."""
        return tuple(
            x
            for entry in self.block_indices(op, step)
            for x in ((entry.start, entry.size) if _is_slice(entry) else (entry,))
        )

    def slot(self, op: OperandPlan, step: Int) -> Int:
        """The buffer slot the body uses for input `op` at `step` under the every-step fetch rule
        (warp-specialized pipelines); the other rules count blocks, not steps
        (`conveyor.plans.fetch.read_slot`). Outputs: see `output_slot`."""
        return 0 if op.invariant else step % op.num_slots

    def input_lookahead(self, op: OperandPlan) -> int:
        """How many fetches of input `op` are in flight: its slots minus delay_release (its own
        `pl.Buffered(n)` count, or max_concurrent_steps)."""
        return op.num_slots - self.delay_release

    def prologue_steps(self, op: OperandPlan) -> range:
        """Steps whose blocks of input `op` are fetched before step 0 runs. With a dynamic grid
        these are the steps that may exist: lowerings predicate each fetch on `before_end(step)`."""
        count = 1 if op.invariant else self.input_lookahead(op)
        return range(min(count, self.num_steps) if self.is_static else count)

    def fetch_step(self, op: OperandPlan, step: Int) -> Int:
        """The step whose block of input `op` is fetched while `step` runs (may be >= num_steps:
        none); under the every-step rule into the slot step `step - delay_release` used, under the
        on-change rule only if that step changes the block (`conveyor.plans.fetch`)."""
        return step + self.input_lookahead(op)

    def fetch_at(self, step: Int) -> Int:
        """`fetch_step` for inputs with max_concurrent_steps slots (all of a warp-specialized
        pipeline's)."""
        return step + self.lookahead

    def block_changes(self, op: OperandPlan, step: Int) -> Any:
        """True when `op`'s block index at step + 1 differs from step's (False at the last step)."""
        if op.invariant:
            return False
        table = self.block_changes_table.get(op.name) if isinstance(step, int) else None
        if table is not None and 0 <= step < len(table):
            return table[step]
        n = self.num_steps
        nxt = (
            min(step + 1, n - 1)
            if isinstance(step, int) and isinstance(n, int)
            else jnp.minimum(step + 1, n - 1)
        )
        a, b = self.block_key(op, step), self.block_key(op, nxt)
        if all(isinstance(x, int) for x in a + b):
            return a != b
        diff = False
        for x, y in zip(a, b):
            diff = jnp.logical_or(diff, jnp.asarray(x) != jnp.asarray(y))
        return diff

    def writes_back(self, op: OperandPlan, step: Int) -> Any:
        """An output block is written back after `step` when its index changes next, or at the
        end."""
        last = step == self.num_steps - 1
        if op.invariant:
            return last
        changes = self.block_changes(op, step)
        if isinstance(last, bool) and isinstance(changes, bool):
            return last or changes
        return jnp.logical_or(last, changes)

    def output_slot(self, op: OperandPlan, writebacks_before: Int) -> Int:
        """Outputs alternate between their slots at each write-back."""
        return 0 if op.invariant else writebacks_before % op.num_slots

    def program(self, in_flight_steps: int = 0) -> Program:
        """The schedule as an event program with one actor, "thread"
        (`conveyor.plans.pipeline_program.pipeline_program`)."""
        return pipeline_program(self, in_flight_steps)


def _is_slice(entry: Any) -> bool:
    """An index-map entry that is a `pl.ds(start, size)` (Pallas's Slice)."""
    return isinstance(entry, _compat.Slice)


def _check_entry(
    name: str, d: int, entry: Any, bounded_dims: tuple[int, ...], block: int | None
) -> None:
    """Index-map entry d is a pl.ds exactly when dimension d is a pl.BoundedSlice."""
    if (d in bounded_dims) != _is_slice(entry):
        raise ValueError(
            f"{name}: index_map entry {d} is {entry!r}: "
            + (
                f"a pl.BoundedSlice({block}) dimension takes pl.ds(start, size)"
                if d in bounded_dims
                else "pl.ds is only for pl.BoundedSlice dimensions"
            )
        )


def _check_bounded(op: OperandPlan, d: int, entry: Any) -> None:
    """A BoundedSlice window: stride 1, and a static size in [0, block size] (a traced size out of
    that range makes the block out of bounds: `conveyor.pipeline.lowering`)."""
    limit = op.block_dims[d]
    if getattr(entry, "stride", 1) != 1:
        raise ValueError(
            f"{op.name}: index_map entry {d} is {entry!r}: a pl.BoundedSlice window takes stride 1"
        )
    if isinstance(entry.size, int) and not 0 <= entry.size <= limit:
        raise ValueError(
            f"{op.name}: index_map entry {d} is {entry!r}: its size must be in [0, {limit}] "
            f"(pl.BoundedSlice({limit}))"
        )


def _is_invariant(
    index_map: Callable,
    grid: tuple[int, ...],
    name: str,
    rank: int,
    bounded_dims: tuple[int, ...] = (),
    block_dims: tuple[Any, ...] = (),
) -> bool:
    """Does the index map ignore the grid? Decided exactly: the map is traced on symbolic grid
    indices and invariant iff none of its results depends on any of them (a map that uses a grid
    index only in some steps, e.g. through `jnp.where`, is grid-dependent). The same answer inside
    and outside jit; errors of the map itself propagate, named."""

    def flat_map(*indices):  # a pl.ds entry (BoundedSlice) counts as its start and size
        out = index_map(*indices)
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(out) == rank:
            for d, entry in enumerate(out):
                _check_entry(name, d, entry, bounded_dims, block_dims[d] if block_dims else None)
        return tuple(
            jnp.asarray(x) for e in out for x in ((e.start, e.size) if _is_slice(e) else (e,))
        )

    slices = len(bounded_dims)
    try:
        num_outputs, used = args_reaching_outputs(flat_map, len(grid))
    except Exception as e:
        e.add_note(f"(raised by the index_map of {name}, traced on {len(grid)} int32 grid indices)")
        raise
    if num_outputs != rank + slices:
        raise ValueError(
            f"{name}: index_map returned {num_outputs - slices} indices for a {rank}-d block_shape"
            + (
                f" ({slices} pl.BoundedSlice dimension(s), each a pl.ds(start, size))"
                if slices
                else ""
            )
        )
    return not used


def _slot_count(
    name: str,
    is_input: bool,
    invariant: bool,
    count: int | None,
    max_concurrent_steps: int,
    delay_release: int,
    no_pipelining: bool,
) -> int:
    """An operand's slots: 1 when index-invariant (fetched once: a `pl.Buffered(n)` asks for slots
    it would never use, as upstream accepts) or under no_pipelining; else its own
    `pl.Buffered(count)` when given and workable (an input needs count > delay_release, an output
    takes 1 or 2); else max_concurrent_steps for an input, 2 for an output. A count the plan
    cannot give is a ValueError naming the operand and the rule."""
    if invariant:
        return 1
    if no_pipelining:
        slots, rule = 1, "no_pipelining gives every operand one slot"
    elif count is None:
        return max_concurrent_steps if is_input else 2
    elif count > delay_release if is_input else count in (1, 2):
        return count
    else:
        slots = max_concurrent_steps if is_input else 2
        rule = (
            f"an input needs more than delay_release={delay_release}, so a slot is free to "
            "prefetch into"
            if is_input
            else "an output takes 1 or 2"
        )
    if count is not None and count != slots:
        raise ValueError(
            f"{name}: pipeline_mode=Buffered({count}) is not supported for this "
            f"{'input' if is_input else 'output'} ({rule}); it gets {slots} slot(s): drop "
            "pipeline_mode or change the count"
        )
    return slots


def _fetch_rule(name: str, options: PallasOptions, reuse_unchanged_blocks: bool) -> str:
    if not isinstance(reuse_unchanged_blocks, bool):
        raise ValueError(f"reuse_unchanged_blocks: expected a bool, got {reuse_unchanged_blocks!r}")
    if options.use_lookahead and not reuse_unchanged_blocks:
        raise ValueError(
            f"{name}: pl.Buffered(use_lookahead=True) fetches only the blocks that change, which "
            "reuse_unchanged_blocks=False forbids; drop one of them"
        )
    if options.use_lookahead:
        return fetch_lib.LOOKAHEAD
    return fetch_lib.ON_CHANGE if reuse_unchanged_blocks else fetch_lib.EVERY_STEP


def _grid_size(size: Any, grid: tuple) -> Int:
    """A grid size: a positive Python int (static), or an integer scalar array, typically traced
    inside a kernel (dynamic: it may be 0, and a negative size runs no step)."""
    if isinstance(size, bool):
        raise ValueError(f"grid: expected positive ints or integer scalars, got {grid!r}")
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(
                f"grid: static sizes must be positive ints, got {grid!r} (a size that may be 0 "
                "must be dynamic: an int32 scalar computed or read inside the kernel)"
            )
        return size
    if getattr(size, "shape", None) == () and jnp.issubdtype(
        getattr(size, "dtype", None), jnp.integer
    ):
        return jnp.maximum(jnp.asarray(size, jnp.int32), 0)
    raise ValueError(f"grid: expected positive ints or integer scalars, got {grid!r}")


def plan(
    *,
    grid: Sequence[Int],
    in_specs: Sequence[Any] = (),
    out_specs: Sequence[Any] = (),
    max_concurrent_steps: int = 1,
    delay_release: int = 0,
    no_pipelining: bool = False,
    dimension_semantics: Sequence[Any] | None = None,
    reuse_unchanged_blocks: bool = True,
) -> PipelinePlan:
    """Build the pipeline plan (docs/pipelining.md describes the schedule it encodes).

    Args:
      grid: static ints mixed with dynamic sizes (integer scalars traced inside the kernel).
      in_specs, out_specs: one entry per operand, a block spec or a pytree of them
        (`conveyor.plans.specs`).
      max_concurrent_steps: input slots, unless an input's `pl.Buffered(n)` (n > delay_release)
        sets its own; an input keeps slots - delay_release fetches in flight. Outputs get 2
        slots, or 1 with `pl.Buffered(1)` (the write-back is then awaited when issued).
      delay_release: steps a slot stays readable after its own step.
      no_pipelining: the debug schedule: one slot per operand, no copy in flight during a body.
      dimension_semantics: "parallel" / "arbitrary" (or `pltpu.PARALLEL` / `pltpu.ARBITRARY`) per
        grid dimension; `for_core` cuts a parallel one.
      reuse_unchanged_blocks: fetch an input only at steps that change its block (with
        `pl.Buffered(n, use_lookahead=True)` as far ahead as its slots allow); False fetches
        every step, as warp-specialized pipelines do (`conveyor.plans.fetch`).

    Returns:
      The `PipelinePlan`.

    Raises:
      ValueError: non-positive static grid sizes, max_concurrent_steps < 1, delay_release < 0, or
        max_concurrent_steps <= delay_release (no slot would ever be free to prefetch into).
    """
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    grid = tuple(_grid_size(g, grid) for g in grid)
    semantics = normalize_semantics(dimension_semantics, len(grid))
    if not isinstance(max_concurrent_steps, int) or max_concurrent_steps < 1:
        raise ValueError(
            f"max_concurrent_steps: expected an int >= 1, got {max_concurrent_steps!r}"
        )
    if not isinstance(delay_release, int) or delay_release < 0:
        raise ValueError(f"delay_release: expected an int >= 0, got {delay_release!r}")
    if not isinstance(no_pipelining, bool):
        raise ValueError(f"no_pipelining: expected a bool, got {no_pipelining!r}")
    if no_pipelining and (max_concurrent_steps, delay_release) != (1, 0):
        raise ValueError(
            "no_pipelining=True runs one step at a time with one slot per operand; it cannot be "
            f"combined with max_concurrent_steps={max_concurrent_steps}, "
            f"delay_release={delay_release} (leave them at 1 and 0)"
        )
    in_specs, in_names, in_trees = flatten_specs(in_specs, "in")
    out_specs, out_names, out_trees = flatten_specs(out_specs, "out")
    in_windowed = tuple(spec is not None for spec in in_specs)
    out_windowed = tuple(spec is not None for spec in out_specs)
    in_names = tuple(nm for sp, nm in zip(in_specs, in_names) if sp is not None)
    out_names = tuple(nm for sp, nm in zip(out_specs, out_names) if sp is not None)
    in_specs = tuple(sp for sp in in_specs if sp is not None)
    out_specs = tuple(sp for sp in out_specs if sp is not None)
    in_options = [pallas_options(spec, name, True) for spec, name in zip(in_specs, in_names)]
    out_options = [pallas_options(spec, name, False) for spec, name in zip(out_specs, out_names)]
    delay_release = max([delay_release] + [o.delay_release for o in in_options])
    if max_concurrent_steps <= delay_release:
        raise ValueError(
            f"max_concurrent_steps={max_concurrent_steps} must be greater than "
            f"delay_release={delay_release} (the largest of the pipeline's and its input "
            "BlockSpecs'): a slot is held for delay_release steps after its use, so with "
            "max_concurrent_steps <= delay_release no slot is ever free to prefetch into"
        )
    steps = math.prod(grid)
    if isinstance(steps, int) and max_concurrent_steps > steps:
        # Documented: no more slots than steps (as upstream), but at least delay_release + 1 so a
        # slot stays free to fetch into. delay_release is kept: a body's manual releases follow it.
        max_concurrent_steps = max(steps, delay_release + 1)

    def build(specs, names, options, is_input):
        ops = []
        for spec, name, opts in zip(specs, names, options):
            bs = as_block_spec(spec, name)
            whole = bs.block_shape == WHOLE_ARRAY
            # A whole-array block is the only block: fetched or written once (its map is checked
            # once its rank is known, in with_array_shapes).
            sizes, elements, bounded = block_dimensions(bs.block_shape, name)
            inv = whole or _is_invariant(
                bs.index_map, grid, name, len(bs.block_shape), bounded, sizes
            )
            slots = _slot_count(
                name,
                is_input,
                inv,
                opts.buffer_count,
                max_concurrent_steps,
                delay_release,
                no_pipelining,
            )
            if opts.prefetched_count > slots:  # an invariant input's single slot
                raise ValueError(
                    f"{name}: prefetched_count={opts.prefetched_count} but this index-invariant "
                    f"input is fetched once into {slots} slot: at most {slots} can be prefetched"
                )
            ops.append(
                OperandPlan(
                    name=name,
                    block_shape=sizes,
                    index_map=bs.index_map,
                    invariant=inv,
                    num_slots=slots,
                    transforms=opts.transforms,
                    element_dims=elements,
                    bounded_dims=bounded,
                    whole_array=whole,
                    fetch_rule=_fetch_rule(name, opts, reuse_unchanged_blocks),
                    prefetched=opts.prefetched_count,
                )
            )
        return tuple(ops)

    return PipelinePlan(
        grid=grid,
        inputs=build(in_specs, in_names, in_options, True),
        outputs=build(out_specs, out_names, out_options, False),
        max_concurrent_steps=max_concurrent_steps,
        delay_release=delay_release,
        in_trees=in_trees,
        out_trees=out_trees,
        in_windowed=in_windowed,
        out_windowed=out_windowed,
        dimension_semantics=semantics,
    )
