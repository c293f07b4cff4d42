"""Conveyor: software-pipelined accelerator kernels on JAX, verified and fast on CPU.

import conveyor as cv
out = cv.gmm(lhs, rhs, group_sizes)
"""

from conveyor import moe, pipeline, sim
from conveyor.dot import dot
from conveyor.interpreters import InterpreterDeadlock
from conveyor.interpreters import set_wait_deadline as set_interpreter_wait_deadline
from conveyor.kernel import kernel, program_id
from conveyor.ops.collective_matmul import RingBlocks, all_gather_matmul, matmul_reduce_scatter
from conveyor.ops.gmm import (
    GroupMetadata,
    gmm,
    gmm_scatter_add,
    make_group_metadata,
    ragged_dot,
    tgmm,
)
from conveyor.pipeline import BlockSpec, emit_pipeline, emit_pipeline_warp_specialized
from conveyor.mpmd import Mesh, MpmdDeadlock, mpmd_errors, mpmd_map
from conveyor.sync import (
    BarrierType,
    SemaphoreType,
    barrier_arrive,
    barrier_wait,
    fence,
    semaphore_signal,
    semaphore_wait,
    wait_produced,
)

__version__ = "0.1.0"
__all__ = [
    "dot",
    "gmm",
    "gmm_scatter_add",
    "tgmm",
    "ragged_dot",
    "make_group_metadata",
    "GroupMetadata",
    "kernel",
    "program_id",
    "emit_pipeline",
    "emit_pipeline_warp_specialized",
    "BlockSpec",
    "pipeline",
    "sim",
    "moe",
    "RingBlocks",
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "mpmd_map",
    "Mesh",
    "MpmdDeadlock",
    "mpmd_errors",
    "SemaphoreType",
    "BarrierType",
    "semaphore_signal",
    "semaphore_wait",
    "barrier_wait",
    "barrier_arrive",
    "wait_produced",
    "fence",
    "InterpreterDeadlock",
    "set_interpreter_wait_deadline",
    "__version__",
]
