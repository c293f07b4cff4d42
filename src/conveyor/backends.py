"""Backend names and the per-platform default choice."""
from __future__ import annotations

import jax

BACKENDS = ("xla", "mosaic_tpu", "mosaic_gpu", "reference")


def default_backend(available: tuple[str, ...]) -> str:
    """The backend `backend=None` picks on this process's default platform.

    TPU runs the Mosaic TPU kernel when the op has one; every other platform (CPU, GPU without a
    Mosaic GPU kernel for the op) runs the XLA backend, which is exact and fast everywhere.
    """
    platform = jax.default_backend()
    if platform == "tpu" and "mosaic_tpu" in available:
        return "mosaic_tpu"
    if platform in ("gpu", "cuda") and "mosaic_gpu" in available:
        return "mosaic_gpu"
    return "xla"


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
