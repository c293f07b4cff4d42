"""Test session setup: 8 simulated CPU devices (must happen before jax is imported)."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# The benchmarks' pause before each timed call (bench/timing.py) only steadies their times, which the
# tests do not judge; subprocesses (the CLI's bench and demo) inherit it.
os.environ.setdefault("CONVEYOR_BENCH_SETTLE_S", "0")
if os.environ.get("CONVEYOR_TEST_PLATFORM", "cpu") == "cpu":  # `make gpu-check` runs on the GPU
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402
import pytest  # noqa: E402

from conveyor import _compat  # noqa: E402

# A race found by a Pallas interpreter fails the run on every supported jax (jax 0.11 only prints it).
_compat.interpreter_races_raise()
# A DMA semaphore left non-zero at a TPU kernel's exit (a copy never awaited) fails the test.
_compat.record_interpreter_semaphore_leaks()
# An interpreter wait that nothing will satisfy fails its test with the semaphore (TPU) or barrier
# (GPU) it waits on, instead of hanging until the test timeout aborts the whole run (legitimate
# waits take seconds).
_compat.interpreter_wait_deadline(60)
# jax 0.11 only: the TPU interpreter's callbacks can deadlock against async dispatch (see _compat).
_compat.avoid_interpreter_dispatch_deadlock()

# Derandomized so CI is repeatable; small example counts keep the suite fast.
hypothesis.settings.register_profile("ci", derandomize=True, max_examples=12, deadline=None,
                                     print_blob=True)
hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _fresh_interpreter_state():
    """Each test starts with fresh Pallas interpreter state (a kernel that raised leaves its own)."""
    _compat.take_interpreter_semaphore_leaks()
    yield
    _compat.reset_interpreter_state()
    leaks = _compat.take_interpreter_semaphore_leaks()
    if leaks:
        pytest.fail("the TPU interpreter found semaphores left non-zero at kernel exit (a DMA started and never "
                    "awaited fails on a TPU): " + "; ".join(leaks[:3]))
