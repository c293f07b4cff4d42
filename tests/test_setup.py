"""The environment the suite relies on."""
import jax


def test_eight_simulated_cpu_devices():
    assert jax.default_backend() == "cpu"
    assert len(jax.devices()) == 8


def test_public_api():
    import conveyor as cv
    for name in ("gmm", "tgmm", "make_group_metadata"):
        assert callable(getattr(cv, name))


def test_the_library_imports_and_checks_without_tqdm_or_extras():
    # The GPU machines run Conveyor from src/ on preinstalled packages without tqdm; a plain
    # install has no matplotlib/optax/equinox. Importing and using the library needs none of them.
    import subprocess
    import sys
    code = ("import sys\n"
            "for name in ('tqdm', 'matplotlib', 'optax', 'equinox'): sys.modules[name] = None\n"
            "import conveyor as cv\n"
            "spec = cv.BlockSpec((8, 128), lambda i: (i, 0))\n"
            "plan = cv.pipeline.plan(grid=(4,), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2)\n"
            "assert cv.sim.check(plan).ok\n"
            "print(cv.sim.simulate_matmul(1024, 1024, 1024).time_us > 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
