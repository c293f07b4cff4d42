"""The token exchange of the expert-parallel MoE layer: exact ragged slices between devices.

`ragged_all_to_all` is `jax.lax.ragged_all_to_all` (each device sends each peer exactly the rows
bound for it, at offsets the sender names in the receiver's buffer) where the platform has it,
chosen when the program is lowered (`lax.platform_dependent`): on TPU and GPU the real collective.
XLA:CPU does not implement it (jax 0.12: "HLO opcode ragged-all-to-all is not supported by
XLA:CPU"), so a CPU lowering runs the same semantics through a dense `all_to_all` of worst-case
blocks: the same numbers, tested against a model of the primitive's documented semantics, at
the dense exchange's traffic (CPU is where the layer is tested, not where it runs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.spmd import match_varying


def ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all` with one slice per peer (the arrays of offsets and sizes have
    the length of `axis_name`), lowered as the real collective on TPU and GPU and emulated on
    CPU."""
    # The result varies like the operand (the real collective would type it like `output`).
    args = match_varying(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    real = functools.partial(lax.ragged_all_to_all, axis_name=axis_name)
    emulated = functools.partial(_emulated, axis_name=axis_name)
    return lax.platform_dependent(*args, cpu=emulated, default=real)


def _emulated(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """ragged_all_to_all's semantics through all_to_all: the slice for peer j (rows
    input_offsets[j] .. + send_sizes[j]) padded to operand's row count; received slice i lands in
    output rows output_offsets_i[me] .. + recv_sizes[i], where output_offsets_i are sender i's."""
    rows = operand.shape[0]
    r = jnp.arange(rows, dtype=jnp.int32)
    source = jnp.clip(input_offsets[:, None] + r[None, :], 0, rows - 1)  # [peers, rows]
    keep = (r[None, :] < send_sizes[:, None]).reshape(*source.shape, *(1,) * (operand.ndim - 1))
    blocks = jnp.where(keep, operand[source], jnp.zeros((), operand.dtype))
    received = lax.all_to_all(blocks, axis_name, 0, 0, tiled=False)  # block i from peer i
    offsets = lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # peer i's, for me
    target = jnp.where(
        r[None, :] < recv_sizes[:, None], offsets[:, None] + r[None, :], output.shape[0]
    )
    return output.at[target.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")
