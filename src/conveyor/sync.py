"""Synchronization objects a kernel body may receive, usable the same way on every backend."""
from __future__ import annotations

from typing import Any


class TraceTimeBarrier:
    """A consumed barrier on the xla backend, where threads need no real synchronization.

    It counts the body's arrivals while it is traced, so a body that never arrives (which would
    make a GPU's memory thread wait forever) is reported instead of silently accepted.
    """

    def __init__(self, name: str):
        self.name = name
        self.arrivals = 0

    def __repr__(self) -> str:
        return f"TraceTimeBarrier({self.name!r})"


def barrier_arrive(barrier: Any) -> None:
    """Arrive on a barrier handed to a kernel body (e.g. a manual consumed barrier of a pipeline)."""
    if isinstance(barrier, TraceTimeBarrier):
        barrier.arrivals += 1
        return
    from jax.experimental.pallas import mosaic_gpu as plgpu
    plgpu.barrier_arrive(barrier)
