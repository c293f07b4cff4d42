"""Programs shared by the mpmd_map tests of every backend."""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

import conveyor as cv

from conveyor.bench import mpmd as bench_mpmd

NB, R = 64, bench_mpmd.ROWS


def producer_consumer(**options):
    """Program A (one instance) fills slots of a shared scratch buffer and signals each consumer;
    program B (two instances) waits, transforms its half of the block and releases the slot
    (the same program the mpmd benchmark times)."""
    return bench_mpmd.producer_consumer(NB, **options)


def barrier_lockstep(blocks=4, rows=8, **options):
    """Producer/consumer synchronised by a barrier across all instances: the producer stages a
    block, everyone meets, the two consumers transform their halves, everyone meets again."""

    def producer(x_ref, o_ref, buf, bar):
        for b in range(blocks):
            buf[...] = x_ref[pl.ds(b * rows, rows), :] + 1.0
            cv.fence()
            cv.barrier_wait(bar)
            cv.barrier_wait(bar)

    def consumer(x_ref, o_ref, buf, bar):
        me = lax.axis_index("core")
        half = rows // 2
        for b in range(blocks):
            cv.barrier_wait(bar)
            o_ref[pl.ds(b * rows + me * half, half), :] = buf[pl.ds(me * half, half), :] * 2.0
            cv.barrier_wait(bar)

    return cv.mpmd_map(
        [(cv.Mesh(p=1), producer), (cv.Mesh(core=2), consumer)],
        jax.ShapeDtypeStruct((blocks * rows, 128), jnp.float32),
        scratch_shapes=[jax.ShapeDtypeStruct((rows, 128), jnp.float32), cv.BarrierType()],
        **options,
    )
