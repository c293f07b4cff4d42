"""The environment the suite relies on."""

import jax


def test_eight_simulated_cpu_devices():
    assert jax.default_backend() == "cpu"
    assert len(jax.devices()) == 8


LOADED_WHEN_USED = (
    "jax.experimental.pallas.tpu",
    "jax.experimental.pallas.mosaic_gpu",
    "jax._src.pallas.mosaic.lowering",
    "jax._src.pallas.mosaic_gpu.lowering",
    "jax._src.pallas.mosaic.interpret.interpret_pallas_call",
    "jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call",
    "conveyor.kernel_tpu",
    "conveyor.kernel_gpu",
    "conveyor.pipeline.mosaic_tpu",
    "conveyor.pipeline.mosaic_gpu",
    "conveyor.ops.gmm.mosaic_tpu",
    "conveyor.moe.mosaic_tpu",
    "conveyor.ops.gmm.mosaic_gpu",
    "conveyor.mpmd.mosaic_gpu",
    "conveyor.bench",
    "conveyor.compile_check",
    "matplotlib",
)


def test_import_loads_no_backend_interpreter_nor_tool():
    """`import conveyor` loads what `jax.experimental.pallas` loads and its own core; the Mosaic
    backends, the interpreters and the tools load when used (a fresh process, so nothing the suite
    imported counts)."""
    import subprocess
    import sys

    code = (
        "import sys\nimport conveyor as cv\nassert all(hasattr(cv, n) for n in cv.__all__), [n "
        f"for n in cv.__all__ if not hasattr(cv, n)]\nprint(sorted(m for m in {LOADED_WHEN_USED!r} "
        "if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_the_library_imports_and_checks_without_tqdm_or_extras():
    # The GPU machines run Conveyor from src/ on preinstalled packages without tqdm; a plain
    # install has no matplotlib/optax/equinox/flax. Importing and using the library needs none of
    # them.
    import subprocess
    import sys

    code = (
        "import sys\nfor name in ('tqdm', 'matplotlib', 'optax', 'equinox', 'flax'): "
        "sys.modules[name] = None\nimport conveyor as cv\nspec = cv.BlockSpec((8, 128), lambda i: "
        "(i, 0))\nplan = cv.pipeline.plan(grid=(4,), in_specs=[spec], out_specs=[spec], "
        "max_concurrent_steps=2)\nassert cv.sim.check(plan).ok\nprint(cv.sim.simulate_matmul(1024, "
        "1024, 1024).time_us > 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
