"""Mosaic TPU ring kernels with credits: all_gather_matmul (gather_dim 1 and 0) and
matmul_reduce_scatter (scatter_dim 0 and 1), each unidirectional or bidirectional.

The kernels run the ring plan's records (`RingPlan.steps()`), which they read at run time from a
table in SMEM (`RingPlan.step_table()`, scalar-prefetched): at grid step t, each operation of
`RingPlan.phases()` (receive, send, compute, ...) runs for each stream whose record enables it.
The same records are the event program the checker explores and the simulator times. So:
- both directions of a bidirectional ring are in flight at once (each phase runs for both streams
  before the next phase);
- a reduce-scatter send is awaited at the next step, after that step's partial product, so a hop
  overlaps the matmul;
- block indices (which shard, which output block) come from the records' `source` offsets.
Flow control: a device writes into its downstream neighbour's slot only after that neighbour
granted a credit on the sender's capacity semaphore; `credit_balance()` is zero, so every
semaphore is back to zero at the end. Receive and send semaphores are per slot.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor.interpreters import tpu_params
from conveyor.spmd import out_struct
from conveyor.cost import matmul_cost, nbytes, shape_bytes
from conveyor.pipeline.lowering import issued
from conveyor.plans.ring import ENABLED_BY, RingPlan
from conveyor.tpu_vmem import vmem_limit

# The slot each operation is reported with (conformance).
SLOT_FIELD = {"receive": "slot", "send": "send_slot", "compute": "slot", "accumulate": "slot",
              "finish_send": "awaits_slot", "grant": "slot", "store": "slot"}


@dataclasses.dataclass(frozen=True)
class _Stream:
    """One direction's receive slots and semaphores on this device, and its neighbours."""
    direction: str
    bufs: Any
    send: Any
    recv: Any
    cap: Any
    downstream: Any
    upstream: Any
    axis: Any

    def copy(self, src_slot, dst_slot):
        """The DMA of slot `src_slot` into slot `dst_slot` of the downstream neighbour (along mesh
        axis `axis`; its other mesh coordinates are this device's own)."""
        return pltpu.make_async_remote_copy(self.bufs.at[src_slot], self.bufs.at[dst_slot], self.send.at[src_slot],
                                            self.recv.at[dst_slot], device_id={self.axis: self.downstream})

    def grant(self, credits):
        pl.semaphore_signal(self.cap, credits, device_id={self.axis: self.upstream})


def _streams(plan: RingPlan, me_ref, axis, per_stream) -> dict[str, _Stream]:
    """The plan's streams from their scratch refs (bufs, send, recv, cap), in `directions` order."""
    size = plan.num_devices
    me = me_ref[0]
    left, right = lax.rem(me + size - 1, size), lax.rem(me + 1, size)
    ends = {"right": (right, left), "left": (left, right)}   # (downstream, upstream)
    return {d: _Stream(d, *refs, *ends[d], axis) for d, refs in zip(plan.directions, per_stream)}


def _run_step(plan: RingPlan, tab_ref, streams: dict[str, _Stream], work: dict[str, Callable]) -> None:
    """Grid step t: every operation of `plan.phases()`, for each stream, where its record enables it.
    Ring transfers are common; `work[op](stream, field, enabled)` emits the kernel's own
    operations (compute, accumulate, store) and guards them itself."""
    t = pl.program_id(0)
    for op, direction in plan.phases():
        s = streams[direction]

        def field(name, direction=direction):
            return tab_ref[plan.table_index(t, direction, name)]

        enabled = field("awaits_slot") >= 0 if op == "finish_send" else field(ENABLED_BY[op]) == 1

        @pl.when(enabled)
        def _(op=op, field=field, s=s):
            issued(t, op, s.direction, field(SLOT_FIELD[op]), t)
            if op == "receive":
                s.copy(field("slot"), field("slot")).wait_recv()
            elif op == "send":
                pl.semaphore_wait(s.cap, 1)   # the downstream slot is free
                s.copy(field("slot"), field("send_slot")).start()
            elif op == "finish_send":
                awaited = field("awaits_slot")
                s.copy(awaited, lax.rem(awaited + 1, plan.buffering)).wait_send()
            elif op == "grant":   # the slot is free and the upstream neighbour will send into it again
                s.grant(1)

        if op in work:
            work[op](s, field, enabled)


def _source_block(plan: RingPlan, direction: str):
    """Index map of the block at ring offset `source` of `direction`'s record: (block, 0)."""
    size = plan.num_devices

    def index(t, me_ref, tab_ref):
        return lax.rem(me_ref[0] + tab_ref[plan.table_index(t, direction, "source")] + 2 * size, size), 0
    return index


def _gather_kernel(me_ref, tab_ref, lhs_hbm, *refs, plan: RingPlan, axis, mode: str):
    """Shards travel; each computing record multiplies its slot's shard by its rhs block. mode:
    "accumulate" (gather_dim=1): out += shard @ K-block; "block" (unidirectional gather_dim=0):
    the step's output row block, chosen by the out BlockSpec, = shard @ rhs; "rows"
    (bidirectional gather_dim=0): the resident output's row block of the source device = shard @ rhs.

    refs: rhs blocks (one per stream), out, then per stream: slots, send sems, receive sems,
    capacity semaphore; then the semaphore of the local copy."""
    k = len(plan.directions)
    rhs_blks, out_ref, scratch, local_sem = refs[:k], refs[k], refs[k + 1:-1], refs[-1]
    streams = _streams(plan, me_ref, axis, [scratch[4 * i:4 * i + 4] for i in range(k)])
    rhs = dict(zip(plan.directions, rhs_blks))
    rows = out_ref.shape[0] // plan.num_devices

    @pl.when(pl.program_id(0) == 0)
    def _():
        for s in streams.values():
            local = pltpu.make_async_copy(lhs_hbm, s.bufs.at[0], local_sem)
            local.start()
            local.wait()
        if mode == "accumulate":
            out_ref[...] = jnp.zeros_like(out_ref)
        for d, s in streams.items():
            if plan.initial_credits(d):
                s.grant(plan.initial_credits(d))

    def compute(s, field, enabled):
        @pl.when(enabled)
        def _():
            value = jnp.dot(s.bufs[field("slot")], rhs[s.direction][...], preferred_element_type=jnp.float32)
            if mode == "accumulate":
                out_ref[...] += value
            elif mode == "block":
                out_ref[...] = value
            else:
                src = lax.rem(me_ref[0] + field("source") + plan.num_devices, plan.num_devices)
                out_ref[pl.ds(pl.multiple_of(src * rows, rows), rows), :] = value

    _run_step(plan, tab_ref, streams, {"compute": compute})


LANES, SUBLANES = 128, 8


def _check_tiles(kernel: str, what: str, block, shape) -> None:
    """Mosaic TPU's rule for a block (the interpreter does not enforce it): its last two dims
    are multiples of (8, 128) or the array's own."""
    rows_ok = block[-2] % SUBLANES == 0 or block[-2] == shape[-2]
    lanes_ok = block[-1] % LANES == 0 or block[-1] == shape[-1]
    if not (rows_ok and lanes_ok):
        raise NotImplementedError(
            f"{kernel}: mosaic_tpu would copy {what} in blocks of {tuple(block)} out of "
            f"{tuple(shape)}; Mosaic TPU needs the last two block dims to be multiples of "
            f"({SUBLANES}, {LANES}) or the whole dims: pick shapes whose per-device shards are, "
            f"or backend='xla'"
        )


def _vmem_bytes(args, in_specs, out_spec, scratch, product) -> tuple[int, int]:
    """(working set, peak) VMEM of a ring kernel. Working set: its scratch slots, two buffers of
    every blocked input (Pallas' double buffering), the output block and one float32 `product`
    (the shape of a step's dot); at or above the compiled kernels' scoped VMEM in every case
    measured on v5e, v6e and v5p (docs/compile-check.md). Peak adds one more output block (the
    value being stored)."""
    slots = sum(shape_bytes(s.shape, s.dtype) for s in scratch
                if isinstance(s.dtype, np.dtype))  # semaphores have no numpy dtype
    blocks = sum(shape_bytes(spec.block_shape, a.dtype) for a, spec in zip(args, in_specs)
                 if spec.block_shape is not None)
    out = shape_bytes(out_spec.block_shape, jnp.float32)
    working = slots + 2 * blocks + out + shape_bytes(product, jnp.float32)
    return working, working + out


def _kernel_call(kernel, plan: RingPlan, *, axis, name, args, in_specs, out_shape, out_spec, scratch, interpret,
                 cost, product):
    """The pallas_call of a ring kernel: one grid step per plan step, the device's ring position and
    the plan's table scalar-prefetched. Its VMEM limit is raised when the chip's default is too
    small, and a kernel that cannot fit the chip's VMEM is refused (`tpu_vmem.vmem_limit`)."""
    for i, (a, spec) in enumerate(zip(args, in_specs)):
        if spec.block_shape is not None:
            _check_tiles(name, f"operand {i}", spec.block_shape, a.shape)
    _check_tiles(name, "the output", out_spec.block_shape, out_shape)
    working, peak = _vmem_bytes(args, in_specs, out_spec, scratch, product)
    limit = vmem_limit(name, working=working, peak=peak,
                       remedy="use smaller per-device shards, more devices, or backend='xla'")
    me = lax.axis_index(axis).astype(jnp.int32)[None]
    table = jnp.asarray(plan.step_table(), jnp.int32)
    call = pl.pallas_call(
        functools.partial(kernel, plan=plan, axis=axis),
        out_shape=out_struct(out_shape, jnp.float32, *args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(plan.num_steps,), in_specs=in_specs, out_specs=out_spec,
            scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), has_side_effects=True,
                                             vmem_limit_bytes=limit),
        cost_estimate=cost,
        interpret=tpu_params(interpret),
        name=name)
    return call(me, table, *args)


def _ring_cost(plan: RingPlan, rows: int, k: int, cols: int, lhs, rhs, out_shape):
    """One device's work: a [rows, k] x [k, cols] product per ring step (each step multiplies one
    shard or block), its operands read once and its float32 output written once."""
    out = jax.ShapeDtypeStruct(out_shape, jnp.float32)
    one_step = matmul_cost(rows, k, cols)
    return pl.CostEstimate(flops=plan.num_devices * one_step.flops, transcendentals=0,
                           bytes_accessed=nbytes(lhs, rhs, out))


def _stream_scratch(plan: RingPlan, slot_shape, dtype) -> list:
    """Per stream: `buffering` receive slots, send and receive semaphores per slot, a capacity semaphore."""
    one = [pltpu.VMEM((plan.buffering, *slot_shape), dtype), pltpu.SemaphoreType.DMA((plan.buffering,)),
           pltpu.SemaphoreType.DMA((plan.buffering,)), pltpu.SemaphoreType.REGULAR]
    return one * len(plan.directions)


def _require_double_buffering(plan: RingPlan, op: str) -> None:
    if plan.buffering < 2 and plan.num_devices > 1:
        raise NotImplementedError(f"mosaic_tpu: {op} needs buffering >= 2 (one slot computes while the next "
                                  f"shard lands; with one, every device waits for a credit: cv.sim.check shows "
                                  f"the deadlock), got buffering={plan.buffering}")


def all_gather_matmul_mosaic_tpu(lhs, rhs, *, axis_name, plan: RingPlan, out_dtype, interpret,
                                 gather_dim: int = 1):
    """The ring kernel of `plan` (from `ring_plan(collective="gather", ...)`, used as given)."""
    _require_double_buffering(plan, "all_gather_matmul")
    n, kd = lhs.shape
    m = rhs.shape[1]
    size = plan.num_devices
    if gather_dim == 1:   # lhs [n, K/D] shards of the contraction; each step's K-block of rhs
        mode, out_shape = "accumulate", (n, m)
        rhs_specs = [pl.BlockSpec((kd, m), _source_block(plan, d)) for d in plan.directions]
        out_spec = pl.BlockSpec((n, m), lambda t, me_ref, tab_ref: (0, 0))
    elif plan.bidirectional:   # output resident, row blocks filled by both streams
        mode, out_shape = "rows", (size * n, m)
        rhs_specs = [pl.BlockSpec((kd, m), lambda t, me_ref, tab_ref: (0, 0))] * 2
        out_spec = pl.BlockSpec(out_shape, lambda t, me_ref, tab_ref: (0, 0))
    else:   # each step writes the output row block of its shard's source
        mode, out_shape = "block", (size * n, m)
        rhs_specs = [pl.BlockSpec((kd, m), lambda t, me_ref, tab_ref: (0, 0))]
        out_spec = pl.BlockSpec((n, m), _source_block(plan, "right"))
    streams = len(plan.directions)
    return _kernel_call(
        functools.partial(_gather_kernel, mode=mode), plan, axis=axis_name, name="conveyor_all_gather_matmul",
        args=(lhs,) + (rhs,) * streams, in_specs=[pl.BlockSpec(memory_space=pl.ANY)] + rhs_specs,
        out_shape=out_shape, out_spec=out_spec,
        scratch=_stream_scratch(plan, (n, kd), lhs.dtype) + [pltpu.SemaphoreType.DMA],
        interpret=interpret, cost=_ring_cost(plan, n, kd, m, lhs, rhs, out_shape),
        product=(n, m)).astype(out_dtype)


def _scatter_kernel(me_ref, tab_ref, *refs, plan: RingPlan, axis, columns: tuple[slice, ...],
                    shared_rhs: bool, rhs_columns: tuple[slice | None, ...]):
    """Accumulators travel, one stream per column range: at each step a stream's partial product
    for the block at its record's `source` is added into the accumulator that arrived and sent on;
    the last step stores it. Every record computes (each step has a partial), so the partial
    products are computed before the transfers are awaited.

    refs: lhs blocks (one per stream), rhs blocks (one per stream, or one that every stream reads
    when `shared_rhs`), out, then per stream: slots, send semaphores, receive semaphores,
    capacity semaphore. Stream i multiplies the `rhs_columns[i]` of its rhs block (all: None)."""
    k = len(plan.directions)
    n_rhs = 1 if shared_rhs else k
    lhs_blks, rhs_blks = refs[:k], refs[k:k + n_rhs]
    out_ref, scratch = refs[k + n_rhs], refs[k + n_rhs + 1:]
    streams = _streams(plan, me_ref, axis, [scratch[4 * i:4 * i + 4] for i in range(k)])
    assert all(r.computes for records in plan.steps() for r in records), "a scatter step without a partial"

    def rhs_of(i):
        block = rhs_blks[0] if shared_rhs else rhs_blks[i]
        return block if rhs_columns[i] is None else block.at[:, rhs_columns[i]]

    blocks = {d: (lhs_blks[i], rhs_of(i), columns[i]) for i, d in enumerate(plan.directions)}
    partials = {}

    @pl.when(pl.program_id(0) == 0)
    def _():
        for d, s in streams.items():
            if plan.initial_credits(d):
                s.grant(plan.initial_credits(d))

    def compute(s, field, enabled):
        lhs_blk, rhs_blk, _ = blocks[s.direction]
        partials[s.direction] = jnp.dot(lhs_blk[...], rhs_blk[...], preferred_element_type=jnp.float32)

    def accumulate(s, field, enabled):
        slot, partial = field("slot"), partials[s.direction]

        @pl.when(field("receives") == 1)
        def _():
            s.bufs[slot] = s.bufs[slot] + partial

        @pl.when(field("receives") == 0)
        def _():
            s.bufs[slot] = partial

    def store(s, field, enabled):
        @pl.when(enabled)
        def _():
            out_ref[:, blocks[s.direction][2]] = s.bufs[field("slot")]

    _run_step(plan, tab_ref, streams, {"compute": compute, "accumulate": accumulate, "store": store})


def matmul_reduce_scatter_mosaic_tpu(lhs, rhs, *, axis_name, plan: RingPlan, out_dtype, interpret,
                                     scatter_dim: int = 0):
    """The ring kernel of `plan` (from `ring_plan(collective="scatter", ...)`, used as given).
    scatter_dim=0: lhs [M, K_local] row blocks fetched by step-driven BlockSpecs. Bidirectional
    splits the n output columns in two halves travelling opposite ways (n must be even)."""
    m, k = lhs.shape
    n = rhs.shape[1]
    size = plan.num_devices
    if scatter_dim == 1 and plan.bidirectional and (n // size) % 2:
        raise NotImplementedError(f"mosaic_tpu: bidirectional scatter_dim=1 splits each device's {n // size} output "
                                  f"columns in halves and needs an even count; pass bidirectional=False")
    if scatter_dim == 0 and plan.bidirectional and n % 2:
        raise NotImplementedError(f"mosaic_tpu: bidirectional matmul_reduce_scatter splits the {n} output "
                                  f"columns in halves and needs an even count; pass bidirectional=False")
    _require_double_buffering(plan, "matmul_reduce_scatter")
    whole = lambda t, me_ref, tab_ref: (0, 0)   # noqa: E731
    streams = len(plan.directions)
    if scatter_dim == 1:   # column blocks of rhs are the step-driven operand (halves when bidirectional)
        width = n // size // streams
        columns = (slice(0, width), slice(width, None))[:streams]
        # A half narrower than whole 128-lane tiles cannot be a block of its own: each stream
        # then fetches the device's whole column block and multiplies its half of it.
        whole_blocks = streams == 2 and width % LANES != 0
        fetched = 2 * width if whole_blocks else width

        def column_block(half, direction):
            block = _source_block(plan, direction)
            if whole_blocks:
                return lambda t, me_ref, tab_ref: (0, block(t, me_ref, tab_ref)[0])
            return lambda t, me_ref, tab_ref: (0, streams * block(t, me_ref, tab_ref)[0] + half)
        lhs_specs = [pl.BlockSpec((m, k), whole)] * streams
        rhs_specs = [pl.BlockSpec((k, fetched), column_block(i, d)) for i, d in enumerate(plan.directions)]
        rhs_columns = columns if whole_blocks else (None,) * streams
        acc_shape, out_shape = (m, width), (m, n // size)
    else:                  # row blocks of lhs are step-driven; the columns split in halves when bidirectional
        mb, width = m // size, n // streams
        columns = (slice(0, width), slice(width, None))[:streams]
        lhs_specs = [pl.BlockSpec((mb, k), _source_block(plan, d)) for d in plan.directions]
        # rhs is fetched once, whole; each stream multiplies its columns of it (a block of half
        # the columns would need n / 2 to be whole 128-lane tiles).
        rhs_specs = [pl.BlockSpec((k, n), whole)]
        rhs_columns = columns
        acc_shape, out_shape = (mb, width), (mb, n)
    shared_rhs = scatter_dim == 0
    kernel = functools.partial(_scatter_kernel, columns=columns, shared_rhs=shared_rhs,
                               rhs_columns=rhs_columns)
    return _kernel_call(
        kernel, plan,
        axis=axis_name, name="conveyor_matmul_reduce_scatter",
        args=(lhs,) * streams + (rhs,) * (1 if shared_rhs else streams),
        in_specs=lhs_specs + rhs_specs, out_shape=out_shape, out_spec=pl.BlockSpec(out_shape, whole),
        scratch=_stream_scratch(plan, acc_shape, jnp.float32), interpret=interpret,
        cost=_ring_cost(plan, m // size if scatter_dim == 0 else m, k,
                        n if scatter_dim == 0 else n // size, lhs, rhs, out_shape),
        product=acc_shape).astype(out_dtype)
