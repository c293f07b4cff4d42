# Two entry points; both create .venv (Python >= 3.12, pinned jax) on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench bootstrap clean gpu-check gpu-bench

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	$(PY) -m conveyor demo

test: bootstrap
	$(PY) -m pytest -q tests

bench: bootstrap
	$(PY) -m conveyor bench gmm

# On a machine with an NVIDIA GPU and JAX's CUDA plugin preinstalled (no .venv needed):
gpu-check:
	bash scripts/gpu_check.sh

gpu-bench:
	bash -c 'source scripts/gpu_env.sh && $$PY -m conveyor bench gmm --platform gpu'

clean:
	rm -rf $(VENV) .pytest_cache
