"""`pl.CostEstimate`s of Conveyor's kernels, from their shapes, for XLA's scheduler (without one
XLA costs a Pallas kernel at about 0 flops and schedules around it blind)."""

from __future__ import annotations

import math

import numpy as np

from jax.experimental import pallas as pl


def shape_bytes(shape, dtype) -> int:
    """Bytes of an array of `shape` and `dtype`."""
    return math.prod(shape) * np.dtype(dtype).itemsize


def nbytes(*arrays) -> int:
    """Bytes of arrays (anything with .shape and .dtype)."""
    return sum(shape_bytes(a.shape, a.dtype) for a in arrays)


def matmul_cost(m: int, k: int, n: int, *arrays) -> pl.CostEstimate:
    """An [m, k] x [k, n] product's flops; each of `arrays` read or written once."""
    return pl.CostEstimate(flops=2 * m * k * n, transcendentals=0, bytes_accessed=nbytes(*arrays))
