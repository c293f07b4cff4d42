"""The token exchange of the expert-parallel MoE layer: exact ragged slices between devices.

Design notes: docs/internals/moe.md, section `moe/exchange.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.spmd import match_varying


def unfilled(shape: tuple[int, ...], dtype) -> jax.Array:
    """A buffer whose rows its user overwrites or never reads (an exchange's output: the rows
    that arrive, and padding nobody reads): `jax.lax.empty`, uninitialized on TPU and GPU (no
    pass that fills it) and zeros on CPU. The tests fill it with NaN instead to show that no
    result reads a row left unwritten."""
    return lax.empty(shape, dtype)


def ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name,
    tpu_rows_view: bool = False,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all` with one slice per peer (the arrays of offsets and sizes have
    the length of `axis_name`), lowered as the real collective on TPU and GPU and emulated on
    CPU. `tpu_rows_view`: on TPU, 16-bit [rows, d] operands travel as [rows, 1, d], the layout in
    which the TPU row-moving gmm kernels read and write 16-bit rows (a row its own tile), so that
    XLA copies neither the received rows into it nor the results out of it; for buffers those
    kernels consume or produce (see the design notes: in training it costs memory)."""
    # The result varies like the operand (the real collective would type it like `output`).
    args = match_varying(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    real = functools.partial(lax.ragged_all_to_all, axis_name=axis_name)
    emulated = functools.partial(_emulated, axis_name=axis_name)
    branches = dict(cpu=emulated, default=real)
    if tpu_rows_view and operand.ndim == 2 and jnp.dtype(operand.dtype).itemsize == 2:

        def as_row_tiles(operand, output, *offsets_and_sizes):
            moved = real(operand[:, None], output[:, None], *offsets_and_sizes)
            return moved.reshape(output.shape)

        branches["tpu"] = as_row_tiles
    return lax.platform_dependent(*args, **branches)


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


def send_chunk(
    chunk: jax.Array, size: jax.Array, recv_size: jax.Array, *, shift: int, axis_name, devices: int
) -> jax.Array:
    """Every device sends its first `size` rows of `chunk` to device (me + shift) % devices and
    returns the chunk it receives from (me - shift) % devices (`recv_size` rows, the rest zeros;
    the sender's rows past `size` must be zeros).

    On TPU and GPU a `ragged_all_to_all` with one nonzero slice moves exactly the rows sent
    (`send_exact`); a CPU lowering moves the whole chunk with a `ppermute` (the same numbers)."""
    config = dict(shift=shift, axis_name=axis_name, devices=devices)
    args = match_varying(chunk, jnp.asarray(size, jnp.int32), jnp.asarray(recv_size, jnp.int32))
    return lax.platform_dependent(
        *args,
        cpu=functools.partial(_send_whole, **config),
        default=functools.partial(send_exact, **config),
    )


def _send_whole(chunk, size, recv_size, *, shift, axis_name, devices):
    del size, recv_size
    return lax.ppermute(chunk, axis_name, [(i, (i + shift) % devices) for i in range(devices)])


def send_exact(chunk, size, recv_size, *, shift, axis_name, devices):
    """`send_chunk` as one ragged slice to one peer (through `ragged_all_to_all`, so a CPU
    lowering emulates it: that is how the tests run this branch)."""
    me = lax.axis_index(axis_name)
    peers = jnp.arange(devices, dtype=jnp.int32)
    zeros = jnp.zeros((devices,), jnp.int32)
    return ragged_all_to_all(
        chunk,
        jnp.zeros_like(chunk),
        zeros,
        jnp.where(peers == (me + shift) % devices, size, 0),
        zeros,
        jnp.where(peers == (me - shift) % devices, recv_size, 0),
        axis_name=axis_name,
    )


def most_received(tokens: int, top_k: int, devices: int, experts_there: int) -> int:
    """The most rows one device can receive in an exchange that carries rows for `experts_there`
    of its experts: each of the `devices` senders sends each token's rows for those experts, and
    a token's top_k experts are distinct (top-k routing), so at most min(top_k, experts_there)
    rows a token. The size of a dropless exchange's receive buffer."""
    return devices * tokens * min(top_k, experts_there)
