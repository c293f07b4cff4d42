"""Opt-in checks for test suites that run kernels through the Pallas interpreters.

Design notes: docs/internals/core.md, section `testing.py`.
"""

from __future__ import annotations

import threading

import jax

from conveyor import _compat, interpreters

_leaks: list[str] = []
_lock = threading.Lock()
_enabled = False


def enable_interpreter_checks() -> None:
    """Turn the checks on for this process (idempotent). Call before the first kernel runs."""
    global _enabled
    with _lock:
        if _enabled:
            return
        interpreters.install_workarounds()
        _races_raise()
        _record_semaphore_leaks()
        if jax.__version_info__ < (0, 12):
            jax.config.update("jax_cpu_enable_async_dispatch", False)
        _enabled = True


def take_semaphore_leaks() -> list[str]:
    """The semaphores found non-zero at kernel exit since the last call, one line each."""
    with _lock:
        leaks = list(_leaks)
        _leaks.clear()
    return leaks


def reset_interpreter_state() -> None:
    """Drop the Pallas TPU and GPU interpreters' shared state. A kernel that raised (a race, a
    failed check) leaves it behind on purpose, for inspection; the next kernel would then run on
    a stale, ever-growing state."""
    from jax.experimental.pallas import tpu as pltpu

    pltpu.reset_tpu_interpret_mode_state()
    _compat.gpu_interpreter_callbacks().reset_gpu_interpret_mode_state()


def finish_test() -> list[str]:
    """End of one test: reset the interpreters' state and return the semaphore leaks it left."""
    reset_interpreter_state()
    return take_semaphore_leaks()


def _races_raise() -> None:
    """jax 0.11: setting the race state's `races_found` raises the error jax 0.12 raises."""
    if _compat.interpreter_raises_on_race():
        return
    cls = _compat.tpu_interpreter_race_state().RaceDetectionState

    def get(self) -> bool:
        return self.__dict__.get("_races_found", False)

    def set_(self, value: bool) -> None:
        self.__dict__["_races_found"] = value
        if value:
            raise RuntimeError("RACE DETECTED (the interpreter printed both accesses above)")

    cls.races_found = property(get, set_)  # GPURaceDetectionState inherits it


def _record_semaphore_leaks() -> None:
    """Wrap the TPU interpreter's end-of-kernel query of non-zero semaphores to keep what it found
    (raising inside the interpreter's callback could hang other devices' clean-up)."""
    cls = _compat.tpu_interpreter_shared_memory().SharedMemory
    original = cls.get_sempahores_with_nonzero_count  # (sic) jax's spelling

    def recording(self, device_id, *args, **kwargs):
        found = original(self, device_id, *args, **kwargs)
        with _lock:
            for sem, core in found:
                _leaks.append(
                    f"semaphore {sem.id} has count {sem.count_by_core[core]} on device {device_id} "
                    f"(core {core}) at kernel exit"
                )
        return found

    cls.get_sempahores_with_nonzero_count = recording
