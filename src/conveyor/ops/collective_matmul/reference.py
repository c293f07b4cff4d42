"""The definitions: an all-gather then a dot; a dot then a psum_scatter (used inside shard_map)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def all_gather_matmul_reference(lhs, rhs, *, axis_name, gather_dim, out_dtype):
    full = lax.all_gather(lhs, axis_name, axis=gather_dim, tiled=True)
    return jnp.dot(full, rhs, preferred_element_type=out_dtype).astype(out_dtype)


def matmul_reduce_scatter_reference(lhs, rhs, *, axis_name, scatter_dim, out_dtype):
    partial = jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)
    return lax.psum_scatter(partial, axis_name, scatter_dimension=scatter_dim, tiled=True).astype(
        out_dtype
    )
