"""The overlapped exchanges of the expert-parallel layer in XLA: the plans' steps
(`conveyor.plans.exchange`: per peer, or per group of local experts) as collectives and expert
matmuls.

Design notes: docs/internals/moe.md, section `moe/overlapped.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.ints import cdiv
from conveyor.moe.exchange import most_received, ragged_all_to_all, send_chunk
from conveyor.plans.exchange import ExchangePlan, StagedExchangePlan


def overlapped_exchange(
    rows: jax.Array,
    ids: jax.Array,
    per_dest: jax.Array,
    first_of_dest: jax.Array,
    experts,
    *,
    plan: ExchangePlan,
    axis_name,
    local_experts: int,
) -> jax.Array:
    """Dropless, overlapped: this device's `rows` (sorted by destination: `per_dest[j]` rows for
    device j from `first_of_dest[j]`, whose local expert at j is `ids`) run through
    `experts(rows, ids)` on their owners, and the results come back to the same rows."""
    n = plan.num_devices
    assignments = rows.shape[0]
    me = lax.axis_index(axis_name)
    sizes = lax.all_gather(per_dest, axis_name)  # [sender, destination]
    r = jnp.arange(assignments, dtype=jnp.int32)

    def pack(dest):
        """My rows for device `dest` (and their expert ids), padded to a whole chunk."""
        keep = r < per_dest[dest]
        at = jnp.minimum(first_of_dest[dest] + r, assignments - 1)
        return (
            jnp.where(keep[:, None], rows[at], jnp.zeros((), rows.dtype)),
            jnp.where(keep, ids[at], local_experts),
        )

    def place(results, chunk, dest):
        """Results of my rows for device `dest`, back in their rows."""
        target = jnp.where(r < per_dest[dest], first_of_dest[dest] + r, assignments)
        return results.at[target].set(chunk, mode="drop")

    def send(chunk, shift, size, recv_size):
        return send_chunk(chunk, size, recv_size, shift=shift, axis_name=axis_name, devices=n)

    results = jnp.zeros_like(rows)
    arrived = {}  # (step, stream) -> (rows, ids) received for it
    for records in plan.steps():
        for s in records:
            if s.dispatches:
                dest = (me + s.dispatch_to) % n
                src = (me - s.dispatch_to) % n
                chunk_rows, chunk_ids = pack(dest)
                got = sizes[src, me]
                got_ids = send(chunk_ids, s.dispatch_to, per_dest[dest], got)
                arrived[(s.step + 1, s.direction)] = (
                    send(chunk_rows, s.dispatch_to, per_dest[dest], got),
                    jnp.where(r < got, got_ids, local_experts),  # an exact send pads with 0
                )
        for s in records:
            if not s.computes:
                continue
            if not s.receives:  # the local chunk
                out = experts(*pack(me))
                results = place(results, out, me)
                continue
            out = experts(*arrived.pop((s.step, s.direction)))
            # home to the source; mine come back from the device I am the source of
            src = (me + s.source) % n
            helper = (me - s.source) % n
            back = send(out, s.source, sizes[src, me], per_dest[helper])
            results = place(results, back, helper)
    return results


def staged_exchange(
    rows: jax.Array,
    local_ids: jax.Array,
    dest: jax.Array,
    experts,
    *,
    plan: StagedExchangePlan,
    axis_name,
    local_experts: int,
    top_k: int,
) -> jax.Array:
    """Dropless, expert-staged (`StagedExchangePlan`): this device's `rows`, sorted by global
    expert (so by destination `dest`, then local expert `local_ids`), go to their owners one
    group of local experts per stage through the exact ragged exchange, the next stage's
    dispatch issued before this stage's experts; the results come back to the same rows. A stage's
    receive buffer holds the most rows its experts can get (`most_received`). The layer does not
    differentiate this plan: its gradients are the exact exchange's, recomputed in the backward
    pass (`expert_parallel._differentiated_as_exact`), so no stage's buffers are saved for it."""
    n, stages = plan.num_devices, plan.stages
    assignments = rows.shape[0]
    me = lax.axis_index(axis_name)
    stage_of = local_ids * stages // local_experts  # contiguous groups of local experts
    counts = jnp.zeros((n, stages), jnp.int32).at[dest, stage_of].add(1)
    # rows are sorted by (destination, stage): each (j, s) slice is contiguous
    first = (jnp.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(n, stages)
    everyone = lax.all_gather(counts, axis_name)  # [sender, destination, stage]
    firsts = lax.all_gather(first, axis_name)
    buffer = most_received(assignments // top_k, top_k, n, cdiv(local_experts, stages))

    def dispatch(s):
        sizes = everyone[:, :, s]  # [sender, destination]
        at_destination = (jnp.cumsum(sizes, axis=0) - sizes)[me]
        recv_sizes = sizes[:, me]

        def send(a, fill):
            # zero-filled, though the rows past those received are never read: unfilled
            # (`exchange.unfilled`), libtpu's forward pass moved 7.96 -> 4.90 GB on v5e but
            # 10.11 -> 9.20 on v6e, which one priced count of layout copies cannot follow
            out = jnp.full((buffer, *a.shape[1:]), fill, a.dtype)
            return ragged_all_to_all(
                a,
                out,
                first[:, s],
                counts[:, s],
                at_destination,
                recv_sizes,
                axis_name=axis_name,
            )

        return send(rows, 0), send(local_ids, local_experts), recv_sizes

    results = jnp.zeros_like(rows)
    arrived = {0: dispatch(0)}
    for r in plan.steps():
        if r.dispatches:
            arrived[r.step + 1] = dispatch(r.step + 1)
        got_rows, got_ids, recv_sizes = arrived.pop(r.step)
        out = experts(got_rows, got_ids)
        received_at = jnp.cumsum(recv_sizes) - recv_sizes
        results = ragged_all_to_all(
            out,
            results,
            received_at,
            recv_sizes,
            firsts[:, me, r.step],  # where sender i keeps its rows for me
            counts[:, r.step],
            axis_name=axis_name,
        )
    return results
