"""mpmd_map on Mosaic TPU: one program on a TensorCore mesh (`pl.kernel` over
`pltpu.TensorCoreMesh`), each point of its one-axis mesh a TensorCore, its scratch each core's own.

Design notes: docs/internals/mpmd.md, section `mpmd/mosaic_tpu.py`.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor.aliasing import call_with_aliases
from conveyor.interpreters import tpu_params
from conveyor.kernel import mpmd_program
from conveyor.mpmd.programs import call_program, program_label, refuse_ref_inputs, split_refs
from conveyor.mpmd.scratch import ScratchLayout
from conveyor.sync import BarrierType, SemaphoreType


def _spelled_for_tpu(s: Any) -> bool:
    """A Pallas TPU scratch type (`pltpu.VMEM(...)`, `pltpu.SMEM(...)`,
    `pltpu.SemaphoreType.REGULAR(...)`): memory of one core, as the spelling says."""
    return isinstance(getattr(s, "memory_space", None), pltpu.MemorySpace) or isinstance(
        s, pltpu.SemaphoreType
    )


def kernel_scratch(layout: ScratchLayout, cores: int) -> list:
    """Each scratch leaf as Pallas TPU allocates it on every core. Conveyor's neutral spellings
    mean memory every instance shares (the CPU executor's rule); a TensorCore's VMEM and
    semaphores are its own, so with several cores they must be spelled as Pallas TPU's types."""
    out = []
    for given, leaf, label in zip(layout.given, layout.leaves, layout.labels):
        if _spelled_for_tpu(given):
            out.append(given)
            continue
        if isinstance(leaf, BarrierType):
            raise NotImplementedError(
                f"mpmd_map on mosaic_tpu: {label} is a cv.BarrierType; a TensorCore mesh has no "
                "barrier: build one from semaphores signalled across cores"
            )
        if cores > 1:
            raise NotImplementedError(
                f"mpmd_map on mosaic_tpu: {label} is {given!r}, memory every instance shares on "
                f"the CPU executor; on a mesh of {cores} TensorCores each core has its own. Spell "
                "it pltpu.VMEM(shape, dtype), pltpu.SMEM(...) or "
                "pltpu.SemaphoreType.REGULAR(shape) to take per-core memory (signal another core "
                "with pl.semaphore_signal(sem, device_id={axis: core}))"
            )
        if isinstance(leaf, SemaphoreType):
            out.append(pltpu.SemaphoreType.REGULAR(tuple(leaf.shape)))
        else:
            out.append(pltpu.VMEM(tuple(leaf.shape), jnp.dtype(leaf.dtype)))
    return out


def _tensorcore_mesh(programs) -> tuple[str, int]:
    """(axis name, cores) of the one program's one-axis mesh."""
    if len(programs) != 1:
        raise NotImplementedError(
            f"mpmd_map on mosaic_tpu: got {len(programs)} programs. Pallas TPU (jax 0.12) runs "
            "several programs in one kernel only on SparseCore meshes (plsc.ScalarSubcoreMesh "
            "beside plsc.VectorSubcoreMesh), and a cv.Mesh names no core type, so Conveyor lowers "
            "one program on a TensorCore mesh. Run the programs on backend='cpu' or "
            "'mosaic_gpu', or as one program branching on its core index"
        )
    mesh, fn = programs[0]
    if len(mesh.axis_sizes) != 1:
        raise NotImplementedError(
            f"mpmd_map on mosaic_tpu: {program_label(0, fn)} runs on {mesh!r}; a TensorCore mesh "
            "has one axis (the chip's cores): use cv.Mesh(core=n)"
        )
    ((axis, cores),) = mesh.axis_sizes.items()
    return axis, cores


def _check_cores(axis: str, cores: int, interpret) -> None:
    """A mesh of more TensorCores than the chip has is refused where the chip is known (a real
    TPU, or a compile-only topology's mesh); the interpreter runs any count."""
    if interpret:
        return
    try:
        chip = pltpu.get_tpu_info()
    except ValueError:  # no TPU known while tracing (e.g. export on CPU): nothing to hold it to
        return
    if cores > chip.num_cores:
        raise ValueError(
            f"mpmd_map on mosaic_tpu: cv.Mesh({axis}={cores}) asks for {cores} TensorCores; this "
            f"chip ({chip.chip_version.name}) has {chip.num_cores} per device"
        )


def build(
    programs,
    out_leaves,
    layout: ScratchLayout,
    aliases,
    interpret,
    name,
    compiler_params=None,
    cost_estimate=None,
    *,
    debug: bool = False,
):
    axis, cores = _tensorcore_mesh(programs)
    fn = programs[0][1]
    scratch_types = kernel_scratch(layout, cores)
    mesh = pltpu.TensorCoreMesh(axis_name=axis, num_cores=cores)

    def call(*inputs):
        refuse_ref_inputs("mosaic_tpu", inputs)
        _check_cores(axis, cores, interpret)
        n_in, n_out = len(inputs), len(out_leaves)

        def body(*refs):
            ins, outs, scratch = split_refs(refs, n_in, n_out)
            with mpmd_program("mosaic_tpu"):
                call_program(0, fn, (*ins, *outs), scratch, layout)

        def make_kernel(kernel_body, out_type):
            return pl.kernel(
                kernel_body,
                out_type=out_type,
                mesh=mesh,
                scratch_types=scratch_types,
                compiler_params=compiler_params,
                cost_estimate=cost_estimate,
                name=name,
                interpret=tpu_params(interpret),
                debug=debug,
            )

        return call_with_aliases(make_kernel, body, inputs, out_leaves, aliases)

    return call


__all__ = ["build", "kernel_scratch"]
