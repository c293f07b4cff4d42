"""Backend names and the per-platform default choice."""
from __future__ import annotations

import jax

BACKENDS = ("xla", "mosaic_tpu", "mosaic_gpu", "reference")


def default_backend(available: tuple[str, ...]) -> str:
    """The backend `backend=None` picks on this process's default platform (see `for_platform`)."""
    platform = jax.default_backend()
    return for_platform("cuda" if platform == "gpu" else platform, available)


# `backend=None` on ops that choose per lowering platform: the choice is made when the op is
# lowered, for the platform it is lowered for (so `jax.export(..., platforms=["tpu"])` from a CPU
# host gets the TPU kernel), not for the process's default device.
AUTO = "auto"


def for_platform(platform: str, available: tuple[str, ...]) -> str:
    """The backend an op lowered for `platform` ("cpu", "cuda", "rocm", "tpu") runs when none was named.

    TPU runs the Mosaic TPU kernel when the op has one, CUDA the Mosaic GPU kernel when it has one
    and the GPUs are Hopper (`local_gpus_run_wgmma`); everything else the XLA backend, which is
    exact and runs everywhere. ROCm has no Mosaic GPU: xla.
    """
    if platform == "tpu" and "mosaic_tpu" in available:
        return "mosaic_tpu"
    if platform == "cuda" and "mosaic_gpu" in available and local_gpus_run_wgmma():
        return "mosaic_gpu"
    return "xla"


def local_gpus_run_wgmma() -> bool:
    """Whether Mosaic GPU kernels built on wgmma and TMA can run here: every CUDA GPU this process
    sees is a Hopper (compute capability 9.x; Ampere lacks both, Blackwell has no wgmma). True on a
    host without GPUs, where a lowering for cuda is an export for the H100s the kernels target."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:   # no GPU platform in this process
        return True
    return all(str(getattr(d, "compute_capability", "9.0")).startswith("9.") for d in gpus)


def check_backend(backend: str | None, available: tuple[str, ...], op: str) -> str:
    """Validate a user's `backend` argument for `op`; None picks the platform default."""
    if backend is None:
        return default_backend(available)
    if backend not in available:
        if backend in BACKENDS:
            raise NotImplementedError(
                f"backend={backend!r}: {op} has no {backend} implementation; available: {available}")
        raise ValueError(f"backend: expected one of {available} or None, got {backend!r}")
    return backend
