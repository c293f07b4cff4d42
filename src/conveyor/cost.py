"""`pl.CostEstimate`s of Conveyor's kernels, from their shapes, for XLA's scheduler (without one
XLA costs a Pallas kernel at about 0 flops and schedules around it blind)."""

from __future__ import annotations

import math

from jax.experimental import pallas as pl


def nbytes(*arrays) -> int:
    """Bytes of arrays (anything with .shape and .dtype)."""
    return sum(math.prod(a.shape) * a.dtype.itemsize for a in arrays)


def matmul_cost(m: int, k: int, n: int, *arrays) -> pl.CostEstimate:
    """An [m, k] x [k, n] product's flops; each of `arrays` read or written once."""
    return pl.CostEstimate(flops=2 * m * k * n, transcendentals=0, bytes_accessed=nbytes(*arrays))
