# Entry points; the setup ones create $(VENV) (Python >= 3.12, jax pinned to one end of
# pyproject's supported range: JAX_END=newest by default, oldest for the second CI leg).
VENV ?= .venv
JAX_END ?= newest
PY := $(VENV)/bin/python

.PHONY: demo test test-oldest-jax wheel-test lint dist ci bench bootstrap clean gpu-check gpu-bench

bootstrap:
	@VENV=$(VENV) JAX_END=$(JAX_END) bash scripts/bootstrap.sh

demo: bootstrap
	$(PY) -m conveyor demo

test: bootstrap
	$(PY) -m pytest -q tests

# The suite at the oldest supported jax/jaxlib, in its own environment.
test-oldest-jax:
	$(MAKE) test VENV=.venv-jax-oldest JAX_END=oldest

# Build the sdist and wheel; install the wheel alone into a fresh venv and run the README quick start there.
wheel-test: bootstrap
	PY=$(PY) bash scripts/wheel_test.sh

lint: bootstrap
	$(VENV)/bin/ruff check src tests examples scripts

dist: bootstrap
	$(PY) -m build --sdist --wheel --outdir dist .

# What CI runs (.ci/run): both ends of the jax range, the installed wheel, the lint.
ci: test test-oldest-jax wheel-test lint

bench: bootstrap
	$(PY) -m conveyor bench gmm

# On a machine with an NVIDIA GPU and JAX's CUDA plugin preinstalled (no .venv needed):
gpu-check:
	bash scripts/gpu_check.sh

gpu-bench:
	bash -c 'source scripts/gpu_env.sh && $$PY -m conveyor bench gmm --platform gpu'

clean:
	rm -rf $(VENV) .venv-jax-oldest .pytest_cache dist
