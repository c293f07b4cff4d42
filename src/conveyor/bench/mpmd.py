"""`conveyor bench mpmd`: the CPU executor of mpmd_map on producer/consumer pipelines.

Design notes: docs/internals/benchmarks.md, section `bench/mpmd.py`.
"""

from __future__ import annotations

import datetime

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

import conveyor as cv
from conveyor.bench.timing import interleaved_medians

ROWS, SLOTS = 8, 4


def producer_consumer(blocks: int, **options):
    """Producer (mesh of 1) stages blocks through SLOTS shared slots; two consumers transform
    halves."""

    def producer(x_ref, o_ref, buf, ready, done):
        def body(b, c):
            @pl.when(b >= SLOTS)
            def _():
                cv.semaphore_wait(done.at[b % SLOTS], 2)

            buf[b % SLOTS] = x_ref[pl.ds(b * ROWS, ROWS), :] + 1.0
            cv.semaphore_signal(ready.at[0, b % SLOTS])
            cv.semaphore_signal(ready.at[1, b % SLOTS])
            return c

        lax.fori_loop(0, blocks, body, 0)

    def consumer(x_ref, o_ref, buf, ready, done):
        me = lax.axis_index("core")

        def body(b, c):
            cv.semaphore_wait(ready.at[me, b % SLOTS])
            o_ref[pl.ds(b * ROWS + me * (ROWS // 2), ROWS // 2), :] = (
                buf[b % SLOTS, pl.ds(me * (ROWS // 2), ROWS // 2), :] * 2.0
            )
            cv.semaphore_signal(done.at[b % SLOTS])
            return c

        lax.fori_loop(0, blocks, body, 0)

    return cv.mpmd_map(
        [(cv.Mesh(p=1), producer), (cv.Mesh(core=2), consumer)],
        jax.ShapeDtypeStruct((blocks * ROWS, 128), jnp.float32),
        scratch_shapes=[
            jax.ShapeDtypeStruct((SLOTS, ROWS, 128), jnp.float32),
            cv.SemaphoreType((2, SLOTS)),
            cv.SemaphoreType((SLOTS,)),
        ],
        **options,
    )


def run(reps: int = 5) -> str:
    rows = [
        f"# mpmd_map CPU executor benchmark, {datetime.date.today().isoformat()}",
        "",
        f"jax {jax.__version__}. Command: `conveyor bench mpmd`. Medians of {reps} interleaved "
        "runs, ms.",
        "",
        "| blocks | instances | mpmd_map (jit) | per block | same arithmetic in jnp |",
        "|---|---|---|---|---|",
    ]
    for blocks in (16, 64, 256):
        x = jnp.asarray(
            np.random.default_rng(blocks).standard_normal((blocks * ROWS, 128)), jnp.float32
        )
        f = jax.jit(producer_consumer(blocks))
        ref = jax.jit(lambda a: (a + 1.0) * 2.0)
        np.testing.assert_array_equal(f(x), ref(x))
        t = interleaved_medians({"mpmd": lambda: f(x), "jnp": lambda: ref(x)}, reps)
        rows.append(
            f"| {blocks} | 3 | {t['mpmd'] * 1e3:.1f} | {t['mpmd'] / blocks * 1e6:.0f} us | "
            f"{t['jnp'] * 1e3:.3f} |"
        )
        print(rows[-1], flush=True)
    return "\n".join(rows) + "\n"
