"""Group-size generators and random operands shared by the gmm tests."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from conveyor.problems import dirichlet_split


def skewed_sizes(
    rng: np.random.Generator, m: int, groups: int, alpha: float = 0.5, total: int | None = None
):
    """Dirichlet-skewed split of `total` (default m) rows into `groups` groups (some may be
    empty)."""
    return dirichlet_split(rng, m if total is None else total, groups, alpha)


def operands(
    rng: np.random.Generator, m: int, k: int, n: int, groups: int, dtype, transpose_rhs=False
):
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs_shape = (groups, n, k) if transpose_rhs else (groups, k, n)
    rhs = (rng.standard_normal(rhs_shape) / np.sqrt(k)).astype(np.float32)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype)


def numpy_gmm(lhs, rhs, sizes, transpose_rhs=False, existing=None, offset=0):
    """float64 per-group loop with concrete sizes: an oracle independent of JAX."""
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    if transpose_rhs:
        rhs = np.swapaxes(rhs, 1, 2)
    out = (
        np.zeros((lhs.shape[0], rhs.shape[2]))
        if existing is None
        else np.array(existing, np.float64)
    )
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    for i in range(rhs.shape[0]):
        s, e = bounds[offset + i], bounds[offset + i + 1]
        out[s:e] = lhs[s:e] @ rhs[i]
    return out


def numpy_tgmm(lhs, rhs, sizes, num_groups=None, offset=0, existing=None):
    lhs = np.asarray(lhs, np.float64)
    rhs = np.asarray(rhs, np.float64)
    num_groups = len(sizes) if num_groups is None else num_groups
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    out = np.zeros((num_groups, lhs.shape[0], rhs.shape[1]))
    if existing is not None:
        out += np.asarray(existing, np.float64)
    for i in range(num_groups):
        s, e = bounds[offset + i], bounds[offset + i + 1]
        out[i] += lhs[:, s:e] @ rhs[s:e]
    return out
