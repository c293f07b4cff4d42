"""The MoE feed-forward layer: route; SwiGLU experts via cv.gmm, the first projections gathering
the tokens into expert order in their loads and the last adding its rows, weighted by the gates,
into the tokens' rows (`cv.gmm_scatter_add`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from conveyor.moe.routing import load_balancing_loss, route
from conveyor.ops.gmm.api import gmm, gmm_scatter_add


def check_layer_args(x, router_w, w_gate, w_up, w_down, top_k) -> None:
    """Shapes and top_k of the layer's arguments, each error naming the argument and the rule."""
    for name, a, ndim in (
        ("x", x, 2),
        ("router_w", router_w, 2),
        ("w_gate", w_gate, 3),
        ("w_up", w_up, 3),
        ("w_down", w_down, 3),
    ):
        if not hasattr(a, "shape") or a.ndim != ndim:
            raise ValueError(
                f"{name}: expected a {ndim}-d array, got {getattr(a, 'shape', type(a).__name__)}"
            )
    tokens, d = x.shape
    num_experts = router_w.shape[1]
    f = w_gate.shape[2]
    expected = {
        "router_w": (d, num_experts),
        "w_gate": (num_experts, d, f),
        "w_up": (num_experts, d, f),
        "w_down": (num_experts, f, d),
    }
    for name, a in (("router_w", router_w), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if tuple(a.shape) != expected[name]:
            raise ValueError(
                f"{name}: expected shape {expected[name]} (x is [tokens={tokens}, d={d}], "
                f"{num_experts} experts, hidden f={f}), got {tuple(a.shape)}"
            )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected an int in [1, num_experts={num_experts}], got {top_k!r}")


def moe_ffn(
    x: jax.Array,
    router_w: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    top_k: int,
    backend: str | None = None,
    fuse_permutation: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """A dropless top-k MoE feed-forward layer.

    Args:
      x: [tokens, d] activations.
      router_w: [d, num_experts] router weights (routing runs in float32).
      w_gate, w_up: [num_experts, d, f]; w_down: [num_experts, f, d]. Expert e computes
        `(silu(x @ w_gate[e]) * (x @ w_up[e])) @ w_down[e]`.
      top_k: experts per token, in [1, num_experts]; their gates are the softmax probabilities
        renormalised over the chosen k.
      backend: passed to `cv.gmm` (None: the lowering platform's default).
      fuse_permutation: move the tokens inside the grouped matmuls (`cv.gmm`'s lhs_indices and
        `cv.gmm_scatter_add`: on TPU, by DMA in the kernels; docs/moe.md), or (False) with an
        XLA gather before them and a scatter-add after them. Same results up to rounding.

    Returns:
      (y [tokens, d] in x's dtype, the load-balancing loss, a float32 scalar: see
      `load_balancing_loss`). Every (token, expert) assignment is computed (no capacity, no
      dropping): the tokens, in expert order, run through three grouped matmuls, and each result
      is added into its token's row weighted by its gate. Differentiable in every array argument.
    """
    check_layer_args(x, router_w, w_gate, w_up, w_down, top_k)
    if not isinstance(fuse_permutation, bool):
        raise TypeError(f"fuse_permutation: expected a bool, got {fuse_permutation!r}")
    num_experts = router_w.shape[1]
    routing = route(x, router_w, top_k=top_k)
    flat_experts = routing.experts.reshape(-1)  # [tokens * top_k]
    order = jnp.argsort(flat_experts, stable=True)  # assignments in expert order
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat_experts].add(1)
    rows = order // top_k
    gates = routing.gates.reshape(-1)[order].astype(jnp.float32)
    if not fuse_permutation:
        out = sorted_swiglu(x[rows], group_sizes, w_gate, w_up, w_down, backend)
        return combine(out, order, routing, x), load_balancing_loss(routing)
    # every assignment row belongs to a group: nothing for the projections to zero-fill
    h = expert_hidden(x, rows, group_sizes, w_gate, w_up, backend, unwritten_rows="unspecified")
    # the last projection adds each assignment's row, weighted by its gate, into its token's row
    y = gmm_scatter_add(
        h,
        w_down,
        group_sizes,
        rows,
        num_out_rows=x.shape[0],
        row_weights=gates,
        preferred_element_type=x.dtype,
        backend=backend,
    )
    return y, load_balancing_loss(routing)


def sorted_swiglu(xs, group_sizes, w_gate, w_up, w_down, backend, interpret=False):
    """The unfused experts: `(silu(xs @ w_gate[e]) * (xs @ w_up[e])) @ w_down[e]` for rows `xs`
    already sorted by expert (`group_sizes` rows each; rows past them come out as 0)."""
    mm = lambda a, w: gmm(
        a, w, group_sizes, preferred_element_type=xs.dtype, backend=backend, interpret=interpret
    )
    return mm(jax.nn.silu(mm(xs, w_gate)) * mm(xs, w_up), w_down)


def expert_hidden(
    x,
    rows,
    group_sizes,
    w_gate,
    w_up,
    backend,
    interpret=False,
    unique=False,
    unwritten_rows="zero",
):
    """`silu(xs @ w_gate[e]) * (xs @ w_up[e])` for `xs = x[rows]`, whose rows are sorted by expert
    e (`group_sizes` rows each; rows past them come out as 0, or with
    `unwritten_rows="unspecified"` as anything: `cv.gmm`'s). Both projections gather their rows
    of x themselves (`cv.gmm`'s lhs_indices: in the kernel's loads on TPU), so the sorted copy of
    x is never written. `unique`: no index of `rows` repeats (x's gradient rows are then set)."""
    mm = lambda w: gmm(
        x,
        w,
        group_sizes,
        lhs_indices=rows,
        unique_indices=unique,
        unwritten_rows=unwritten_rows,
        preferred_element_type=x.dtype,
        backend=backend,
        interpret=interpret,
    )
    return jax.nn.silu(mm(w_gate)) * mm(w_up)


def combine(out, order, routing, x):
    """Add each assignment's result (`out[i]` belongs to assignment `order[i]`, a flat
    (token, slot) index) into its token's row, weighted by its gate; float32 sums, x's dtype.

    `order` is a permutation, so each token gathers its top_k results and sums them: one pass
    over `out`, where a scatter-add would write a float32 copy of it and read that back."""
    tokens, top_k = routing.experts.shape
    slot = (
        jnp.zeros_like(order)
        .at[order]
        .set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
    )  # the inverse permutation: assignment a's result is out[slot[a]]
    per_token = out[slot].reshape(tokens, top_k, out.shape[-1]).astype(jnp.float32)
    y = jnp.sum(per_token * routing.gates.astype(jnp.float32)[:, :, None], axis=1)
    return y.astype(x.dtype)
