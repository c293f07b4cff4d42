"""Running one program of an `mpmd_map` call, shared by its executors (CPU, Mosaic GPU)."""

from __future__ import annotations

import re

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
    try:
        result = fn(*refs, *args, **kwargs)
    except ValueError as e:  # Pallas's own check of the semaphore it was handed
        from conveyor.kernel import current_sync

        cpu = current_sync("mpmd_map") == "cpu"
        if not (cpu and re.search(r"Must (signal|wait) semaphores", str(e))):
            raise
        raise NotImplementedError(
            f"mpmd_map on CPU: {program_label(i, fn)} calls pl.semaphore_signal or "
            "pl.semaphore_wait on the CPU executor's semaphore scratch, which every instance "
            "shares (a device_id addressing one instance's semaphore has no meaning there): use "
            "cv.semaphore_signal / cv.semaphore_wait"
        ) from e
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


def refuse_ref_inputs(backend: str, inputs) -> None:
    """A Mosaic kernel takes arrays: a jax Ref input (which the CPU executor updates in place) is
    refused naming it."""
    for i, x in enumerate(inputs):
        if is_jax_ref(x):
            raise NotImplementedError(
                f"mpmd_map on {backend}: input {i} is a jax Ref; its kernel takes arrays only (the "
                "CPU executor updates Refs in place)"
            )


def split_refs(refs, n_in: int, n_out: int) -> tuple:
    """A kernel body's refs as (inputs, outputs, scratch)."""
    return refs[:n_in], refs[n_in : n_in + n_out], refs[n_in + n_out :]
