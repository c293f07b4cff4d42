"""The overlapped exchange of the expert-parallel layer in XLA: the plan's steps
(`conveyor.plans.exchange`) as collectives and expert matmuls.

At every step each stream first sends the chunk its next step's receiver needs, then runs the
experts on the chunk that arrived, then sends the results home. Nothing in a step's expert
matmuls depends on that step's sends, so a platform with asynchronous collectives (TPU, GPU) may
run them at once; XLA's scheduler decides. A kernel that guarantees it is the Mosaic one (not
written yet: see docs/moe.md). XLA:CPU runs collectives synchronously: there this path gives the
plan's numbers, not its overlap.

A chunk has the worst case's rows (every assignment of the sender bound for one device); rows past
the sender's count are zeros with the padding expert id, which the experts skip (they come out
as zeros and are never placed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from conveyor.moe.exchange import send_chunk
from conveyor.plans.exchange import ExchangePlan


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
