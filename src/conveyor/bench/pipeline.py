"""`conveyor bench pipeline`: the xla pipeline executor against plain jnp and the Mosaic GPU
interpreter.

Design notes: docs/internals/benchmarks.md, section `bench/pipeline.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import conveyor as cv
from conveyor.bench.timing import interleaved_medians
from conveyor.progress import bar as progress_bar


# (kernel, size, blocks, also time the Mosaic GPU interpreter)
CASES = [
    ("matmul", (2048, 2048, 2048), (256, 256, 256), True),
    # Interpreter rows fit sm_90's 227 KiB of shared memory, which the Mosaic GPU lowering (and so
    # its interpreter) enforces: f32 (128, 128, 128) blocks with two slots would need 384 KiB.
    ("matmul", (512, 512, 512), (64, 128, 64), True),
    ("add", (8192, 1024), (512,), False),  # 2 MiB f32 blocks: far over the shared-memory budget
    ("add", (1024, 1024), (8,), True),
    ("ws-matmul", (2048, 2048, 2048), (256, 256, 256), True),
    ("ws-matmul", (512, 512, 512), (64, 128, 64), True),
]
# The interpreter runs a few ms per grid step: larger grids are not timed on it.
INTERPRETER_MAX_STEPS = 256


def tiled_matmul(m, k, n, bm, bk, bn, backend, interpret=False):
    def kernel(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob):
            part = jnp.dot(xb[...], yb[...], preferred_element_type=jnp.float32)
            ob[...] = jnp.where(idx[2] == 0, 0.0, ob[...]) + part

        cv.emit_pipeline(
            body,
            grid=(m // bm, n // bn, k // bk),
            in_specs=[
                cv.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                cv.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            ],
            out_specs=[cv.BlockSpec((bm, bn), lambda i, j, kk: (i, j))],
            max_concurrent_steps=2,
        )(x_ref, y_ref, o_ref)

    return jax.jit(
        cv.kernel(
            kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), backend=backend, interpret=interpret
        )
    )


def warp_specialized_matmul(m, k, n, bm, bk, bn, backend, interpret=False, compute_threads=2):
    """The tiled matmul with `compute_threads` compute warpgroups, each owning bm / threads rows."""
    rows = bm // compute_threads

    def kernel(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob):
            mine = pl.ds(lax.axis_index("wg") * rows, rows)
            part = jnp.dot(xb[mine, :], yb[...], preferred_element_type=jnp.float32)
            ob[mine, :] = jnp.where(idx[2] == 0, 0.0, ob[mine, :]) + part

        cv.emit_pipeline_warp_specialized(
            body,
            grid=(m // bm, n // bn, k // bk),
            memory_registers=40,
            wg_axis="wg",
            num_compute_wgs=compute_threads,
            in_specs=[
                cv.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                cv.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            ],
            out_specs=[cv.BlockSpec((bm, bn), lambda i, j, kk: (i, j))],
        )(x_ref, y_ref, o_ref)

    return jax.jit(
        cv.kernel(
            kernel,
            jax.ShapeDtypeStruct((m, n), jnp.float32),
            backend=backend,
            interpret=interpret,
            num_threads=compute_threads + 1,
            thread_name="wg",
        )
    )


def step_loop_matmul(m, k, n, bm, bk, bn):
    """The floor of any per-step executor: the same grid as a plain fori_loop of dynamic slices,
    one (bm, bk) x (bk, bn) dot per step into the output block (no buffers, masks or poison)."""
    gi, gj, gk = m // bm, n // bn, k // bk

    def run(x, y):
        def step(s, o):
            i, j, kk = s // (gj * gk), (s // gk) % gj, s % gk
            xb = lax.dynamic_slice(x, (i * bm, kk * bk), (bm, bk))
            yb = lax.dynamic_slice(y, (kk * bk, j * bn), (bk, bn))
            ob = jnp.where(kk == 0, 0.0, lax.dynamic_slice(o, (i * bm, j * bn), (bm, bn)))
            return lax.dynamic_update_slice(
                o, ob + jnp.dot(xb, yb, preferred_element_type=jnp.float32), (i * bm, j * bn)
            )

        return lax.fori_loop(0, gi * gj * gk, step, jnp.zeros((m, n), jnp.float32))

    return jax.jit(run)


def slab_loop_matmul(m, k, n, bk):
    """The floor of the batched steps for this body: the (i, j) steps of one k index, run
    together, are one (m, bk) x (bk, n) dot added into the resident (m, n) output; a fori_loop
    over the k // bk slabs, with the body's `where(k == 0, 0, o) + dot` (no blocks, masks or
    poison)."""

    def run(x, y):
        def step(kk, o):
            part = jnp.dot(
                lax.dynamic_slice(x, (0, kk * bk), (m, bk)),
                lax.dynamic_slice(y, (kk * bk, 0), (bk, n)),
                preferred_element_type=jnp.float32,
            )
            return jnp.where(kk == 0, 0.0, o) + part

        return lax.fori_loop(0, k // bk, step, jnp.zeros((m, n), jnp.float32))

    return jax.jit(run)


def thread_slab_loop_matmul(m, k, n, bm, bk, threads, bn=None):
    """The batched steps' floor for the warp-specialized body, whose compute threads each take
    bm // threads rows of every block (`warp_specialized_matmul`): per k slab, each thread's rows
    of all (i, j) blocks as one (m // threads, bk) x (bk, n) dot, added into those rows of the
    resident output with the body's `where(k == 0, 0, o)`. The output is held as the executor holds
    its batched blocks, [m // bm, bm, n // bn, bn], so a thread's rows are one slice of it. Its
    ratio to `slab_loop_matmul` is what XLA:CPU charges for each thread's rows multiplied on their
    own."""
    bn = bn or bm
    rows, gi, gj = bm // threads, m // bm, n // bn

    def run(x, y):
        def step(kk, o):
            xs = lax.dynamic_slice(x, (0, kk * bk), (m, bk)).reshape(gi, bm, bk)
            ys = lax.dynamic_slice(y, (kk * bk, 0), (bk, n))
            for t in range(threads):
                part = jnp.dot(
                    xs[:, t * rows : (t + 1) * rows].reshape(-1, bk),
                    ys,
                    preferred_element_type=jnp.float32,
                )
                mine = lax.slice_in_dim(o, t * rows, (t + 1) * rows, axis=1)
                o = lax.dynamic_update_slice_in_dim(
                    o,
                    jnp.where(kk == 0, 0.0, mine) + part.reshape(gi, rows, gj, bn),
                    t * rows,
                    axis=1,
                )
            return o

        return lax.fori_loop(0, k // bk, step, jnp.zeros((gi, bm, gj, bn), jnp.float32)).reshape(
            m, n
        )

    return jax.jit(run)


def elementwise_add(m, n, bm, backend, interpret=False):
    def kernel(x_ref, y_ref, o_ref):
        def body(idx, xb, yb, ob):
            ob[...] = xb[...] + yb[...]

        spec = cv.BlockSpec((bm, n), lambda i: (i, 0))
        cv.emit_pipeline(
            body, grid=(m // bm,), in_specs=[spec, spec], out_specs=[spec], max_concurrent_steps=2
        )(x_ref, y_ref, o_ref)

    return jax.jit(
        cv.kernel(
            kernel, jax.ShapeDtypeStruct((m, n), jnp.float32), backend=backend, interpret=interpret
        )
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One benchmark row's jitted candidates (floor and interp may be None) and operand shapes."""

    x_shape: tuple[int, ...]
    y_shape: tuple[int, ...]
    steps: int
    ours: Callable
    ref: Callable
    floor: Callable | None
    slab_floor: Callable | None
    thread_slab_floor: Callable | None = None  # warp-specialized rows only
    interp: Callable | None


def build_case(
    name: str, size: tuple[int, ...], blocks: tuple[int, ...], with_interp: bool
) -> Case:
    """The kernels a CASES row times: cv's xla executor, plain jnp, the step-loop floor (matmuls)
    and the Mosaic GPU interpreter (when asked and the grid has at most INTERPRETER_MAX_STEPS)."""
    gpu = plgpu.InterpretGPUParams()
    if name.endswith("matmul"):
        m, k, n = size
        build = tiled_matmul if name == "matmul" else warp_specialized_matmul
        steps = (m // blocks[0]) * (n // blocks[2]) * (k // blocks[1])
        interp = (
            build(m, k, n, *blocks, backend="mosaic_gpu", interpret=gpu)
            if with_interp and steps <= INTERPRETER_MAX_STEPS
            else None
        )
        return Case(
            x_shape=(m, k),
            y_shape=(k, n),
            steps=steps,
            ours=build(m, k, n, *blocks, backend="xla"),
            ref=jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)),
            floor=step_loop_matmul(m, k, n, *blocks),
            slab_floor=slab_loop_matmul(m, k, n, blocks[1]),
            thread_slab_floor=None
            if name == "matmul"
            else thread_slab_loop_matmul(m, k, n, blocks[0], blocks[1], 2, blocks[2]),
            interp=interp,
        )
    m, n = size
    steps = m // blocks[0]
    interp = (
        elementwise_add(m, n, blocks[0], backend="mosaic_gpu", interpret=gpu)
        if with_interp and steps <= INTERPRETER_MAX_STEPS
        else None
    )
    return Case(
        x_shape=(m, n),
        y_shape=(m, n),
        steps=steps,
        ours=elementwise_add(m, n, blocks[0], backend="xla"),
        ref=jax.jit(jnp.add),
        floor=None,
        slab_floor=None,
        interp=interp,
    )


def run(reps: int = 5) -> str:
    rng = np.random.default_rng(0)
    rows = [
        f"# pipeline benchmark, {datetime.date.today().isoformat()}",
        "",
        f"jax {jax.__version__}, {jax.device_count()} CPU device(s). Command: `conveyor bench "
        f"pipeline`. Medians of {reps} interleaved runs, ms.",
        "",
        "| kernel | size | blocks | steps | jnp | k-slab floor | per-thread k-slab floor | "
        "step-loop floor | cv xla | xla/jnp | slab/jnp | thread-slab/jnp | floor/jnp | GPU "
        "interpreter | interp/xla |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    bar = progress_bar(len(CASES), "bench pipeline", "row")
    for name, size, blocks, with_interp in CASES:
        case = build_case(name, size, blocks, with_interp)
        ours, ref, floor, interp, steps = case.ours, case.ref, case.floor, case.interp, case.steps
        x = jnp.asarray(rng.standard_normal(case.x_shape), jnp.float32)
        y = jnp.asarray(rng.standard_normal(case.y_shape), jnp.float32)
        err = float(jnp.abs(ours(x, y) - ref(x, y)).max())
        assert err < 1e-2, (name, err)
        fns = {"jnp": lambda: ref(x, y), "xla": lambda: ours(x, y)}
        if floor is not None:
            assert float(jnp.abs(floor(x, y) - ref(x, y)).max()) < 1e-2, (name, "step-loop floor")
            assert float(jnp.abs(case.slab_floor(x, y) - ref(x, y)).max()) < 1e-2, (
                name,
                "k-slab floor",
            )
            fns["floor"] = lambda: floor(x, y)
            fns["slab"] = lambda: case.slab_floor(x, y)
        if case.thread_slab_floor is not None:
            assert float(jnp.abs(case.thread_slab_floor(x, y) - ref(x, y)).max()) < 1e-2, (
                name,
                "per-thread k-slab floor",
            )
            fns["thread_slab"] = lambda: case.thread_slab_floor(x, y)
        if interp is not None:
            fns["interp"] = lambda: interp(x, y)
        t = interleaved_medians(fns, reps, {"interp": 2})
        it, fl, sl, ts = t.get("interp"), t.get("floor"), t.get("slab"), t.get("thread_slab")
        rows.append(
            f"| {name} | {size} | {blocks} | {steps} | {t['jnp'] * 1e3:.1f} | "
            f"{'-' if sl is None else f'{sl * 1e3:.1f}'} | "
            f"{'-' if ts is None else f'{ts * 1e3:.1f}'} | "
            f"{'-' if fl is None else f'{fl * 1e3:.1f}'} | {t['xla'] * 1e3:.1f} | "
            f"{t['xla'] / t['jnp']:.2f}x | {'-' if sl is None else f'{sl / t["jnp"]:.2f}x'} | "
            f"{'-' if ts is None else f'{ts / t["jnp"]:.2f}x'} | "
            f"{'-' if fl is None else f'{fl / t["jnp"]:.2f}x'} | "
            f"{'-' if it is None else f'{it * 1e3:.0f}'} | "
            f"{'-' if it is None else f'{it / t["xla"]:.0f}x'} |"
        )
        bar.write(rows[-1])
        bar.update()
    bar.close()
    rows += [
        "",
        f"The GPU interpreter runs only where the grid has at most {INTERPRETER_MAX_STEPS} steps "
        "(a few ms per step).",
        "k-slab floor: a floor for this body, one (m, bk) x (bk, n) dot and add per k "
        "(`slab_loop_matmul`); per-thread k-slab floor (warp-specialized rows): the same with each "
        "compute thread's rows of every block as their own dot (`thread_slab_loop_matmul`); "
        "step-loop floor: a per-step executor's (`step_loop_matmul`).",
    ]
    return "\n".join(rows) + "\n"
