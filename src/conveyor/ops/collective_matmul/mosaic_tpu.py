"""Mosaic TPU ring kernels with credits: all_gather_matmul (gather_dim 1 and 0) and
matmul_reduce_scatter (scatter_dim 0 and 1), each unidirectional or bidirectional.

Two levels, both plans:
- **The ring** (outer): the kernel runs the ring plan's records (`RingPlan.steps()`), which it
  reads at run time from a table in SMEM (`RingPlan.step_table()`, scalar-prefetched): at grid step
  t, each operation of `RingPlan.phases()` (receive, send, compute, ...) runs for each stream whose
  record enables it. The same records are the event program the checker explores and the
  simulator times. So both directions of a bidirectional ring are in flight at once (each phase
  runs for both streams before the next phase); a reduce-scatter send is awaited at the next step,
  after that step's partial product, so a hop overlaps the matmul; block indices (which shard,
  which output block) come from the records' `source` offsets.
- **The blocks** (inner): operands, the output and the ring's receive slots stay in HBM; each
  compute (and each reduce-scatter accumulate) is a `cv.emit_pipeline` over VMEM blocks of at most
  `RingBlocks` (512 x 512 x 512 by default). VMEM holds only those blocks, so the kernels compile
  whatever the shard size (a collective matmul exists for shards too big for VMEM).

The slots (and a reduce-scatter's partial products) are extra HBM outputs of the pallas_call,
dropped afterwards: every device allocates them at the same place, so a neighbour's remote copy
lands in them. Flow control: a device writes into its downstream neighbour's slot only after that
neighbour granted a credit on the sender's capacity semaphore; `credit_balance()` is zero, so every
semaphore is back to zero at the end. Receive and send semaphores are per slot.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor.cost import matmul_cost, nbytes, shape_bytes
from conveyor.interpreters import tpu_params
from conveyor.kernel import KernelContext, entered_kernel
from conveyor.pipeline.api import emit_pipeline
from conveyor.pipeline.lowering import issued
from conveyor.plans.ring import ENABLED_BY, RingPlan
from conveyor.spmd import out_struct
from conveyor.tpu_vmem import vmem_limit

# The slot each operation is reported with (conformance).
SLOT_FIELD = {"receive": "slot", "send": "send_slot", "compute": "slot", "accumulate": "slot",
              "finish_send": "awaits_slot", "grant": "slot", "store": "slot"}

LANES = 128


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingBlocks:
    """The largest VMEM blocks of a ring kernel's inner pipelines: `rows` x `depth` of the lhs,
    `depth` x `cols` of the rhs, `rows` x `cols` of the float32 output. Each dimension takes the
    largest divisor of the array's that is at most this and a whole number of (sublane, lane)
    tiles; the whole dimension when none is."""
    rows: int = 512
    cols: int = 512
    depth: int = 512

    def __post_init__(self):
        for name in ("rows", "cols", "depth"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RingBlocks: {name} must be an int >= 1, got {v!r}")


def _sublanes(dtype) -> int:
    """Rows of one native VMEM tile of `dtype` (8 for 32-bit, 16 for 16-bit, ...)."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _block(dim: int, at_most: int, align: int) -> int:
    """The largest divisor of `dim` that is a multiple of `align` and at most `at_most`; `dim`
    itself when there is none (a whole dimension is always a valid block)."""
    for size in range(min(dim, at_most) // align * align, 0, -align):
        if dim % size == 0:
            return size
    return dim


def _matmul_blocks(a, b, blocks: RingBlocks) -> tuple[int, int, int]:
    """(rows, cols, depth) of the blocks of `a @ b`."""
    (n, k), m = a.shape, b.shape[1]
    return (_block(n, blocks.rows, _sublanes(a.dtype)), _block(m, blocks.cols, LANES),
            _block(k, blocks.depth, LANES))


def _matmul(a_ref, b_ref, out_ref, *, blocks: RingBlocks, add=False) -> None:
    """out = a @ b in float32, or out + a @ b where `add` (a traced bool) holds: a pipeline over
    (row block, column block, depth block), each output block resident over its depth blocks."""
    bn, bm, bk = _matmul_blocks(a_ref, b_ref, blocks)
    (n, k), m = a_ref.shape, b_ref.shape[1]
    accumulates = add is not False
    out_spec = pl.BlockSpec((bn, bm), lambda i, j, kk: (i, j))

    def body(indices, a, b, *rest):
        previous, out = rest if accumulates else (None, rest[0])

        @pl.when(indices[2] == 0)
        def _():
            out[...] = jnp.where(add, previous[...], 0.0) if accumulates else jnp.zeros_like(out)

        out[...] += jnp.dot(a[...], b[...], preferred_element_type=jnp.float32)

    in_specs = [pl.BlockSpec((bn, bk), lambda i, j, kk: (i, kk)), pl.BlockSpec((bk, bm), lambda i, j, kk: (kk, j))]
    operands = (a_ref, b_ref) + ((out_ref,) if accumulates else ())
    emit_pipeline(body, grid=(n // bn, m // bm, k // bk), in_specs=in_specs + [out_spec] * accumulates,
                  out_specs=[out_spec])(*operands, out_ref)


def _add_into(acc_ref, partial_ref, *, blocks: RingBlocks, add) -> None:
    """acc = acc + partial where `add` (traced) holds, else acc = partial: a pipeline over blocks."""
    rows, cols = acc_ref.shape
    spec = pl.BlockSpec((_block(rows, blocks.rows, 8), _block(cols, blocks.cols, LANES)), lambda i, j: (i, j))

    def body(indices, acc, partial, out):
        out[...] = jnp.where(add, acc[...], 0.0) + partial[...]

    emit_pipeline(body, grid=(rows // spec.block_shape[0], cols // spec.block_shape[1]), in_specs=[spec, spec],
                  out_specs=[spec])(acc_ref, partial_ref, acc_ref)


def _matmul_vmem(a_shape, a_dtype, b_shape, b_dtype, blocks: RingBlocks, accumulates: bool) -> int:
    """VMEM of `_matmul`'s pipeline: two slots per operand block, the float32 output block (and
    the previous output's when accumulating), and one float32 product."""
    a = jax.ShapeDtypeStruct(a_shape, a_dtype)
    bn, bm, bk = _matmul_blocks(a, jax.ShapeDtypeStruct(b_shape, b_dtype), blocks)
    out = shape_bytes((bn, bm), jnp.float32)
    return 2 * (shape_bytes((bn, bk), a_dtype) + shape_bytes((bk, bm), b_dtype)) + 2 * out * (1 + accumulates) + out


def _add_vmem(shape, blocks: RingBlocks) -> int:
    """VMEM of `_add_into`'s pipeline: two slots of each of its three float32 blocks, one sum."""
    block = (_block(shape[0], blocks.rows, 8), _block(shape[1], blocks.cols, LANES))
    return 7 * shape_bytes(block, jnp.float32)


@dataclasses.dataclass(frozen=True)
class _Stream:
    """One direction's receive slots (HBM) and semaphores on this device, and its neighbours."""
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


def _streams(plan: RingPlan, me_ref, axis, slots, sems) -> dict[str, _Stream]:
    """The plan's streams, in `directions` order, from their slot refs and (send, recv, cap) semaphores."""
    size = plan.num_devices
    me = me_ref[0]
    left, right = lax.rem(me + size - 1, size), lax.rem(me + 1, size)
    ends = {"right": (right, left), "left": (left, right)}   # (downstream, upstream)
    return {d: _Stream(d, slots[i], *sems[3 * i:3 * i + 3], *ends[d], axis) for i, d in enumerate(plan.directions)}


def _run_step(plan: RingPlan, tab_ref, streams: dict[str, _Stream], work: dict[str, Callable]) -> None:
    """Grid step t: every operation of `plan.phases()`, for each stream, where its record enables it.
    Ring transfers are common; `work[op](stream, field)` emits the kernel's own operations
    (compute, accumulate, store), run only where the record enables them."""
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
            elif op in work:
                work[op](s, field)


def _source(plan: RingPlan, me_ref, field):
    """The device whose shard (gather) or block (scatter) the record's `source` offset names."""
    return lax.rem(me_ref[0] + field("source") + 2 * plan.num_devices, plan.num_devices)


def _copy(src, dst, sem) -> None:
    """A local DMA, awaited."""
    c = pltpu.make_async_copy(src, dst, sem)
    c.start()
    c.wait()


def _gather_kernel(me_ref, tab_ref, lhs_hbm, rhs_hbm, out_ref, *refs, plan: RingPlan, axis, gather_dim: int,
                   blocks: RingBlocks, interpret):
    """Shards travel through the slots; each computing record multiplies its slot's shard by rhs.
    gather_dim=1: out += shard @ (the source's K-block of rhs); gather_dim=0: the output's row
    block of the source device = shard @ rhs.

    refs: the slots (one HBM output per stream), then per stream: send semaphores, receive
    semaphores, capacity semaphore; then the semaphore of the local copy."""
    k = len(plan.directions)
    slots, sems, local_sem = refs[:k], refs[k:-1], refs[-1]
    n, kd = lhs_hbm.shape
    with entered_kernel(KernelContext(backend="mosaic_tpu", interpret=interpret, grid=(plan.num_steps,))):
        streams = _streams(plan, me_ref, axis, slots, sems)

        @pl.when(pl.program_id(0) == 0)
        def _():
            for s in streams.values():
                _copy(lhs_hbm, s.bufs.at[0], local_sem)
            for d, s in streams.items():
                if plan.initial_credits(d):
                    s.grant(plan.initial_credits(d))

        def compute(s, field):
            src = _source(plan, me_ref, field)
            shard = s.bufs.at[field("slot")]
            if gather_dim == 1:   # step 0 computes on one stream only: it starts the sum
                rhs = rhs_hbm.at[pl.ds(pl.multiple_of(src * kd, kd), kd)]
                _matmul(shard, rhs, out_ref, blocks=blocks, add=pl.program_id(0) > 0)
            else:
                _matmul(shard, rhs_hbm, out_ref.at[pl.ds(pl.multiple_of(src * n, n), n)], blocks=blocks)

        _run_step(plan, tab_ref, streams, {"compute": compute})


def _scatter_kernel(me_ref, tab_ref, lhs_hbm, rhs_hbm, out_ref, *refs, plan: RingPlan, axis, scatter_dim: int,
                    blocks: RingBlocks, interpret):
    """Accumulators travel, one stream per column range: at each step a stream's partial product
    for the block at its record's `source` goes into its partial buffer (before the transfers are
    awaited), is added into the accumulator that arrived and sent on; the last step stores it.

    refs: per stream the slots, then per stream the partial buffer (HBM outputs), then per stream:
    send semaphores, receive semaphores, capacity semaphore; then the semaphore of the store."""
    k = len(plan.directions)
    slots, partials, sems, local_sem = refs[:k], refs[k:2 * k], refs[2 * k:-1], refs[-1]
    acc_rows, width = partials[0].shape
    size = plan.num_devices
    cols_per_device = rhs_hbm.shape[1] // size   # scatter_dim=1
    assert all(r.computes for records in plan.steps() for r in records), "a scatter step without a partial"
    with entered_kernel(KernelContext(backend="mosaic_tpu", interpret=interpret, grid=(plan.num_steps,))):
        streams = _streams(plan, me_ref, axis, slots, sems)
        index = {d: i for i, d in enumerate(plan.directions)}

        @pl.when(pl.program_id(0) == 0)
        def _():
            for d, s in streams.items():
                if plan.initial_credits(d):
                    s.grant(plan.initial_credits(d))

        def compute(s, field):
            src, i = _source(plan, me_ref, field), index[s.direction]
            if scatter_dim == 0:   # the source's row block of lhs, this stream's columns of rhs
                lhs = lhs_hbm.at[pl.ds(pl.multiple_of(src * acc_rows, acc_rows), acc_rows)]
                rhs = rhs_hbm.at[:, pl.ds(i * width, width)]
            else:                  # lhs whole, this stream's part of the source's column block
                lhs = lhs_hbm
                rhs = rhs_hbm.at[:, pl.ds(src * cols_per_device + i * width, width)]
            _matmul(lhs, rhs, partials[i], blocks=blocks)

        def accumulate(s, field):
            _add_into(s.bufs.at[field("slot")], partials[index[s.direction]], blocks=blocks,
                      add=field("receives") == 1)

        def store(s, field):
            _copy(s.bufs.at[field("slot")], out_ref.at[:, pl.ds(index[s.direction] * width, width)], local_sem)

        _run_step(plan, tab_ref, streams, {"compute": compute, "accumulate": accumulate, "store": store})


def _semaphores(plan: RingPlan) -> list:
    """Per stream: send and receive DMA semaphores per slot, a capacity semaphore; then one for local copies."""
    one = [pltpu.SemaphoreType.DMA((plan.buffering,)), pltpu.SemaphoreType.DMA((plan.buffering,)),
           pltpu.SemaphoreType.REGULAR]
    return one * len(plan.directions) + [pltpu.SemaphoreType.DMA]


def _kernel_call(kernel, plan: RingPlan, *, axis, name, lhs, rhs, outs, vmem: int, interpret, cost):
    """The pallas_call of a ring kernel: one grid step per plan step, the device's ring position and
    the plan's table scalar-prefetched, every operand and output in HBM. `outs[0]` is the result;
    the others are the kernel's HBM buffers (slots, partials), dropped. Its VMEM limit is raised
    when the chip's default is too small for `vmem` bytes, and a kernel that cannot fit the chip's
    VMEM is refused (`tpu_vmem.vmem_limit`)."""
    limit = vmem_limit(name, working=vmem, peak=vmem,
                       remedy="use smaller RingBlocks, or shards whose dimensions have divisors that are "
                              "multiples of 128, or backend='xla'")
    me = lax.axis_index(axis).astype(jnp.int32)[None]
    table = jnp.asarray(plan.step_table(), jnp.int32)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        functools.partial(kernel, plan=plan, axis=axis, interpret=interpret),
        out_shape=tuple(out_struct(shape, dtype, lhs, rhs) for shape, dtype in outs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(plan.num_steps,), in_specs=[anywhere, anywhere],
            out_specs=[anywhere] * len(outs), scratch_shapes=_semaphores(plan)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), has_side_effects=True,
                                             vmem_limit_bytes=limit),
        cost_estimate=cost,
        interpret=tpu_params(interpret),
        name=name)
    return call(me, table, lhs, rhs)[0]


def _ring_cost(plan: RingPlan, rows: int, k: int, cols: int, lhs, rhs, out_shape):
    """One device's work: a [rows, k] x [k, cols] product per ring step (each step multiplies one
    shard or block), its operands read once and its float32 output written once."""
    out = jax.ShapeDtypeStruct(out_shape, jnp.float32)
    one_step = matmul_cost(rows, k, cols)
    return pl.CostEstimate(flops=plan.num_devices * one_step.flops, transcendentals=0,
                           bytes_accessed=nbytes(lhs, rhs, out))


def _require_double_buffering(plan: RingPlan, op: str) -> None:
    if plan.buffering < 2 and plan.num_devices > 1:
        raise NotImplementedError(f"mosaic_tpu: {op} needs buffering >= 2 (one slot computes while the next "
                                  f"shard lands; with one, every device waits for a credit: cv.sim.check shows "
                                  f"the deadlock), got buffering={plan.buffering}")


def all_gather_matmul_mosaic_tpu(lhs, rhs, *, axis_name, plan: RingPlan, out_dtype, interpret,
                                 gather_dim: int = 1, blocks: RingBlocks = RingBlocks()):
    """The ring kernel of `plan` (from `ring_plan(collective="gather", ...)`, used as given)."""
    _require_double_buffering(plan, "all_gather_matmul")
    n, kd = lhs.shape
    m = rhs.shape[1]
    out_shape = (n, m) if gather_dim == 1 else (plan.num_devices * n, m)
    slots = [((plan.buffering, n, kd), lhs.dtype)] * len(plan.directions)
    vmem = _matmul_vmem((n, kd), lhs.dtype, (kd, m), rhs.dtype, blocks, accumulates=gather_dim == 1)
    return _kernel_call(
        functools.partial(_gather_kernel, gather_dim=gather_dim, blocks=blocks), plan, axis=axis_name,
        name="conveyor_all_gather_matmul", lhs=lhs, rhs=rhs, outs=[(out_shape, jnp.float32)] + slots, vmem=vmem,
        interpret=interpret, cost=_ring_cost(plan, n, kd, m, lhs, rhs, out_shape)).astype(out_dtype)


def matmul_reduce_scatter_mosaic_tpu(lhs, rhs, *, axis_name, plan: RingPlan, out_dtype, interpret,
                                     scatter_dim: int = 0, blocks: RingBlocks = RingBlocks()):
    """The ring kernel of `plan` (from `ring_plan(collective="scatter", ...)`, used as given).
    scatter_dim=0: device d ends with row block d of lhs @ rhs; scatter_dim=1: column block d.
    Bidirectional splits each accumulator's columns in two halves travelling opposite ways (the
    column count must be even)."""
    m, k = lhs.shape
    n = rhs.shape[1]
    size = plan.num_devices
    streams = len(plan.directions)
    if scatter_dim == 1 and plan.bidirectional and (n // size) % 2:
        raise NotImplementedError(f"mosaic_tpu: bidirectional scatter_dim=1 splits each device's {n // size} output "
                                  f"columns in halves and needs an even count; pass bidirectional=False")
    if scatter_dim == 0 and plan.bidirectional and n % 2:
        raise NotImplementedError(f"mosaic_tpu: bidirectional matmul_reduce_scatter splits the {n} output "
                                  f"columns in halves and needs an even count; pass bidirectional=False")
    _require_double_buffering(plan, "matmul_reduce_scatter")
    if scatter_dim == 0:
        rows, out_shape = m // size, (m // size, n)
    else:
        rows, out_shape = m, (m, n // size)
    width = out_shape[1] // streams
    acc = (rows, width)
    buffers = [((plan.buffering, *acc), jnp.float32)] * streams + [(acc, jnp.float32)] * streams
    vmem = max(_matmul_vmem((rows, k), lhs.dtype, (k, width), rhs.dtype, blocks, accumulates=False),
               _add_vmem(acc, blocks))
    return _kernel_call(
        functools.partial(_scatter_kernel, scatter_dim=scatter_dim, blocks=blocks), plan, axis=axis_name,
        name="conveyor_matmul_reduce_scatter", lhs=lhs, rhs=rhs, outs=[(out_shape, jnp.float32)] + buffers,
        vmem=vmem, interpret=interpret,
        cost=_ring_cost(plan, rows, k, out_shape[1], lhs, rhs, out_shape)).astype(out_dtype)
