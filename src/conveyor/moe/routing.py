"""Top-k routing and the load-balancing loss, shared by the layer and its dense reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each token goes: `experts[t, j]` is its j-th expert, `gates[t, j]` that expert's weight
    (the softmax probabilities of the chosen k, renormalised to sum to 1); `probs[t, e]` is the
    full softmax, which the load-balancing loss needs."""

    experts: jax.Array  # int32 [tokens, top_k]
    gates: jax.Array  # float32 [tokens, top_k]
    probs: jax.Array  # float32 [tokens, num_experts]


def route(x: jax.Array, router_w: jax.Array, *, top_k: int) -> Routing:
    """Softmax over `x @ router_w` (in float32), keep the top_k experts per token, renormalise."""
    logits = jnp.dot(
        x.astype(jnp.float32), router_w.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )
    probs = jax.nn.softmax(logits, axis=-1)
    top, experts = lax.top_k(probs, top_k)
    gates = top / jnp.sum(top, axis=-1, keepdims=True)
    return Routing(experts.astype(jnp.int32), gates, probs)


def load_balancing_loss(routing: Routing, axis_names: tuple[str, ...] = ()) -> jax.Array:
    """The Switch Transformer / GShard auxiliary loss: num_experts * sum_e f_e * P_e, with f_e the
    fraction of the (token, slot) assignments sent to expert e (a count: no gradient) and P_e the
    mean router probability of e. Equals 1 when routing is perfectly balanced.

    With `axis_names` (inside shard_map, tokens sharded equally over those mesh axes) f and P are
    averaged over all devices' tokens first, so every device gets the loss of the whole batch."""
    tokens, num_experts = routing.probs.shape
    counts = jnp.zeros((num_experts,), jnp.float32).at[routing.experts.reshape(-1)].add(1.0)
    fraction = counts / routing.experts.size
    mean_prob = jnp.mean(routing.probs, axis=0)
    if axis_names:
        fraction, mean_prob = lax.pmean(fraction, axis_names), lax.pmean(mean_prob, axis_names)
    return num_experts * jnp.sum(lax.stop_gradient(fraction) * mean_prob)
