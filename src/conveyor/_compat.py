"""The one module that touches JAX internals: primitive machinery and private Pallas names.

Everything else in Conveyor imports these names from here, so a JAX upgrade is mended in one place.
"""
from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["Primitive", "ad", "batching", "mlir", "is_undefined_primal", "Zero",
           "register_lowering_from_function"]

is_undefined_primal = ad.is_undefined_primal
Zero = ad.Zero


def register_lowering_from_function(prim: Primitive, impl) -> None:
    """Lower `prim` on every platform by tracing `impl(*args, **params)`."""
    mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=False))


# ---- JAX state (refs) for the XLA kernel executor ----------------------------------------------
# `run_state_reference` discharges the stateful function at trace time (the plain `run_state`
# defers it to lowering, where the axis names of an enclosing vmap are gone, so
# `lax.axis_index(thread_name)` inside a threaded xla kernel would fail).
from jax._src.state.discharge import run_state_reference as run_state  # noqa: E402  (no public alias)

__all__ += ["run_state"]


def varying_axes(x) -> frozenset:
    """Mesh axes over which `x` varies inside shard_map (jax 0.12: aval.mat.varying; older: aval.vma)."""
    import jax
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    if mat is not None and hasattr(mat, "varying"):
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


__all__ += ["varying_axes"]
