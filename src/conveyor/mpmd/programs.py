"""Running one program of an `mpmd_map` call, shared by its executors (CPU, Mosaic GPU)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from conveyor.jaxprs import is_jax_ref, underlying_ref


def program_label(i: int, fn: Callable) -> str:
    return f"program {i} ({getattr(fn, '__name__', type(fn).__name__)!r})"


def call_program(i: int, fn: Callable, refs: Sequence[Any], scratch: Sequence[Any], layout) -> None:
    """Run program `i` on its refs, scratch in scratch_shapes' structure (by keyword when it was a
    dict); it must return None."""
    args, kwargs = layout.arguments(scratch)
    result = fn(*refs, *args, **kwargs)
    if result is not None:
        what = "an array" if hasattr(result, "shape") else f"a {type(result).__name__}"
        raise TypeError(
            f"mpmd_map: {program_label(i, fn)} returned {what}; a program writes its results "
            "through the output refs and returns None"
        )


def refuse_high(x, where: str) -> None:
    """A hijax value or Ref (a type JAX lowers to several arrays, `HiType`): the CPU executor
    holds each Ref in one buffer of one array, so it refuses these by name."""
    try:
        aval = jax.typeof(underlying_ref(x) if is_jax_ref(x) else x)
    except TypeError:  # not a JAX type at all: the caller's own check names it
        return
    if getattr(aval, "is_high", False):
        kind = "jax Ref" if is_jax_ref(x) else "value"
        raise NotImplementedError(
            f"mpmd_map: {where} a {kind} of a hijax type ({aval}); Conveyor's mpmd_map holds "
            "arrays only (one buffer per Ref): pass or close over the arrays it is made of"
        )
