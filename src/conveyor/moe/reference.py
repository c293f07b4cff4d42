"""The dense definition of the MoE layer: every token through every expert, masked by the router.

Slow on purpose (num_experts times the work); shares only the routing with the layer, and none of
its permutation or grouped-matmul code. float32 with HIGHEST precision (float64 under x64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.moe.routing import load_balancing_loss, route


def moe_ffn_reference(x, router_w, w_gate, w_up, w_down, *, top_k: int):
    """Same signature and results as `moe_ffn`: (y [tokens, d], aux_loss)."""
    routing = route(x, router_w, top_k=top_k)
    num_experts = w_gate.shape[0]
    acc = jnp.promote_types(x.dtype, jnp.float32)
    # weight[t, e]: the gate of expert e for token t (0 when e is not among its top_k)
    weight = jnp.sum(
        jax.nn.one_hot(routing.experts, num_experts, dtype=acc)
        * routing.gates[..., None].astype(acc),
        axis=1,
    )
    dot = lambda a, b: jnp.dot(a.astype(acc), b.astype(acc), precision=lax.Precision.HIGHEST)
    y = jnp.zeros((x.shape[0], w_down.shape[2]), acc)
    for e in range(num_experts):
        hidden = jax.nn.silu(dot(x, w_gate[e])) * dot(x, w_up[e])
        y = y + weight[:, e : e + 1] * dot(hidden, w_down[e])
    return y.astype(x.dtype), load_balancing_loss(routing)
