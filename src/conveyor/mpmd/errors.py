"""Errors of mpmd_map programs that ran inside `jax.jit`, brought back to their own types.

Design notes: docs/internals/mpmd.md, section `mpmd/errors.py`.
"""

from __future__ import annotations

import collections
import contextlib
import re
import threading

MARK = "conveyor-mpmd-error#"
_KEPT = 64  # the most recent failures are kept; older ones are forgotten
_lock = threading.Lock()
_failures: collections.OrderedDict[int, BaseException] = collections.OrderedDict()
_counter = 0


class ProgramsFailed(RuntimeError):
    """What a host callback raises in place of a program's error; its text names the original."""


def marked(e: BaseException) -> ProgramsFailed:
    """Keep `e` and return the error to raise in the callback: its text carries the mark of `e`."""
    global _counter
    with _lock:
        _counter += 1
        _failures[_counter] = e
        while len(_failures) > _KEPT:
            _failures.popitem(last=False)
        token = _counter
    notes = "".join(f"\n{note}" for note in getattr(e, "__notes__", ()))  # who raised it
    return ProgramsFailed(
        f"[{MARK}{token}] {type(e).__name__}: {e}{notes}\n(wrap the jitted call in `with "
        f"cv.mpmd_errors():` to receive this error as {type(e).__name__})"
    )


def original(e: BaseException) -> BaseException | None:
    """The program error whose mark `e`'s text carries, if it is still kept."""
    found = re.search(re.escape(MARK) + r"(\d+)", str(e))
    if found is None:
        return None
    with _lock:
        return _failures.pop(int(found.group(1)), None)


class mpmd_errors(contextlib.ContextDecorator):
    """Re-raise the errors of mpmd_map programs run under `jax.jit` as their own types.

        with cv.mpmd_errors():
            step(x)                  # a deadlock inside the jitted step raises cv.MpmdDeadlock

    Errors that did not come from an mpmd_map program pass through unchanged.
    """

    def __enter__(self) -> mpmd_errors:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            return False
        program_error = original(exc)
        if program_error is None:
            return False
        raise program_error from exc


__all__ = ["MARK", "ProgramsFailed", "marked", "mpmd_errors", "original"]
