"""Expert parallelism: the MoE layer with its experts sharded over a mesh axis (inside shard_map).

Each device holds its own tokens and `E / D` of the experts (D = size of `axis_name`). A token
assignment travels to the device that owns its expert and back:
  1. route the local tokens over all E experts; sort the (token, slot) assignments by expert, so
     those bound for each device are contiguous;
  2. pack them into a send buffer [D, capacity, d] (one row block per destination) with their
     local expert ids, and `all_to_all` it over `axis_name`;
  3. the owner sorts what it received by local expert and runs the SwiGLU experts through
     `cv.gmm` (padding slots sort last, past the groups, and come out as zeros);
  4. the results go back by the inverse `all_to_all` and are added into their tokens' rows,
     weighted by the gates.
`jax.lax.ragged_all_to_all` would send exactly the rows needed, but XLA:CPU does not implement it
(jax 0.12: "HLO opcode ragged-all-to-all is not supported by XLA:CPU"), so the exchange uses a
fixed capacity per destination. With `capacity_factor=None` the capacity is the worst case (every
local assignment to one device): dropless, at D times the minimal traffic and buffer memory.
With a factor c the capacity is ceil(c * tokens * top_k / D) rows and assignments beyond it are
dropped (they contribute 0); the count of dropped assignments is returned, never hidden.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.moe.layer import check_layer_args, combine, swiglu_experts
from conveyor.moe.routing import load_balancing_loss, route


def capacity(tokens: int, top_k: int, devices: int, capacity_factor: float | None) -> int:
    """Rows per destination in the exchange buffers (see the module docstring)."""
    worst = tokens * top_k
    if capacity_factor is None:
        return worst
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or not capacity_factor > 0:
        raise ValueError(f"capacity_factor: expected None (dropless) or a number > 0, got {capacity_factor!r}")
    return max(1, min(worst, math.ceil(capacity_factor * worst / devices)))


def moe_ffn_expert_parallel(x: jax.Array, router_w: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                            w_down: jax.Array, *, top_k: int, axis_name: str,
                            capacity_factor: float | None = None, loss_axes: tuple[str, ...] | None = None,
                            backend: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`moe_ffn` with experts sharded over `axis_name`; call it inside `jax.shard_map`.

    Args:
      x: this device's tokens [tokens, d]. router_w: [d, E], replicated.
      w_gate, w_up: this device's experts [E / D, d, f]; w_down: [E / D, f, d]. Device i owns
        experts i * E / D ... (i + 1) * E / D - 1 (shard the expert dimension over axis_name).
      top_k: experts per token, in [1, E].
      axis_name: the mesh axis the experts are sharded over (tokens travel along it).
      capacity_factor: None (dropless, worst-case buffers) or c > 0 (see the module docstring).
      loss_axes: mesh axes over which the tokens are sharded, for the load-balancing loss's global
        averages (default: (axis_name,)); on a data x expert mesh pass both.

    Returns:
      (y [tokens, d], the load-balancing loss over all tokens of loss_axes, the number of this
      device's assignments dropped for capacity: an int32 scalar, 0 when dropless).
    """
    try:
        devices = lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"axis_name: {axis_name!r} is not an axis of the enclosing shard_map's mesh (call "
                         f"moe_ffn_expert_parallel inside jax.shard_map over a mesh with that axis)") from e
    local_experts = w_gate.shape[0] if hasattr(w_gate, "shape") and w_gate.ndim == 3 else 0
    num_experts = router_w.shape[1] if hasattr(router_w, "shape") and router_w.ndim == 2 else 0
    if local_experts * devices != num_experts:
        raise ValueError(f"w_gate: expected num_experts / {axis_name} size = {num_experts} / {devices} local experts "
                         f"(the expert count must divide evenly over the axis), got shape "
                         f"{getattr(w_gate, 'shape', None)}")
    for name, w in (("w_up", w_up), ("w_down", w_down)):
        if getattr(w, "ndim", 0) != 3 or w.shape[0] != local_experts:
            raise ValueError(f"{name}: expected {local_experts} local experts in dimension 0 (like w_gate), got shape "
                             f"{getattr(w, 'shape', None)}")
    full = lambda w: jax.ShapeDtypeStruct((num_experts, *w.shape[1:]), w.dtype)
    check_layer_args(x, router_w, full(w_gate), full(w_up), full(w_down), top_k)
    tokens, d = x.shape
    cap = capacity(tokens, top_k, devices, capacity_factor)

    routing = route(x, router_w, top_k=top_k)
    flat_experts = routing.experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    sorted_experts = flat_experts[order]
    dest = sorted_experts // local_experts
    per_dest = jnp.zeros((devices,), jnp.int32).at[dest].add(1)
    first_of_dest = jnp.cumsum(per_dest) - per_dest
    rank = jnp.arange(order.shape[0], dtype=jnp.int32) - first_of_dest[dest]
    kept = rank < cap
    dropped = jnp.sum(~kept).astype(jnp.int32)
    slot = jnp.where(kept, dest * cap + rank, devices * cap)  # dropped: an extra row, cut below

    rows = jnp.zeros((devices * cap + 1, d), x.dtype).at[slot].set(x[order // top_k])[:-1]
    ids = jnp.full((devices * cap + 1,), local_experts, jnp.int32).at[slot].set(sorted_experts % local_experts)[:-1]
    exchange = lambda a: lax.all_to_all(a.reshape(devices, cap, *a.shape[1:]), axis_name, 0, 0,
                                        tiled=False).reshape(a.shape)
    recv_rows, recv_ids = exchange(rows), exchange(ids)

    by_expert = jnp.argsort(recv_ids, stable=True)  # padding (id = local_experts) sorts last
    group_sizes = jnp.zeros((local_experts + 1,), jnp.int32).at[recv_ids].add(1)[:local_experts]
    out_sorted = swiglu_experts(recv_rows[by_expert], group_sizes, w_gate, w_up, w_down, backend)
    out = jnp.zeros_like(out_sorted).at[by_expert].set(out_sorted)
    back = exchange(out)

    results = jnp.concatenate([back, jnp.zeros((1, d), back.dtype)])[slot]  # dropped rows read 0
    aux = load_balancing_loss(routing, axis_names=tuple(loss_axes) if loss_axes is not None else (axis_name,))
    return combine(results, order, routing, x), aux, dropped
