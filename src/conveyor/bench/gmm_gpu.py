"""`conveyor bench gmm --platform gpu`: grouped matmul on a real GPU against its floors and
baselines.

Design notes: docs/internals/benchmarks.md, section `bench/gmm_gpu.py`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import conveyor as cv
from conveyor.problems import BENCH_GMM_GPU, GmmProblem, skewed_group_sizes


# Tilings measured beside the default mosaic_gpu rows, so that one run on a GPU decides between
# them: the previous default (a 128 x 128 tile, 64 rows per compute warpgroup).
GMM_ALTERNATIVE_TILINGS = ((128, 64, 128),)
ZEROS = "dense jnp.dot, zero operands"
TGMM_ALTERNATIVE_TILINGS = ((64, 128, 128),)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Timing:
    """How each candidate is timed: the median of `reps` timings, each of `calls` back-to-back
    calls (synchronised only around them)."""

    reps: int = 10
    calls: int = 5


def device_median(fn: Callable[[], object], timing: Timing) -> float:
    """Median seconds per call of `fn` (already compiled and run once)."""
    times = []
    for _ in range(timing.reps):
        jax.block_until_ready(fn())
        t0 = time.perf_counter()
        out = None
        for _ in range(timing.calls):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / timing.calls)
    return float(np.median(times))


def copy_bandwidth(timing: Timing) -> float:
    """Bytes per second of a 1 GiB read + 1 GiB write on the device."""
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    jax.block_until_ready(f(x))
    return 2 * x.nbytes / device_median(lambda: f(x), timing)


def _rel_err(out, ref) -> float:
    """|out - ref| / |ref| over ref's leading entries (tgmm's reference may cover the first
    groups only: `REF_GROUPS`)."""
    out = jnp.asarray(out[: ref.shape[0]], jnp.float32)
    ref = jnp.asarray(ref, jnp.float32)
    return float(jnp.linalg.norm(out - ref) / jnp.linalg.norm(ref))


# tgmm's float32 reference holds G x k x n floats: 60 GB at G=256 of Mixtral's shape, which ran an
# H200 out of memory beside the candidates' outputs. Past this many bytes it covers the rows of the
# first REF_GROUPS groups only (their [k, n] blocks are checked; the rest are timed unchecked).
REF_MAX_BYTES = 8 * 2**30
REF_GROUPS = 8


def _upstream_gmm(transpose: bool = False):
    """JAX's own Mosaic GPU kernels with a few configurations; the best one is reported."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    if transpose:
        return {
            f"bm{bm},bn{bn},bk{bk},s{s}": functools.partial(
                transposed_ragged_dot_mgpu.transposed_ragged_dot,
                block_m=bm,
                block_n=bn,
                block_k=bk,
                max_concurrent_steps=s,
                grid_block_n=1,
            )
            for bm, bn, bk, s in [(64, 128, 64, 4), (128, 128, 64, 4)]
        }
    return {
        f"bm{bm},bn{bn},bk{bk},s{s},gbn{g}": functools.partial(
            ragged_dot_mgpu.ragged_dot,
            block_m=bm,
            block_n=bn,
            block_k=bk,
            max_concurrent_steps=s,
            grid_block_n=g,
        )
        for bm, bn, bk, s, g in [(128, 128, 64, 4, 1), (128, 256, 64, 4, 1), (64, 256, 64, 4, 1)]
    }


def _best(cands: dict[str, Callable], args, timing: Timing, ref) -> tuple[str, float, float] | None:
    """(config, seconds, rel err) of the fastest candidate that compiles, or None."""
    best = None
    for name, f in cands.items():
        jf = jax.jit(f)
        try:
            out = jax.block_until_ready(jf(*args))
        except Exception as e:  # noqa: BLE001 - a config over the SMEM budget is skipped, and said
            print(
                f"  {name}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}",
                flush=True,
            )
            continue
        t = device_median(lambda: jf(*args), timing)
        print(f"  {name}: {t * 1e3:.3f} ms", flush=True)
        if best is None or t < best[1]:
            best = (name, t, _rel_err(out, ref))
    return best


def _upstream_row(name: str, best: tuple[str, float, float] | None) -> dict:
    """The table row of an upstream kernel's fastest configuration, or of its failure (said)."""
    if best is None:
        return dict(
            name=name,
            t=None,
            err=None,
            config="failed: no configuration ran (errors in the log above)",
        )
    return dict(name=name, t=best[1], err=best[2], config=best[0])


def _measure(
    rows: list[dict], timing: Timing, ref, name: str, f: Callable, args, check: bool = True
) -> None:
    """Append `name`'s row: its median time and error against `ref` (`check`; a floor computes
    other math), or why it failed to run."""
    jf = jax.jit(f)
    try:
        out = jax.block_until_ready(jf(*args))
    except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
        rows.append(
            dict(name=name, t=None, err=None, config=f"failed: {type(e).__name__}: {str(e)[:120]}")
        )
        print(f"  {name}: {rows[-1]['config']}", flush=True)
        return
    t = device_median(lambda: jf(*args), timing)
    rows.append(dict(name=name, t=t, err=_rel_err(out, ref) if check else None, config=""))
    print(f"  {name}: {t * 1e3:.3f} ms", flush=True)


def hardware_model(device_kind: str) -> str | None:
    """The simulator's model of a device ("NVIDIA H100 80GB HBM3" -> "h100"), None when it has
    none."""
    kind = device_kind.lower()
    for key in ("h200", "h800", "h100", "b200"):
        if key in kind:
            return key
    return None


def _models(rows: list[dict], dense_mkn: tuple[int, int, int], bw: float) -> tuple:
    """(the device's datasheet model, the same model at this run's rates) for the simulated
    columns, (None, None) without a model; the dense row (rows[0], timed on normal data) gets its
    prediction at the datasheet model. The run's model is fitted to that row and to the copy
    bandwidth `bw` timed in the same run (cv.sim.calibrate): a kernel's measured / simulated at
    it leaves out what the machine sustained then (its clocks under its power limit)."""
    from conveyor.sim.calibrate import at_measured_rates

    hw = hardware_model(jax.devices()[0].device_kind)
    dense = rows[0]
    if hw is None or dense["t"] is None:
        return None, None
    dense["sim"] = cv.sim.simulate_matmul(*dense_mkn, dtype="bf16", hardware=hw).time_s
    try:
        run = at_measured_rates(hw, matmul=(*dense_mkn, dense["t"]), copy_bytes_per_s=bw)
    except ValueError as e:  # a rate past the datasheet's: said, and that column left blank
        print(f"  no model at this run's rates: {e}", flush=True)
        return hw, None
    dense["sim_run"] = "fitted"
    return hw, run


def _predict(
    rows: list[dict], simulate: Callable, sizes, k: int, n: int, models, tiling=None
) -> None:
    """Attach the simulator's time for the mosaic_gpu kernel (with `tiling`, None: its default)
    to the last row (when it ran), at the datasheet model and at this run's rates (`models`, from
    `_models`)."""
    sizes = [int(x) for x in sizes]
    for key, hw in zip(("sim", "sim_run"), models):
        if hw is not None and rows[-1]["t"] is not None:
            rows[-1][key] = simulate(sizes, k, n, dtype="bf16", hardware=hw, tiling=tiling).time_s


def _inputs(p: GmmProblem, seed: int):
    sizes = skewed_group_sizes(p.m, p.groups, seed=seed, alpha=p.alpha)
    key = jax.random.key(seed)
    k1, k2 = jax.random.split(key)
    return sizes, k1, k2


@functools.partial(jax.jit, static_argnums=(1, 2))
def _scaled_normal(key, shape: tuple[int, ...], scale: float):
    """bf16 normals times `scale`, drawn in bf16: at G=256 the Mixtral weights are 30 GB, and a
    float32 draw of them (60 GB, then a scaled copy) ran an H200 out of memory."""
    return jax.random.normal(key, shape, jnp.bfloat16) * jnp.bfloat16(scale)


def bench_gmm(
    p: GmmProblem,
    timing: Timing,
    backends: tuple[str, ...],
    interpret: bool = False,
    bw: float = 0.0,
) -> list[dict]:
    sizes, k1, k2 = _inputs(p, p.groups)
    lhs = jax.random.normal(k1, (p.m, p.k), jnp.bfloat16)
    rhs = _scaled_normal(k2, (p.groups, p.k, p.n), 1 / np.sqrt(p.k))
    gs = jnp.asarray(sizes)
    ref = jax.jit(lambda a, b, s: lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32))(
        lhs, rhs, gs
    )
    rows = []
    add = functools.partial(_measure, rows, timing, ref)
    bf16 = jnp.bfloat16
    # different math: a floor, not a candidate
    dense = lambda a, b: jnp.dot(a, b[0], preferred_element_type=bf16)  # noqa: E731
    add("dense jnp.dot", dense, (lhs, rhs), False)
    models = _models(rows, (p.m, p.k, p.n), bw)
    # the same matmul on zeros: the tensor cores draw less power, and clock higher, than on normal
    # data (docs/simulator.md); the gap is how much the run's power limit held them back
    add(ZEROS, dense, (jnp.zeros_like(lhs), jnp.zeros_like(rhs)), False)
    add(
        "lax.ragged_dot",
        lambda a, b, s: lax.ragged_dot(a, b, s, preferred_element_type=bf16),
        (lhs, rhs, gs),
    )
    best = _best(
        {k: functools.partial(f, group_sizes=gs) for k, f in _upstream_gmm().items()},
        (lhs, rhs),
        timing,
        ref,
    )
    rows.append(_upstream_row("ragged_dot_mgpu", best))
    for b in backends:
        mosaic = dict(interpret=interpret) if b.startswith("mosaic") else {}
        add(
            f"cv.gmm {b}",
            functools.partial(cv.gmm, preferred_element_type=bf16, backend=b, **mosaic),
            (lhs, rhs, gs),
        )
        if b == "mosaic_gpu":
            _predict(rows, cv.sim.simulate_gmm, sizes, p.k, p.n, models)
            for t in GMM_ALTERNATIVE_TILINGS:
                add(
                    f"cv.gmm {b} tiling={t}",
                    functools.partial(
                        cv.gmm, preferred_element_type=bf16, backend=b, tiling=t, **mosaic
                    ),
                    (lhs, rhs, gs),
                )
                _predict(rows, cv.sim.simulate_gmm, sizes, p.k, p.n, models, t)
    return rows


def bench_tgmm(
    p: GmmProblem,
    timing: Timing,
    backends: tuple[str, ...],
    interpret: bool = False,
    bw: float = 0.0,
) -> list[dict]:
    sizes, k1, k2 = _inputs(p, 100 + p.groups)
    x = jax.random.normal(k1, (p.m, p.k), jnp.bfloat16)  # tokens [m, k]
    dy = jax.random.normal(k2, (p.m, p.n), jnp.bfloat16)  # output gradient [m, n]
    gs = jnp.asarray(sizes)
    checked = p.groups if p.groups * p.k * p.n * 4 <= REF_MAX_BYTES else REF_GROUPS
    rows_checked = int(np.sum(sizes[:checked]))
    ref = jax.jit(lambda a, b, s: cv.tgmm(a.T, b, s, backend="xla"))(
        x[:rows_checked], dy[:rows_checked], gs[:checked]
    )
    rows = []
    add = functools.partial(_measure, rows, timing, ref)
    bf16 = jnp.bfloat16
    dense = lambda a, b: jnp.dot(a.T, b, preferred_element_type=bf16)  # noqa: E731
    add("dense jnp.dot", dense, (x, dy), False)
    models = _models(rows, (p.k, p.m, p.n), bw)
    add(ZEROS, dense, (jnp.zeros_like(x), jnp.zeros_like(dy)), False)
    best = _best(
        {k: functools.partial(f, group_sizes=gs) for k, f in _upstream_gmm(transpose=True).items()},
        (x, dy),
        timing,
        ref,
    )
    rows.append(_upstream_row("transposed_ragged_dot_mgpu", best))
    for b in backends:
        mosaic = dict(interpret=interpret) if b.startswith("mosaic") else {}
        add(
            f"cv.tgmm {b}",
            lambda a, c, s, b=b, kw=mosaic: cv.tgmm(
                a.T, c, s, preferred_element_type=bf16, backend=b, **kw
            ),
            (x, dy, gs),
        )
        if b == "mosaic_gpu":
            _predict(rows, cv.sim.simulate_tgmm, sizes, p.k, p.n, models)
            for t in TGMM_ALTERNATIVE_TILINGS:
                add(
                    f"cv.tgmm {b} tiling={t}",
                    lambda a, c, s, b=b, t=t, kw=mosaic: cv.tgmm(
                        a.T, c, s, preferred_element_type=bf16, backend=b, tiling=t, **kw
                    ),
                    (x, dy, gs),
                )
                _predict(rows, cv.sim.simulate_tgmm, sizes, p.k, p.n, models, t)
    return rows


def _floor(dense: float | None, moving: float) -> float:
    """The roofline floor: the larger of the dense matmul's time (None when it failed to run; its
    row says why) and the time to move the bytes once."""
    return moving if dense is None else max(dense, moving)


def _ratio(t: float | None, sim) -> str:
    """measured / simulated as printed: '-' without either, 'fitted' where the model was fitted
    to this row."""
    if sim == "fitted":
        return "fitted"
    return "-" if t is None or sim is None else f"{t / sim:.2f}"


def _table(title: str, p: GmmProblem, rows: list[dict], floor: float, floor_what: str) -> list[str]:
    flops = 2 * p.m * p.k * p.n
    out = [
        f"### {title}, G={p.groups}",
        "",
        f"Roofline floor {floor * 1e3:.3f} ms ({floor_what}).",
        "",
        "| candidate | ms | TFLOP/s | time / floor | simulated ms | measured / simulated | "
        "measured / simulated at this run's rates | rel. err vs f32 | config |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, sim = r["t"], r.get("sim")
        out.append(
            f"| {r['name']} | {'-' if t is None else f'{t * 1e3:.3f}'} | "
            f"{'-' if t is None else f'{flops / t / 1e12:.0f}'} | "
            f"{'-' if t is None else f'{t / floor:.2f}x'} | "
            f"{'-' if sim is None else f'{sim * 1e3:.3f}'} | {_ratio(t, sim)} | "
            f"{_ratio(t, r.get('sim_run'))} | "
            f"{'-' if r['err'] is None else f'{r["err"]:.1e}'} | {r['config'] or ''} |"
        )
    return out + [""]


def run(
    reps: int = 10,
    calls: int = 5,
    groups: tuple[int, ...] = (8, 64, 256),
    backends: tuple[str, ...] = ("mosaic_gpu", "xla"),
    tgmm: bool = True,
    shape: tuple[int, int, int] | None = None,
    interpret: bool = False,
) -> str:
    """The GPU table; `shape` is (m, k, n) (default: the Mixtral expert shape). `interpret` runs the
    Mosaic rows through their Pallas interpreters: the CPU check of this benchmark (tiny shapes)."""
    m, k, n = shape or (BENCH_GMM_GPU[0].m, BENCH_GMM_GPU[0].k, BENCH_GMM_GPU[0].n)
    dev = jax.devices()[0]
    lines = [
        f"# gmm on GPU, {datetime.date.today().isoformat()}",
        "",
        f"Device: {dev.device_kind} ({getattr(dev, 'core_count', '?')} SMs), jax "
        f"{jax.__version__}. Command: `conveyor bench gmm --platform gpu`. bf16 inputs and "
        f"outputs, f32 accumulation. Medians of {reps} timings of {calls} back-to-back "
        "calls.",
        "",
    ]
    timing = Timing(reps=reps, calls=calls)
    bw = copy_bandwidth(timing)
    lines += [
        f"Measured copy bandwidth {bw / 1e12:.2f} TB/s (read + write). Simulated: cv.sim's "
        "model of the device; at this run's rates: the same model with its matrix fraction "
        "fitted to the dense jnp.dot row (normal data) and its HBM fraction to this copy "
        "(cv.sim.calibrate.at_measured_rates), which leaves out what this machine sustained in "
        "this run. The zero-operand row is the dense matmul on zeros (less power, higher clocks).",
        "",
    ]
    for p in [GmmProblem(name=f"mixtral-g{g}", m=m, k=k, n=n, groups=g) for g in groups]:
        print(f"gmm G={p.groups}", flush=True)
        rows = bench_gmm(p, timing, backends, interpret, bw)
        dense = rows[0]["t"]
        weights = 2 * (p.groups * p.k * p.n + p.m * p.k + p.m * p.n)
        floor = _floor(dense, weights / bw)
        lines += _table(
            "gmm",
            p,
            rows,
            floor,
            "max of the dense matmul and moving lhs, the G*k*n weights and the output once at the "
            "measured copy bandwidth",
        )
        print("\n".join(lines[-len(rows) - 6 :]), flush=True)
        if tgmm:
            print(f"tgmm G={p.groups}", flush=True)
            rows = bench_tgmm(p, timing, backends, interpret, bw)
            dense = rows[0]["t"]
            floor = _floor(dense, 2 * (p.m * p.k + p.m * p.n + p.groups * p.k * p.n) / bw)
            lines += _table(
                "tgmm",
                p,
                rows,
                floor,
                "max of the dense matmul and moving the inputs and the G*k*n outputs once",
            )
            print("\n".join(lines[-len(rows) - 6 :]), flush=True)
    return "\n".join(lines) + "\n"
