"""Mosaic TPU ring kernels with credits: all_gather_matmul (gather_dim 1 and 0) and
matmul_reduce_scatter (scatter_dim 0 and 1), each unidirectional or bidirectional.

Step t of the grid multiplies the shard of device (me - t) by the matching K-block of the
stationary rhs, which a BlockSpec driven by the step fetches. Shards travel right through
`buffering` receive slots per device. Flow control: a device may write into its right
neighbour's slot only after that neighbour granted a credit on the sender's capacity semaphore.
The schedule (slots, when to send, the credits granted on entry and after each step) comes from
`RingPlan`, whose `credit_balance()` is zero: every semaphore is back to zero at the end.
Receive and send semaphores are per slot, never shared between in-flight transfers.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conveyor._compat import out_struct
from conveyor.plans.ring import RingPlan


def _remote_copy(bufs, send, recv, dst_dev, src_slot, dst_slot, axis):
    """DMA of slot `src_slot` into slot `dst_slot` of the same buffer on the device at ring position
    `dst_dev` along mesh axis `axis` (its other mesh coordinates are this device's own)."""
    return pltpu.make_async_remote_copy(bufs.at[src_slot], bufs.at[dst_slot], send.at[src_slot], recv.at[dst_slot],
                                        device_id={axis: dst_dev})


def _ring_position(me_ref, plan: RingPlan):
    """(step, left neighbour, right neighbour, this step's slot, next step's slot)."""
    size = plan.num_devices
    t = pl.program_id(0)
    me = me_ref[0]
    return t, lax.rem(me + size - 1, size), lax.rem(me + 1, size), plan.slot(t), plan.slot(t + 1)


def _kernel(me_ref, lhs_hbm, rhs_blk, out_ref, bufs, send_sems, recv_sems, cap_sem, local_sem, *, plan: RingPlan,
            axis, accumulate: bool = True):
    """accumulate=True (gather_dim=1): out += shard @ K-block. False (gather_dim=0): the step's
    output row block (chosen by the out BlockSpec) = shard @ rhs."""
    t, left, right, slot, nxt = _ring_position(me_ref, plan)

    def transfer(src_slot, dst_slot):
        return _remote_copy(bufs, send_sems, recv_sems, right, src_slot, dst_slot, axis)

    @pl.when(t == 0)
    def _():
        local = pltpu.make_async_copy(lhs_hbm, bufs.at[0], local_sem)
        local.start()
        local.wait()
        if accumulate:
            out_ref[...] = jnp.zeros_like(out_ref)
        if plan.initial_credits():
            pl.semaphore_signal(cap_sem, plan.initial_credits(), device_id={axis: left})

    @pl.when(t > 0)
    def _():
        transfer(slot, slot).wait_recv()   # the shard of device me - t has landed in `slot`

    @pl.when(plan.sends_at(t))
    def _():
        pl.semaphore_wait(cap_sem, 1)   # the right neighbour's slot `nxt` is free
        transfer(slot, nxt).start()

    if accumulate:
        out_ref[...] += jnp.dot(bufs[slot], rhs_blk[...], preferred_element_type=jnp.float32)
    else:
        out_ref[...] = jnp.dot(bufs[slot], rhs_blk[...], preferred_element_type=jnp.float32)

    @pl.when(plan.sends_at(t))
    def _():
        transfer(slot, nxt).wait_send()

    @pl.when(plan.grants_credit_after(t))
    def _():   # slot is free again and the left neighbour will send into it once more
        pl.semaphore_signal(cap_sem, 1, device_id={axis: left})


def _bidi_kernel(me_ref, lhs_hbm, rhs_r, rhs_l, out_ref, bufs_r, bufs_l, send_r, recv_r, send_l, recv_l,
                 cap_r, cap_l, local_sem, *, plan: RingPlan, axis, rows: int | None = None):
    """Two streams: shards moving right (used at step t: device me - t) and moving left (me + t).

    rows=None (gather_dim=1): out += shard @ K-block. rows=n (gather_dim=0): the whole output
    stays resident and each shard's product fills its own row block (source device * n)."""
    t, left, right, slot, nxt = _ring_position(me_ref, plan)
    size = plan.num_devices

    def emit(src, value):
        if rows is None:
            out_ref[...] += value
        else:
            out_ref[pl.ds(pl.multiple_of(src * rows, rows), rows), :] = value
    streams = (("right", bufs_r, send_r, recv_r, cap_r, right, left, rhs_r),
               ("left", bufs_l, send_l, recv_l, cap_l, left, right, rhs_l))

    @pl.when(t == 0)
    def _():
        for bufs in (bufs_r, bufs_l):
            local = pltpu.make_async_copy(lhs_hbm, bufs.at[0], local_sem)
            local.start()
            local.wait()
        local = jnp.dot(bufs_r[0], rhs_r[...], preferred_element_type=jnp.float32)
        if rows is None:
            out_ref[...] = local
        else:
            emit(me_ref[0], local)
        for direction, _, _, _, cap, _, upstream, _ in streams:
            if plan.initial_credits(direction):
                pl.semaphore_signal(cap, plan.initial_credits(direction), device_id={axis: upstream})

    for direction, bufs, send, recv, cap, downstream, upstream, rhs_blk in streams:
        uses = plan.stream_uses(direction)

        @pl.when((t > 0) & (t <= uses))
        def _():
            _remote_copy(bufs, send, recv, downstream, slot, slot, axis).wait_recv()

        @pl.when(plan.sends_at(t, direction))
        def _():
            pl.semaphore_wait(cap, 1)
            _remote_copy(bufs, send, recv, downstream, slot, nxt, axis).start()

        @pl.when((t > 0) & (t <= uses))
        def _():
            src = lax.rem(me_ref[0] + (size - t if direction == "right" else t), size)
            emit(src, jnp.dot(bufs[slot], rhs_blk[...], preferred_element_type=jnp.float32))

        @pl.when(plan.sends_at(t, direction))
        def _():
            _remote_copy(bufs, send, recv, downstream, slot, nxt, axis).wait_send()

        @pl.when(plan.grants_credit_after(t, direction))
        def _():
            pl.semaphore_signal(cap, 1, device_id={axis: upstream})


def all_gather_matmul_mosaic_tpu(lhs, rhs, *, axis_name, size, plan: RingPlan, out_dtype, interpret,
                                 gather_dim: int = 1):
    n, kd = lhs.shape
    m = rhs.shape[1]
    buffering = max(1, min(plan.buffering, size))
    plan = RingPlan(size, plan.bidirectional and size > 2, buffering)
    if buffering < 2 and size > 1:
        raise NotImplementedError("mosaic_tpu: all_gather_matmul needs buffering >= 2 (one slot computes "
                                  "while the next shard lands)")
    me = lax.axis_index(axis_name).astype(jnp.int32)[None]
    steps = plan.num_gather_steps

    def from_left(t, me_ref):
        return lax.rem(me_ref[0] - t + size, size), 0

    def from_right(t, me_ref):
        return lax.rem(me_ref[0] + t, size), 0

    sems = [pltpu.SemaphoreType.DMA((buffering,)), pltpu.SemaphoreType.DMA((buffering,))]
    if plan.bidirectional and gather_dim == 0:   # output resident in VMEM, rows filled by both streams
        kernel = functools.partial(_bidi_kernel, rows=n)
        stationary = pl.BlockSpec((kd, m), lambda t, me_ref: (0, 0))
        in_specs = [pl.BlockSpec(memory_space=pl.ANY), stationary, stationary]
        scratch = [pltpu.VMEM((buffering, n, kd), lhs.dtype)] * 2 + sems * 2 + \
                  [pltpu.SemaphoreType.REGULAR] * 2 + [pltpu.SemaphoreType.DMA]
        args = (me, lhs, rhs, rhs)
    elif plan.bidirectional:
        kernel = _bidi_kernel
        in_specs = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((kd, m), from_left),
                    pl.BlockSpec((kd, m), from_right)]
        scratch = [pltpu.VMEM((buffering, n, kd), lhs.dtype)] * 2 + sems * 2 + \
                  [pltpu.SemaphoreType.REGULAR] * 2 + [pltpu.SemaphoreType.DMA]
        args = (me, lhs, rhs, rhs)
    elif gather_dim == 0:   # lhs [Mb, K] row shards travel; each step writes output row block me - t
        kernel = functools.partial(_kernel, accumulate=False)
        in_specs = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((kd, m), lambda t, me_ref: (0, 0))]
        scratch = [pltpu.VMEM((buffering, n, kd), lhs.dtype)] + sems + \
                  [pltpu.SemaphoreType.REGULAR, pltpu.SemaphoreType.DMA]
        args = (me, lhs, rhs)
    else:
        kernel = _kernel
        in_specs = [pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec((kd, m), from_left)]
        scratch = [pltpu.VMEM((buffering, n, kd), lhs.dtype)] + sems + \
                  [pltpu.SemaphoreType.REGULAR, pltpu.SemaphoreType.DMA]
        args = (me, lhs, rhs)
    if gather_dim == 0 and plan.bidirectional:
        out_shape, out_spec = (size * n, m), pl.BlockSpec((size * n, m), lambda t, me_ref: (0, 0))
    elif gather_dim == 0:
        out_shape, out_spec = (size * n, m), pl.BlockSpec((n, m), from_left)
    else:
        out_shape, out_spec = (n, m), pl.BlockSpec((n, m), lambda t, me_ref: (0, 0))
    call = pl.pallas_call(
        functools.partial(kernel, plan=plan, axis=axis_name),
        out_shape=out_struct(out_shape, jnp.float32, *args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(steps,), in_specs=in_specs, out_specs=out_spec, scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), has_side_effects=True),
        interpret=(pltpu.InterpretParams() if interpret is True else interpret) if interpret else False,
        name="conveyor_all_gather_matmul")
    return call(*args).astype(out_dtype)


def _rs_kernel(me_ref, *refs, plan: RingPlan, axis, columns: tuple[slice, ...]):
    """One stream per column range: the stream going right adds block me - 1 - t, the one going
    left (bidirectional only) block me + 1 + t; each accumulator makes the whole D - 1 hop trip.

    refs: lhs blocks, rhs blocks (one per stream), out, then per stream: receive slots, send
    semaphores, receive semaphores, capacity semaphore.
    """
    k = len(columns)
    lhs_blks, rhs_blks, (out_ref,) = refs[:k], refs[k:2 * k], refs[2 * k:2 * k + 1]
    bufs_s, send_s, recv_s, cap_s = (refs[2 * k + 1 + i * k:2 * k + 1 + (i + 1) * k] for i in range(4))
    size = plan.num_devices
    t, left, right, slot, nxt = _ring_position(me_ref, plan)
    directions = ("right", "left")[:k]
    neighbours = {"right": (right, left), "left": (left, right)}   # (downstream, upstream)

    @pl.when(t == 0)
    def _():
        for direction, cap in zip(directions, cap_s):
            if plan.initial_credits(direction):
                pl.semaphore_signal(cap, plan.initial_credits(direction), device_id={axis: neighbours[direction][1]})

    for i, direction in enumerate(directions):
        bufs, send, recv, cap = bufs_s[i], send_s[i], recv_s[i], cap_s[i]
        downstream, upstream = neighbours[direction]
        partial = jnp.dot(lhs_blks[i][...], rhs_blks[i][...], preferred_element_type=jnp.float32)

        @pl.when(t == 0)
        def _():
            bufs[slot] = partial

        @pl.when(t > 0)
        def _():
            _remote_copy(bufs, send, recv, downstream, slot, slot, axis).wait_recv()
            bufs[slot] = bufs[slot] + partial

        @pl.when(plan.sends_at(t, direction))
        def _():
            pl.semaphore_wait(cap, 1)
            _remote_copy(bufs, send, recv, downstream, slot, nxt, axis).start()
            _remote_copy(bufs, send, recv, downstream, slot, nxt, axis).wait_send()

        @pl.when(t == size - 1)
        def _():
            out_ref[:, columns[i]] = bufs[slot]

        @pl.when(plan.grants_credit_after(t, direction))
        def _():
            pl.semaphore_signal(cap, 1, device_id={axis: upstream})


def matmul_reduce_scatter_mosaic_tpu(lhs, rhs, *, axis_name, size, plan: RingPlan, out_dtype, interpret,
                                     scatter_dim: int = 0):
    """scatter_dim=0: lhs [M, K_local] row blocks fetched by step-driven BlockSpecs. Bidirectional
    splits the n output columns in two halves travelling opposite ways (n must be even)."""
    m, k = lhs.shape
    n = rhs.shape[1]
    mb = m // size
    buffering = max(1, min(plan.buffering, size))
    bidi = plan.bidirectional and size > 1
    if scatter_dim == 1 and bidi and (n // size) % 2:
        raise NotImplementedError(f"mosaic_tpu: bidirectional scatter_dim=1 splits each device's {n // size} output "
                                  f"columns in halves and needs an even count; pass bidirectional=False")
    if scatter_dim == 0 and bidi and n % 2:
        raise NotImplementedError(f"mosaic_tpu: bidirectional matmul_reduce_scatter splits the {n} output "
                                  f"columns in halves and needs an even count; pass bidirectional=False")
    plan = RingPlan(size, bidi, buffering, collective="scatter")
    if buffering < 2 and size > 1:
        raise NotImplementedError("mosaic_tpu: matmul_reduce_scatter needs buffering >= 2")
    me = lax.axis_index(axis_name).astype(jnp.int32)[None]

    def block_from(direction):
        def index(t, me_ref):
            off = plan.scatter_block(t, direction)
            return lax.rem(me_ref[0] + off + 2 * size, size), 0
        return index

    if bidi and scatter_dim == 1:   # each device's column block split in halves, one per direction
        hb = n // size // 2

        def half_block(direction, half):
            index = block_from(direction)
            return lambda t, me_ref: (0, 2 * index(t, me_ref)[0] + half)
        columns = (slice(0, hb), slice(hb, None))
        stationary = pl.BlockSpec((m, k), lambda t, me_ref: (0, 0))
        in_specs = [stationary, stationary, pl.BlockSpec((k, hb), half_block("right", 0)),
                    pl.BlockSpec((k, hb), half_block("left", 1))]
        acc_shape, args = (m, hb), (me, lhs, lhs, rhs, rhs)
    elif bidi:
        h = n // 2
        columns = (slice(0, h), slice(h, None))
        in_specs = [pl.BlockSpec((mb, k), block_from("right")), pl.BlockSpec((mb, k), block_from("left")),
                    pl.BlockSpec((k, h), lambda t, me_ref: (0, 0)), pl.BlockSpec((k, h), lambda t, me_ref: (0, 1))]
        acc_shape, args = (mb, h), (me, lhs, lhs, rhs, rhs)
    elif scatter_dim == 1:   # column blocks of rhs are the step-driven operand
        nb = n // size
        right = block_from("right")
        columns = (slice(None),)
        in_specs = [pl.BlockSpec((m, k), lambda t, me_ref: (0, 0)),
                    pl.BlockSpec((k, nb), lambda t, me_ref: (0, right(t, me_ref)[0]))]
        acc_shape, args = (m, nb), (me, lhs, rhs)
    else:
        columns = (slice(None),)
        in_specs = [pl.BlockSpec((mb, k), block_from("right")), pl.BlockSpec((k, n), lambda t, me_ref: (0, 0))]
        acc_shape, args = (mb, n), (me, lhs, rhs)
    streams = len(columns)
    scratch = ([pltpu.VMEM((buffering, *acc_shape), jnp.float32)] * streams
               + [pltpu.SemaphoreType.DMA((buffering,))] * (2 * streams) + [pltpu.SemaphoreType.REGULAR] * streams)
    kernel = functools.partial(_rs_kernel, plan=plan, axis=axis_name, columns=columns)
    out_shape = (m, n // size) if scatter_dim == 1 else (mb, n)
    call = pl.pallas_call(
        kernel,
        out_shape=out_struct(out_shape, jnp.float32, *args),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(size,), in_specs=in_specs,
            out_specs=pl.BlockSpec(out_shape, lambda t, me_ref: (0, 0)), scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",), has_side_effects=True),
        interpret=(pltpu.InterpretParams() if interpret is True else interpret) if interpret else False,
        name="conveyor_matmul_reduce_scatter")
    return call(*args).astype(out_dtype)
