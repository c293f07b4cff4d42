"""Timing helpers: interleaved repetitions and medians, so ratios within one run are fair.

This machine's speed drifts by tens of percent over seconds (other tenants); running candidates
round-robin and taking medians keeps the ratios between them stable even when absolute times move.
Before every timed call we also `settle()`: evict the 32 MiB L3 (so weights come from DRAM, as in a
real layer, and no candidate inherits another's warm cache) and pause briefly so the spinning
worker threads of the previous candidate (OpenBLAS, XLA's Eigen pool) go idle instead of stealing
one of the two cores. Without this, a NumPy call right before an XLA call slowed it by up to 1.5x.

Even so, single calls on the 2-core VM are bimodal: the same jitted f32 dot on the same buffers ran
11.1-11.8 ms or 14.6-21.0 ms after `settle()` (2026-11-25, `gmm-2026-11-25-2.md`), so a median of
a few runs can land in either mode and a ratio of two medians can move by up to 1.5x between runs.

`CONVEYOR_BENCH_SETTLE_S` sets the pause (seconds, default 0.3); the test suite sets 0, since it
checks that the benchmarks run and agree, not their times.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import numpy as np


_EVICT = np.zeros(64 * 1024 * 1024 // 8)  # 64 MiB: twice the L3 of the reference machine


def _settle_seconds() -> float:
    """$CONVEYOR_BENCH_SETTLE_S, else 0.3: OpenBLAS threads spin for 2^28 cycles (~0.1 s) before sleeping."""
    text = os.environ.get("CONVEYOR_BENCH_SETTLE_S", "0.3")
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(f"CONVEYOR_BENCH_SETTLE_S: expected seconds >= 0, got {text!r}")
    return value


SETTLE_SECONDS = _settle_seconds()


def settle() -> None:
    """Evict caches and let other libraries' spinning threads fall asleep (single-threaded)."""
    _EVICT.fill(1.0)
    time.sleep(SETTLE_SECONDS)


def run_once(fn: Callable[[], object]) -> float:
    settle()
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
