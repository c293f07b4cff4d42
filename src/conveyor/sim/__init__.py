"""Replaying plans: the protocol checker (and, next, the hardware simulator)."""
from conveyor.sim.check import CheckReport, Finding, check

__all__ = ["check", "CheckReport", "Finding"]
