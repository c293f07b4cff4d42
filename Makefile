# Entry points; the setup ones create $(VENV) (Python >= 3.12, jax pinned to one end of
# pyproject's supported range: JAX_END=newest by default, oldest for the second CI leg).
VENV ?= .venv
JAX_END ?= newest
PY := $(VENV)/bin/python

.PHONY: demo test test-fast test-oldest-jax wheel-test lint dist ci bench bootstrap clean gpu-check gpu-bench \
	compile-env compile-check gpu-lowering-check

bootstrap:
	@VENV=$(VENV) JAX_END=$(JAX_END) bash scripts/bootstrap.sh

demo: bootstrap
	$(PY) examples/demo.py

# The suite in tiers (tests/conftest.py): the fast tier first, its schedule tests in one process
# (a schedule bug fails within seconds), then the rest of it (plans, checker, simulator, the xla
# executors, references, errors), then the slow, interpreter and subprocess tiers; all but the
# schedule tests spread over TEST_WORKERS processes (pytest-xdist; each test is independent, each
# process has its own 8 simulated devices; work stealing evens out the long tests at the end).
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist worksteal
test: test-fast
	$(PY) -m pytest -q -m "not fast" $(XDIST) tests

test-fast: bootstrap
	$(PY) -m pytest -q -m schedule tests
	$(PY) -m pytest -q -m "fast and not schedule" $(XDIST) tests

# The suite at the oldest supported jax/jaxlib, in its own environment.
test-oldest-jax:
	$(MAKE) test VENV=.venv-jax-oldest JAX_END=oldest

# Build the sdist and wheel; install the wheel alone into a fresh venv and run the README quick start there.
wheel-test: bootstrap
	PY=$(PY) bash scripts/wheel_test.sh

lint: bootstrap
	$(VENV)/bin/ruff check src tests examples scripts
	$(VENV)/bin/ruff format --check src tests examples scripts

dist: bootstrap
	$(PY) -m build --sdist --wheel --outdir dist .

# The real compilers' environments (one per toolchain; scripts/compile_env.sh).
compile-env:
	bash scripts/compile_env.sh cuda
	bash scripts/compile_env.sh tpu

# Every kernel at production sizes through the real compilers for H100 and TPU v5e/v6e/v5p
# (deviceless AOT on this CPU; docs/compile-check.md). Fails when a compiler refuses a kernel
# Conveyor let through, or a GPU kernel spills; the tables land in build/compile-check/.
COMPILE_OUT ?= build/compile-check
compile-check: compile-env
	.venv-compile-cuda/bin/python -m conveyor compile-check production --target h100 \
		--allow-refused --out $(COMPILE_OUT)/h100.md
	.venv-compile-tpu/bin/python -m conveyor compile-check production --target v5e,v6e,v5p \
		--allow-refused --out $(COMPILE_OUT)/tpu.md

# On CPU, the tests gpu-check runs with their mosaic_gpu kernels lowered for CUDA instead of
# interpreted (tests/cuda_lowering.py): what Mosaic GPU does not lower fails here, as on a GPU.
# .ci/run runs it at both ends of the jax range (the GPU machine's image holds jax 0.11.2).
gpu-lowering-check: bootstrap
	CONVEYOR_TEST_PLATFORM=cuda-lowering bash scripts/gpu_tests.sh $(PY) $(XDIST)

# What CI runs (.ci/run): both ends of the jax range, the installed wheel, the lint, the
# real compilers.
ci: test test-oldest-jax wheel-test lint gpu-lowering-check compile-check

bench: bootstrap
	$(PY) -m conveyor bench gmm

# On a machine with an NVIDIA GPU and JAX's CUDA plugin preinstalled (no .venv needed):
gpu-check:
	bash scripts/gpu_check.sh

gpu-bench:
	bash -c 'source scripts/gpu_env.sh && $$PY -m conveyor bench gmm --platform gpu'

clean:
	rm -rf $(VENV) .venv-jax-oldest .venv-compile-cuda .venv-compile-tpu .pytest_cache dist build
