# Two entry points; both create .venv (Python >= 3.12, pinned jax) on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test bench bootstrap clean

bootstrap:
	@bash scripts/bootstrap.sh

demo: bootstrap
	$(PY) -m conveyor demo

test: bootstrap
	$(PY) -m pytest -q tests

bench: bootstrap
	$(PY) -m conveyor bench gmm

clean:
	rm -rf $(VENV) .pytest_cache
