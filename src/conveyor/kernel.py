"""cv.kernel: one launcher for kernels over refs, on every backend.

`cv.kernel(body, out_shape, ...)(*inputs)` runs `body(*in_refs, *out_refs, *scratch_refs)`.
Inside the body, `cv.emit_pipeline(...)` builds pipelines for the backend this launcher chose.

On the `xla` backend refs are JAX state refs discharged into an ordinary compiled program. Output
and scratch memory starts poisoned (NaN for floats, the minimum value for ints), as uninitialized
memory does on accelerators, so a kernel that forgets to write a block is caught by its tests.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from conveyor import backends
from conveyor._compat import run_state

AVAILABLE = ("xla", "mosaic_tpu", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class KernelContext:
    backend: str
    interpret: Any


_CONTEXT: contextvars.ContextVar[KernelContext | None] = contextvars.ContextVar("conveyor_kernel", default=None)


def current_context(api: str) -> KernelContext:
    ctx = _CONTEXT.get()
    if ctx is None:
        raise RuntimeError(f"{api} must be called inside a kernel body launched by cv.kernel")
    return ctx


@contextlib.contextmanager
def _entered(ctx: KernelContext):
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def poison(shape, dtype) -> jax.Array:
    """Memory that was never written: NaN for floats, the minimum for integers, False for bools."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.full(shape, jnp.nan, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.full(shape, jnp.iinfo(dtype).min, dtype)
    return jnp.zeros(shape, dtype)


def _shapes(x, name):
    leaves = jax.tree_util.tree_leaves(x)
    for leaf in leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise TypeError(f"{name}: expected jax.ShapeDtypeStruct-like entries, got {leaf!r}")
    return leaves


def kernel(body: Callable[..., None], out_shape: Any, *, backend: str | None = None, interpret: Any = False,
           num_threads: int | None = None, thread_name: str | None = None,
           scratch_shapes: Sequence[Any] = (), grid: Sequence[int] = ()) -> Callable[..., Any]:
    """Wrap `body(*in_refs, *out_refs, *scratch_refs)` into a function of arrays returning `out_shape`.

    Args:
      body: writes its outputs through refs and returns None.
      out_shape: a ShapeDtypeStruct or a sequence of them.
      backend: "xla" (the CPU default) or "mosaic_tpu" (a Pallas TPU kernel whose refs live in HBM;
        pipelines copy blocks into VMEM) or "mosaic_gpu" (a Mosaic GPU kernel, operands in GMEM,
        pipelines copy blocks into SMEM with TMA).
      interpret: run a mosaic backend through its Pallas interpreter (True or InterpretParams).
      scratch_shapes: ShapeDtypeStructs of extra on-chip buffers passed after the outputs (VMEM on
        TPU, SMEM on GPU). Mosaic backends also take their native scratch types as they are
        (e.g. `pltpu.SemaphoreType.DMA((2,))`, `plgpu.Barrier(...)`).
      grid, num_threads, thread_name: accepted for API compatibility; only () / None are supported
        on the xla backend for now (NotImplementedError otherwise).
    """
    backend = backends.check_backend(backend, AVAILABLE, "cv.kernel")
    if tuple(grid) != () or num_threads not in (None, 1) or thread_name is not None:
        raise NotImplementedError("cv.kernel: grid, num_threads and thread_name are not implemented yet "
                                  f"(got grid={tuple(grid)}, num_threads={num_threads}, thread_name={thread_name})")
    single = not isinstance(out_shape, (tuple, list))
    outs = _shapes(out_shape, "out_shape")
    scratch = tuple(scratch_shapes)
    if backend == "xla":
        _shapes(scratch, "scratch_shapes")

    if backend == "mosaic_tpu":
        from conveyor import kernel_tpu
        return kernel_tpu.launch(body, outs, scratch, single, interpret, lambda: _entered(KernelContext(backend, interpret)))
    if backend == "mosaic_gpu":
        from conveyor import kernel_gpu
        return kernel_gpu.launch(body, outs, scratch, single, interpret, lambda: _entered(KernelContext(backend, interpret)))

    def run(*inputs):
        for i, x in enumerate(inputs):
            if not hasattr(x, "shape"):
                raise TypeError(f"input {i}: expected an array, got {type(x).__name__}")
        n_in, n_out = len(inputs), len(outs)

        def stateful(refs):
            result = body(*refs)
            if result is not None:
                raise TypeError(f"kernel body must return None (it writes outputs through refs), got {type(result).__name__}")

        init = (*[jnp.asarray(x) for x in inputs], *[poison(s.shape, s.dtype) for s in outs],
                *[poison(s.shape, s.dtype) for s in scratch])
        with _entered(KernelContext(backend, interpret)):
            final = run_state(stateful)(init)
        results = tuple(final[n_in:n_in + n_out])
        return results[0] if single else results

    return run
