"""`CONVEYOR_TEST_PLATFORM=cuda-lowering` (`make gpu-lowering-check`): on a CPU host, every
mosaic_gpu kernel a test launches through `cv.kernel` is lowered for CUDA (`jax.export`, which runs
Pallas' Mosaic GPU lowering and Mosaic's own passes, layout inference included) instead of being
interpreted. What only a real GPU refused before (a primitive Mosaic GPU does not lower, a layout
it cannot infer) fails here, on a CPU, with the lowering's error. Kernels that lower return zeros,
so a test's value checks mean nothing in this mode: a test whose kernels all lowered is reported
skipped ("lowered for cuda"); one whose kernel did not lower fails with `CudaLoweringError`.
ptxas (registers, spills) is `make compile-check`'s job, for the production kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from conveyor import kernel_gpu
from conveyor.mpmd import mosaic_gpu as mpmd_gpu
from conveyor.compile_check.device import raised_by_conveyor

MODE = "cuda-lowering"


# mosaic_gpu kernels lowered since the current test's setup (`relabel` reads it)
lowered = 0


class CudaLoweringError(Exception):
    """A mosaic_gpu kernel of the test did not lower for CUDA."""


def _lowered(run, outs, pack):
    """`run` (a mosaic_gpu launcher) lowered for CUDA at each call, returning zeros packed as
    `pack(list of zeros)` (the launcher's own return structure)."""

    def lower_then_zeros(*inputs):
        global lowered
        structs = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in inputs]
        try:
            jax.export.export(jax.jit(run), platforms=["cuda"])(*structs)
        except Exception as e:  # noqa: BLE001 - the lowering's verdict is the point
            if raised_by_conveyor(e):  # Conveyor's own refusal: the test may expect it
                raise
            raise CudaLoweringError(f"{type(e).__name__}: {e}") from e
        lowered += 1
        return pack([jnp.zeros(o.shape, o.dtype) for o in outs])

    return lower_then_zeros


def install() -> None:
    """Lower instead of run: wraps the launchers of `cv.kernel(backend="mosaic_gpu")` and of
    `mpmd_map` on mosaic_gpu (kernels a test interprets on every platform still run)."""
    launch, build = kernel_gpu.launch, mpmd_gpu.build

    def lowering_launch(body, outs, scratch, single, interpret, *args, **kwargs):
        run = launch(body, outs, scratch, single, interpret, *args, **kwargs)
        return run if interpret else _lowered(run, outs, lambda z: z[0] if single else tuple(z))

    def lowering_build(programs, axes, out_leaves, layout, aliases, interpret, *args, **kwargs):
        call = build(programs, axes, out_leaves, layout, aliases, interpret, *args, **kwargs)
        return call if interpret else _lowered(call, out_leaves, list)

    kernel_gpu.launch, mpmd_gpu.build = lowering_launch, lowering_build


def relabel(report) -> None:
    """A test that lowered a kernel and then failed on anything but a CudaLoweringError (its value
    checks met zeros), or passed: reported skipped, with that reason. A test that lowered no
    mosaic_gpu kernel keeps its outcome."""
    global lowered
    if report.when == "setup":
        lowered = 0
        jax.clear_caches()  # a kernel traced by an earlier test would not be lowered again
    if report.when != "call" or report.skipped or not lowered:
        return
    if report.failed and "CudaLoweringError" in str(report.longrepr):
        return
    report.outcome = "skipped"
    report.longrepr = (str(report.fspath), 0, "Skipped: lowered for cuda (values not checked)")
