"""Mosaic TPU ring kernels with credits: all_gather_matmul (gather_dim 1 and 0) and
matmul_reduce_scatter (scatter_dim 0 and 1), each unidirectional or bidirectional.

Design notes: docs/internals/collective-matmul.md, section `ops/collective_matmul/mosaic_tpu.py`.
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
from conveyor.plans.ring import (
    ENABLED_BY,
    LANES,
    SLOT_FIELD,
    RingBlocks,
    RingOperation,
    RingPlan,
    sublanes,
)
from conveyor.spmd import out_struct
from conveyor.tpu_vmem import vmem_limit


def _matmul_blocks(
    n: int, k: int, m: int, itemsize: int, blocks: RingBlocks, window: int | None
) -> tuple[int, int, int]:
    """(rows, cols, depth) blocks of an [n, k] @ [k, m] product; with a `window`, the rhs is
    fetched `window` columns at a time (the whole window) and its m columns sliced in VMEM."""
    bn, bm, bk = blocks.for_matmul(n, k, m, itemsize)
    return (bn, m, bk) if window is not None else (bn, bm, bk)


def _matmul(
    a_ref, b_ref, out_ref, *, blocks: RingBlocks, add=False, b_columns: slice | None = None
) -> None:
    """out = a @ b in float32, or out + a @ b where `add` (a traced bool) holds: a pipeline over
    (row block, column block, depth block), each output block resident over its depth blocks.
    `b_columns`: multiply only these (static) columns of b, sliced from each whole-width block in
    VMEM (for column ranges HBM cannot be sliced at: not whole 128-lane tiles)."""
    (n, k), width = a_ref.shape, b_ref.shape[1]
    m = width if b_columns is None else b_columns.stop - b_columns.start
    bn, bm, bk = _matmul_blocks(
        n, k, m, jnp.dtype(a_ref.dtype).itemsize, blocks, None if b_columns is None else width
    )
    b_block = (bk, bm) if b_columns is None else (bk, width)
    accumulates = add is not False
    out_spec = pl.BlockSpec((bn, bm), lambda i, j, kk: (i, j))

    def body(indices, a, b, *rest):
        previous, out = rest if accumulates else (None, rest[0])

        @pl.when(indices[2] == 0)
        def _():
            out[...] = jnp.where(add, previous[...], 0.0) if accumulates else jnp.zeros_like(out)

        rhs = b[...] if b_columns is None else b[:, b_columns]
        out[...] += jnp.dot(a[...], rhs, preferred_element_type=jnp.float32)

    in_specs = [
        pl.BlockSpec((bn, bk), lambda i, j, kk: (i, kk)),
        pl.BlockSpec(b_block, lambda i, j, kk: (kk, j)),
    ]
    operands = (a_ref, b_ref) + ((out_ref,) if accumulates else ())
    emit_pipeline(
        body,
        grid=(n // bn, m // bm, k // bk),
        in_specs=in_specs + [out_spec] * accumulates,
        out_specs=[out_spec],
        max_concurrent_steps=2,  # the next blocks land while these multiply
    )(*operands, out_ref)


def _add_into(acc_ref, partial_ref, *, blocks: RingBlocks, add) -> None:
    """acc = acc + partial where `add` (traced) holds, else acc = partial: a pipeline over
    blocks."""
    rows, cols = acc_ref.shape
    spec = pl.BlockSpec(blocks.for_sum(rows, cols), lambda i, j: (i, j))

    def body(indices, acc, partial, out):
        out[...] = jnp.where(add, acc[...], 0.0) + partial[...]

    emit_pipeline(
        body,
        grid=(rows // spec.block_shape[0], cols // spec.block_shape[1]),
        in_specs=[spec, spec],
        out_specs=[spec],
        max_concurrent_steps=2,
    )(acc_ref, partial_ref, acc_ref)


def _matmul_vmem(
    n: int,
    k: int,
    m: int,
    a_dtype,
    b_dtype,
    blocks: RingBlocks,
    accumulates: bool,
    window: int | None = None,
) -> int:
    """VMEM of `_matmul`'s pipeline for an [n, k] @ [k, m] product: two slots per operand block,
    the float32 output block (and the previous output's when accumulating), one float32 product."""
    bn, bm, bk = _matmul_blocks(n, k, m, jnp.dtype(a_dtype).itemsize, blocks, window)
    out = shape_bytes((bn, bm), jnp.float32)
    b_block = (bk, bm if window is None else window)
    return (
        2 * (shape_bytes((bn, bk), a_dtype) + shape_bytes(b_block, b_dtype))
        + 2 * out * (1 + accumulates)
        + out
    )


def _add_vmem(shape, blocks: RingBlocks) -> int:
    """VMEM of `_add_into`'s pipeline: two slots of each of its three float32 blocks, one sum."""
    return 7 * shape_bytes(blocks.for_sum(*shape), jnp.float32)


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
        return pltpu.make_async_remote_copy(
            self.bufs.at[src_slot],
            self.bufs.at[dst_slot],
            self.send.at[src_slot],
            self.recv.at[dst_slot],
            device_id={self.axis: self.downstream},
        )

    def grant(self, credits):
        pl.semaphore_signal(self.cap, credits, device_id={self.axis: self.upstream})


def _streams(plan: RingPlan, me_ref, axis, slots, sems) -> dict[str, _Stream]:
    """The plan's streams, in `directions` order, from their slot refs and (send, recv, cap)
    semaphores."""
    size = plan.num_devices
    me = me_ref[0]
    left, right = lax.rem(me + size - 1, size), lax.rem(me + 1, size)
    ends = {"right": (right, left), "left": (left, right)}  # (downstream, upstream)
    return {
        d: _Stream(d, slots[i], *sems[3 * i : 3 * i + 3], *ends[d], axis)
        for i, d in enumerate(plan.directions)
    }


def _run_step(
    plan: RingPlan, tab_ref, streams: dict[str, _Stream], work: dict[str, Callable]
) -> None:
    """Grid step t: every operation of `plan.phases()`, for each stream, where its record enables
    it.
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
            issued(RingOperation, op, s.direction, step=t, slot=field(SLOT_FIELD[op]))
            if op == "receive":
                s.copy(field("slot"), field("slot")).wait_recv()
            elif op == "send":
                pl.semaphore_wait(s.cap, 1)  # the downstream slot is free
                s.copy(field("slot"), field("send_slot")).start()
            elif op == "finish_send":
                awaited = field("awaits_slot")
                s.copy(awaited, lax.rem(awaited + 1, plan.buffering)).wait_send()
            # the slot is free and the upstream neighbour will send into it again
            elif op == "grant":
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


def _gather_kernel(
    me_ref,
    tab_ref,
    lhs_hbm,
    rhs_hbm,
    out_ref,
    *refs,
    plan: RingPlan,
    axis,
    gather_dim: int,
    blocks: RingBlocks,
    interpret,
):
    """Shards travel through the slots; each computing record multiplies its slot's shard by rhs.
    gather_dim=1: out += shard @ (the source's K-block of rhs); gather_dim=0: the output's row
    block of the source device = shard @ rhs.

    refs: the slots (one HBM output per stream), then per stream: send semaphores, receive
    semaphores, capacity semaphore; then the semaphore of the local copy."""
    k = len(plan.directions)
    slots, sems, local_sem = refs[:k], refs[k:-1], refs[-1]
    n, kd = lhs_hbm.shape
    with entered_kernel(
        KernelContext(backend="mosaic_tpu", interpret=interpret, grid=(plan.num_steps,))
    ):
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
            if gather_dim == 1:  # step 0 computes on one stream only: it starts the sum
                rhs = rhs_hbm.at[pl.ds(pl.multiple_of(src * kd, kd), kd)]
                _matmul(shard, rhs, out_ref, blocks=blocks, add=pl.program_id(0) > 0)
            else:
                _matmul(
                    shard, rhs_hbm, out_ref.at[pl.ds(pl.multiple_of(src * n, n), n)], blocks=blocks
                )

        _run_step(plan, tab_ref, streams, {"compute": compute})


@dataclasses.dataclass(frozen=True)
class _Window:
    """Where a reduce-scatter stream's rhs columns come from: the HBM window of `size` columns
    starting at column `per_device * source + offset`, of which the `inner` ones (None: all) are
    multiplied. HBM is sliced only in whole 128-lane tiles (or not at all)."""

    per_device: int
    offset: int
    size: int
    inner: slice | None


def _windows(scatter_dim: int, n: int, size: int, streams: int) -> tuple[_Window, ...] | None:
    """Each stream's rhs window (stream i multiplies the i-th of `streams` equal column ranges of
    the output block), or None when HBM cannot be sliced there."""
    out_cols = n // size if scatter_dim == 1 else n
    width, per_device = out_cols // streams, (out_cols if scatter_dim == 1 else 0)

    def sliceable(w: _Window) -> bool:
        whole = w.size == n and w.per_device == 0 and w.offset == 0
        return whole or all(v % LANES == 0 for v in (w.size, w.per_device, w.offset))

    out = []
    for i in range(streams):
        # the block's
        candidates = [
            _Window(per_device, i * width, width, None),  # the stream's own columns
            _Window(per_device, 0, out_cols, slice(i * width, (i + 1) * width)),
        ]
        if scatter_dim == 0:  # all of rhs, its columns sliced in VMEM
            candidates.append(_Window(0, 0, n, slice(i * width, (i + 1) * width)))
        chosen = next((w for w in candidates if sliceable(w)), None)
        if chosen is None:
            return None
        out.append(chosen)
    return tuple(out)


def _scatter_kernel(
    me_ref,
    tab_ref,
    lhs_hbm,
    rhs_hbm,
    out_ref,
    *refs,
    plan: RingPlan,
    axis,
    scatter_dim: int,
    windows: tuple[_Window, ...],
    blocks: RingBlocks,
    interpret,
):
    """Accumulators travel, one stream per column range: at each step a stream's partial product
    for the block at its record's `source` goes into its partial buffer (before the transfers are
    awaited), is added into the accumulator that arrived and sent on; the last step stores it into
    the stream's part of the output ([streams, rows, width]).

    refs: per stream the slots, then per stream the partial buffer (HBM outputs), then per stream:
    send semaphores, receive semaphores, capacity semaphore; then the semaphore of the store."""
    k = len(plan.directions)
    slots, partials, sems, local_sem = refs[:k], refs[k : 2 * k], refs[2 * k : -1], refs[-1]
    acc_rows = partials[0].shape[0]
    assert all(r.computes for records in plan.steps() for r in records), (
        "a scatter step without a partial"
    )
    with entered_kernel(
        KernelContext(backend="mosaic_tpu", interpret=interpret, grid=(plan.num_steps,))
    ):
        streams = _streams(plan, me_ref, axis, slots, sems)
        index = {d: i for i, d in enumerate(plan.directions)}

        @pl.when(pl.program_id(0) == 0)
        def _():
            for d, s in streams.items():
                if plan.initial_credits(d):
                    s.grant(plan.initial_credits(d))

        def compute(s, field):
            src, i = _source(plan, me_ref, field), index[s.direction]
            # scatter_dim=0: the source's row block of lhs; scatter_dim=1: all of lhs
            lhs = (
                lhs_hbm.at[pl.ds(pl.multiple_of(src * acc_rows, acc_rows), acc_rows)]
                if scatter_dim == 0
                else lhs_hbm
            )
            w = windows[i]
            if w.size == rhs_hbm.shape[1]:
                rhs = rhs_hbm
            else:
                rhs = rhs_hbm.at[
                    :, pl.ds(pl.multiple_of(src * w.per_device + w.offset, LANES), w.size)
                ]
            _matmul(lhs, rhs, partials[i], blocks=blocks, b_columns=w.inner)

        def accumulate(s, field):
            _add_into(
                s.bufs.at[field("slot")],
                partials[index[s.direction]],
                blocks=blocks,
                add=field("receives") == 1,
            )

        def store(s, field):
            _copy(s.bufs.at[field("slot")], out_ref.at[index[s.direction]], local_sem)

        _run_step(
            plan, tab_ref, streams, {"compute": compute, "accumulate": accumulate, "store": store}
        )


def _check_rows(kernel: str, what: str, rows: int, dtype, plan: RingPlan) -> None:
    """A row block sliced out of HBM at a device's offset must be whole (sublane, 128) tiles."""
    tile = sublanes(jnp.dtype(dtype).itemsize)
    if plan.num_devices > 1 and rows % tile:
        raise NotImplementedError(
            f"{kernel}: mosaic_tpu slices {what} out of HBM in blocks of {rows} rows per device; "
            f"Mosaic TPU slices HBM of {jnp.dtype(dtype).name} in whole tiles of {tile} rows: use "
            f"per-device shards whose row count is a multiple of {tile}, or backend='xla'"
        )


def _semaphores(plan: RingPlan) -> list:
    """Per stream: send and receive DMA semaphores per slot, a capacity semaphore; then one for
    local copies."""
    one = [
        pltpu.SemaphoreType.DMA((plan.buffering,)),
        pltpu.SemaphoreType.DMA((plan.buffering,)),
        pltpu.SemaphoreType.REGULAR,
    ]
    return one * len(plan.directions) + [pltpu.SemaphoreType.DMA]


def _kernel_call(kernel, plan: RingPlan, *, axis, name, lhs, rhs, outs, vmem: int, interpret, cost):
    """The pallas_call of a ring kernel: one grid step per plan step, the device's ring position and
    the plan's table scalar-prefetched, every operand and output in HBM. `outs[0]` is the result;
    the others are the kernel's HBM buffers (slots, partials), dropped. Its VMEM limit is raised
    when the chip's default is too small for `vmem` bytes, and a kernel that cannot fit the chip's
    VMEM is refused (`tpu_vmem.vmem_limit`)."""
    limit = vmem_limit(
        name,
        working=vmem,
        peak=vmem,
        remedy=(
            "use smaller RingBlocks, or shards whose dimensions have divisors that are multiples "
            "of 128, or backend='xla'"
        ),
    )
    me = lax.axis_index(axis).astype(jnp.int32)[None]
    table = jnp.asarray(plan.step_table(), jnp.int32)
    anywhere = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        functools.partial(kernel, plan=plan, axis=axis, interpret=interpret),
        out_shape=tuple(out_struct(shape, dtype, lhs, rhs) for shape, dtype in outs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(plan.num_steps,),
            in_specs=[anywhere, anywhere],
            out_specs=[anywhere] * len(outs),
            scratch_shapes=_semaphores(plan),
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), has_side_effects=True, vmem_limit_bytes=limit
        ),
        cost_estimate=cost,
        interpret=tpu_params(interpret),
        name=name,
    )
    return call(me, table, lhs, rhs)[0]


def _ring_cost(plan: RingPlan, rows: int, k: int, cols: int, lhs, rhs, out_shape):
    """One device's work: a [rows, k] x [k, cols] product per ring step (each step multiplies one
    shard or block), its operands read once and its float32 output written once."""
    out = jax.ShapeDtypeStruct(out_shape, jnp.float32)
    one_step = matmul_cost(rows, k, cols)
    return pl.CostEstimate(
        flops=plan.num_devices * one_step.flops,
        transcendentals=0,
        bytes_accessed=nbytes(lhs, rhs, out),
    )


def _require_double_buffering(plan: RingPlan, op: str) -> None:
    if plan.buffering < 2 and plan.num_devices > 1:
        raise NotImplementedError(
            f"mosaic_tpu: {op} needs buffering >= 2 (one slot computes while the next shard lands; "
            "with one, every device waits for a credit: cv.sim.check shows the deadlock), got "
            f"buffering={plan.buffering}"
        )


def all_gather_matmul_mosaic_tpu(
    lhs,
    rhs,
    *,
    axis_name,
    plan: RingPlan,
    out_dtype,
    interpret,
    gather_dim: int = 1,
    blocks: RingBlocks = RingBlocks(),
):
    """The ring kernel of `plan` (from `ring_plan(collective="gather", ...)`, used as given)."""
    _require_double_buffering(plan, "all_gather_matmul")
    n, kd = lhs.shape
    m = rhs.shape[1]
    out_shape = (n, m) if gather_dim == 1 else (plan.num_devices * n, m)
    if gather_dim == 1:
        _check_rows("all_gather_matmul", "rhs (each shard's K-block)", kd, rhs.dtype, plan)
    else:
        _check_rows(
            "all_gather_matmul", "the float32 output (each shard's row block)", n, jnp.float32, plan
        )
    slots = [((plan.buffering, n, kd), lhs.dtype)] * len(plan.directions)
    vmem = _matmul_vmem(n, kd, m, lhs.dtype, rhs.dtype, blocks, accumulates=gather_dim == 1)
    return _kernel_call(
        functools.partial(_gather_kernel, gather_dim=gather_dim, blocks=blocks),
        plan,
        axis=axis_name,
        name="conveyor_all_gather_matmul",
        lhs=lhs,
        rhs=rhs,
        outs=[(out_shape, jnp.float32)] + slots,
        vmem=vmem,
        interpret=interpret,
        cost=_ring_cost(plan, n, kd, m, lhs, rhs, out_shape),
    ).astype(out_dtype)


def matmul_reduce_scatter_mosaic_tpu(
    lhs,
    rhs,
    *,
    axis_name,
    plan: RingPlan,
    out_dtype,
    interpret,
    scatter_dim: int = 0,
    blocks: RingBlocks = RingBlocks(),
):
    """The ring kernel of `plan` (from `ring_plan(collective="scatter", ...)`, used as given).
    scatter_dim=0: device d ends with row block d of lhs @ rhs; scatter_dim=1: column block d.
    Bidirectional splits each accumulator's columns in two halves travelling opposite ways (the
    column count must be even)."""
    m, k = lhs.shape
    n = rhs.shape[1]
    size = plan.num_devices
    streams = len(plan.directions)
    if scatter_dim == 1 and plan.bidirectional and (n // size) % 2:
        raise NotImplementedError(
            f"mosaic_tpu: bidirectional scatter_dim=1 splits each device's {n // size} output "
            "columns in halves and needs an even count; pass bidirectional=False"
        )
    if scatter_dim == 0 and plan.bidirectional and n % 2:
        raise NotImplementedError(
            f"mosaic_tpu: bidirectional matmul_reduce_scatter splits the {n} output columns in "
            "halves and needs an even count; pass bidirectional=False"
        )
    _require_double_buffering(plan, "matmul_reduce_scatter")
    if scatter_dim == 0:
        rows, out_cols = m // size, n
        _check_rows("matmul_reduce_scatter", "lhs (each device's row block)", rows, lhs.dtype, plan)
    else:
        rows, out_cols = m, n // size
    windows = _windows(scatter_dim, n, size, streams)
    if windows is None:
        raise NotImplementedError(
            f"matmul_reduce_scatter: mosaic_tpu would slice rhs [{k}, {n}] in HBM at "
            f"{out_cols // streams}-column ranges (each device's {out_cols} output "
            f"columns{' in halves' if streams == 2 else ''}); Mosaic TPU slices HBM in whole "
            "128-lane tiles: use per-device column counts that are multiples of 128, or "
            "backend='xla'"
        )
    width = out_cols // streams
    acc = (rows, width)
    buffers = [((plan.buffering, *acc), jnp.float32)] * streams + [(acc, jnp.float32)] * streams
    vmem = max(
        max(
            _matmul_vmem(
                rows,
                k,
                width,
                lhs.dtype,
                rhs.dtype,
                blocks,
                accumulates=False,
                window=None if w.inner is None else w.size,
            )
            for w in windows
        ),
        _add_vmem(acc, blocks),
    )
    parts = _kernel_call(
        functools.partial(_scatter_kernel, scatter_dim=scatter_dim, windows=windows, blocks=blocks),
        plan,
        axis=axis_name,
        name="conveyor_matmul_reduce_scatter",
        lhs=lhs,
        rhs=rhs,
        outs=[((streams, *acc), jnp.float32)] + buffers,
        vmem=vmem,
        interpret=interpret,
        cost=_ring_cost(plan, rows, k, out_cols, lhs, rhs, (rows, out_cols)),
    )
    # [streams, rows, width] -> [rows, streams * width], fused with the cast by XLA
    return jnp.concatenate(list(parts), axis=1).astype(out_dtype)
