"""Which implementation runs an op: one registry per op, and each platform's default order.

Design notes: docs/internals/core.md, section `backends.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import jax

BACKENDS = ("xla", "mosaic_tpu", "mosaic_gpu", "reference")

PLATFORM_DEFAULTS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "tpu": ("mosaic_tpu", "xla"),
        "cuda": ("xla",),
        "rocm": ("xla",),
        "cpu": ("xla",),
    }
)

# `backend=None` on ops that choose per lowering platform (a primitive parameter).
AUTO = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Implementation:
    """One backend of one op: `run(*args, **params)` computes it; `check(*args, **params)`, when
    given, raises NotImplementedError naming why these arguments are beyond it (so `backend=None`
    passes it by); `interprets`: it has a Pallas interpreter (takes `interpret=`)."""

    name: str
    run: Callable[..., Any]
    check: Callable[..., None] | None = None
    interprets: bool = False


@dataclasses.dataclass(frozen=True)
class Registry:
    """An op's implementations, by name."""

    op: str
    implementations: tuple[Implementation, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.implementations)

    def get(self, backend: str) -> Implementation:
        """The implementation a user named; a clear error for a name this op lacks."""
        for impl in self.implementations:
            if impl.name == backend:
                return impl
        if backend in BACKENDS:
            raise NotImplementedError(
                f"backend={backend!r}: {self.op} has no {backend} implementation; available: "
                f"{self.names}"
            )
        raise ValueError(f"backend: expected one of {self.names} or None, got {backend!r}")

    def for_platform(self, platform: str, *args, **params) -> Implementation:
        """The first implementation in `platform`'s default order that accepts these arguments;
        NotImplementedError listing every implementation's reason when none does."""
        reasons = []
        for name in PLATFORM_DEFAULTS.get(platform, ("xla",)):
            impl = next((i for i in self.implementations if i.name == name), None)
            if impl is None:
                reasons.append(f"{name}: {self.op} has none")
                continue
            try:
                if impl.check is not None:
                    impl.check(*args, **params)
            except NotImplementedError as e:
                reasons.append(f"{name}: {e}")
                continue
            return impl
        raise NotImplementedError(
            f"{self.op} lowered for {platform}: no implementation in its default order runs these "
            f"arguments ({'; '.join(reasons)}); name one with backend="
        )


def process_platform() -> str:
    """The platform of this process's default device, as lowering names it ("cpu", "cuda", "rocm",
    "tpu")."""
    platform = jax.default_backend()
    return "cuda" if platform == "gpu" else platform


def default_backend(available: tuple[str, ...]) -> str:
    """The backend `backend=None` picks, for ops that choose when called (cv.kernel with
    `interpret`): the first of the process platform's default order that the op has."""
    return next(
        (b for b in PLATFORM_DEFAULTS.get(process_platform(), ("xla",)) if b in available), "xla"
    )


def check_backend(backend: str | None, available: tuple[str, ...], op: str) -> str:
    """Validate a user's `backend` argument for `op`; None picks the platform default."""
    if backend is None:
        return default_backend(available)
    if backend not in available:
        if backend in BACKENDS:
            raise NotImplementedError(
                f"backend={backend!r}: {op} has no {backend} implementation; available: {available}"
            )
        raise ValueError(f"backend: expected one of {available} or None, got {backend!r}")
    return backend
