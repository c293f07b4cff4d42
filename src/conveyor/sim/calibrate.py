"""A hardware model at the rates one machine sustained in one run: the matrix fraction fitted to a
dense matmul timed in that run, the HBM fraction to a copy timed in it.

A benchmark then divides a kernel's time by a prediction made at its own machine's rates, so that
what the machine ran at that moment (its clocks under its power limit, which depend on the data:
../../docs/simulator.md) is told apart from what the model misses about the kernel's schedule.

Design notes: docs/internals/simulator.md, section `sim/calibrate.py`.
"""

from __future__ import annotations

import dataclasses

from conveyor.sim.hardware import Hardware, Value
from conveyor.sim.hardware import get as get_hardware
from conveyor.sim.simulate import simulate_matmul

# The fit's relative precision on the matmul's time: far below the run-to-run spread of a timing.
FIT_TOLERANCE = 1e-4
LOWEST_FRACTION = 1e-6  # a CPU standing in for a GPU (the benchmark's CPU test) fits far below 1


def at_measured_rates(
    hardware: str | Hardware,
    *,
    matmul: tuple[int, int, int, float],
    copy_bytes_per_s: float,
    dtype: str = "bf16",
) -> Hardware:
    """`hardware` whose achievable matrix fraction makes the simulator's (m, k, n) matmul take the
    measured seconds (`matmul` = (m, k, n, seconds)), and whose achievable HBM fraction is the
    measured copy rate (`copy_bytes_per_s`, read + write) over the datasheet bandwidth. Every other
    number is the model's. Raises ValueError, naming the argument, for a rate the datasheet peak
    cannot reach."""
    hw = get_hardware(hardware)
    m, k, n, seconds = matmul
    if not seconds > 0:
        raise ValueError(f"matmul: the measured seconds must be positive, got {seconds!r}")
    if not copy_bytes_per_s > 0:
        raise ValueError(f"copy_bytes_per_s: must be positive, got {copy_bytes_per_s!r}")
    hbm_fraction = copy_bytes_per_s / hw.hbm_bandwidth.value
    if hbm_fraction > 1:
        raise ValueError(
            f"copy_bytes_per_s: {copy_bytes_per_s:.4g} B/s is past {hw.name}'s datasheet HBM "
            f"bandwidth ({hw.hbm_bandwidth.value:.4g} B/s)"
        )
    # the tiling the model picks at its own rates, kept fixed while the fraction is fitted
    config = simulate_matmul(m, k, n, dtype=dtype, hardware=hw).config
    tiling, stages = config["tiling"], config["stages"]

    def model(fraction: float) -> Hardware:
        return dataclasses.replace(
            hw,
            name=f"{hw.name} at a run's measured rates",
            matrix_efficiency=Value(fraction, "measured-run"),
            hbm_efficiency=Value(hbm_fraction, "measured-run"),
        )

    def seconds_at(fraction: float) -> float:
        return simulate_matmul(
            m, k, n, dtype=dtype, hardware=model(fraction), tiling=tiling, stages=stages
        ).time_s

    if seconds_at(1.0) > seconds:
        raise ValueError(
            f"matmul: {seconds:.4g} s for {m}x{k}x{n} is faster than {hw.name} at its datasheet "
            f"peak ({seconds_at(1.0):.4g} s)"
        )
    if seconds_at(LOWEST_FRACTION) < seconds:
        raise ValueError(
            f"matmul: {seconds:.4g} s for {m}x{k}x{n} is slower than {hw.name} at "
            f"{LOWEST_FRACTION:g} of its peak: not this hardware"
        )
    lo, hi = LOWEST_FRACTION, 1.0  # the time falls as the fraction rises
    while hi - lo > FIT_TOLERANCE * lo:
        mid = (lo * hi) ** 0.5  # geometric: the range spans decades
        if seconds_at(mid) > seconds:
            lo = mid
        else:
            hi = mid
    return model(hi)


__all__ = ["at_measured_rates"]
