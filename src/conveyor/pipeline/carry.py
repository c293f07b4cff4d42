"""Carries of warp-specialized pipelines: carry coroutines (prologue, then the final carry sent
back) and upstream's compute contexts (which must call the pipeline exactly once)."""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any


def _direct(fn):
    return fn()


def start(
    carry_coroutine: Callable[[], Generator] | None, run: Callable = _direct
) -> tuple[Generator | None, Any]:
    """Run the coroutine up to its (only) yield; returns it and the initial carry it yielded.

    `run(thunk)` executes the coroutine's code (the xla backend runs it as a given thread)."""
    if carry_coroutine is None:
        return None, None
    gen = carry_coroutine()
    if not hasattr(gen, "send"):
        raise TypeError(
            "carry_coroutine must be a generator function (one that yields the initial carry), "
            f"calling it returned {type(gen).__name__}"
        )

    def first():
        try:
            return True, next(gen)
        except StopIteration:
            return False, None

    yielded, init = run(first)
    if not yielded:
        raise ValueError(
            "carry_coroutine finished without yielding the initial carry (it must yield exactly "
            "once)"
        )
    return gen, init


def finish(gen: Generator | None, final: Any, run: Callable = _direct) -> None:
    """Send the final carry into the coroutine, which must then return."""
    if gen is None:
        return

    def send():
        try:
            gen.send(final)
        except StopIteration:
            return True
        return False

    if run(send):
        return
    raise ValueError(
        "carry_coroutine yielded a second time; it must yield exactly once (the initial carry) and "
        "receive the final carry as the value of that yield"
    )


def check_single_call(called: list) -> None:
    """A compute context's `eval_pipeline` runs the pipeline once: a second call is an error."""
    if called:
        raise ValueError(
            "compute_context called the pipeline (eval_pipeline) a second time; it must call it "
            "exactly once"
        )


def check_called(called: list) -> None:
    """A compute context that returned without calling `eval_pipeline` is an error."""
    if not called:
        raise ValueError(
            "compute_context returned without calling the pipeline (eval_pipeline); it must call "
            "it exactly once"
        )
