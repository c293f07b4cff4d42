"""`conveyor bench gmm`: grouped matmul against the dense floor, a per-group BLAS loop and
ragged_dot.

Design notes: docs/internals/benchmarks.md, section `bench/gmm.py`.
"""

from __future__ import annotations

import datetime
import itertools
import platform

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import conveyor as cv
from conveyor.bench.timing import interleaved_medians
from conveyor.progress import bar as progress_bar
from conveyor.problems import BENCH_GMM, GmmProblem, skewed_group_sizes

# Baselines slower than this are measured once (after a warm-up); above RAGGED_MAX_G they are not
# run at all: lax.ragged_dot's G-times dense expansion takes ~30 s per call at G=256.
RAGGED_MAX_G = 64
REFERENCE_MAX_G = 64


def copy_bandwidth(reps: int) -> float:
    """Bytes per second of a large streaming read+write (256 MiB each way)."""
    x = jnp.ones((64 * 1024 * 1024,), jnp.float32)
    f = jax.jit(lambda a: a * 1.0001)
    t = interleaved_medians({"copy": lambda: f(x)}, reps)["copy"]
    return 2 * x.nbytes / t


def equal_split_gmm(lhs, rhs):
    """The floor once G*k*n weights dominate: the same rows split evenly, one batched dot
    (m // G rows per group; every weight read once, no group bookkeeping)."""
    g, k, _ = rhs.shape
    rows = lhs.shape[0] // g
    x = lhs[: g * rows].reshape(g, rows, k)
    return jnp.einsum("grk,gkn->grn", x, rhs, preferred_element_type=jnp.float32).reshape(
        g * rows, -1
    )


def equal_split_tgmm(lhs_t, rhs, groups: int):
    """tgmm's floor: the rows split evenly, one batched dot writing the G*k*n outputs."""
    k, m = lhs_t.shape
    rows = m // groups
    x = lhs_t[:, : groups * rows].reshape(k, groups, rows)
    y = rhs[: groups * rows].reshape(groups, rows, -1)
    return jnp.einsum("kgr,grn->gkn", x, y, preferred_element_type=jnp.float32)


def equal_split_loop_gmm(lhs, rhs):
    """The floor of any one-dot-per-group formulation on XLA:CPU: the batched floor's equal split,
    one dot per group in a `lax.fori_loop` (no skew, no tiles, no masks). Its ratio to the batched
    floor is what XLA:CPU charges for running the groups' dots one after another
    (docs/xla-backend-notes.md)."""
    g, k, n = rhs.shape
    rows = lhs.shape[0] // g

    def group(i, out):
        x = lax.dynamic_slice_in_dim(lhs, i * rows, rows, 0)
        y = jnp.dot(
            x,
            lax.dynamic_index_in_dim(rhs, i, 0, keepdims=False),
            preferred_element_type=jnp.float32,
        )
        return lax.dynamic_update_slice_in_dim(out, y, i * rows, 0)

    return lax.fori_loop(0, g, group, jnp.zeros((g * rows, n), jnp.float32))


def equal_split_loop_tgmm(lhs_t, rhs, groups: int):
    """tgmm's loop floor: the equal split, one [k, rows] @ [rows, n] dot per group in a fori
    loop."""
    k, m = lhs_t.shape
    rows = m // groups

    def group(i, out):
        x = lax.dynamic_slice_in_dim(lhs_t, i * rows, rows, 1)
        y = lax.dynamic_slice_in_dim(rhs, i * rows, rows, 0)
        return lax.dynamic_update_index_in_dim(
            out, jnp.dot(x, y, preferred_element_type=jnp.float32), i, 0
        )

    return lax.fori_loop(0, groups, group, jnp.zeros((groups, k, rhs.shape[1]), jnp.float32))


def numpy_group_loop(lhs: np.ndarray, rhs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """What a CPU user writes by hand: one BLAS matmul per group into a preallocated output."""
    out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
    start = 0
    for g, size in enumerate(sizes):
        np.matmul(lhs[start : start + size], rhs[g], out=out[start : start + size])
        start += size
    return out


def numpy_tgroup_loop(lhs_t: np.ndarray, rhs: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    out = np.empty((len(sizes), lhs_t.shape[0], rhs.shape[1]), np.float32)
    start = 0
    for g, size in enumerate(sizes):
        np.matmul(lhs_t[:, start : start + size], rhs[start : start + size], out=out[g])
        start += size
    return out


def _fmt(x: float | None, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ratio(t: float | None, base: float) -> str:
    return "-" if t is None else f"{t / base:.2f}x"


def bench_gmm_forward(p: GmmProblem, dtype, reps: int) -> dict:
    rng = np.random.default_rng(p.groups)
    sizes = skewed_group_sizes(p.m, p.groups, seed=p.groups, alpha=p.alpha)
    lhs = jnp.asarray(rng.standard_normal((p.m, p.k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((p.groups, p.k, p.n)) / np.sqrt(p.k), dtype)
    gs = jnp.asarray(sizes)
    lhs_np = np.asarray(lhs, np.float32)
    rhs_np = np.asarray(rhs, np.float32)
    dense = jax.jit(lambda a, b: jnp.dot(a, b[0], preferred_element_type=jnp.float32))
    batched = jax.jit(equal_split_gmm)
    loop = jax.jit(equal_split_loop_gmm)
    ours = jax.jit(lambda a, b, s: cv.gmm(a, b, s))
    ours_xla = jax.jit(lambda a, b, s: cv.gmm(a, b, s, backend="xla"))
    ragged = jax.jit(lambda a, b, s: lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32))
    ref = jax.jit(lambda a, b, s: cv.gmm(a, b, s, backend="reference"))
    fns = {
        "dense": lambda: dense(lhs, rhs),
        "batched": lambda: batched(lhs, rhs),
        "loop": lambda: loop(lhs, rhs),
        "numpy": lambda: numpy_group_loop(lhs_np, rhs_np, sizes),
        "gmm": lambda: ours(lhs, rhs, gs),
        "xla": lambda: ours_xla(lhs, rhs, gs),
    }
    if p.groups <= RAGGED_MAX_G:
        fns["ragged_dot"] = lambda: ragged(lhs, rhs, gs)
    if p.groups <= REFERENCE_MAX_G:
        fns["reference"] = lambda: ref(lhs, rhs, gs)
    slow = {"ragged_dot": 1 if p.groups > 8 else 2, "reference": 1 if p.groups > 8 else 2}
    t = interleaved_medians(fns, reps, slow)
    err = float(
        np.abs(np.asarray(ours(lhs, rhs, gs)) - numpy_group_loop(lhs_np, rhs_np, sizes)).max()
    )
    return dict(t=t, err=err)


def bench_tgmm(p: GmmProblem, dtype, reps: int) -> dict:
    rng = np.random.default_rng(100 + p.groups)
    sizes = skewed_group_sizes(p.m, p.groups, seed=p.groups, alpha=p.alpha)
    lhs_t = jnp.asarray(rng.standard_normal((p.k, p.m)), dtype)
    rhs = jnp.asarray(rng.standard_normal((p.m, p.n)), dtype)
    gs = jnp.asarray(sizes)
    lhs_np, rhs_np = np.asarray(lhs_t, np.float32), np.asarray(rhs, np.float32)
    dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    batched = jax.jit(lambda a, b: equal_split_tgmm(a, b, p.groups))
    loop = jax.jit(lambda a, b: equal_split_loop_tgmm(a, b, p.groups))
    ours = jax.jit(lambda a, b, s: cv.tgmm(a, b, s))
    ours_xla = jax.jit(lambda a, b, s: cv.tgmm(a, b, s, backend="xla"))
    t = interleaved_medians(
        {
            "dense": lambda: dense(lhs_t, rhs),
            "batched": lambda: batched(lhs_t, rhs),
            "loop": lambda: loop(lhs_t, rhs),
            "numpy": lambda: numpy_tgroup_loop(lhs_np, rhs_np, sizes),
            "tgmm": lambda: ours(lhs_t, rhs, gs),
            "xla": lambda: ours_xla(lhs_t, rhs, gs),
        },
        reps,
    )
    err = float(
        np.abs(np.asarray(ours(lhs_t, rhs, gs)) - numpy_tgroup_loop(lhs_np, rhs_np, sizes)).max()
    )
    return dict(t=t, err=err)


def moe_ffn(x, w1, w2, sizes, matmul):
    """Two-layer MoE feed-forward: gelu(x @ w1[e]) @ w2[e] per expert e. Every matmul returns
    float32; the hidden activation goes back to the operands' dtype (bf16 training keeps bf16
    activations)."""
    return matmul(jax.nn.gelu(matmul(x, w1, sizes)).astype(x.dtype), w2, sizes)


def ffn_loss_and_grads(matmul):
    def loss(x, w1, w2, sizes, ct):
        return jnp.vdot(moe_ffn(x, w1, w2, sizes, matmul), ct)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def bench_moe_ffn(groups: int, reps: int, m=2048, d=512, f=1024, dtype=jnp.float32) -> dict:
    rng = np.random.default_rng(200 + groups)
    sizes = jnp.asarray(skewed_group_sizes(m, groups, seed=groups))
    x = jnp.asarray(rng.standard_normal((m, d)), dtype)
    w1 = jnp.asarray(rng.standard_normal((groups, d, f)) / np.sqrt(d), dtype)
    w2 = jnp.asarray(rng.standard_normal((groups, f, d)) / np.sqrt(f), dtype)
    ct = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    f32 = jnp.float32
    ours = ffn_loss_and_grads(lambda a, b, s: cv.gmm(a, b, s, preferred_element_type=f32))
    ours_xla = ffn_loss_and_grads(
        lambda a, b, s: cv.gmm(a, b, s, backend="xla", preferred_element_type=f32)
    )
    ragged = ffn_loss_and_grads(
        lambda a, b, s: lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32)
    )
    batched = ffn_loss_and_grads(lambda a, b, s: equal_split_gmm(a, b))
    loop = ffn_loss_and_grads(lambda a, b, s: equal_split_loop_gmm(a, b))
    t = interleaved_medians(
        {
            "batched": lambda: batched(x, w1, w2, sizes, ct),
            "loop": lambda: loop(x, w1, w2, sizes, ct),
            "gmm": lambda: ours(x, w1, w2, sizes, ct),
            "xla": lambda: ours_xla(x, w1, w2, sizes, ct),
            "ragged_dot": lambda: ragged(x, w1, w2, sizes, ct),
        },
        reps,
        {"ragged_dot": 1 if groups > 8 else 3},
    )
    g_ours, g_ragged = ours(x, w1, w2, sizes, ct)[1], ragged(x, w1, w2, sizes, ct)[1]
    rel = max(
        float(jnp.abs(a.astype(f32) - b.astype(f32)).max() / jnp.abs(b.astype(f32)).max())
        for a, b in zip(g_ours, g_ragged)
    )
    return dict(t=t, rel=rel, shape=(m, d, f))


def compile_cost(
    matmul, reps: int, groups: int = 8, m: int = 4096, k: int = 1024, n: int = 1024
) -> dict:
    """Seconds to lower and to compile a fresh forward+backward of one grouped matmul, and the size
    of its StableHLO (medians over `reps` fresh functions, so no compilation cache is hit)."""
    import statistics
    import time

    lhs = jax.ShapeDtypeStruct((m, k), jnp.float32)
    rhs = jax.ShapeDtypeStruct((groups, k, n), jnp.float32)
    ct = jax.ShapeDtypeStruct((m, n), jnp.float32)
    sizes = jnp.asarray(skewed_group_sizes(m, groups, seed=groups))
    lower_s, compile_s, chars = [], [], 0
    for _ in range(reps):

        def loss(x, w, c):
            return jnp.vdot(matmul(x, w, sizes), c)

        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        t0 = time.perf_counter()
        lowered = f.lower(lhs, rhs, ct)
        t1 = time.perf_counter()
        lowered.compile()
        compile_s.append(time.perf_counter() - t1)
        lower_s.append(t1 - t0)
        chars = len(lowered.as_text())
    return dict(lower=statistics.median(lower_s), compile=statistics.median(compile_s), chars=chars)


def run(
    reps: int = 5,
    groups: tuple[int, ...] = (1, 8, 64, 256),
    dtypes=("float32", "bfloat16"),
    ffn_groups: tuple[int, ...] = (8, 64),
    shape: tuple[int, int, int] | None = None,
) -> str:
    """Run the whole gmm benchmark and return it as a markdown report.

    `shape` is (m, k, n) of the gmm/tgmm rows (default: the table's m=4096, k=n=1024).
    """
    m, k, n = shape or (BENCH_GMM[0].m, BENCH_GMM[0].k, BENCH_GMM[0].n)
    problems = [GmmProblem(name=f"moe-g{g}", m=m, k=k, n=n, groups=g) for g in groups]
    bar = progress_bar(
        len(dtypes) * (len(problems) + sum(p.groups > 1 for p in problems))
        + 2
        + len(dtypes) * len(ffn_groups),
        "bench gmm",
        "row",
    )
    lines = [
        f"# gmm benchmark, {datetime.date.today().isoformat()}",
        "",
        f"Machine: {platform.machine()}, {jax.device_count()} JAX CPU device(s), jax "
        f"{jax.__version__}, numpy {np.__version__}. Command: `conveyor bench gmm`.",
        f"Medians of {reps} interleaved runs (slow baselines: 1-2 runs). Times in ms.",
        "",
    ]
    lines.append(
        "cv.gmm / cv.tgmm: backend=None, which runs xla on CPU. cv xla: the same call "
        'with backend="xla".'
    )
    bw = copy_bandwidth(reps)
    lines.append(f"Measured copy bandwidth: {bw / 1e9:.1f} GB/s (read+write).")
    lines.append("")
    lines += [
        f"## gmm forward (m={m}, k={k}, n={n})",
        "",
        "| dtype | G | dense floor | batched floor | loop floor | roofline | numpy loop | cv.gmm | "
        "cv xla | ragged_dot | reference | gmm/dense | gmm/batched | loop/batched | gmm/loop | "
        "gmm/numpy | ragged/gmm | max err vs numpy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dt in dtypes:
        dtype = jnp.dtype(dt)
        for p in problems:
            r = bench_gmm_forward(p, dtype, reps)
            t = r["t"]
            rate = 2 * p.m * p.k * p.n / t["dense"]  # measured in the same interleaved set
            isz = dtype.itemsize
            must_move = isz * (p.m * p.k + p.groups * p.k * p.n) + 4 * p.m * p.n
            floor = max(2 * p.m * p.k * p.n / rate, must_move / bw)
            ragged, ref = t.get("ragged_dot"), t.get("reference")
            lines.append(
                f"| {dt} | {p.groups} | {_fmt(t['dense'] * 1e3)} | {_fmt(t['batched'] * 1e3)} | "
                f"{_fmt(t['loop'] * 1e3)} | {_fmt(floor * 1e3)} | {_fmt(t['numpy'] * 1e3)} | "
                f"{_fmt(t['gmm'] * 1e3)} | {_fmt(t['xla'] * 1e3)} | "
                f"{_fmt(ragged and ragged * 1e3)} | {_fmt(ref and ref * 1e3)} | "
                f"{_ratio(t['gmm'], t['dense'])} | {_ratio(t['gmm'], t['batched'])} | "
                f"{_ratio(t['loop'], t['batched'])} | {_ratio(t['gmm'], t['loop'])} | "
                f"{_ratio(t['gmm'], t['numpy'])} | "
                f"{'-' if ragged is None else f'{ragged / t["gmm"]:.1f}x'} | {r['err']:.1e} |"
            )
            bar.write(lines[-1])
            bar.update()
    lines += [
        "",
        "numpy loop: one `np.matmul` per group on float32 copies (NumPy has no fast bf16 matmul); "
        "ragged_dot and reference are skipped above G=64 (about 30 s and 12 s per call).",
        "",
        "## tgmm (lhs [k, m], rhs [m, n] -> [G, k, n])",
        "",
        "| dtype | G | dense floor | batched floor | loop floor | roofline | numpy loop | cv.tgmm "
        "| cv xla | tgmm/dense | tgmm/batched | loop/batched | tgmm/loop | tgmm/numpy | max err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dt in dtypes:
        dtype = jnp.dtype(dt)
        for p in problems:
            if p.groups == 1:
                continue
            r = bench_tgmm(p, dtype, reps)
            t = r["t"]
            rate = 2 * p.m * p.k * p.n / t["dense"]
            must_move = dtype.itemsize * (p.m * p.k + p.m * p.n) + 4 * p.groups * p.k * p.n
            floor = max(2 * p.m * p.k * p.n / rate, must_move / bw)
            lines.append(
                f"| {dt} | {p.groups} | {_fmt(t['dense'] * 1e3)} | {_fmt(t['batched'] * 1e3)} | "
                f"{_fmt(t['loop'] * 1e3)} | {_fmt(floor * 1e3)} | {_fmt(t['numpy'] * 1e3)} | "
                f"{_fmt(t['tgmm'] * 1e3)} | {_fmt(t['xla'] * 1e3)} | "
                f"{_ratio(t['tgmm'], t['dense'])} | {_ratio(t['tgmm'], t['batched'])} | "
                f"{_ratio(t['loop'], t['batched'])} | {_ratio(t['tgmm'], t['loop'])} | "
                f"{_ratio(t['tgmm'], t['numpy'])} | {r['err']:.1e} |"
            )
            bar.write(lines[-1])
            bar.update()
    lines += [
        "",
        "## Compile time: one gmm forward + backward (G=8, m=4096, k=n=1024, f32)",
        "",
        "| op | lower (s) | compile (s) | total (s) | StableHLO chars |",
        "|---|---|---|---|---|",
    ]
    for name, matmul in (
        ("cv.gmm", lambda a, b, s: cv.gmm(a, b, s)),
        (
            "lax.ragged_dot",
            lambda a, b, s: lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32),
        ),
    ):
        c = compile_cost(matmul, max(1, min(reps, 3)))
        lines.append(
            f"| {name} | {c['lower']:.2f} | {c['compile']:.2f} | {c['lower'] + c['compile']:.2f} | "
            f"{c['chars']} |"
        )
        bar.write(lines[-1])
        bar.update()
    lines += [
        "",
        "## Two-layer MoE FFN, forward + backward",
        "",
        "Operands and weights in the row's dtype, every matmul returning float32 (the floors' "
        "einsums too).",
        "",
        "| dtype | G | tokens, d, f | batched floor | loop floor | cv.gmm | cv xla | ragged_dot | "
        "gmm/batched | loop/batched | gmm/loop | speed-up vs ragged_dot | max rel. grad diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dt, g in itertools.product(dtypes, ffn_groups):
        r = bench_moe_ffn(g, reps, dtype=jnp.dtype(dt))
        t = r["t"]
        lines.append(
            f"| {dt} | {g} | {r['shape']} | {_fmt(t['batched'] * 1e3)} | {_fmt(t['loop'] * 1e3)} | "
            f"{_fmt(t['gmm'] * 1e3)} | {_fmt(t['xla'] * 1e3)} | {_fmt(t['ragged_dot'] * 1e3)} | "
            f"{_ratio(t['gmm'], t['batched'])} | {_ratio(t['loop'], t['batched'])} | "
            f"{_ratio(t['gmm'], t['loop'])} | {t['ragged_dot'] / t['gmm']:.1f}x | {r['rel']:.1e} |"
        )
        bar.write(lines[-1])
        bar.update()
    bar.close()
    return "\n".join(lines) + "\n"
