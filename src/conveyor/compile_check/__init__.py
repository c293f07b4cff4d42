"""Compile Conveyor's kernels with the real compilers for chips this host does not have
(deviceless AOT: H100 through Mosaic GPU and ptxas, TPU v5e/v6e/v5p through libtpu)."""

from conveyor.compile_check.cases import Case, case, production
from conveyor.compile_check.run import markdown, run, verdict
from conveyor.compile_check.targets import TARGETS, Target, target

__all__ = [
    "Case",
    "TARGETS",
    "Target",
    "case",
    "markdown",
    "production",
    "run",
    "target",
    "verdict",
]
