"""Where the mosaic_gpu tests run: through the GPU interpreter on CPU (CI), natively on a GPU.

`make gpu-check` sets CONVEYOR_TEST_PLATFORM=gpu: the same tests then run their mosaic_gpu cases as
real kernels on the GPU (interpret=False), compared against the same references.
"""

import os

from jax.experimental.pallas import mosaic_gpu as plgpu

ON_GPU = os.environ.get("CONVEYOR_TEST_PLATFORM", "cpu") == "gpu"


def gpu_interpret(**options):
    """`interpret` for a mosaic_gpu kernel: False on a GPU, the GPU interpreter (with `options`) on
    CPU."""
    return False if ON_GPU else plgpu.InterpretGPUParams(**options)
