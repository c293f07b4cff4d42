"""cv.mpmd_map: several programs, each on its own mesh, in one call, sharing memory."""
from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


DEFAULT_TIMEOUT_S = 30.0


class Mesh:
    """A mesh of cores or threads for one program: `cv.Mesh(core=2)`, `cv.Mesh(x=2, y=4)`."""

    def __init__(self, **axis_sizes: int):
        for name, size in axis_sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"cv.Mesh: axis {name!r} must have a positive int size, got {size!r}")
        self.axis_sizes: dict[str, int] = dict(axis_sizes)

    @property
    def size(self) -> int:
        return math.prod(self.axis_sizes.values())

    def points(self) -> list[dict[str, int]]:
        names = list(self.axis_sizes)
        return [dict(zip(names, p)) for p in itertools.product(*(range(s) for s in self.axis_sizes.values()))]

    def __repr__(self) -> str:
        return "cv.Mesh(" + ", ".join(f"{k}={v}" for k, v in self.axis_sizes.items()) + ")"


def _label(i: int, fn: Callable) -> str:
    return f"program {i} ({getattr(fn, '__name__', type(fn).__name__)!r})"


def call_program(i: int, fn: Callable, refs: Sequence[Any], scratch: Sequence[Any], scratch_names) -> None:
    """Run program `i` on its refs (scratch by keyword when scratch_shapes was a dict); it must return None."""
    if scratch_names is None:
        result = fn(*refs, *scratch)
    else:
        result = fn(*refs, **dict(zip(scratch_names, scratch)))
    if result is not None:
        what = "an array" if hasattr(result, "shape") else f"a {type(result).__name__}"
        raise TypeError(f"mpmd_map: {_label(i, fn)} returned {what}; a program writes its "
                        f"results through the output refs and returns None")


def super_mesh(meshes_and_fns) -> dict[str, int]:
    """The union of the programs' axes; an axis given two sizes is an error naming it."""
    axes: dict[str, tuple[int, str]] = {}
    for i, (mesh, fn) in enumerate(meshes_and_fns):
        for name, size in mesh.axis_sizes.items():
            if name in axes and axes[name][0] != size:
                raise ValueError(f"mpmd_map: axis {name!r} has size {axes[name][0]} in {axes[name][1]} but size "
                                 f"{size} in {_label(i, fn)}; one axis name must have one size")
            axes.setdefault(name, (size, _label(i, fn)))
    return {k: v for k, (v, _) in axes.items()}


def _validate(meshes_and_fns):
    if not isinstance(meshes_and_fns, Sequence) or isinstance(meshes_and_fns, (str, bytes)) or not meshes_and_fns:
        raise ValueError(f"mpmd_map: meshes_and_fns must be a non-empty sequence of (cv.Mesh, fn) pairs, "
                         f"got {meshes_and_fns!r}")
    out = []
    for i, pair in enumerate(meshes_and_fns):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"mpmd_map: entry {i} must be a (cv.Mesh, fn) pair, got {pair!r}")
        mesh, fn = pair
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mpmd_map: {_label(i, fn)}: expected a cv.Mesh, got {mesh!r}")
        if not callable(fn):
            raise TypeError(f"mpmd_map: program {i}: fn must be callable, got {fn!r}")
        out.append((mesh, fn))
    return out


def mpmd_map(meshes_and_fns: Sequence[tuple[Mesh, Callable[..., None]]], /, out_shapes: Any, *,
             scratch_shapes: Sequence[Any] | Mapping[str, Any] = (), input_output_aliases: Mapping[int, int] = {},
             compiler_params: Any = None, interpret: Any = False, debug: Any = False, cost_estimate: Any = None,
             name: str | None = None, metadata: Any = None) -> Callable[..., Any]:
    """Run several kernels over refs, each on every point of its own mesh, all at once, on shared memory.

    Each `fn(*in_refs, *out_refs, *scratch_refs)` (a dict of `scratch_shapes` is passed by keyword)
    returns None and runs once per point of its mesh; `lax.axis_index(axis)` is the point's
    coordinate. Programs synchronise with `cv.semaphore_signal` / `cv.semaphore_wait` on
    `cv.SemaphoreType` scratch and `cv.barrier_wait` on a `cv.BarrierType` scratch.

    Args:
      out_shapes: a pytree of ShapeDtypeStructs; outputs start poisoned (NaN / int min) unless aliased.
      scratch_shapes: ShapeDtypeStructs (poisoned), SemaphoreTypes (zero) or BarrierTypes.
      input_output_aliases: {input index: output index}: the output starts as that input, in place.
      compiler_params: {"timeout_s": seconds} bounds every wait on the CPU executor (default 30 s);
        `{"backend": "mosaic_gpu" | "mosaic_tpu"}` selects a Mosaic lowering.
      debug: True prints each program's jaxpr; {"timeout_s": ...} works as in compiler_params.
      interpret: run a Mosaic backend through its Pallas interpreter.
      cost_estimate, metadata: accepted and passed on where a backend uses them.
    Programs may close over array constants (they are captured in the trace).
    """
    programs = _validate(meshes_and_fns)
    axes = super_mesh(programs)
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shapes)
    for j, s in enumerate(out_leaves):
        if not (hasattr(s, "shape") and hasattr(s, "dtype")):
            raise TypeError(f"mpmd_map: out_shapes leaf {j}: expected a jax.ShapeDtypeStruct, got {s!r}")
    scratch_names = list(scratch_shapes) if isinstance(scratch_shapes, Mapping) else None
    scratch = list(scratch_shapes.values()) if scratch_names is not None else list(scratch_shapes)
    params = _options(compiler_params, debug)
    backend = params.get("backend") or _default_backend(interpret)

    def call(*args):
        in_leaves, _ = jax.tree_util.tree_flatten(args)
        for i, x in enumerate(in_leaves):
            if not (hasattr(x, "shape") and hasattr(x, "dtype")) or jnp.dtype(x.dtype) == np.dtype(object):
                raise TypeError(f"mpmd_map{f' {name!r}' if name else ''}: input {i} is not an array a ref can hold "
                                f"(got {type(x).__name__})")
        for src, dst in input_output_aliases.items():
            if not (0 <= src < len(in_leaves) and 0 <= dst < len(out_leaves)):
                raise ValueError(f"mpmd_map: input_output_aliases {{{src}: {dst}}} is out of range "
                                 f"({len(in_leaves)} inputs, {len(out_leaves)} outputs)")
            a, o = in_leaves[src], out_leaves[dst]
            if tuple(a.shape) != tuple(o.shape) or jnp.dtype(a.dtype) != jnp.dtype(o.dtype):
                raise ValueError(f"mpmd_map: input {src} ({a.dtype}{list(a.shape)}) cannot alias output {dst} "
                                 f"({o.dtype}{list(o.shape)}): shapes and dtypes must match")
        if backend == "mosaic_gpu":
            from conveyor.mpmd import mosaic_gpu
            outs = mosaic_gpu.build(programs, axes, out_leaves, scratch, scratch_names, dict(input_output_aliases),
                                    interpret, name)(*in_leaves)
            return jax.tree_util.tree_unflatten(out_tree, list(outs))
        if backend == "mosaic_tpu":
            raise NotImplementedError(
                "mpmd_map on mosaic_tpu: Pallas TPU (jax 0.12) runs several programs in one kernel only on "
                "SparseCore (pl.kernel with a list of meshes), and mapping instances onto a TensorCore mesh "
                "needs scratch shared between cores, which its interpreter does not model (HBM scratch fails "
                "an interpreter assertion; VMEM_SHARED written on one core reads back uninitialized on another). "
                "Use the CPU executor (the default on CPU) or mosaic_gpu")
        from conveyor.mpmd import cpu_call
        outs = cpu_call.run(programs, axes, in_leaves, out_leaves, scratch, scratch_names,
                            dict(input_output_aliases), params, name)
        return jax.tree_util.tree_unflatten(out_tree, list(outs))

    return call


def _options(compiler_params, debug) -> dict:
    out = {"timeout_s": DEFAULT_TIMEOUT_S, "print_jaxpr": debug is True}
    for src in (compiler_params, debug):
        if isinstance(src, Mapping):
            out.update(src)
        elif src not in (None, False, True):
            kind = type(src).__module__
            if "mosaic_gpu" in kind:
                out["backend"] = "mosaic_gpu"
            elif "mosaic" in kind or "tpu" in kind:
                out["backend"] = "mosaic_tpu"
    if not isinstance(out["timeout_s"], (int, float)) or out["timeout_s"] <= 0:
        raise ValueError(f"mpmd_map: timeout_s must be a positive number of seconds, got {out['timeout_s']!r}")
    return out


def _default_backend(interpret) -> str:
    if interpret:
        return "mosaic_gpu" if "GPU" in type(interpret).__name__ else "mosaic_tpu"
    platform = jax.default_backend()
    return {"gpu": "mosaic_gpu", "cuda": "mosaic_gpu", "tpu": "mosaic_tpu"}.get(platform, "cpu")


__all__ = ["Mesh", "mpmd_map", "super_mesh"]
