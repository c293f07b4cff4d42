"""Expert parallelism: the MoE layer with its experts sharded over a mesh axis (inside shard_map).

Design notes: docs/internals/moe.md, section `moe/expert_parallel.py`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.moe.exchange import most_received, ragged_all_to_all, unfilled
from conveyor.moe.overlapped import overlapped_exchange, staged_exchange
from conveyor.moe.layer import check_layer_args, combine, expert_hidden, sorted_swiglu
from conveyor.ops.gmm.api import gmm_scatter_add
from conveyor.moe.routing import load_balancing_loss, route
from conveyor.plans.exchange import default_stages, exchange_plan, staged_exchange_plan

OVERLAPS = (None, "peers", "experts")


def capacity(tokens: int, top_k: int, devices: int, capacity_factor: float | None) -> int:
    """Rows per destination in the exchange buffers (see the design notes)."""
    worst = tokens * top_k
    if capacity_factor is None:
        return worst
    if (
        isinstance(capacity_factor, bool)
        or not isinstance(capacity_factor, (int, float))
        or not capacity_factor > 0
    ):
        raise ValueError(
            f"capacity_factor: expected None (dropless) or a number > 0, got {capacity_factor!r}"
        )
    return max(1, min(worst, math.ceil(capacity_factor * worst / devices)))


def moe_ffn_expert_parallel(
    x: jax.Array,
    router_w: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    top_k: int,
    axis_name: str,
    capacity_factor: float | None = None,
    loss_axes: tuple[str, ...] | None = None,
    backend: str | None = None,
    fuse_permutation: bool = True,
    overlap: str | None = None,
    overlap_stages: int | None = None,
    interpret=False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`moe_ffn` with experts sharded over `axis_name`; call it inside `jax.shard_map`.

    Args:
      x: this device's tokens [tokens, d]. router_w: [d, E], replicated.
      w_gate, w_up: this device's experts [E / D, d, f]; w_down: [E / D, f, d]. Device i owns
        experts i * E / D ... (i + 1) * E / D - 1 (shard the expert dimension over axis_name).
      top_k: experts per token, in [1, E].
      axis_name: the mesh axis the experts are sharded over (tokens travel along it).
      capacity_factor: None (dropless: the exact ragged exchange) or c > 0 (a fixed capacity; see
        docs/internals/moe.md).
      loss_axes: mesh axes over which the tokens are sharded, for the load-balancing loss's global
        averages (default: (axis_name,)); on a data x expert mesh pass both.
      backend, fuse_permutation: as in `moe_ffn`; fuse_permutation moves the received rows into
        expert order and back inside the grouped matmuls.
      overlap: dropless only; None (one exchange each way), "peers" or "experts"
        (`conveyor.plans.exchange`, docs/moe.md): "peers" exchanges peer by peer, each peer's
        chunk in flight while the experts run on the one before and its results sent home during
        the next; "experts" exchanges one local expert per stage with every peer at once, the
        next stage's rows in flight while the experts run (each expert's weights read once;
        needs 2 or more local experts). Same results as the exact exchange. With
        backend="mosaic_tpu", "peers" runs as one Mosaic TPU kernel: remote DMAs carry the chunks
        and results while its grouped matmuls run the experts (`conveyor.moe.mosaic_tpu`).
        Gradients: "experts", and "peers" with backend="mosaic_tpu", are differentiated as the
        exact exchange (its forward recomputed in the backward pass), in reverse mode only;
        "peers" on the other backends differentiates its own plan.
      overlap_stages: overlap="experts": how many stages the local experts split into (contiguous
        groups), in [1, local experts]; default one per local expert, at most 8
        (`conveyor.plans.exchange.default_stages`).
      interpret: with backend="mosaic_tpu" (or "mosaic_gpu"), run the kernels through their Pallas
        interpreter (True, or the interpreter's params): how the layer is tested on CPU.

    Returns:
      (y [tokens, d], the load-balancing loss over all tokens of loss_axes, the number of this
      device's assignments dropped for capacity: an int32 scalar, 0 when dropless).
    """
    if not isinstance(fuse_permutation, bool):
        raise TypeError(f"fuse_permutation: expected a bool, got {fuse_permutation!r}")
    if overlap not in OVERLAPS:
        raise ValueError(f"overlap: expected one of {OVERLAPS}, got {overlap!r}")
    if overlap is not None and capacity_factor is not None:
        raise ValueError(
            f"overlap: the overlapped exchange is dropless; pass capacity_factor=None (got "
            f"capacity_factor={capacity_factor!r})"
        )
    try:
        devices = lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(
            f"axis_name: {axis_name!r} is not an axis of the enclosing shard_map's mesh (call "
            "moe_ffn_expert_parallel inside jax.shard_map over a mesh with that axis)"
        ) from e
    local_experts = w_gate.shape[0] if hasattr(w_gate, "shape") and w_gate.ndim == 3 else 0
    num_experts = router_w.shape[1] if hasattr(router_w, "shape") and router_w.ndim == 2 else 0
    if local_experts * devices != num_experts:
        raise ValueError(
            f"w_gate: expected num_experts / {axis_name} size = {num_experts} / {devices} local "
            "experts (the expert count must divide evenly over the axis), got shape "
            f"{getattr(w_gate, 'shape', None)}"
        )
    for name, w in (("w_up", w_up), ("w_down", w_down)):
        if getattr(w, "ndim", 0) != 3 or w.shape[0] != local_experts:
            raise ValueError(
                f"{name}: expected {local_experts} local experts in dimension 0 (like w_gate), got "
                f"shape {getattr(w, 'shape', None)}"
            )
    if overlap == "experts" and local_experts < 2:
        raise ValueError(
            f"overlap: 'experts' stages the exchange by local expert and needs at least 2 per "
            f"device, got {local_experts} ({num_experts} experts over {devices} devices); use "
            "'peers'"
        )
    if overlap_stages is not None and (
        overlap != "experts"
        or isinstance(overlap_stages, bool)
        or not isinstance(overlap_stages, int)
        or not 1 <= overlap_stages <= local_experts
    ):
        raise ValueError(
            f"overlap_stages: expected None, or with overlap='experts' an int in [1, "
            f"{local_experts}] (the local experts), got {overlap_stages!r} with overlap={overlap!r}"
        )
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
    experts = lambda rows, ids, w_gate=w_gate, w_up=w_up, w_down=w_down: _experts(
        rows, ids, local_experts, w_gate, w_up, w_down, backend, fuse_permutation, interpret
    )
    rows, ids = x[order // top_k], sorted_experts % local_experts
    dropped = jnp.zeros((), jnp.int32)  # dropless unless a capacity drops some
    where = dict(axis_name=axis_name, local_experts=local_experts)
    # on TPU the row-moving gmm kernels take the received rows and give the results
    rows_view = fuse_permutation and backend in (None, "mosaic_tpu")
    weights, routed = (w_gate, w_up, w_down), (ids, per_dest, first_of_dest, dest)
    exact_options = dict(experts=experts, devices=devices, top_k=top_k, **where)
    if overlap == "experts":
        plan = staged_exchange_plan(
            num_devices=devices, stages=overlap_stages or default_stages(local_experts)
        )

        def staged(rows, weights, routed):
            by = lambda r, i: experts(r, i, *weights)  # noqa: E731
            return staged_exchange(rows, routed[0], routed[3], by, plan=plan, top_k=top_k, **where)

        results = _differentiated_as_exact(staged, rows, weights, routed, **exact_options)
    elif overlap == "peers" and backend == "mosaic_tpu":
        from conveyor.moe.mosaic_tpu import overlapped_exchange_mosaic_tpu

        plan = exchange_plan(num_devices=devices)

        def kernel(rows, weights, routed):
            return overlapped_exchange_mosaic_tpu(
                rows, *routed[:3], *weights, plan=plan, axis_name=axis_name, interpret=interpret
            )

        results = _differentiated_as_exact(kernel, rows, weights, routed, **exact_options)
    elif overlap == "peers":
        plan = exchange_plan(num_devices=devices)
        results = overlapped_exchange(
            rows, ids, per_dest, first_of_dest, experts, plan=plan, **where
        )
    elif capacity_factor is None:
        results = _exact_exchange_lean_unless_differentiated(
            rows,
            ids,
            per_dest,
            first_of_dest,
            w_gate,
            w_up,
            w_down,
            experts=experts,
            devices=devices,
            top_k=top_k,
            tpu_rows_view=rows_view,
            **where,
        )
    else:
        results, dropped = _capacity_exchange(
            rows, sorted_experts, dest, first_of_dest, experts, devices=devices, cap=cap, **where
        )
    aux = load_balancing_loss(
        routing, axis_names=tuple(loss_axes) if loss_axes is not None else (axis_name,)
    )
    return combine(results, order, routing, x), aux, dropped


def _experts(
    rows, ids, local_experts, w_gate, w_up, w_down, backend, fuse_permutation, interpret=False
):
    """The SwiGLU experts on received `rows` whose local expert is `ids` (padding: `local_experts`),
    results in the rows' order."""
    by_expert = jnp.argsort(ids, stable=True)  # padding sorts last
    group_sizes = jnp.zeros((local_experts + 1,), jnp.int32).at[ids].add(1)[:local_experts]
    if not fuse_permutation:
        out = sorted_swiglu(rows[by_expert], group_sizes, w_gate, w_up, w_down, backend, interpret)
        return jnp.zeros_like(out).at[by_expert].set(out)
    # padding rows belong to no group and are never read (the last projection's kernel reads
    # only its groups' rows), so no projection zero-fills them
    h = expert_hidden(
        rows,
        by_expert,
        group_sizes,
        w_gate,
        w_up,
        backend,
        interpret,
        unique=True,
        unwritten_rows="unspecified",
    )
    # the last projection puts each result back in its received row (a permutation: each row
    # once)
    return gmm_scatter_add(
        h,
        w_down,
        group_sizes,
        by_expert,
        num_out_rows=rows.shape[0],
        unique_indices=True,
        unwritten_rows="unspecified",
        preferred_element_type=rows.dtype,
        backend=backend,
        interpret=interpret,
    )


def _differentiated_as_exact(forward, rows, weights, routed, *, experts, **exact_options):
    """`forward(rows, weights, routed)`, an overlapped exchange of the experts (the staged XLA plan,
    the per-peer TPU kernel), differentiated as the exact exchange, the same function: the
    backward pass recomputes the exact exchange's forward (one transfer each way, the experts
    once over every received row) and runs its VJP. So each weight's gradient is one tgmm, where
    the plans' own VJPs ran one per peer or stage (per peer: each into a zero-filled weight-sized
    start, summed in XLA), and no per-chunk or per-stage buffer is saved for the backward pass.
    `routed`: (ids, per_dest, first_of_dest, dest), integers. Reverse mode only (a custom VJP):
    forward-mode differentiation is refused by JAX (docs/moe.md)."""

    @jax.custom_vjp
    def run(rows, weights, routed):
        return forward(rows, weights, routed)

    def run_forward(rows, weights, routed):
        return forward(rows, weights, routed), (rows, weights, routed)

    def run_backward(saved, grad):
        rows, weights, (ids, per_dest, first_of_dest, _) = saved

        def exact(rows, weights):
            by = lambda r, i: experts(r, i, *weights)  # noqa: E731
            return _exact_exchange(rows, ids, per_dest, first_of_dest, by, **exact_options)

        _, pull = jax.vjp(exact, rows, weights)
        d_rows, d_weights = pull(grad)
        return d_rows, d_weights, None

    run.defvjp(run_forward, run_backward)
    return run(rows, weights, routed)


def _exact_exchange_lean_unless_differentiated(
    rows, ids, per_dest, first_of_dest, w_gate, w_up, w_down, *, experts, tpu_rows_view, **where
):
    """`_exact_exchange` with the forward pass's lean buffers when the layer is not
    differentiated (`tpu_rows_view` as asked, the receive buffer unfilled), and plain ones when it
    is (a custom JVP whose rule runs it without either): the same numbers either way. libtpu,
    DeepSeek-like layer on v5e: the view cut the forward pass's temporaries from 11.44 to 6.04 GB
    per chip but raised the training step's from 7.83 to 9.84 GB; the unfilled receive buffer cut
    the forward pass's XLA traffic from 9.01 to 7.13 GB and its temporaries to 5.32, but raised
    the training step's temporaries from 5.23 to 6.00 GB (docs/internals/moe.md)."""

    def run(lean, *args):
        rows, ids, per_dest, first_of_dest, w_gate, w_up, w_down = args
        by = lambda r, i: experts(r, i, w_gate, w_up, w_down)  # noqa: E731
        return _exact_exchange(
            *(rows, ids, per_dest, first_of_dest, by),
            tpu_rows_view=lean and tpu_rows_view,
            unfilled_receive=lean,
            **where,
        )

    @jax.custom_jvp
    def lean(*args):
        return run(True, *args)

    @lean.defjvp
    def plain(primals, tangents):
        return jax.jvp(functools.partial(run, False), primals, tangents)

    return lean(rows, ids, per_dest, first_of_dest, w_gate, w_up, w_down)


def _exact_exchange(
    rows,
    ids,
    per_dest,
    first_of_dest,
    experts,
    *,
    axis_name,
    devices,
    local_experts,
    top_k,
    tpu_rows_view=False,
    unfilled_receive=False,
):
    """Dropless: each device's rows (sorted by destination, `per_dest` each from `first_of_dest`)
    go to their owners as ragged slices, and the results come back to the same rows
    (`tpu_rows_view`: see `exchange.ragged_all_to_all`). `unfilled_receive`: the receive
    buffer's rows past those received are left unfilled (`exchange.unfilled`); the experts never
    read them."""
    assignments, d = rows.shape
    sizes = lax.all_gather(per_dest, axis_name)  # [sender, destination]
    me = lax.axis_index(axis_name)
    recv_sizes = sizes[:, me]
    # where my slice lands at each destination: after the slices of the senders before me
    at_destination = (jnp.cumsum(sizes, axis=0) - sizes)[me]
    received_at = jnp.cumsum(recv_sizes) - recv_sizes  # sender i's slice in my buffer
    buffer = most_received(assignments // top_k, top_k, devices, local_experts)
    send = lambda a, out, **view: ragged_all_to_all(  # noqa: E731
        a,
        out,
        first_of_dest,
        per_dest,
        at_destination,
        recv_sizes,
        axis_name=axis_name,
        **view,
    )
    # rows past those received are never read: the experts compute only their groups' rows
    start = unfilled if unfilled_receive else jnp.zeros
    recv_rows = send(rows, start((buffer, d), rows.dtype), tpu_rows_view=tpu_rows_view)
    recv_ids = send(ids, jnp.full((buffer,), local_experts, ids.dtype))
    out = experts(recv_rows, recv_ids)
    # back: sender i's rows return to where they left it (its first_of_dest[me])
    home = (jnp.cumsum(sizes, axis=1) - sizes)[:, me]
    return ragged_all_to_all(
        out,
        jnp.zeros((assignments, d), out.dtype),
        received_at,
        recv_sizes,
        home,
        per_dest,
        axis_name=axis_name,
        tpu_rows_view=tpu_rows_view,
    )


def _capacity_exchange(
    rows, sorted_experts, dest, first_of_dest, experts, *, axis_name, devices, cap, local_experts
):
    """Fixed capacity: [D, cap, d] buffers through a dense all_to_all; rows past a destination's
    capacity are dropped (they read 0) and counted."""
    d = rows.shape[1]
    rank = jnp.arange(rows.shape[0], dtype=jnp.int32) - first_of_dest[dest]
    kept = rank < cap
    dropped = jnp.sum(~kept).astype(jnp.int32)
    slot = jnp.where(kept, dest * cap + rank, devices * cap)  # dropped: an extra row, cut below
    packed = jnp.zeros((devices * cap + 1, d), rows.dtype).at[slot].set(rows)[:-1]
    ids = (
        jnp.full((devices * cap + 1,), local_experts, jnp.int32)
        .at[slot]
        .set(sorted_experts % local_experts)[:-1]
    )
    exchange = lambda a: lax.all_to_all(
        a.reshape(devices, cap, *a.shape[1:]),
        axis_name,
        0,
        0,  # noqa: E731
        tiled=False,
    ).reshape(a.shape)
    back = exchange(experts(exchange(packed), exchange(ids)))
    # dropped rows read 0
    return jnp.concatenate([back, jnp.zeros((1, d), back.dtype)])[slot], dropped
