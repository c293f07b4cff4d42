"""cv.mpmd_map: several programs, each on its own mesh, in one call, sharing memory."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from conveyor.aliasing import check_alias_operands, check_aliases
from conveyor.mpmd.programs import program_label, refuse_high
from conveyor.mpmd.scratch import ScratchLayout


DEFAULT_TIMEOUT_S = 30.0


class Mesh:
    """A mesh of cores or threads for one program: `cv.Mesh(core=2)`, `cv.Mesh(x=2, y=4)`."""

    def __init__(self, **axis_sizes: int):
        for name, size in axis_sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(
                    f"cv.Mesh: axis {name!r} must have a positive int size, got {size!r}"
                )
        self.axis_sizes: dict[str, int] = dict(axis_sizes)

    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes.values())

    def points(self) -> list[dict[str, int]]:
        names = list(self.axis_sizes)
        return [
            dict(zip(names, p))
            for p in itertools.product(*(range(s) for s in self.axis_sizes.values()))
        ]

    def __repr__(self) -> str:
        return "cv.Mesh(" + ", ".join(f"{k}={v}" for k, v in self.axis_sizes.items()) + ")"


def super_mesh(meshes_and_fns) -> dict[str, int]:
    """The union of the programs' axes; an axis given two sizes is an error naming it."""
    axes: dict[str, tuple[int, str]] = {}
    for i, (mesh, fn) in enumerate(meshes_and_fns):
        for name, size in mesh.axis_sizes.items():
            if name in axes and axes[name][0] != size:
                raise ValueError(
                    f"mpmd_map: axis {name!r} has size {axes[name][0]} in {axes[name][1]} but size "
                    f"{size} in {program_label(i, fn)}; one axis name must have one size"
                )
            axes.setdefault(name, (size, program_label(i, fn)))
    return {k: v for k, (v, _) in axes.items()}


def _validate(meshes_and_fns):
    if (
        not isinstance(meshes_and_fns, Sequence)
        or isinstance(meshes_and_fns, (str, bytes))
        or not meshes_and_fns
    ):
        raise ValueError(
            "mpmd_map: meshes_and_fns must be a non-empty sequence of (cv.Mesh, fn) pairs, got "
            f"{meshes_and_fns!r}"
        )
    out = []
    for i, pair in enumerate(meshes_and_fns):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"mpmd_map: entry {i} must be a (cv.Mesh, fn) pair, got {pair!r}")
        mesh, fn = pair
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mpmd_map: {program_label(i, fn)}: expected a cv.Mesh, got {mesh!r}")
        if not callable(fn):
            raise TypeError(f"mpmd_map: program {i}: fn must be callable, got {fn!r}")
        out.append((mesh, fn))
    return out


def mpmd_map(
    meshes_and_fns: Sequence[tuple[Mesh, Callable[..., None]]],
    /,
    out_shapes: Any,
    *,
    scratch_shapes: Sequence[Any] | Mapping[str, Any] = (),
    input_output_aliases: Mapping[int, int] = {},
    compiler_params: Any = None,
    interpret: Any = False,
    debug: Any = False,
    cost_estimate: Any = None,
    name: str | None = None,
    metadata: Any = None,
    backend: str | None = None,
) -> Callable[..., Any]:
    """Run several kernels over refs, each on every point of its own mesh, all at once, on shared
    memory.

    Each `fn(*in_refs, *out_refs, *scratch_refs)` returns None and runs once per point of its
    mesh (`lax.axis_index(axis)` is the point's coordinate); programs synchronise with
    `cv.semaphore_signal` / `cv.semaphore_wait` and `cv.barrier_wait` on scratch. What the CPU
    executor takes beyond that (jax Refs updated in place, closures, `jax.vmap`, Pallas's scratch
    spellings, `pl.run_scoped`, `pl.debug_print`) is in the README's `mpmd_map` section.

    Args:
      meshes_and_fns: (mesh, fn) pairs, one per program.
      out_shapes: a pytree of ShapeDtypeStructs; outputs start poisoned (NaN / int min) unless
        aliased.
      scratch_shapes: a sequence, dict (passed by keyword) or nested pytree of ShapeDtypeStructs
        (poisoned), `cv.SemaphoreType` (zero), `cv.BarrierType`, or their Pallas spellings.
      input_output_aliases: {input index: output index}: the output starts as that input, in
        place; one input per output.
      compiler_params: {"timeout_s": seconds} bounds every wait on the CPU executor (default 30 s);
        a `plgpu.CompilerParams` is accepted with backend="mosaic_gpu".
      interpret: run a Mosaic backend through its Pallas interpreter.
      debug: True prints each program's jaxpr (on mosaic_gpu / mosaic_tpu: Pallas prints the
        kernel's jaxpr and Mosaic module); {"timeout_s": ...} works as in compiler_params (cpu
        only).
      cost_estimate: a `pl.CostEstimate` for the Mosaic GPU kernel (jax >= 0.12); unused on cpu.
      name: the kernel's name. metadata: a dict of str, accepted and unused.
      backend: "cpu" (the default on every platform: concurrent threads in a host callback),
        "mosaic_gpu" (the programs as warpgroups of one kernel) or "mosaic_tpu" (one program on a
        TensorCore mesh: `cv.Mesh(core=n)`, a core per instance, scratch per core).

    Returns:
      A function of the inputs (arrays or jax Refs) returning outputs shaped like `out_shapes`.

    Raises:
      cv.MpmdDeadlock: a wait nothing satisfies within the timeout, naming every instance's wait.
        Under jit it reaches the caller as XLA's JaxRuntimeError; `with cv.mpmd_errors():`
        re-raises it as its own type.
    """
    programs = _validate(meshes_and_fns)
    axes = super_mesh(programs)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
    for j, s in enumerate(out_leaves):
        if not (hasattr(s, "shape") and hasattr(s, "dtype")):
            raise TypeError(
                f"mpmd_map: out_shapes leaf {j}: expected a jax.ShapeDtypeStruct, got {s!r}"
            )
    layout = ScratchLayout.of(scratch_shapes, sum(mesh.size for mesh, _ in programs))
    check_aliases("mpmd_map", input_output_aliases)
    _check_annotations(cost_estimate, metadata)
    backend = _check_backend(backend, compiler_params, interpret)
    params = _options(compiler_params, debug)
    kernel_debug = _kernel_debug(backend, debug)

    def call(*args):
        in_leaves, _ = jax.tree_util.tree_flatten(args)
        for i, x in enumerate(in_leaves):
            refuse_high(x, f"input {i} is")
            if not (hasattr(x, "shape") and hasattr(x, "dtype")) or jnp.dtype(x.dtype) == np.dtype(
                object
            ):
                raise TypeError(
                    f"mpmd_map{f' {name!r}' if name else ''}: input {i} is not an array a ref can "
                    f"hold (got {type(x).__name__})"
                )
        check_alias_operands("mpmd_map", input_output_aliases, in_leaves, out_leaves)
        if backend == "mosaic_gpu":
            from conveyor.mpmd import mosaic_gpu

            outs = mosaic_gpu.build(
                programs,
                axes,
                out_leaves,
                layout,
                dict(input_output_aliases),
                interpret,
                name,
                cost_estimate,
                debug=kernel_debug,
            )(*in_leaves)
            return jax.tree_util.tree_unflatten(out_tree, list(outs))
        if backend == "mosaic_tpu":
            from conveyor.mpmd import mosaic_tpu

            outs = mosaic_tpu.build(
                programs,
                out_leaves,
                layout,
                dict(input_output_aliases),
                interpret,
                name,
                compiler_params if not isinstance(compiler_params, Mapping) else None,
                cost_estimate,
                debug=kernel_debug,
            )(*in_leaves)
            return jax.tree_util.tree_unflatten(out_tree, list(outs))
        from conveyor.mpmd import cpu_call

        outs = cpu_call.run(
            programs, axes, in_leaves, out_leaves, layout, dict(input_output_aliases), params, name
        )
        return jax.tree_util.tree_unflatten(out_tree, list(outs))

    return call


def _check_annotations(cost_estimate, metadata) -> None:
    if cost_estimate is not None:
        from jax.experimental import pallas as pl

        if not isinstance(cost_estimate, pl.CostEstimate):
            raise TypeError(
                f"mpmd_map: cost_estimate must be a pl.CostEstimate or None, got {cost_estimate!r}"
            )
    if metadata is not None and not (
        isinstance(metadata, Mapping)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise TypeError(
            f"mpmd_map: metadata must be a dict of str to str or None, got {metadata!r}"
        )


BACKENDS = ("cpu", "mosaic_gpu", "mosaic_tpu")


def _check_backend(backend, compiler_params, interpret) -> str:
    """The backend named by `backend=` (None: "cpu"), checked against the other arguments."""
    if backend is None:
        backend = "cpu"
    if backend not in BACKENDS:
        raise ValueError(f"mpmd_map: backend must be one of {BACKENDS} or None, got {backend!r}")
    if isinstance(compiler_params, Mapping) and "backend" in compiler_params:
        raise TypeError(
            "mpmd_map: compiler_params has no 'backend' key; pass "
            f"backend={compiler_params['backend']!r} instead"
        )
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas import tpu as pltpu

    if isinstance(compiler_params, plgpu.CompilerParams):
        if backend != "mosaic_gpu":
            raise ValueError(
                "mpmd_map: compiler_params is a plgpu.CompilerParams, for backend='mosaic_gpu'; "
                f"got backend={backend!r}"
            )
        if compiler_params != plgpu.CompilerParams():
            raise NotImplementedError(
                "mpmd_map on mosaic_gpu: compiler_params fields are not passed to the kernel yet; "
                f"leave them at their defaults, got {compiler_params!r}"
            )
    elif isinstance(compiler_params, pltpu.CompilerParams):
        if backend != "mosaic_tpu":
            raise ValueError(
                "mpmd_map: compiler_params is a pltpu.CompilerParams, for backend='mosaic_tpu'; "
                f"got backend={backend!r}"
            )
    elif isinstance(compiler_params, Mapping) and backend == "mosaic_tpu":
        raise TypeError(
            f"mpmd_map on mosaic_tpu: compiler_params {dict(compiler_params)!r} is the CPU "
            "executor's (a wait deadline); pass a pltpu.CompilerParams or None"
        )
    elif compiler_params is not None and not isinstance(compiler_params, Mapping):
        raise TypeError(
            "mpmd_map: compiler_params must be a dict ({'timeout_s': seconds}), a "
            "plgpu.CompilerParams with backend='mosaic_gpu' or a pltpu.CompilerParams with "
            f"backend='mosaic_tpu'; got {compiler_params!r}"
        )
    if interpret and backend == "cpu":
        raise ValueError(
            "mpmd_map: interpret runs a Mosaic backend through its Pallas interpreter; the cpu "
            "backend has none (pass backend='mosaic_gpu' with it, or leave interpret out)"
        )
    return backend


def _kernel_debug(backend: str, debug) -> bool:
    """What a Mosaic backend passes to its Pallas kernel as `debug`: only a bool means something
    there (a dict's wait deadline is the CPU executor's)."""
    if backend == "cpu" or isinstance(debug, bool):
        return debug is True
    raise TypeError(
        f"mpmd_map on {backend}: debug must be True or False (Pallas prints the kernel's jaxpr); "
        f"{debug!r} sets the CPU executor's wait deadline, which a Mosaic kernel does not have"
    )


def _options(compiler_params, debug) -> dict:
    if not isinstance(debug, (bool, Mapping)):
        raise TypeError(
            "mpmd_map: debug must be True, False or a dict ({'timeout_s': seconds}), got "
            f"{debug!r}"
        )
    out = {"timeout_s": DEFAULT_TIMEOUT_S, "print_jaxpr": debug is True}
    for src in (compiler_params, debug):
        if isinstance(src, Mapping):
            out.update(src)
    if not isinstance(out["timeout_s"], (int, float)) or out["timeout_s"] <= 0:
        raise ValueError(
            f"mpmd_map: timeout_s must be a positive number of seconds, got {out['timeout_s']!r}"
        )
    return out


__all__ = ["Mesh", "mpmd_map", "super_mesh"]
