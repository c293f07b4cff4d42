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

from conveyor import testing  # noqa: E402

# A race found by a Pallas interpreter fails the run on every supported jax (jax 0.11 only prints
# it); a semaphore left non-zero at a TPU kernel's exit (a copy never awaited) is recorded.
# Every interpreted kernel Conveyor launches already has a wait deadline (60 s by default), so a
# deadlocked kernel fails its test instead of hanging the run.
testing.enable_interpreter_checks()

# Derandomized so CI is repeatable; small example counts keep the suite fast.
hypothesis.settings.register_profile("ci", derandomize=True, max_examples=12, deadline=None,
                                     print_blob=True)
hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _fresh_interpreter_state():
    """Each test starts with fresh Pallas interpreter state (a kernel that raised leaves its own)."""
    testing.take_semaphore_leaks()
    yield
    leaks = testing.finish_test()
    if leaks:
        pytest.fail("the TPU interpreter found semaphores left non-zero at kernel exit (a DMA started and never "
                    "awaited fails on a TPU): " + "; ".join(leaks[:3]))
