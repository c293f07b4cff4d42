"""Timing helpers: interleaved repetitions and medians, so ratios within one run are fair.

This machine's speed drifts by tens of percent over seconds (other tenants); running candidates
round-robin and taking medians keeps the ratios between them stable even when absolute times move.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import jax
import numpy as np


def run_once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def interleaved_medians(fns: dict[str, Callable[[], object]], reps: int,
                        slow: dict[str, int] | None = None) -> dict[str, float]:
    """Median seconds of each zero-argument function, measured round-robin after one warm-up.

    `slow` maps names to a smaller repetition count for very slow baselines.
    """
    slow = slow or {}
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile + warm caches
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps):
        for name, fn in fns.items():
            if rep < slow.get(name, reps):
                times[name].append(run_once(fn))
    return {name: float(np.median(t)) for name, t in times.items()}
