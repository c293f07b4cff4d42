"""Benchmarks runnable from the CLI: `conveyor bench gmm` (or `python -m conveyor.bench gmm`)."""
