"""Test session setup: 8 simulated CPU devices (must happen before jax is imported)."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# The benchmarks' pause before each timed call (bench/timing.py) only steadies their times, which
# the tests do not judge; subprocesses (the CLI's bench and demo) inherit it.
os.environ.setdefault("CONVEYOR_BENCH_SETTLE_S", "0")
if os.environ.get("CONVEYOR_TEST_PLATFORM", "cpu") in ("cpu", "cuda-lowering"):  # not gpu-check
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    # Most of the suite's time is XLA:CPU compiling small programs once each (interpreted kernels
    # above all): LLVM's cheaper pipeline compiles them faster. Same semantics (no fast-math either
    # way); the tolerances are derived from dtypes and sizes, not from one compiler's rounding.
    # Test session only (and its subprocesses): users' programs and `make compile-check` keep
    # XLA's defaults (README, "Install").
    os.environ["XLA_FLAGS"] += (
        " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    )

import hypothesis  # noqa: E402
import pytest  # noqa: E402

from tests import cuda_lowering  # noqa: E402

from conveyor import testing  # noqa: E402

# A race found by a Pallas interpreter fails the run on every supported jax (jax 0.11 only prints
# it); a semaphore left non-zero at a TPU kernel's exit (a copy never awaited) is recorded.
# Every interpreted kernel Conveyor launches already has a wait deadline (60 s by default), so a
# deadlocked kernel fails its test instead of hanging the run.
testing.enable_interpreter_checks()

if os.environ.get("CONVEYOR_TEST_PLATFORM") == cuda_lowering.MODE:
    cuda_lowering.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if os.environ.get("CONVEYOR_TEST_PLATFORM") == cuda_lowering.MODE:
        cuda_lowering.relabel(outcome.get_result())


# Derandomized so CI is repeatable; small example counts keep the suite fast.
hypothesis.settings.register_profile(
    "ci", derandomize=True, max_examples=12, deadline=None, print_blob=True
)
hypothesis.settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _fresh_interpreter_state():
    """Each test starts with fresh Pallas interpreter state (a kernel that raised leaves its
    own)."""
    testing.take_semaphore_leaks()
    yield
    leaks = testing.finish_test()
    if leaks:
        pytest.fail(
            "the TPU interpreter found semaphores left non-zero at kernel exit (a DMA started and "
            "never "
            "awaited fails on a TPU): " + "; ".join(leaks[:3])
        )


# ---- tiers ---------------------------------------------------------------------------------------
# fast: plans, the checker and simulator on small programs, the xla executors (default and
#   checked), references, errors; the schedule tests first (SCHEDULE_FIRST). `make test-fast`.
# slow: pure-Python or xla work too long for the fast tier (the simulator's validation table,
#   exhaustive checks of 4-device rings, the MoE layers against their dense references).
# interpreter: kernels run through the Pallas TPU / Mosaic GPU interpreters, exports and compiles
#   of Mosaic kernels.
# subprocess: tests that start Python processes (the CLI, the multi-process launcher).
# A test's tier follows from what it runs: its module, an explicit `pytest.mark.slow`, or its
# parameters and name naming a Mosaic backend or an interpreter. The fast tier runs first; the
# others, which `make test` runs together on TEST_WORKERS processes, longest tests first
# (RUN_ORDER): the few long subprocess tests then start early instead of finishing last on one
# worker while the other waits.
TIERS = ("fast", "slow", "interpreter", "subprocess")
RUN_ORDER = ("fast", "subprocess", "interpreter", "slow")
SCHEDULE_FIRST = (
    "test_plan.py",
    "test_check.py",
    "test_ring_plan.py",
    "test_checked_schedule.py",
    "test_fetch_rules.py",
    "test_sequence.py",
)
SUBPROCESS_MODULES = {
    "test_cli.py",
    "test_cli_collective.py",
    "test_bench_setup.py",
    "test_multiprocess.py",
    "test_examples.py",
    "test_docs.py",
}
SLOW_MODULES = {"test_expert_parallel.py", "test_moe_layer.py", "test_overlapped.py"}
INTERPRETER_MODULES = {
    "test_mosaic_tpu_ring.py",
    "test_overlapped_mosaic_tpu.py",
    "test_mosaic_gpu.py",
    "test_mosaic_gpu_tgmm.py",
    "test_mosaic_tpu.py",
    "test_delay_release_tpu.py",
    "test_conformance.py",
    "test_ring_conformance.py",
    "test_interpreter_deadline.py",
    "test_mpmd_gpu.py",
    "test_compile_check.py",
    "test_cost_estimates.py",
}
MOSAIC_WORDS = ("mosaic", "tpu", "gpu", "interpret")


def _tier(item) -> str:
    module = item.path.name
    if module in SUBPROCESS_MODULES:
        return "subprocess"
    if module in INTERPRETER_MODULES:
        return "interpreter"
    params = getattr(getattr(item, "callspec", None), "params", {})
    words = [item.originalname.lower(), *(str(v).lower() for v in params.values())]
    if any(w in text for text in words for w in MOSAIC_WORDS):
        return "interpreter"
    if module in SLOW_MODULES or item.get_closest_marker("slow") is not None:
        return "slow"
    return "fast"


def _order(item) -> tuple[int, int]:
    tier = _tier(item)
    first = tier == "fast" and item.path.name in SCHEDULE_FIRST
    return RUN_ORDER.index(tier), (
        SCHEDULE_FIRST.index(item.path.name) if first else len(SCHEDULE_FIRST)
    )


def pytest_configure(config):
    for tier in TIERS:
        config.addinivalue_line(
            "markers", f"{tier}: the {tier} tier of the suite (tests/conftest.py)"
        )
    config.addinivalue_line(
        "markers", "schedule: the fast tier's schedule tests (SCHEDULE_FIRST), run first"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = _tier(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
        if tier == "fast" and item.path.name in SCHEDULE_FIRST:
            item.add_marker("schedule")
    items.sort(key=_order)  # stable: file order within a tier
