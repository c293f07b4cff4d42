"""Synchronization objects a kernel body may receive, usable the same way on every backend."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


class TraceTimeBarrier:
    """A pipeline barrier handed to a body on the xla backend, where threads need no real
    synchronization (copies are synchronous there).

    It counts the body's arrivals and waits while it is traced, so a body that never arrives on a
    consumed barrier (a GPU's memory thread would wait forever) or never waits on a produced one
    (a GPU would read the slot before its copy lands) is reported instead of silently accepted.
    """

    def __init__(self, name: str):
        self.name = name
        self.arrivals = 0
        self.waits = 0

    def __repr__(self) -> str:
        return f"TraceTimeBarrier({self.name!r})"


def barrier_arrive(barrier: Any) -> None:
    """Arrive on a barrier handed to a kernel body (e.g. a manual consumed barrier of a
    pipeline)."""
    if isinstance(barrier, TraceTimeBarrier):
        barrier.arrivals += 1
        return
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.barrier_arrive(barrier)


def wait_produced(barrier: Any) -> None:
    """Wait on a produced barrier handed to a warp-specialized pipeline's body
    (`manual_produced_barriers=True`): returns once the copy of that input's block for this step
    has landed in its slot. On mosaic_gpu it is `plgpu.barrier_wait` (upstream bodies that call
    that directly run unchanged there); on xla the block is already there and the wait is
    counted."""
    if isinstance(barrier, TraceTimeBarrier):
        barrier.waits += 1
        return
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.barrier_wait(barrier)


# ---- semaphores and barriers shared by the programs of cv.mpmd_map -----------------------------


@dataclasses.dataclass(frozen=True)
class SemaphoreType:
    """Scratch shape for counting semaphores (int32 counters starting at 0), e.g.
    SemaphoreType((8,))."""

    shape: tuple[int, ...] = ()


def mosaic_scratch(s, onchip, regular_semaphore):
    """A kernel scratch entry as a Mosaic backend takes it: a ShapeDtypeStruct as
    `onchip(shape, dtype)` (VMEM, SMEM), a `SemaphoreType` as `regular_semaphore(shape)`, native
    Pallas types as they are."""
    if isinstance(s, jax.ShapeDtypeStruct):
        return onchip(s.shape, s.dtype)
    if isinstance(s, SemaphoreType):
        return regular_semaphore(tuple(s.shape))
    return s


@dataclasses.dataclass(frozen=True)
class BarrierType:
    """Scratch shape for a barrier across every instance of every program of one mpmd_map call."""


def _primitive(name):
    from conveyor._compat import Primitive
    from conveyor.jaxprs import write_effect

    p = Primitive(name)
    p.multiple_results = True
    p.def_effectful_abstract_eval(lambda *avals, **params: ([], {write_effect(0)}))
    return p


semaphore_signal_p = _primitive("cv_semaphore_signal")
semaphore_wait_p = _primitive("cv_semaphore_wait")
barrier_p = _primitive("cv_barrier")


def _backend(api: str) -> str:
    from conveyor.kernel import current_sync

    return current_sync(api)


def semaphore_signal(sem, inc: int | jax.Array = 1) -> None:
    """Add `inc` to a semaphore (a scratch ref of `SemaphoreType`, or one element of it:
    `sems.at[i]`)."""
    backend = _backend("cv.semaphore_signal")
    if backend != "cpu":
        from jax.experimental import pallas as pl

        return pl.semaphore_signal(sem, inc)
    from conveyor.jaxprs import ref_and_transforms

    ref, leaves, tree = ref_and_transforms(sem, "cv.semaphore_signal")
    semaphore_signal_p.bind(ref, jnp.asarray(inc, jnp.int32), *leaves, tree=tree)


def semaphore_wait(sem, value: int | jax.Array = 1) -> None:
    """Block until the semaphore holds at least `value`, then subtract it. On the CPU executor a
    wait that outlasts the timeout aborts the call with a report of who waits on what."""
    backend = _backend("cv.semaphore_wait")
    if backend != "cpu":
        from jax.experimental import pallas as pl

        return pl.semaphore_wait(sem, value)
    from conveyor.jaxprs import ref_and_transforms

    ref, leaves, tree = ref_and_transforms(sem, "cv.semaphore_wait")
    semaphore_wait_p.bind(ref, jnp.asarray(value, jnp.int32), *leaves, tree=tree)


def barrier_wait(barrier) -> None:
    """Wait until every instance of every program has reached this barrier (a `BarrierType`
    scratch)."""
    backend = _backend("cv.barrier_wait")
    if backend == "mosaic_gpu":  # an mbarrier expecting one arrival per warpgroup of the kernel
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.barrier_arrive(barrier)
        plgpu.barrier_wait(barrier)
        return
    if backend != "cpu":
        raise NotImplementedError(
            f"cv.barrier_wait: not available on {backend}; build it from semaphores"
        )
    barrier_p.bind(barrier)


def fence() -> None:
    """Make this instance's shared-memory writes visible to the hardware's copy engines before it
    signals another program (Mosaic GPU: `commit_smem`); nothing to do on the CPU executor."""
    if _backend("cv.fence") == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.commit_smem()
