"""mpmd_map's scratch: Conveyor's and Pallas's spellings, in any pytree, brought to one vocabulary.

Design notes: docs/internals/mpmd.md, section `mpmd/scratch.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from conveyor.jaxprs import pallas_scratch_kind
from conveyor.sync import BarrierType, SemaphoreType

Scratch = jax.ShapeDtypeStruct | SemaphoreType | BarrierType


def _is_leaf(x) -> bool:
    return (
        isinstance(x, (SemaphoreType, BarrierType, jax.ShapeDtypeStruct))
        or pallas_scratch_kind(x) is not None
        or (hasattr(x, "shape") and hasattr(x, "dtype"))
    )


def _label(path) -> str:
    if not path:
        return "scratch"
    first, rest = path[0], path[1:]
    name = getattr(first, "key", getattr(first, "idx", first))
    return f"scratch {name}{jax.tree_util.keystr(tuple(rest))}"


def normalize(s: Any, label: str, num_instances: int) -> Scratch:
    """One scratch leaf in Conveyor's vocabulary; a clear TypeError for what mpmd_map cannot
    hold."""
    if isinstance(s, (SemaphoreType, BarrierType)):
        return s
    kind = pallas_scratch_kind(s)
    if kind == "semaphore":
        return SemaphoreType(tuple(getattr(s, "shape", ())))  # a bare REGULAR is one semaphore
    if kind == "dma_semaphore":
        raise TypeError(
            f"mpmd_map: {label} is a DMA semaphore, which counts the bytes of asynchronous copies; "
            "programs of mpmd_map synchronise with counting semaphores: use "
            "cv.SemaphoreType(shape) or pltpu.SemaphoreType.REGULAR(shape)"
        )
    if kind == "barrier":
        if s.num_barriers not in ((), 1) or s.num_arrivals != num_instances:
            raise ValueError(
                f"mpmd_map: {label}: a plgpu.Barrier stands for cv.BarrierType(), a single barrier "
                "that every instance of every program reaches, so it needs num_barriers=1 and "
                f"num_arrivals={num_instances} (the number of instances); got {s!r}"
            )
        return BarrierType()
    if kind == "array" or (hasattr(s, "shape") and hasattr(s, "dtype")):
        return jax.ShapeDtypeStruct(tuple(s.shape), jnp.dtype(s.dtype))
    raise TypeError(
        f"mpmd_map: {label} must be a jax.ShapeDtypeStruct, cv.SemaphoreType, cv.BarrierType or "
        "one of Pallas's spellings of them (pltpu.VMEM / plgpu.SMEM shapes, "
        f"SemaphoreType.REGULAR, plgpu.Barrier); got {s!r}"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScratchLayout:
    """The flat scratch leaves of one mpmd_map call and how to hand them back to a program."""

    leaves: tuple[Scratch, ...]
    given: tuple[Any, ...]  # the leaves as spelled (a backend may keep Pallas's memory spaces)
    labels: tuple[str, ...]
    tree: Any  # the PyTreeDef of scratch_shapes
    by_keyword: bool  # scratch_shapes was a dict: programs take it by keyword

    @classmethod
    def of(cls, scratch_shapes: Any, num_instances: int) -> ScratchLayout:
        if not isinstance(scratch_shapes, (Mapping, list, tuple)):
            raise TypeError(
                "mpmd_map: scratch_shapes must be a sequence or a dict of scratch types, got "
                f"{type(scratch_shapes).__name__}"
            )
        by_keyword = isinstance(scratch_shapes, Mapping)
        if by_keyword:
            bad = [k for k in scratch_shapes if not isinstance(k, str)]
            if bad:
                raise TypeError(
                    "mpmd_map: scratch_shapes given as a dict passes scratch by keyword, so its "
                    f"keys must be str; got {bad[0]!r}"
                )
        with_paths, tree = jax.tree_util.tree_flatten_with_path(scratch_shapes, is_leaf=_is_leaf)
        labels = tuple(_label(path) for path, _ in with_paths)
        leaves = tuple(
            normalize(s, label, num_instances) for (_, s), label in zip(with_paths, labels)
        )
        given = tuple(s for _, s in with_paths)
        return cls(leaves=leaves, given=given, labels=labels, tree=tree, by_keyword=by_keyword)

    def arguments(self, refs) -> tuple[tuple, dict]:
        """(positional, keyword) scratch arguments of a program, in scratch_shapes' structure."""
        structured = jax.tree_util.tree_unflatten(self.tree, list(refs))
        return ((), dict(structured)) if self.by_keyword else (tuple(structured), {})


__all__ = ["Scratch", "ScratchLayout", "normalize"]
