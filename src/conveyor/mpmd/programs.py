"""Running one program of an `mpmd_map` call, shared by its executors (CPU, Mosaic GPU)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


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
