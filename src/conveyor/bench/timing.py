"""Timing helpers: interleaved repetitions and medians, so ratios within one run are fair.

Design notes: docs/internals/benchmarks.md, section `bench/timing.py`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import numpy as np


_EVICT = np.zeros(64 * 1024 * 1024 // 8)  # 64 MiB written before each timed call (see above)


def _settle_seconds() -> float:
    """$CONVEYOR_BENCH_SETTLE_S, else 0.3: OpenBLAS threads spin for 2^28 cycles (~0.1 s) before
    sleeping."""
    text = os.environ.get("CONVEYOR_BENCH_SETTLE_S", "0.3")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"CONVEYOR_BENCH_SETTLE_S: expected seconds >= 0, got {text!r}")
    return value


SETTLE_SECONDS = _settle_seconds()


# Candidates whose last call took longer than this get no warm call before the next timed one.
WARM_CALL_MAX_S = 0.25


def run_once(fn: Callable[[], object], warm: bool = True) -> float:
    """Seconds of one call of `fn`, after the pause, an untimed call of `fn` (when `warm`) and the
    cache eviction of the design notes."""
    time.sleep(SETTLE_SECONDS)
    if warm:
        jax.block_until_ready(fn())
    _EVICT.fill(1.0)
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


def interleaved_medians(
    fns: dict[str, Callable[[], object]], reps: int, slow: dict[str, int] | None = None
) -> dict[str, float]:
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
                warm = not times[name] or times[name][-1] <= WARM_CALL_MAX_S
                times[name].append(run_once(fn, warm))
    return {name: float(np.median(t)) for name, t in times.items()}
