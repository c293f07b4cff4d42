"""cv.emit_pipeline: build the plan, then hand it to the launching kernel's backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax import lax
from jax.experimental import pallas as pl

from conveyor.kernel import current_context, program_id
from conveyor.pipeline import xla as xla_exec
from conveyor.pipeline.lowering import under_vmap
from conveyor.pipeline.caller_allocations import (
    PrefetchedBlocks,
    check_caller_allocations,
    claim,
    note_pending,
    refuse_gpu_allocations,
)
from conveyor.pipeline import gpu_tiles
from conveyor.pipeline.tpu_tiles import tpu_tile
from conveyor.plans import pipeline as plan_lib, specs as specs_lib, warp


def _check_shapes(p: plan_lib.PipelinePlan, refs):
    for op, ref in zip(p.inputs + p.outputs, refs):
        if len(op.block_shape) != len(ref.shape):
            raise ValueError(
                f"{op.name}: block_shape {op.block_shape} has {len(op.block_shape)} dims, the ref "
                f"has shape {tuple(ref.shape)}"
            )
        for d, (b, s) in enumerate(zip(op.block_dims, ref.shape)):
            if d in op.bounded_dims and b > s:
                raise ValueError(
                    f"{op.name}: pl.BoundedSlice({b}) in dimension {d} is larger than the array "
                    f"({tuple(ref.shape)}); its windows could never fill a slot"
                )


def _refuse_inner_vmap(refs, backend: str) -> None:
    """`jax.vmap` of a pipeline inside a Mosaic kernel: JAX has no batching rule for
    `pl.run_scoped`, which allocates the pipeline's on-chip slots; refused by name (xla batches
    it)."""
    if backend in ("mosaic_tpu", "mosaic_gpu") and under_vmap(refs):
        raise NotImplementedError(
            f"emit_pipeline under jax.vmap inside a {backend} kernel: JAX has no batching rule "
            "for pl.run_scoped, which allocates the pipeline's on-chip slots. Loop over the batch "
            "instead (a Python or lax.fori_loop loop calling the pipeline on ref.at[b]), add the "
            "batch to the pipeline's grid, or vmap the whole cv.kernel; on xla it runs as is"
        )


def _refuse_bounded_windows_on_gpu(p: plan_lib.PipelinePlan) -> None:
    bounded = [op.name for op in p.inputs + p.outputs if op.bounded_dims]
    if bounded:
        raise NotImplementedError(
            f"pl.BoundedSlice windows ({', '.join(bounded)}) on mosaic_gpu: a TMA copy's box has a "
            "static size, so a window whose size varies per step cannot be copied; use a fixed "
            "block (pl.Element offsets) and mask the rows in the body"
        )


def _check_tpu_tiling(p: plan_lib.PipelinePlan, refs):
    """Mosaic TPU lays VMEM blocks out in (sublane, 128-lane) tiles (`tpu_tiles`): the last block
    dim must be a multiple of 128 and the second-to-last a multiple of 8 (32-bit), 16 (16-bit) or
    32 (8-bit), unless the block spans the whole array dimension; a partial last block there copies
    a window the compiler must prove tile-aligned, so the array's extent must be a multiple of the
    tile. The TPU interpreter does not check this (shared FACTS), so we do, before a real TPU
    compile would refuse."""
    for op, ref in zip(p.inputs + p.outputs, refs):
        shape = tuple(ref.shape)
        for d in range(max(0, len(shape) - 2), len(shape)):
            need = tpu_tile(ref.dtype, d, len(shape))
            if op.block_shape[d] is None:
                continue
            b = op.block_shape[d]
            if b % need and b != shape[d]:
                raise ValueError(
                    f"{op.name}: block_shape {op.block_shape} does not fit Mosaic TPU tiling for "
                    f"{ref.dtype}: dimension {d} is {b}, expected a multiple of {need} or the "
                    f"whole dimension ({shape[d]})"
                )
            if d in op.partial_dims and shape[d] % need:
                raise ValueError(
                    f"{op.name}: block_shape {op.block_shape} leaves a partial last block in "
                    f"dimension {d} of an array of shape {shape}; on Mosaic TPU that dimension "
                    f"must be a multiple of its tile ({need} for {ref.dtype}) so the partial copy "
                    f"stays tile-aligned, got {shape[d]}: pad the array to a multiple of {need}"
                )


def _split_refs(p: plan_lib.PipelinePlan, refs, api: str):
    """From one argument per operand (each a pytree of refs shaped like its spec): the plan with
    its whole-array blocks sized, the refs of the planned inputs and outputs, and every flattened
    leaf's ref in order (the body wrapper passes the unwindowed ones through)."""
    n_in, n_out = len(p.in_trees), len(p.out_trees)
    if len(refs) != n_in + n_out:
        raise ValueError(
            f"{api}: expected {n_in} input refs and {n_out} output refs ({n_in + n_out} in all, "
            f"matching in_specs/out_specs), got {len(refs)}"
        )
    flat = []
    for k, (tree, ref) in enumerate(zip(p.in_trees + p.out_trees, refs)):
        name = f"in[{k}]" if k < n_in else f"out[{k - n_in}]"
        try:
            flat += tree.flatten_up_to(ref)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"{api}: {name}: the refs do not have the structure of its block specs ({tree}): "
                f"{e}"
            ) from None
    windowed = p.in_windowed + p.out_windowed
    n_leaves_in = len(p.in_windowed)
    ins = tuple(r for r, w in zip(flat[:n_leaves_in], p.in_windowed) if w)
    outs = tuple(r for r, w in zip(flat[n_leaves_in:], p.out_windowed) if w)
    p = p.with_array_shapes([r.shape for r in ins + outs])
    _check_shapes(p, ins + outs)
    return p, ins, outs, tuple(r if not w else None for r, w in zip(flat, windowed))


def _structured_body(p: plan_lib.PipelinePlan, body, passthrough):
    """The body on the planned block refs, calling the user's with one argument per operand (each a
    pytree shaped like its spec, unwindowed leaves as their whole refs); the body itself when every
    operand is one planned spec."""
    trees = p.in_trees + p.out_trees
    windowed = p.in_windowed + p.out_windowed
    if all(t.num_leaves == 1 and t.num_nodes == 1 for t in trees) and all(windowed):
        return body
    n_blocks = sum(windowed)

    def flat_body(indices, *args):
        blocks, rest = iter(args[:n_blocks]), args[n_blocks:]
        leaves = [next(blocks) if w else ref for w, ref in zip(windowed, passthrough)]
        grouped, at = [], 0
        for tree in trees:
            grouped.append(tree.unflatten(leaves[at : at + tree.num_leaves]))
            at += tree.num_leaves
        return body(indices, *grouped, *rest)

    return flat_body


def _core_info(core_axis: Any, core_axis_name: Any, ctx) -> tuple[int, Any] | None:
    """Megacore: (number of cores, this core's index) from the kernel grid axis `core_axis` or the
    named axis `core_axis_name`, as upstream resolves them; None without either."""
    if core_axis is not None and core_axis_name is not None:
        raise ValueError(
            f"emit_pipeline: give core_axis ({core_axis!r}) or core_axis_name "
            f"({core_axis_name!r}), not both"
        )
    if core_axis is not None:
        if (
            isinstance(core_axis, bool)
            or not isinstance(core_axis, int)
            or not 0 <= core_axis < len(ctx.grid)
        ):
            raise ValueError(
                f"core_axis: expected an axis of this kernel's grid {ctx.grid} (an int in [0, "
                f"{len(ctx.grid)})), got {core_axis!r}"
            )
        return ctx.grid[core_axis], program_id(core_axis)
    if core_axis_name is not None:
        if not isinstance(core_axis_name, str):
            raise NotImplementedError(
                f"core_axis_name: one axis name is supported, got {core_axis_name!r}"
            )
        size = lax.axis_size(core_axis_name)
        if not isinstance(size, int):
            raise ValueError(
                f"core_axis_name={core_axis_name!r}: the axis size must be static, got {size!r}"
            )
        return size, lax.axis_index(core_axis_name)
    return None


def _with_scratches(
    body: Callable[..., Any], scratches: Sequence[Any], n_operands: int
) -> Callable[..., Any]:
    """Upstream's `scratches=`: refs handed to every step after the operands' blocks (before a
    carry)."""
    if not isinstance(scratches, (tuple, list)):
        raise ValueError(
            f"scratches: expected a tuple or list of refs for the body, got {scratches!r}"
        )
    if not scratches:
        return body

    def with_scratches(indices, *args):
        return body(indices, *args[:n_operands], *scratches, *args[n_operands:])

    return with_scratches


def _check_onchip_spaces(in_specs, out_specs, backend: str) -> None:
    """A spec's `memory_space` naming one Mosaic backend's on-chip memory is refused on the other
    (xla, which emulates both, takes either)."""
    for side, specs in (("in", in_specs), ("out", out_specs)):
        flat, names, _ = specs_lib.flatten_specs(specs, side)
        for spec, name in zip(flat, names):
            wanted = specs_lib.onchip_backend(getattr(spec, "memory_space", None))
            if wanted not in (None, backend) and backend != "xla":
                raise ValueError(
                    f"{name}: memory_space={spec.memory_space!r} is {wanted}'s on-chip memory; "
                    f"this pipeline runs on {backend}: name its space or leave it unset"
                )


def emit_pipeline(
    body: Callable[..., Any],
    *,
    grid: Sequence[Any],
    in_specs: Sequence[Any] = (),
    out_specs: Sequence[Any] = (),
    max_concurrent_steps: int = 1,
    delay_release: int = 0,
    init_carry: Any = None,
    no_pipelining: bool = False,
    dimension_semantics: Sequence[Any] | None = None,
    core_axis: Any = None,
    core_axis_name: Any = None,
) -> Callable[..., Any]:
    """A software pipeline over `grid`: block copies into on-chip memory overlapped with `body`.

    Call the returned `run` inside a `cv.kernel` body with the global-memory refs (inputs, then
    outputs). `body(indices, *in_block_refs, *out_block_refs)` runs once per grid step, row-major,
    `indices` being the step's grid indices on every backend. The schedule (slots, fetch and
    write-back rules, output residency) is `conveyor.plans.pipeline`'s; docs/pipelining.md shows
    each option at work: pytree operands, dynamic grids, megacore, allocations and prefetch.

    Args:
      body: the step; with `init_carry`, `body(indices, *refs, carry)` returns the next carry.
      grid: positive ints, or int32 scalars computed inside the kernel (a dynamic grid, possibly
        empty; the checker and simulator then need `run.plan.with_grid(...)`).
      in_specs: one entry per input: a block spec (`cv.BlockSpec`, `pl.BlockSpec`) or a pytree of
        them, and the body gets block refs of the same structure (errors name a leaf as
        `in[0]['w']`). `pipeline_mode=pl.Buffered(n, prefetched_count=p)` says the caller put the
        input's first p blocks in its first p slots (xla and mosaic_tpu).
      out_specs: the same per output; `pl.Buffered(1)` gives an output one slot.
      max_concurrent_steps: slots per input; `max_concurrent_steps - delay_release` fetches are in
        flight.
      delay_release: steps a slot stays held after the step that read it.
      init_carry: the first step's carry; the pipeline returns the last one.
      no_pipelining: the debug schedule: one slot per operand, no copy in flight during a body.
      dimension_semantics: "parallel" / "arbitrary" per grid dimension: what a core axis cuts.
      core_axis: an axis of the `cv.kernel` grid (or `core_axis_name`, a named axis in scope)
        whose programs each run their part of `grid` (megacore; indices stay the whole grid's).
      core_axis_name: see `core_axis`.

    Returns:
      `run(*refs, allocations=None, scratches=(), prefetched=None)`: `scratches` are refs handed
      to every step after the blocks; `allocations` the on-chip memory to run on
      (`run.get_allocations(*refs)`, or inside `run.with_allocations(fn, *refs)`); `prefetched`
      what `run.prefetch(*refs, allocations=a)` returned, whose fetches overlap the kernel's work
      before the pipeline. Allocations and prefetch run on xla and mosaic_tpu (NotImplementedError
      on mosaic_gpu). `run.plan` is the schedule.

    Raises:
      ValueError: refs that do not match the specs, an option out of range (each names the
        operand, the rule and the value). A block that does not divide its array is allowed: the
        last block is partial (the out-of-bounds rule in docs/pipelining.md).
    """
    whole = plan_lib.plan(
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        max_concurrent_steps=max_concurrent_steps,
        delay_release=delay_release,
        no_pipelining=no_pipelining,
        dimension_semantics=dimension_semantics,
    )

    def prepare(refs, api: str):
        ctx = current_context(api)
        _check_onchip_spaces(in_specs, out_specs, ctx.backend)
        _refuse_inner_vmap(refs, ctx.backend)
        cores = _core_info(core_axis, core_axis_name, ctx)
        p = whole if cores is None else whole.for_core(cores[1], cores[0])
        p, ins, outs, passthrough = _split_refs(p, refs, "pipeline")
        if ctx.backend == "mosaic_tpu":
            _check_tpu_tiling(p, ins + outs)
        elif ctx.backend == "mosaic_gpu":
            _refuse_bounded_windows_on_gpu(p)
            gpu_tiles.check_pipeline_arrays(p.inputs + p.outputs, ins + outs)
            _refuse_prefetched_count(p, "a plain pipeline on mosaic_gpu")
            if ctx.num_threads > 1:
                raise NotImplementedError(
                    "emit_pipeline: a plain pipeline inside a mosaic_gpu kernel with "
                    f"num_threads={ctx.num_threads} is not supported (its shared-memory slots "
                    "would have to be allocated per warpgroup): use "
                    "cv.emit_pipeline_warp_specialized, or launch the kernel with one thread"
                )
        elif ctx.backend != "xla":
            raise NotImplementedError(
                f"emit_pipeline: backend {ctx.backend!r} is not implemented yet"
            )
        return ctx, p, ins, outs, passthrough

    def get_allocations(*refs) -> dict:
        ctx, p, ins, outs, _ = prepare(refs, "emit_pipeline(...).get_allocations(refs)")
        if ctx.backend == "xla":
            return {}  # no on-chip memory: the pipeline's blocks are fresh refs
        if ctx.backend == "mosaic_tpu":
            from conveyor.pipeline import mosaic_tpu

            return mosaic_tpu.allocations(p, ins, outs)
        refuse_gpu_allocations("get_allocations")

    def with_allocations(fn: Callable[[dict], Any], *refs) -> Any:
        allocations = get_allocations(*refs)
        return fn(allocations) if not allocations else pl.run_scoped(fn, allocations)

    def prefetch(*refs, allocations: dict) -> PrefetchedBlocks:
        ctx, p, ins, outs, _ = prepare(refs, "emit_pipeline(...).prefetch(refs)")
        if ctx.backend == "mosaic_gpu":
            refuse_gpu_allocations("prefetch")
        check_caller_allocations(ctx, allocations)
        token = PrefetchedBlocks(pipeline=run, allocations=allocations)
        note_pending(ctx, allocations, None, token)
        if ctx.backend == "mosaic_tpu":
            from conveyor.pipeline import mosaic_tpu

            mosaic_tpu.prefetch(p, ins, outs, allocations)
        return token

    def run(
        *refs,
        allocations: dict | None = None,
        scratches: Sequence[Any] = (),
        prefetched: PrefetchedBlocks | None = None,
        **call_options,
    ):
        # older upstream TPU call options (first_cycle, last_cycle, init_accumulators, ...)
        if call_options:
            raise NotImplementedError(
                f"emit_pipeline(...)(refs, {', '.join(f'{k}=' for k in sorted(call_options))}): "
                "not supported by Conveyor's plain pipeline, which takes allocations=, scratches= "
                "and prefetched= (see run.get_allocations and run.prefetch)"
            )
        ctx, p, ins, outs, passthrough = prepare(refs, "emit_pipeline(...)(refs)")
        if p.prefetched_inputs and allocations is None:  # every backend: code runs the same on each
            raise ValueError(
                f"{', '.join(p.prefetched_inputs)}: pl.Buffered(prefetched_count=...) says the "
                "caller has put the first blocks in the input's slots, so the pipeline must run "
                "on the caller's allocations: run(*refs, allocations=a), with a from "
                "run.get_allocations(*refs) (or run.with_allocations) and a['slots'][i][j] "
                "holding the input's j-th block (none was given)"
            )
        if prefetched is not None:
            claim(prefetched, run, allocations)
        if allocations is not None:
            check_caller_allocations(ctx, allocations)
            note_pending(ctx, allocations, run, prefetched)
        user_body = _with_scratches(body, scratches, len(p.in_trees) + len(p.out_trees))
        body_on_blocks = _structured_body(p, user_body, passthrough)
        has_carry = init_carry is not None
        if ctx.backend == "xla":
            return xla_exec.run_pipeline(p, body_on_blocks, ins, outs, init_carry, has_carry)
        if ctx.backend == "mosaic_tpu":
            from conveyor.pipeline import mosaic_tpu

            return mosaic_tpu.run_pipeline(
                p,
                body_on_blocks,
                ins,
                outs,
                init_carry,
                has_carry,
                allocations,
                prefetched is not None,
            )
        if allocations is not None or prefetched is not None:
            refuse_gpu_allocations("allocations=" if prefetched is None else "prefetched=")
        from conveyor.pipeline import mosaic_gpu

        return mosaic_gpu.run_pipeline(p, body_on_blocks, ins, outs, init_carry, has_carry)

    run.plan = whole
    run.get_allocations = get_allocations
    run.with_allocations = with_allocations
    run.prefetch = prefetch
    return run


def _refuse_prefetched_count(p: plan_lib.PipelinePlan, where: str) -> None:
    if p.prefetched_inputs:
        raise NotImplementedError(
            f"{where}: {', '.join(p.prefetched_inputs)} use pl.Buffered(prefetched_count=...), "
            "slots filled by the caller before the pipeline, which only plain pipelines on "
            "mosaic_tpu and xla take (a GPU pipeline's slots are its own shared memory; chain "
            "warp-specialized pipelines with pipeline_state= instead)"
        )


def emit_pipeline_with_allocations(
    body: Callable[..., Any], **options: Any
) -> tuple[Callable[..., Any], Callable[..., dict]]:
    """Upstream TPU's spelling: `(pipeline, make_allocations)`, i.e. `emit_pipeline(body,
    **options)`
    and its `get_allocations`, whose dict `pl.run_scoped` allocates once for several calls of the
    pipeline (`pipeline(*refs, allocations=...)`)."""
    run = emit_pipeline(body, **options)
    return run, run.get_allocations


def emit_pipeline_warp_specialized(
    body: Callable[..., Any],
    *,
    grid: Sequence[Any],
    memory_registers: int,
    in_specs: Sequence[Any] = (),
    out_specs: Sequence[Any] = (),
    max_concurrent_steps: int = 2,
    delay_release: int = 0,
    wg_axis: str,
    num_compute_wgs: int,
    manual_consumed_barriers: bool = False,
    manual_produced_barriers: bool = False,
    carry_coroutine: Callable[[], Any] | None = None,
    memory_thread_idx: int | None = None,
    compute_context: Callable[[Callable[..., Any]], None] | None = None,
    pipeline_state: Any = None,
) -> Callable[..., Any]:
    """A pipeline whose fetches one memory thread issues while `num_compute_wgs` threads compute.

    Every thread of a `cv.kernel(..., num_threads=num_compute_wgs + 1, thread_name=wg_axis)` body
    calls the result with the global refs (inputs, then outputs). The thread whose
    `lax.axis_index(wg_axis)` is `memory_thread_idx` (default: the last) fetches; the others run
    `body(indices, *in_block_refs, *out_block_refs[, *produced_barriers][, *consumed_barriers][,
    carry])` at each step, picking their share by `lax.axis_index(wg_axis)`. Outputs may be shared
    by several compute threads, each writing its part: a block is stored once all are done with
    it. Protocol: `conveyor.plans.warp`; guide: docs/pipelining.md, "Warp specialization".

    Args:
      memory_registers: the memory thread's register budget on GPU (a multiple of 8 in [24, 256]);
        the compute threads get the rest of the register file, rounded down to a multiple of 8.
      grid, in_specs, out_specs: as in `emit_pipeline`.
      max_concurrent_steps, delay_release: as in `emit_pipeline` (default 2 slots).
      wg_axis: the kernel's thread axis name (`cv.kernel(thread_name=...)`).
      num_compute_wgs: the compute threads; the kernel has one more, the memory thread.
      memory_thread_idx: the memory thread's index on `wg_axis` (default: the last); with 0 the
        compute threads are 1..num_compute_wgs.
      manual_consumed_barriers: pass one consumed barrier per input to the body (after the output
        refs). As upstream Pallas does, at step s it is the barrier of the slot step
        s - delay_release used: the body must `cv.barrier_arrive` on each at every step
        s >= delay_release (and not before), once it no longer reads that older block. A body that
        also arrives in the first delay_release steps releases slots early (a race on hardware);
        one that never arrives is reported on xla. Otherwise each compute thread arrives after the
        body, delayed by `delay_release` steps, on its own.
      manual_produced_barriers: pass one produced barrier per input to the body (after the output
        refs, before any consumed barriers), as upstream Pallas does: the barrier of the slot step s
        reads, which completes when that block's copy has landed. The compute threads then do not
        wait for the copies; the body must `cv.wait_produced` on each barrier at every step before
        it reads that input's block (e.g. to start on one input while another is still in flight).
        A body that never waits is reported on xla. Inputs must depend on the grid.
      carry_coroutine: a generator function run by each compute thread: it yields the initial carry,
        receives the final carry as the value of that yield (`final = yield init`) and returns
        (an epilogue, e.g. storing the carry). The body then takes and returns the carry.
      compute_context: upstream's form of the carry: each compute thread calls
        `compute_context(eval_pipeline)`, which may allocate (e.g. a `plgpu.ACC` accumulator with
        `pl.run_scoped`), call `eval_pipeline(carry)` (the body then takes and returns the carry;
        a Ref carry is handed to every step as it is) and run an epilogue on the result. Its
        allocations nest inside the pipeline's own, as Mosaic GPU requires of register
        accumulators (on xla, each thread's context runs inside the previous one's `eval_pipeline`,
        and the innermost runs the pipeline once for all). It must call `eval_pipeline` exactly once
        (a ValueError otherwise). Exclusive with carry_coroutine.
      pipeline_state: chain pipelines without a bubble between them, as upstream: the first of a
        chain is `PipelineState.START` (or `plgpu.PipelinePipeline.START`), then any number of
        STEADY, then one STOP; a traced int32 scalar picks at run time (e.g. in a loop over
        pipelines). Only the START fetches a prologue; the others fetch their first blocks as the
        previous pipeline's last steps release their slots, and only the STOP waits for the last
        releases. Every pipeline of the chain must run on the same caller-owned allocations
        (`run.get_allocations` / `run.with_allocations`, then `run(*refs, allocations=...)`), with
        the same block shapes, dtypes and max_concurrent_steps; the grid may differ but its number
        of steps must be a multiple of max_concurrent_steps; no delay_release, no index-invariant
        input. Until the STOP is done, the compute threads' operands may change only through the
        chain's pipelines.

    Returns:
      `run(*refs, allocations=None)`, with `run.get_allocations(*refs)` (the shared memory it runs
      on, a dict as `pl.run_scoped` takes it; empty on xla) and `run.with_allocations(fn, *refs)`,
      which calls `fn(allocations)` inside that scope on every backend (on mosaic_gpu
      `pl.run_scoped(fn, get_allocations(*refs), collective_axes=wg_axis)`).

    Raises:
      NotImplementedError: on mosaic_tpu (TPU cores have no warpgroups).
    """
    if carry_coroutine is not None and not callable(carry_coroutine):
        raise TypeError(f"carry_coroutine: expected a generator function, got {carry_coroutine!r}")
    if compute_context is not None and (
        carry_coroutine is not None or not callable(compute_context)
    ):
        raise ValueError(
            "compute_context: expected a function of eval_pipeline, and not together with "
            "carry_coroutine (both would own the compute threads' carry)"
        )
    p = plan_lib.plan(
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        max_concurrent_steps=max_concurrent_steps,
        delay_release=delay_release,
    )
    _refuse_prefetched_count(p, "emit_pipeline_warp_specialized")
    uneven = [
        op.name for op in p.inputs if not op.invariant and op.num_slots != p.max_concurrent_steps
    ]
    if uneven:
        raise NotImplementedError(
            f"emit_pipeline_warp_specialized: per-input buffering ({', '.join(uneven)}: a "
            f"pl.Buffered count other than max_concurrent_steps={p.max_concurrent_steps}) is not "
            "supported: the consumed barriers are shared by every input's slots"
        )
    wp = warp.WarpSpecializedPlan(
        pipeline=p,
        wg_axis=wg_axis,
        num_compute_wgs=num_compute_wgs,
        memory_thread_idx=memory_thread_idx,
        memory_registers=memory_registers,
        manual_consumed_barriers=bool(manual_consumed_barriers),
        manual_produced_barriers=manual_produced_barriers,
        pipeline_state=pipeline_state,
    )

    def prepare(refs, api: str):
        ctx = current_context(api)
        _check_onchip_spaces(in_specs, out_specs, ctx.backend)
        _refuse_inner_vmap(refs, ctx.backend)
        if ctx.backend == "mosaic_tpu":
            raise NotImplementedError(
                "emit_pipeline_warp_specialized: not available on mosaic_tpu (a TPU core has no "
                "warpgroups; its DMA engine already overlaps copies with compute): use "
                "cv.emit_pipeline"
            )
        if ctx.thread_name != wg_axis or ctx.num_threads != wp.num_threads:
            raise ValueError(
                f"emit_pipeline_warp_specialized: wg_axis={wg_axis!r} with "
                f"num_compute_wgs={num_compute_wgs} needs a kernel launched with "
                f"num_threads={wp.num_threads}, thread_name={wg_axis!r}; this kernel has "
                f"num_threads={ctx.num_threads}, thread_name={ctx.thread_name!r}"
            )
        sized, ins, outs, passthrough = _split_refs(p, refs, "warp-specialized pipeline")
        if ctx.backend == "mosaic_gpu":
            _refuse_bounded_windows_on_gpu(sized)
            gpu_tiles.check_pipeline_arrays(sized.inputs + sized.outputs, ins + outs)
        plan = wp if sized is p else dataclasses.replace(wp, pipeline=sized)
        return ctx, plan, ins, outs, passthrough

    def get_allocations(*refs) -> dict:
        ctx, plan, ins, outs, _ = prepare(
            refs, "emit_pipeline_warp_specialized(...).get_allocations(refs)"
        )
        if ctx.backend == "xla":
            return {}  # no on-chip memory: the pipeline's blocks are fresh refs
        from conveyor.pipeline import mosaic_gpu

        return mosaic_gpu.warp_allocations(plan, ins, outs)

    def with_allocations(fn: Callable[[dict], Any], *refs) -> Any:
        allocations = get_allocations(*refs)
        if not allocations:
            return fn(allocations)
        return pl.run_scoped(fn, allocations, collective_axes=wg_axis)

    def run(*refs, allocations: dict | None = None):
        ctx, plan, ins, outs, passthrough = prepare(
            refs, "emit_pipeline_warp_specialized(...)(refs)"
        )
        body_on_blocks = _structured_body(plan.pipeline, body, passthrough)
        if pipeline_state is not None and allocations is None:
            raise ValueError(
                f"pipeline_state={pipeline_state!r} needs caller-owned allocations shared by the "
                "chain: call the pipeline with allocations=... from run.get_allocations(*refs) "
                "(or inside run.with_allocations); with its own scoped allocation each pipeline "
                "would start afresh"
            )
        if ctx.backend == "xla":
            if allocations not in (None, {}):
                raise ValueError(
                    "allocations: on xla a pipeline has no on-chip memory; pass what "
                    f"get_allocations gives there ({{}}), got {allocations!r}"
                )
            return xla_exec.run_warp_specialized(
                plan, body_on_blocks, ins, outs, carry_coroutine, ctx.thread_index, compute_context
            )
        from conveyor.pipeline import mosaic_gpu

        return mosaic_gpu.run_warp_specialized(
            plan, body_on_blocks, ins, outs, carry_coroutine, compute_context, allocations
        )

    run.plan = wp
    run.get_allocations = get_allocations
    run.with_allocations = with_allocations
    return run
