"""cv.kernel: one launcher for kernels over refs, on every backend.

Design notes: docs/internals/core.md, section `kernel.py`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from conveyor import backends
from conveyor.aliasing import check_alias_operands, check_aliases
from conveyor.jaxprs import call_as_thread, run_state
from conveyor.lowering_guard import per_platform
from conveyor.plans.grid import normalize_semantics, unravel
from conveyor.spmd import per_device_call

AVAILABLE = ("xla", "mosaic_tpu", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class KernelContext:
    """What the code traced inside a kernel body needs to know of its launch: the one piece of
    ambient state of kernel tracing (entered by `entered_kernel`)."""

    backend: str | None  # None: an mpmd_map program (no cv.kernel pipelines there)
    interpret: Any
    num_threads: int = 1
    thread_name: str | None = None
    thread_index: int | None = None  # xla: the (static) thread being traced; None elsewhere
    grid: tuple[int, ...] = ()
    program_ids: tuple[Any, ...] = ()  # xla: the traced grid point being run
    scratch_bytes: int = (
        0  # mosaic_gpu: shared memory of scratch_shapes, which pipelines count against the budget
    )
    checked: bool = False  # xla: pipelines run the checked mode (`cv.kernel(checked=...)`)
    # The backend of cv.semaphore_* / cv.barrier_* calls: "cpu" (mpmd_map's CPU executor) or
    # "mosaic_gpu" inside an mpmd_map program; None elsewhere (they are refused there).
    sync: str | None = None
    # Trace-time record of pipeline prefetches not yet consumed, by the id of each allocation ref
    # they fill (`emit_pipeline(...).prefetch`); shared by every point and thread of one kernel.
    pending_prefetches: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)
    # mosaic_gpu: the array each untransformed pipeline slot is copied from, by the slot ref's id
    # (`pipeline.gpu_tiles`: cv.dot checks it against the tiling Mosaic GPU infers for wgmma).
    gpu_slot_arrays: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)


GRID_NAMES = ("_cv_grid0", "_cv_grid1", "_cv_grid2")  # Mosaic GPU names the CTA grid axes


def program_id(axis: int) -> Any:
    """The index of the current grid point along `axis` of `cv.kernel(..., grid=...)` (int32)."""
    ctx = current_context("cv.program_id")
    if not isinstance(axis, int) or not 0 <= axis < len(ctx.grid):
        raise ValueError(
            f"cv.program_id: axis must be in [0, {len(ctx.grid)}) for this kernel's grid "
            f"{ctx.grid}, got {axis!r}"
        )
    if ctx.backend == "xla":
        return ctx.program_ids[axis]
    if ctx.backend == "mosaic_tpu":
        from jax.experimental import pallas as pl

        return pl.program_id(axis)
    return jax.lax.axis_index(GRID_NAMES[axis])


_CONTEXT: contextvars.ContextVar[KernelContext | None] = contextvars.ContextVar(
    "conveyor_kernel", default=None
)


def current_context(api: str) -> KernelContext:
    ctx = _CONTEXT.get()
    if ctx is None or ctx.backend is None:
        raise RuntimeError(f"{api} must be called inside a kernel body launched by cv.kernel")
    return ctx


def current_sync(api: str) -> str:
    """The backend running a synchronisation call (`KernelContext.sync`); a RuntimeError naming
    `api` outside an mpmd_map program."""
    ctx = _CONTEXT.get()
    if ctx is None or ctx.sync is None:
        raise RuntimeError(f"{api} must be called inside a program of cv.mpmd_map")
    return ctx.sync


_CHECKED_BY_DEFAULT = contextvars.ContextVar("conveyor_checked_schedule", default=False)


def checked_schedule(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """`cv.kernel(checked=None)` kernels whose bodies are traced inside this block run their
    pipelines in the xla backend's checked mode (see `conveyor.pipeline.xla`): slower, and a
    schedule bug shows up as wrong values. The test suite's way to run every pipeline test in that
    mode; it sets cv.kernel's default only, read when a kernel body is traced, so a function
    jitted earlier keeps its mode. `cv.kernel(checked=...)` names the mode for one kernel."""
    if not isinstance(enabled, bool):
        raise TypeError(f"checked_schedule: enabled must be a bool, got {enabled!r}")

    @contextlib.contextmanager
    def block():
        token = _CHECKED_BY_DEFAULT.set(enabled)
        try:
            yield
        finally:
            _CHECKED_BY_DEFAULT.reset(token)

    return block()


def mpmd_program(sync: str):
    """Trace what follows as an mpmd_map program whose synchronisation runs on `sync`."""
    return entered_kernel(KernelContext(backend=None, interpret=None, sync=sync))


@contextlib.contextmanager
def entered_kernel(ctx: KernelContext):
    """Trace what follows as the body of a kernel `ctx` describes (so `cv.emit_pipeline` and
    friends know their backend): cv.kernel's launches, and Conveyor's own pallas_calls."""
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def _poison_value(dtype):
    """What never-written memory holds: NaN for floats, the minimum for integers, False for
    bools."""
    if jnp.issubdtype(dtype, jnp.floating):
        return np.nan
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).min
    return 0


def poison(shape, dtype) -> jax.Array:
    """Memory that was never written (see `_poison_value`), as a traced array."""
    dtype = jnp.dtype(dtype)
    return jnp.full(shape, _poison_value(dtype), dtype)


def poison_numpy(shape, dtype) -> np.ndarray:
    """`poison` as a host NumPy array (usable while tracing, e.g. inside host callbacks)."""
    dtype = jnp.dtype(dtype)
    return np.full(shape, _poison_value(dtype), dtype)


def _shapes(x, name):
    leaves = jax.tree_util.tree_leaves(x)
    for leaf in leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(f"{name}: expected jax.ShapeDtypeStruct-like entries, got {leaf!r}")
    return leaves


def _check_threads(num_threads, thread_name, backend) -> int:
    if num_threads is None:
        if thread_name is not None:
            raise ValueError(f"cv.kernel: thread_name={thread_name!r} given without num_threads")
        return 1
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"cv.kernel: num_threads must be an int >= 1, got {num_threads!r}")
    if not isinstance(thread_name, str):
        raise ValueError(
            f"cv.kernel: num_threads={num_threads} needs thread_name (a str naming the axis that "
            f"lax.axis_index reads), got {thread_name!r}"
        )
    if backend == "mosaic_tpu":
        raise NotImplementedError(
            "cv.kernel: num_threads is not supported on mosaic_tpu (a TPU core has no warpgroups; "
            "its DMA engine already runs copies asynchronously). Use cv.emit_pipeline, or "
            "backend='mosaic_gpu' / 'xla'"
        )
    return num_threads


def kernel(
    body: Callable[..., None],
    out_shape: Any,
    *,
    backend: str | None = None,
    interpret: Any = False,
    num_threads: int | None = None,
    thread_name: str | None = None,
    scratch_shapes: Sequence[Any] = (),
    grid: Sequence[int] = (),
    dimension_semantics: Sequence[Any] | None = None,
    input_output_aliases: Mapping[int, int] | None = None,
    cost_estimate: Any = None,
    checked: bool | None = None,
) -> Callable[..., Any]:
    """Wrap `body(*in_refs, *out_refs, *scratch_refs)` into a function of arrays returning
    `out_shape`. `jax.vmap` of the result works on every backend (on mosaic_tpu as a loop of
    kernel calls).

    Args:
      body: writes its outputs through refs and returns None.
      out_shape: a ShapeDtypeStruct or a sequence of them.
      backend: "xla" (the CPU default) or "mosaic_tpu" (a Pallas TPU kernel whose refs live in HBM;
        pipelines copy blocks into VMEM) or "mosaic_gpu" (a Mosaic GPU kernel, operands in GMEM,
        pipelines copy blocks into SMEM with TMA). None chooses when the kernel is lowered, for
        the platform lowered for (TPU: mosaic_tpu; CPU, CUDA, ROCm: xla): the body is traced for
        both, and `jax.export(..., platforms=["tpu"])` from a CPU host holds the Pallas kernel.
        A backend that cannot trace the body (e.g. num_threads on mosaic_tpu) is refused, with
        its reason, only when lowered for its platform. A lowering for several platforms at once
        with a TPU among them needs a named backend.
      interpret: run a mosaic backend through its Pallas interpreter (True or InterpretParams).
      checked: xla only: run the kernel's pipelines in checked mode (True), or not (False); None
        takes `cv.pipeline.checked_schedule()`'s setting where the body is traced.
      scratch_shapes: ShapeDtypeStructs of extra on-chip buffers passed after the outputs (VMEM on
        TPU, SMEM on GPU). Mosaic backends also take `cv.SemaphoreType(shape)` (Pallas' REGULAR
        semaphores, used with `pl.semaphore_signal` / `pl.semaphore_wait`) and their native
        scratch types as they are (e.g. `pltpu.SemaphoreType.DMA((2,))`, `plgpu.Barrier(...)`).
      num_threads, thread_name: run the body on `num_threads` concurrent threads (GPU warpgroups),
        each seeing its index as `lax.axis_index(thread_name)`; needed by
        `cv.emit_pipeline_warp_specialized`. On xla the threads run one after the other on the
        same memory, each traced with its own constant thread index: exact for race-free kernels
        (and the warp-specialized pipeline interleaves its compute threads step by step). Not on
        mosaic_tpu (TPU cores have no warpgroups).
      grid: run the body once per point of this grid (up to 3 axes), in parallel on hardware
        (TPU grid iterations, GPU thread blocks) and one after the other on xla; the body reads its
        point with `cv.program_id(axis)`. Points should write disjoint parts of the outputs.
      dimension_semantics: "parallel" or "arbitrary" per grid axis (or `pltpu.PARALLEL` /
        `pltpu.ARBITRARY`). On mosaic_tpu it goes to Mosaic, which spreads "parallel" axes over a
        chip's TensorCores (megacore: TPU v4 / v5p; with `cv.emit_pipeline(core_axis=...)`) and
        runs "arbitrary" ones in order on one core (the default). GPU thread blocks are always
        independent and xla always runs points in order: there it is validated and changes nothing.
      input_output_aliases: {input index: output index}: that output starts as that input (same
        shape and dtype), so the body writes only what changes and the rest keeps the input's
        values; on every backend (mosaic_tpu: Pallas's aliasing, in place; mosaic_gpu: a jax Ref
        the kernel updates in place; xla: the output's initial value). Without it an output
        starts uninitialized (poisoned on xla).
      cost_estimate: a `pl.CostEstimate` handed to the Mosaic backends' pallas_call (what XLA's
        scheduler and `cost_analysis()` see of the kernel); xla ignores it: its loop is ordinary
        XLA, costed as such.

    Returns:
      A function of the input arrays returning `out_shape`'s arrays (one array for a single
      ShapeDtypeStruct).
    """
    if checked is not None and not isinstance(checked, bool):
        raise TypeError(f"cv.kernel: checked must be True, False or None, got {checked!r}")
    if backend is not None or interpret:
        return _launcher(
            body,
            out_shape,
            backend=backend,
            interpret=interpret,
            num_threads=num_threads,
            thread_name=thread_name,
            scratch_shapes=scratch_shapes,
            grid=grid,
            dimension_semantics=dimension_semantics,
            input_output_aliases=input_output_aliases,
            cost_estimate=cost_estimate,
            checked=checked,
        )
    launch = functools.partial(
        _launcher,
        body,
        out_shape,
        interpret=False,
        num_threads=num_threads,
        thread_name=thread_name,
        scratch_shapes=scratch_shapes,
        grid=grid,
        dimension_semantics=dimension_semantics,
        input_output_aliases=input_output_aliases,
        cost_estimate=cost_estimate,
    )
    return per_platform(
        lambda backend: launch(backend=backend, checked=checked if backend == "xla" else None),
        AVAILABLE,
        "cv.kernel(backend=None)",
    )


def _launcher(
    body: Callable[..., None],
    out_shape: Any,
    *,
    backend: str | None = None,
    interpret: Any = False,
    num_threads: int | None = None,
    thread_name: str | None = None,
    scratch_shapes: Sequence[Any] = (),
    grid: Sequence[int] = (),
    dimension_semantics: Sequence[Any] | None = None,
    input_output_aliases: Mapping[int, int] | None = None,
    cost_estimate: Any = None,
    checked: bool | None = None,
) -> Callable[..., Any]:
    """`kernel` for a named backend (or None with interpret: this process's default)."""
    if checked is not None and not isinstance(checked, bool):
        raise TypeError(f"cv.kernel: checked must be True, False or None, got {checked!r}")
    if checked is not None and backend not in (None, "xla"):
        raise ValueError(
            f"cv.kernel: checked is the xla backend's mode, got backend={backend!r} with "
            f"checked={checked}"
        )
    backend = backends.check_backend(backend, AVAILABLE, "cv.kernel")
    if cost_estimate is not None and not isinstance(cost_estimate, pl.CostEstimate):
        raise TypeError(
            f"cv.kernel: cost_estimate must be a pl.CostEstimate or None, got {cost_estimate!r}"
        )
    grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)
    if len(grid) > 3 or any(isinstance(g, bool) or not isinstance(g, int) or g < 1 for g in grid):
        raise ValueError(f"cv.kernel: grid must be up to 3 positive ints, got {grid!r}")
    threads = _check_threads(num_threads, thread_name, backend)
    semantics = normalize_semantics(
        dimension_semantics, len(grid), "cv.kernel: dimension_semantics"
    )
    single = not isinstance(out_shape, (tuple, list))
    outs = _shapes(out_shape, "out_shape")
    aliases = check_aliases(
        "cv.kernel", {} if input_output_aliases is None else input_output_aliases
    )
    scratch = tuple(scratch_shapes)
    if backend == "xla":
        _shapes(scratch, "scratch_shapes")

    if backend == "mosaic_tpu":
        from conveyor import kernel_tpu

        return kernel_tpu.launch(
            body,
            outs,
            scratch,
            single,
            interpret,
            lambda: entered_kernel(KernelContext(backend, interpret, grid=grid)),
            grid,
            semantics,
            aliases,
            cost_estimate,
        )
    ctx = KernelContext(backend, interpret, threads, thread_name, grid=grid)
    if backend == "mosaic_gpu":
        from conveyor import kernel_gpu

        ctx = dataclasses.replace(ctx, scratch_bytes=kernel_gpu.smem_bytes(scratch))
        return kernel_gpu.launch(
            body,
            outs,
            scratch,
            single,
            interpret,
            lambda: entered_kernel(ctx),
            threads,
            thread_name,
            grid,
            GRID_NAMES[: len(grid)],
            aliases,
            cost_estimate,
        )

    def run(*inputs):
        for i, x in enumerate(inputs):
            if not hasattr(x, "shape"):
                raise TypeError(f"input {i}: expected an array, got {type(x).__name__}")
        check_alias_operands("cv.kernel", aliases, inputs, outs)
        starts = {dst: src for src, dst in aliases.items()}
        n_in, n_out = len(inputs), len(outs)

        def stateful(refs):
            result = body(*refs)
            if result is not None:
                raise TypeError(
                    "kernel body must return None (it writes outputs through refs), got "
                    f"{type(result).__name__}"
                )

        def execute(*arrays):
            init = (
                *arrays,
                *[
                    arrays[starts[j]] if j in starts else poison(s.shape, s.dtype)
                    for j, s in enumerate(outs)
                ],
                *[poison(s.shape, s.dtype) for s in scratch],
            )
            final = run_state(every_point)(init)
            return list(final[n_in : n_in + n_out])

        def one_point(refs, program_ids):
            mode = _CHECKED_BY_DEFAULT.get() if checked is None else checked
            point = dataclasses.replace(ctx, program_ids=program_ids, checked=mode)
            if thread_name is None:
                with entered_kernel(point):
                    stateful(refs)
                return
            for t in range(threads):  # threads one after the other, each with its own axis index
                with entered_kernel(dataclasses.replace(point, thread_index=t)):
                    call_as_thread(lambda: stateful(refs), thread_name, threads, t)

        def every_point(refs):
            if not grid:
                return one_point(refs, ())

            def step(i, _):
                one_point(refs, unravel(i, grid))

            jax.lax.fori_loop(0, math.prod(grid), step, None)

        # Inside shard_map the kernel runs per device (outputs vary as its inputs do).
        results = tuple(per_device_call(execute, outs, *[jnp.asarray(x) for x in inputs]))
        return results[0] if single else results

    return run
