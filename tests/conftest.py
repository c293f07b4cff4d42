"""Test session setup: 8 simulated CPU devices (must happen before jax is imported)."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if os.environ.get("CONVEYOR_TEST_PLATFORM", "cpu") == "cpu":  # `make gpu-check` runs on the GPU
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hypothesis  # noqa: E402

from conveyor import _compat  # noqa: E402

# A race found by a Pallas interpreter fails the run on every supported jax (jax 0.11 only prints it).
_compat.interpreter_races_raise()

# Derandomized so CI is repeatable; small example counts keep the suite fast.
hypothesis.settings.register_profile("ci", derandomize=True, max_examples=12, deadline=None,
                                     print_blob=True)
hypothesis.settings.load_profile("ci")
