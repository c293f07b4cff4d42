"""The Pallas interpreters as Conveyor launches them, and the workarounds of their gaps.

Design notes: docs/internals/core.md, section `interpreters.py`.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from conveyor import _compat

DEFAULT_WAIT_DEADLINE_S = 60.0
_deadline = {"seconds": DEFAULT_WAIT_DEADLINE_S}
_install_lock = threading.Lock()
_installed: set[str] = set()


class InterpreterDeadlock(RuntimeError):
    """An interpreted kernel waited past the wait deadline for something nothing will do.

    Raised inside the interpreter's host callback: under `jax.jit` XLA reports it as a
    `jax.errors.JaxRuntimeError` whose last line is this message."""


def set_wait_deadline(seconds: float | None) -> None:
    """Set how long an interpreter wait may block before it raises `InterpreterDeadlock`.

    `seconds` > 0, or None for no deadline (a deadlocked kernel then hangs). Applies to waits
    that start after the call, on the Pallas TPU and Mosaic GPU interpreters.
    """
    if seconds is not None and not (
        isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0
    ):
        raise ValueError(
            "set_interpreter_wait_deadline: seconds must be a finite number > 0 or None, got "
            f"{seconds!r}"
        )
    _deadline["seconds"] = None if seconds is None else float(seconds)


def wait_deadline() -> float | None:
    """The current interpreter wait deadline in seconds (None: waits never time out)."""
    return _deadline["seconds"]


def tpu_params(interpret: Any):
    """The `interpret=` value for a Pallas TPU call: False, or the InterpretParams to run with."""
    if interpret is None or interpret is False:
        return False
    _install("tpu")
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams() if interpret is True else interpret


def gpu_params(interpret: Any):
    """The `interpret=` value for a Mosaic GPU kernel: None, or the InterpretGPUParams to run
    with."""
    if interpret is None or interpret is False:
        return None
    _install("gpu")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.InterpretGPUParams() if interpret is True else interpret


def install_workarounds() -> None:
    """Install the workarounds for both interpreters now, so that kernels launched with Pallas
    directly (`pl.pallas_call(..., interpret=...)`) get them too (`conveyor.testing` calls this)."""
    _install("tpu")
    _install("gpu")


def _install(which: str) -> None:
    with _install_lock:
        if which in _installed:
            return
        if which == "tpu":
            _tpu_semaphore_deadline()
        else:
            _gpu_barrier_deadline()
            _gpu_multi_device_barrier_check()
        _installed.add(which)


def _tpu_semaphore_deadline() -> None:
    """TPU: the interpreter's semaphore wait loop polls `SharedMemory.check_failed` every 0.1 s
    while it blocks; the deadline is checked there, in the waiting thread."""
    sm = _compat.tpu_interpreter_shared_memory()
    waiting = threading.local()
    original_wait, original_check = sm.Semaphore.wait, sm.SharedMemory.check_failed

    def wait(self, value, global_core_id, *args, **kwargs):
        waiting.since, waiting.what = time.monotonic(), (self.id, value, int(global_core_id))
        try:
            return original_wait(self, value, global_core_id, *args, **kwargs)
        finally:
            waiting.since = None

    def check_failed(self):
        original_check(self)
        since, limit = getattr(waiting, "since", None), _deadline["seconds"]
        if since is not None and limit is not None and time.monotonic() - since > limit:
            sem, value, core = waiting.what
            waiting.since = None
            raise InterpreterDeadlock(
                f"Pallas TPU interpreter: core {core} waited {limit:g} s on semaphore {sem} for a "
                f"count of {value}, and nothing signals it: a DMA never started or a signal never "
                "sent (a deadlock; cv.sim.check finds schedule deadlocks with a trace; "
                f"cv.set_interpreter_wait_deadline changes the {limit:g} s)"
            )

    sm.Semaphore.wait, sm.SharedMemory.check_failed = wait, check_failed


def _gpu_barrier_deadline() -> None:
    """GPU: a barrier wait blocks on the barrier's condition variable; each barrier gets one whose
    untimed wait raises when nothing arrives at the barrier for the deadline (an arrival notifies
    it)."""
    barrier_cls = _compat.gpu_interpreter_shared_memory().Barrier
    waiting = threading.local()

    class DeadlineCondition(threading.Condition):
        def __init__(self, barrier):
            super().__init__()
            self.barrier = barrier

        def wait(self, timeout=None):
            limit = _deadline["seconds"]
            if timeout is not None or limit is None:
                return super().wait(timeout)
            if super().wait(limit):
                return True
            b = self.barrier
            raise InterpreterDeadlock(
                f"Pallas GPU interpreter: {getattr(waiting, 'thread', 'a thread')} waited "
                f"{limit:g} s at barrier {id(b)} ({b.num_arrivals} arrival(s) per phase) for phase "
                f"{b.phase} to complete, and nothing arrived meanwhile: an arrival never made or a "
                "copy never issued (a deadlock; cv.sim.check finds schedule deadlocks with a "
                f"trace; cv.set_interpreter_wait_deadline changes the {limit:g} s)"
            )

    original_init, original_wait = barrier_cls.__init__, barrier_cls._wait

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.cv = DeadlineCondition(self)

    def wait(self, thread, *args, **kwargs):
        waiting.thread = thread
        return original_wait(self, thread, *args, **kwargs)

    barrier_cls.__init__, barrier_cls._wait = init, wait


def _gpu_multi_device_barrier_check() -> None:
    """At the end of a kernel each device's GPU interpreter asserts that *no* barrier is allocated
    in the shared state, which holds every device's barriers: a device that finishes first sees
    another device's live barriers ("Barrier remains allocated"; seen with cv.kernel inside
    shard_map over 4 CPU devices, intermittently). Every device now reaches the interpreter's own
    cross-device `threading.Barrier` before the check, so the check keeps its meaning."""
    callbacks = _compat.gpu_interpreter_callbacks()

    @callbacks.fail_on_exception
    def _assert_no_barriers_allocated(token):
        shared = callbacks._get_shared_memory()
        if shared.num_devices > 1:
            shared.barrier.wait()  # every device has finished its kernel and freed its barriers
        shared.assert_no_barriers_allocated()
        if shared.num_devices > 1:
            shared.barrier.wait()  # nobody starts cleaning up while another device still checks
        return token

    callbacks._assert_no_barriers_allocated = _assert_no_barriers_allocated
