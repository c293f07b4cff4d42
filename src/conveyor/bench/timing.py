"""Timing helpers: interleaved repetitions and medians, so ratios within one run are fair.

This machine's speed drifts by tens of percent over seconds (other tenants); running candidates
round-robin and taking medians keeps the ratios between them stable even when absolute times move.
Each timed call is prepared (`run_once`) by:
- a pause, so the spinning worker threads of the previous candidate (OpenBLAS, XLA's Eigen pool) go
  idle instead of stealing one of the two cores (without it, a NumPy call right before an XLA call
  slowed it by up to 1.5x on the 2026-11-25 VM; on the 2026-11-27 VM, bf16 cv.gmm G=64 ran 30.4 ms
  right after the NumPy group loop against 22.3 after nothing);
- an untimed call of the candidate itself, so the timed call starts on a machine that is working,
  as a layer's op does inside a training step: on the 2026-11-27 VM an idle pause slowed the next
  memory-bound call (bf16 batched floor at G=64, medians of 7: 18.6 ms right after another call,
  20.2 after 0.3 s idle, 23.9 after 1 s), and the warm call tightened the spread (16.2-17.0 ms in 8
  of 9 calls against 16.9-27.2 without it, `conveyor bench gmm` shapes);
- a 64 MiB write, so the timed call finds its operands out of the caches the warm call filled (as
  weights come from DRAM in a real layer). The 2026-11-27 VM reports a 480 MiB L3 shared with
  other tenants, yet there the batched floor's 128 MiB of bf16 weights did not stay in it: after the
  warm call, 17.1 ms with no write, 17.4 after 64 MiB, 17.8 after 960 MiB (medians of 9).
Candidates slower than WARM_CALL_MAX_S get no warm call (an idle pause costs a few ms at most).

Even so, single calls on the 2-core VMs are bimodal: the same jitted f32 dot on the same buffers ran
11.1-11.8 ms or 14.6-21.0 ms (2026-11-25, `gmm-2026-11-25-2.md`), and on the 2026-11-27 VM calls
that run on AMX (bf16 cv.gmm and XLA's bf16 dot) take about twice as long in some calls, back to
back on the same buffers (cv.gmm G=8: 5.1-6.7 ms in 17 of 20 calls, 11.3-11.8 in 3). So a median
of a few runs can land in either mode and a ratio of two medians can move by up to 1.5x between runs.

`CONVEYOR_BENCH_SETTLE_S` sets the pause (seconds, default 0.3); the test suite sets 0, since it
checks that the benchmarks run and agree, not their times.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

import jax
import numpy as np


_EVICT = np.zeros(64 * 1024 * 1024 // 8)  # 64 MiB: twice the L3 of the 2026-11-25 VM (see above)


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


# Candidates whose last call took longer than this get no warm call before the next timed one.
WARM_CALL_MAX_S = 0.25


def run_once(fn: Callable[[], object], warm: bool = True) -> float:
    """Seconds of one call of `fn`, after the pause, an untimed call of `fn` (when `warm`) and the
    cache eviction of the module docstring."""
    time.sleep(SETTLE_SECONDS)
    if warm:
        jax.block_until_ready(fn())
    _EVICT.fill(1.0)
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
                warm = not times[name] or times[name][-1] <= WARM_CALL_MAX_S
                times[name].append(run_once(fn, warm))
    return {name: float(np.median(t)) for name, t in times.items()}
