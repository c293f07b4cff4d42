"""How much VMEM a Mosaic TPU kernel may hold on the chip it is lowered for."""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import tpu as pltpu

MiB = 2**20

# Default scoped-VMEM limit by TPU generation: what a kernel gets without `vmem_limit_bytes`
# (libtpu 0.0.50: 16 MiB on v5e and v5p, 32 MiB on v6e; docs/compile-check.md).
_DEFAULT_SCOPED = {6: 32 * MiB}
_DEFAULT_SCOPED_OTHERS = 16 * MiB


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChipVmem:
    name: str
    default: int  # bytes a kernel may use without asking
    physical: int  # bytes `vmem_limit_bytes` can ask for at most


# Lowering without a TPU in view (an export from a CPU host with no TPU mesh): assume the least
# VMEM of the chips Conveyor compiles for (v5p: 64 MiB physical, 16 MiB scoped).
UNKNOWN_CHIP = ChipVmem(
    name="an unnamed TPU (v5p's limits assumed)", default=16 * MiB, physical=64 * MiB
)


def chip_vmem() -> ChipVmem:
    """The VMEM limits of the TPU being lowered for (Pallas reads it from the current mesh)."""
    try:
        info = pltpu.get_tpu_info()
    except ValueError:  # "Unsupported TPU device kind: cpu": no TPU named anywhere
        return UNKNOWN_CHIP
    default = _DEFAULT_SCOPED.get(info.generation, _DEFAULT_SCOPED_OTHERS)
    name = getattr(info.chip_version, "name", str(info.chip_version))
    return ChipVmem(name=name, default=default, physical=info.vmem_capacity_bytes)


def vmem_limit(kernel: str, *, working: int, peak: int, remedy: str) -> int | None:
    """`vmem_limit_bytes` for a kernel whose buffers take `working` bytes of VMEM and at most
    `peak` with its temporaries: None when the chip's default covers `peak`, else `peak` capped
    at the chip's VMEM. A NotImplementedError names the bytes, the chip and `remedy` when
    `working` does not fit."""
    chip = chip_vmem()
    if working > chip.physical:
        raise NotImplementedError(
            f"{kernel}: mosaic_tpu needs {working / MiB:.1f} MiB of VMEM at these shapes (its "
            f"buffers), over the {chip.physical / MiB:.0f} MiB of {chip.name}; {remedy}"
        )
    if peak <= chip.default:
        return None
    return min(peak, chip.physical)
