"""Replaying plans: the protocol checker and the hardware simulator.

report = cv.sim.simulate_matmul(8192, 8192, 8192, dtype="bf16", hardware="h100")
report.time_us, report.utilization, report.bottleneck; report.save_png("t.png")
cv.sim.check(cv.pipeline.plan(...), in_flight_steps=1)   # races and deadlocks
"""

from conveyor.plans.sequence import Prefetched
from conveyor.sim.calibrate import at_measured_rates
from conveyor.sim.check import CheckReport, Finding, check
from conveyor.sim.hardware import HARDWARE, Hardware, Value
from conveyor.sim.moe import MoeShape, simulate_moe_layer
from conveyor.sim.report import Box, Report
from conveyor.sim.simulate import (
    DoesNotFit,
    simulate,
    simulate_collective_matmul,
    simulate_copy,
    simulate_gmm,
    simulate_tgmm,
    simulate_matmul,
)

__all__ = [
    "check",
    "CheckReport",
    "Finding",
    "HARDWARE",
    "Hardware",
    "Value",
    "Report",
    "Box",
    "simulate",
    "simulate_matmul",
    "simulate_gmm",
    "simulate_tgmm",
    "simulate_copy",
    "simulate_collective_matmul",
    "simulate_moe_layer",
    "at_measured_rates",
    "MoeShape",
    "DoesNotFit",
    "Prefetched",
]
