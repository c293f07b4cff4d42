"""Where the mosaic_gpu tests run: through the GPU interpreter on CPU (CI), natively on a GPU.

`make gpu-check` sets CONVEYOR_TEST_PLATFORM=gpu: the same tests then run their mosaic_gpu cases as
real kernels on the GPU (interpret=False), compared against the same references.
"""

import os

from jax.experimental.pallas import mosaic_gpu as plgpu

PLATFORM = os.environ.get("CONVEYOR_TEST_PLATFORM", "cpu")
ON_GPU = PLATFORM == "gpu"
# `make gpu-lowering-check` (tests/cuda_lowering.py): the kernels are lowered for CUDA, not run
LOWERING_FOR_CUDA = PLATFORM == "cuda-lowering"


def gpu_interpret(**options):
    """`interpret` for a mosaic_gpu kernel: False on a GPU, the GPU interpreter (with `options`) on
    CPU."""
    return False if ON_GPU or LOWERING_FOR_CUDA else plgpu.InterpretGPUParams(**options)


def gpu_interpreter_always(**options):
    """The GPU interpreter on every platform, for a mosaic_gpu kernel that only the interpreter
    can run: one that records its copies through `jax.debug.callback` (`record_issued`), relies on
    the interpreter's race detector, or has a body Mosaic GPU's warpgroup lowering refuses (a
    float32 `jnp.dot`: real-GPU matmul pipelines use `cv.dot`). On a real H200 these failed to
    lower (benchmarks/results/gpu-check-2026-11-30.md); each call site says which it is."""
    return plgpu.InterpretGPUParams(**options)
