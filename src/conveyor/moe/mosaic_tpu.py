"""The overlapped expert-parallel exchange (`conveyor.plans.exchange.ExchangePlan`) as one Mosaic
TPU kernel: remote DMAs carry each peer's rows in and the results home while the SwiGLU experts
run, as grouped matmuls over the received rows, on the chunk that arrived before.

Design notes: docs/internals/moe.md, section `moe/mosaic_tpu.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor.cost import matmul_cost, shape_bytes
from conveyor.interpreters import tpu_params
from conveyor.ints import cdiv
from conveyor.kernel import KernelContext, entered_kernel
from conveyor.ops.gmm.metadata import make_group_metadata, max_visits
from conveyor.ops.gmm.tiling import tpu_default
from conveyor.ops.gmm.tpu_blocks import RELAYOUT_FREE_ELEMENTS
from conveyor.pipeline.api import emit_pipeline
from conveyor.pipeline.lowering import issued
from conveyor.plans.exchange import ExchangeOperation, ExchangePlan
from conveyor.spmd import out_struct
from conveyor.tpu_vmem import vmem_limit

SUPPORTED = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertTiles:
    """Blocks of the two grouped matmuls: [rows, d] @ [d, f] (gate and up, fused) and
    [rows, f] @ [f, d] (down); `tm` rows each. A chunk also travels in whole `tm`-row tiles (one
    DMA each), so at most tm - 1 padding rows per chunk cross a link."""

    tm: int
    d_block: int
    f_block: int

    @classmethod
    def for_layer(cls, *, rows: int, groups: int, d: int, f: int) -> "ExpertTiles":
        """`tiling.tpu_default` for a chunk of `rows` rows in `groups` local experts (the gmm
        kernels' default: tm from the mean rows per group, the widest blocks dividing d and f).
        Shapes only."""
        tm, d_block, f_block = tpu_default(rows, d, f, groups)
        return cls(tm=tm, d_block=min(d_block, d), f_block=min(f_block, f))

    def vmem(self, dtype) -> int:
        """VMEM of the larger of the two pipelines: two slots of every block, the float32
        accumulators (two for gate and up), and Mosaic's relayout copy of a 16-bit left operand
        (`tpu_blocks.working_set`'s rule)."""
        tm, bd, bf = self.tm, self.d_block, self.f_block

        def relayout(block):
            copied = jnp.dtype(dtype).itemsize < 4 and block[0] * block[1] > RELAYOUT_FREE_ELEMENTS
            return shape_bytes(block, dtype) if copied else 0

        up = 2 * shape_bytes((tm, bd), dtype) + 4 * shape_bytes((bd, bf), dtype)
        up += 2 * shape_bytes((tm, bf), dtype) + 2 * shape_bytes((tm, bf), jnp.float32)
        down = 2 * shape_bytes((tm, bf), dtype) + 2 * shape_bytes((bf, bd), dtype)
        down += 2 * shape_bytes((tm, bd), dtype) + shape_bytes((tm, bd), jnp.float32)
        return max(up + relayout((tm, bd)), down + relayout((tm, bf)))


@dataclasses.dataclass(frozen=True)
class _Chunks:
    """Group metadata (SMEM) of the chunk each sender sends this device, flattened: sender s's
    visit v at `[s * visits + v]`, its group g's rows at `[s * groups + g]`."""

    group_ids: object
    tile_ids: object
    starts: object
    ends: object
    num_visits: object
    visits: int
    groups: int

    def group(self, s, v):
        return self.group_ids[s * self.visits + v]

    def tile(self, s, v):
        return self.tile_ids[s * self.visits + v]

    def rows_of(self, s, g):
        return self.starts[s * self.groups + g], self.ends[s * self.groups + g]


def _grouped_swiglu(
    x_ref, wg_ref, wu_ref, wd_ref, h_ref, out_ref, chunks: _Chunks, s, tiles, x_at=0, out_at=0
):
    """out = (silu(x @ wg[g]) * (x @ wu[g])) @ wd[g] for the rows of each group g of sender s's
    chunk, which starts at row tile `x_at` of `x_ref` (its results at row tile `out_at` of
    `out_ref`; rows past the groups: unspecified), through `h_ref` [C, f]; two pipelines over
    (column block, visit, depth block), visits of sender s only."""
    tm, bd, bf = tiles.tm, tiles.d_block, tiles.f_block
    d, f = wg_ref.shape[1:]
    visits = chunks.num_visits[s]

    def first_of_tile(v):
        prev = jnp.maximum(v - 1, 0)
        return (v == 0) | (chunks.tile(s, v) != chunks.tile(s, prev))

    def store(v, out, value):
        """Write the visit's group's rows of the block (the tile's other rows keep their value)."""
        tile = chunks.tile(s, v)
        lo, hi = chunks.rows_of(s, chunks.group(s, v))
        rows = tile * tm + lax.broadcasted_iota(jnp.int32, out.shape, 0)
        out[...] = jnp.where((rows >= lo) & (rows < hi), value.astype(out.dtype), out[...])

    x_row = lambda j, v, kk: (x_at + chunks.tile(s, v), kk)  # noqa: E731
    h_row = lambda j, v, kk: (chunks.tile(s, v), kk)  # noqa: E731
    weight = lambda j, v, kk: (chunks.group(s, v), kk, j)  # noqa: E731
    h_block = lambda j, v, kk: (chunks.tile(s, v), j)  # noqa: E731
    out_block = lambda j, v, kk: (out_at + chunks.tile(s, v), j)  # noqa: E731

    def up(acc_g, acc_u):
        def body(idx, x, wg, wu, h):
            _, v, kk = idx

            @pl.when(kk == 0)
            def _():
                acc_g[...] = jnp.zeros_like(acc_g)
                acc_u[...] = jnp.zeros_like(acc_u)

            @pl.when((kk == 0) & first_of_tile(v))
            def _():
                h[...] = jnp.zeros_like(h)

            acc_g[...] += jnp.dot(x[...], wg[...], preferred_element_type=jnp.float32)
            acc_u[...] += jnp.dot(x[...], wu[...], preferred_element_type=jnp.float32)

            @pl.when(kk == d // bd - 1)
            def _():
                store(v, h, jax.nn.silu(acc_g[...]) * acc_u[...])

        w_spec = pl.BlockSpec((None, bd, bf), weight)
        emit_pipeline(
            body,
            grid=(f // bf, visits, d // bd),
            in_specs=[pl.BlockSpec((tm, bd), x_row), w_spec, w_spec],
            out_specs=[pl.BlockSpec((tm, bf), h_block)],
            max_concurrent_steps=2,
        )(x_ref, wg_ref, wu_ref, h_ref)

    def down(acc):
        def body(idx, h, wd, out):
            _, v, kk = idx

            @pl.when(kk == 0)
            def _():
                acc[...] = jnp.zeros_like(acc)

            @pl.when((kk == 0) & first_of_tile(v))
            def _():
                out[...] = jnp.zeros_like(out)

            acc[...] += jnp.dot(h[...], wd[...], preferred_element_type=jnp.float32)

            @pl.when(kk == f // bf - 1)
            def _():
                store(v, out, acc[...])

        emit_pipeline(
            body,
            grid=(d // bd, visits, f // bf),
            in_specs=[pl.BlockSpec((tm, bf), h_row), pl.BlockSpec((None, bf, bd), weight)],
            out_specs=[pl.BlockSpec((tm, bd), out_block)],
            max_concurrent_steps=2,
        )(h_ref, wd_ref, out_ref)

    pl.run_scoped(up, *[pltpu.VMEM((tm, bf), jnp.float32)] * 2)
    pl.run_scoped(down, pltpu.VMEM((tm, bd), jnp.float32))


def _kernel(
    me_ref,
    tiles_ref,
    regions_ref,
    group_ids,
    tile_ids,
    starts,
    ends,
    num_visits,
    packed_hbm,
    wg_hbm,
    wu_hbm,
    wd_hbm,
    results_hbm,
    in_slots,
    out_slots,
    hidden,
    dispatch_sems,
    recv_sems,
    return_sems,
    home_sem,
    credit_sems,
    *,
    plan: ExchangePlan,
    axis,
    tiles: ExpertTiles,
    interpret,
):
    """One device's part of `plan`. tiles_ref[s * D + j]: the row tiles of sender s's chunk for
    device j (its rows sorted by local expert); regions_ref[s * D + j]: the row tile where that
    chunk starts in sender s's `packed_hbm` (and its results in s's
    `results_hbm`). Slots: in_slots / out_slots[stream, slot] (HBM, [C, d] each); semaphores: per
    stream its dispatches' sends, per (stream, slot) the landings and the returns' sends, one for
    the results landing home, and one credit per peer offset (a sender waits for the receiver's
    credit before each dispatch)."""
    n = plan.num_devices
    experts = wg_hbm.shape[0]
    tm = tiles.tm
    me = me_ref[0]
    chunks = _Chunks(
        group_ids, tile_ids, starts, ends, num_visits, group_ids.shape[0] // n, experts
    )
    stream = {name: i for i, name in enumerate(plan.directions)}

    def device(offset):
        return lax.rem(me + offset + n, n)

    def blocks(sender, receiver):
        """Row tiles of sender's chunk for receiver (each one DMA)."""
        return tiles_ref[sender * n + receiver]

    def tile(ref, i):
        return ref.at[pl.ds(pl.multiple_of(i * tm, tm), tm)]

    def region(sender, receiver):
        return regions_ref[sender * n + receiver]

    def remote(src, dst, send, recv, to):
        return pltpu.make_async_remote_copy(src, dst, send, recv, device_id={axis: to})

    def each(count, fn):
        lax.fori_loop(0, count, lambda i, c: (fn(i), c)[1], 0)

    def report(operation, r, slot):
        issued(ExchangeOperation, operation, r.direction, step=r.step, slot=slot)

    def dispatch(r):
        report("dispatch", r, r.dispatch_slot)
        to, si = device(r.dispatch_to), stream[r.direction]
        pl.semaphore_wait(credit_sems.at[r.dispatch_to % n], 1)
        each(
            blocks(me, to),
            lambda i: remote(
                tile(packed_hbm, region(me, to) + i),
                tile(in_slots.at[si, r.dispatch_slot], i),
                dispatch_sems.at[si],
                recv_sems.at[si, r.dispatch_slot],
                to,
            ).start(),
        )

    def landing(si, slot):  # any tile's DMA into the slot: waits count bytes
        s = in_slots.at[si, slot]
        return remote(tile(s, 0), tile(s, 0), dispatch_sems.at[si], recv_sems.at[si, slot], me)

    def homecoming(si, slot):
        s = out_slots.at[si, slot]
        return remote(tile(s, 0), tile(results_hbm, 0), return_sems.at[si, slot], home_sem, me)

    def await_return(direction, slot, step):
        """Wait until the results computed at `step` in `slot` have left for home."""
        src, si = device(plan.offset(step, direction)), stream[direction]
        each(blocks(src, me), lambda i: homecoming(si, slot).wait_send())

    def run_experts(src, x, out, at=0):
        _grouped_swiglu(
            x, wg_hbm, wu_hbm, wd_hbm, hidden, out, chunks, src, tiles, x_at=at, out_at=at
        )

    with entered_kernel(KernelContext(backend="mosaic_tpu", interpret=interpret, grid=(1,))):
        for direction in plan.directions:
            for o in plan.initial_credits(direction):
                pl.semaphore_signal(credit_sems.at[(-o) % n], 1, device_id={axis: device(o)})
        returned = []  # (stream, slot, step) of the returns started, not yet awaited
        for records in plan.steps():
            for r in records:  # every stream's dispatch before any experts: both links busy
                if r.dispatches:
                    dispatch(r)
            for r in records:
                if not r.computes:
                    continue
                if not r.receives:  # the local chunk
                    report("experts", r, r.slot)
                    run_experts(me, packed_hbm, results_hbm, at=region(me, me))
                    continue
                si, src = stream[r.direction], device(r.source)
                report("receive", r, r.slot)
                each(blocks(src, me), lambda i, si=si, r=r: landing(si, r.slot).wait_recv())
                if r.rewrites_output_of is not None:  # its results must be home first
                    report("await_return", r, r.slot)
                    returned.remove((r.direction, r.slot, r.rewrites_output_of))
                    await_return(r.direction, r.slot, r.rewrites_output_of)
                report("experts", r, r.slot)
                run_experts(src, in_slots.at[si, r.slot], out_slots.at[si, r.slot])
                if r.grants_to is not None:
                    report("grant", r, r.slot)
                    pl.semaphore_signal(
                        credit_sems.at[(-r.grants_to) % n], 1, device_id={axis: device(r.grants_to)}
                    )
                report("return", r, r.slot)
                each(
                    blocks(src, me),
                    lambda i, si=si, r=r, src=src: remote(
                        tile(out_slots.at[si, r.slot], i),
                        tile(results_hbm, region(src, me) + i),
                        return_sems.at[si, r.slot],
                        home_sem,
                        src,
                    ).start(),
                )
                returned.append((r.direction, r.slot, r.step))
        # leave only once every copy of this device has landed and its own are done
        for j in range(n):
            peer = device(j)
            if j:
                each(blocks(me, peer), lambda i: homecoming(0, 0).wait_recv())
        for records in plan.steps():
            for r in records:
                if r.dispatches:
                    si = stream[r.direction]
                    each(
                        blocks(me, device(r.dispatch_to)),
                        lambda i, si=si: landing(si, 0).wait_send(),
                    )
        for direction, slot, step in returned:
            await_return(direction, slot, step)


def check_operands(rows, w_gate, w_up, w_down) -> None:
    """What the kernel needs of the layer's shapes and dtypes, refused by name otherwise."""
    dtype = jnp.dtype(rows.dtype)
    if dtype not in SUPPORTED:
        raise NotImplementedError(
            f"x: the mosaic_tpu overlapped exchange supports float32 and bfloat16, got "
            f"{dtype.name}; pass backend='xla'"
        )
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if jnp.dtype(w.dtype) != dtype:
            raise NotImplementedError(
                f"{name}: the mosaic_tpu overlapped exchange computes in x's dtype ({dtype.name}) "
                f"and needs the weights in it too, got {jnp.dtype(w.dtype).name}; cast them, or "
                "pass backend='xla'"
            )
    d, f = rows.shape[1], w_gate.shape[2]
    for name, size in (("d (x's columns)", d), ("f (the experts' hidden size)", f)):
        if size % 128:
            raise NotImplementedError(
                f"{name}: the mosaic_tpu overlapped exchange tiles it in 128-lane blocks and "
                f"needs a multiple of 128, got {size}; pass backend='xla'"
            )


def overlapped_exchange_mosaic_tpu(
    rows: jax.Array,
    ids: jax.Array,
    per_dest: jax.Array,
    first_of_dest: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    plan: ExchangePlan,
    axis_name,
    interpret=None,
) -> jax.Array:
    """`conveyor.moe.overlapped.overlapped_exchange` with the SwiGLU experts, in one kernel:
    this device's `rows` (sorted by destination, then local expert `ids`; `per_dest[j]` rows for
    device j from `first_of_dest[j]`) go to their owners, through their experts, and back to the
    same rows."""
    assignments, d = rows.shape
    experts, _, f = w_gate.shape
    n = plan.num_devices
    check_operands(rows, w_gate, w_up, w_down)
    # balanced routing: a chunk holds 1 / n of the assignments, in `experts` groups
    tiles = ExpertTiles.for_layer(rows=max(assignments // n, 1), groups=experts, d=d, f=f)
    tm = tiles.tm
    cap = cdiv(assignments, tm) * tm  # a chunk at most: every assignment, in whole tiles
    dest = jnp.searchsorted(jnp.cumsum(per_dest), jnp.arange(assignments), side="right")
    counts = jnp.zeros((n, experts), jnp.int32).at[dest, ids].add(1)
    all_counts = lax.all_gather(counts, axis_name)  # [sender, receiver, expert]
    me = lax.axis_index(axis_name).astype(jnp.int32)
    # each sender's rows for receiver j start at a whole tile (Mosaic DMAs tile-aligned rows):
    # `regions[s, j]`, in tiles; `packed` holds mine so (the padding is never computed on, sent
    # or read), and my results come home to the same rows
    tiles_of = (jnp.sum(all_counts, axis=2) + tm - 1) // tm  # [sender, receiver]
    regions = jnp.cumsum(tiles_of, axis=1) - tiles_of
    packed_rows = cap + n * tm  # at most tm - 1 padding rows per receiver
    at = regions[me, dest] * tm + jnp.arange(assignments) - first_of_dest[dest]
    packed = jnp.zeros((packed_rows, d), rows.dtype).at[at].set(rows, unique_indices=True)
    metas = jax.vmap(lambda sizes: make_group_metadata(sizes, cap, tm))(all_counts[:, me])
    flat = lambda a: a.reshape(-1).astype(jnp.int32)  # noqa: E731
    prefetch = (
        me[None],
        flat(tiles_of),
        flat(regions),
        flat(metas.group_ids),
        flat(metas.tile_ids),
        flat(metas.group_starts),
        flat(metas.group_ends),
        flat(metas.num_visits),
    )
    assert metas.group_ids.shape[1] == max_visits(cap, tm, experts)
    k = len(plan.directions)
    slot = (cap, d)
    outs = [
        ((packed_rows, d), rows.dtype),  # results: in `packed`'s rows, home from each receiver
        ((k, plan.buffering, *slot), rows.dtype),  # in slots
        ((k, plan.buffering, *slot), rows.dtype),  # out slots
        ((cap, f), rows.dtype),  # the hidden activations of one chunk
    ]
    semaphores = [
        pltpu.SemaphoreType.DMA((k,)),
        pltpu.SemaphoreType.DMA((k, plan.buffering)),
        pltpu.SemaphoreType.DMA((k, plan.buffering)),
        pltpu.SemaphoreType.DMA,
        pltpu.SemaphoreType.REGULAR((n,)),
    ]
    working = tiles.vmem(rows.dtype)
    limit = vmem_limit(
        "moe overlapped exchange",
        working=working,
        peak=working + 2 * shape_bytes((tm, tiles.f_block), jnp.float32),
        remedy="pass backend='xla'",
    )
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    weights = (w_gate, w_up, w_down)
    call = pl.pallas_call(
        functools.partial(_kernel, plan=plan, axis=axis_name, tiles=tiles, interpret=interpret),
        out_shape=tuple(out_struct(shape, dt, rows, w_gate) for shape, dt in outs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(1,),
            in_specs=[anywhere] * 4,
            out_specs=[anywhere] * len(outs),
            scratch_shapes=semaphores,
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), has_side_effects=True, vmem_limit_bytes=limit
        ),
        cost_estimate=matmul_cost(assignments, d, 3 * f, packed, *weights),
        interpret=tpu_params(interpret),
        name="conveyor_moe_overlapped_exchange",
    )
    results = call(*prefetch, packed, *weights)[0]
    return results[at]
