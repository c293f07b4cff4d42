"""The `conveyor` command: demo | bench | simulate | check | compile-check.

Every bad argument is a one-line error and exit status 2 (argument types in cli_args.py, the
options a subcommand would ignore refused by name); a missing optional dependency says which
extra to install. No traceback reaches the user for either.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from conveyor import cli_args as t

# Optional dependencies and the extra that installs each.
EXTRAS = {"matplotlib": "plot", "optax": "demo", "equinox": "examples"}


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block) and point to --help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _parser() -> tuple[_Parser, dict[str, _Parser]]:
    p = _Parser(prog="conveyor", description="Conveyor: pipelined kernels on JAX")
    sub = p.add_subparsers(dest="command", required=True)
    subs = {
        "demo": sub.add_parser(
            "demo",
            help="run examples/demo.py of the source tree: an MoE layer through cv.gmm, checked, "
            "timed and trained",
        )
    }

    b = subs["bench"] = sub.add_parser("bench", help="run a benchmark and print its table")
    b.add_argument("which", choices=["gmm", "pipeline", "collective", "mpmd", "moe"])
    b.add_argument(
        "--reps",
        type=t.positive_int,
        default=5,
        help="interleaved repetitions per candidate (median)",
    )
    b.add_argument(
        "--groups",
        type=t.int_list(minimum=1),
        default=None,
        help="gmm: comma-separated group counts (default 1,8,64,256 on CPU, 8,64,256 on GPU)",
    )
    b.add_argument("--m", type=t.positive_int, help="gmm: rows (default 4096 on CPU, 8192 on GPU)")
    b.add_argument(
        "--k", type=t.positive_int, help="gmm: contraction size (default 1024 on CPU, 4096 on GPU)"
    )
    b.add_argument(
        "--n", type=t.positive_int, help="gmm: columns (default 1024 on CPU, 14336 on GPU)"
    )
    b.add_argument(
        "--dtypes",
        type=t.measured_dtypes,
        default=("float32", "bfloat16"),
        help=(
            "gmm on CPU: comma-separated input dtypes among f32/float32, bf16/bfloat16, f16/float16"
        ),
    )
    b.add_argument(
        "--ffn-groups",
        type=t.int_list(minimum=1, allow_empty=True),
        default=(8, 64),
        help="gmm on CPU: group counts for the MoE FFN rows ('' to skip)",
    )
    b.add_argument("--out", type=pathlib.Path, help="also write the markdown report here")
    b.add_argument(
        "--platform",
        choices=["cpu", "gpu"],
        default="cpu",
        help="gmm: 'gpu' runs the bf16 Mixtral-shape table on this machine's GPU",
    )
    b.add_argument(
        "--backends",
        type=t.gmm_backends,
        default=("mosaic_gpu", "xla"),
        help="gmm --platform gpu: comma-separated cv.gmm backends to time",
    )
    b.add_argument("--no-tgmm", action="store_true", help="gmm --platform gpu: skip the tgmm rows")

    s = subs["simulate"] = sub.add_parser(
        "simulate", help="predict a kernel's time on a hardware model (see docs/simulator.md)"
    )
    s.add_argument(
        "which",
        choices=[
            "matmul",
            "gmm",
            "tgmm",
            "all-gather-matmul",
            "matmul-reduce-scatter",
            "copy",
            "moe",
        ],
    )
    s.add_argument(
        "--m",
        type=t.positive_int,
        help="rows (default 4096; collectives: rows per device; gmm, tgmm: the sum of --sizes)",
    )
    s.add_argument("--k", type=t.positive_int, default=4096)
    s.add_argument(
        "--n", type=t.positive_int, default=4096, help="columns (all-gather-matmul: local columns)"
    )
    s.add_argument(
        "--dtype",
        type=t.dtype,
        default="bfloat16",
        help=(
            "bf16/bfloat16, f16/float16, f32/float32, fp8/float8_e4m3fn, int8 (the hardware "
            "decides)"
        ),
    )
    s.add_argument(
        "--hardware",
        type=t.hardware,
        default="h100",
        help="one of: h100, h200, h800, b200, v5e, v6e, v5p",
    )
    s.add_argument(
        "--tiling",
        type=t.tiling,
        help="tm,tk,tn, cv.gmm's tiling order; gmm/tgmm on GPU and TPU: the kernel run with these "
        "tiles (default: the kernel's own; matmul: searched)",
    )
    # the old bm,bn,bk spelling: refused with a pointer
    s.add_argument("--tile", help=argparse.SUPPRESS)
    s.add_argument("--stages", type=t.positive_int, help="max_concurrent_steps (default: searched)")
    s.add_argument("--delay-release", type=t.non_negative_int, default=0)
    s.add_argument("--warp-specialized", action="store_true")
    s.add_argument("--compute-threads", type=t.positive_int, default=2)
    s.add_argument(
        "--groups",
        type=t.positive_int,
        help="gmm, tgmm: number of groups (default 8, or len(--sizes))",
    )
    s.add_argument(
        "--sizes",
        type=t.int_list(minimum=0),
        help="gmm, tgmm: comma-separated group sizes (default: --m split evenly)",
    )
    s.add_argument(
        "--hypothetical",
        action="store_true",
        help=(
            "gmm, tgmm: price an operand dtype no cv.gmm kernel takes on the hardware, labelled "
            "hypothetical"
        ),
    )
    s.add_argument("--devices", type=t.positive_int, default=8)
    s.add_argument("--unidirectional", action="store_true")
    s.add_argument("--unfused", action="store_true", help="the collective, then the matmul")
    s.add_argument("--buffering", type=t.positive_int, default=2)
    s.add_argument("--bytes", type=t.positive_float, default=4e9, help="copy: bytes to copy")
    s.add_argument(
        "--shape",
        choices=["mixtral", "deepseek"],
        default="mixtral",
        help="moe: the layer (docs/moe.md): Mixtral 8x7B's or DeepSeek-V3's, 4096 tokens per chip",
    )
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("--png", type=pathlib.Path, help="draw the timeline here (needs conveyor[plot])")
    s.add_argument("--trace", type=pathlib.Path, help="write a Chrome/Perfetto trace here")

    c = subs["check"] = sub.add_parser(
        "check",
        help=(
            "replay a pipeline, ring or MoE exchange plan under every interleaving; exit 1 on a "
            "race or deadlock"
        ),
    )
    c.add_argument("which", choices=["pipeline", "ring", "exchange"])
    c.add_argument(
        "--grid",
        type=t.int_list(minimum=1),
        default=(6,),
        help="pipeline grid, comma-separated (keep it small: the states grow exponentially)",
    )
    c.add_argument("--inputs", type=t.positive_int, default=2, help="pipelined inputs (pipeline)")
    c.add_argument(
        "--stages", type=t.positive_int, default=2, help="max_concurrent_steps (pipeline)"
    )
    c.add_argument("--delay-release", type=t.non_negative_int, default=0)
    c.add_argument(
        "--in-flight",
        type=t.non_negative_int,
        default=0,
        help="the body leaves async work reading its inputs for this many more steps",
    )
    c.add_argument("--warp-specialized", action="store_true")
    c.add_argument("--compute-threads", type=t.positive_int, default=2)
    c.add_argument("--devices", type=t.positive_int, default=4, help="ring size (ring, exchange)")
    c.add_argument(
        "--buffering",
        type=t.positive_int,
        default=2,
        help="receive slots per device and stream (ring, exchange)",
    )
    c.add_argument("--unidirectional", action="store_true")
    c.add_argument(
        "--scatter", action="store_true", help="reduce-scatter ring (partial sums travel)"
    )
    c.add_argument(
        "--no-credits", action="store_true", help="drop the credit protocol (expect a race)"
    )
    c.add_argument(
        "--expert-stages",
        type=t.positive_int,
        help="exchange: the expert-staged plan with this many stages (default: per peer)",
    )
    c.add_argument(
        "--max-states",
        type=t.positive_int,
        default=200_000,
        help="states explored exhaustively; then random interleavings are sampled",
    )
    c.add_argument(
        "--max-seconds",
        type=t.positive_float,
        default=60.0,
        help="time budget; the report then says it stopped and shows what it found so far",
    )
    c.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    _compile_check_parser(sub, subs)
    return p, subs


def _compile_check_parser(sub, subs) -> None:
    c = subs["compile-check"] = sub.add_parser(
        "compile-check",
        help=(
            "compile kernels with the real compilers for H100 / TPU chips this host does not have "
            "(see docs/compile-check.md)"
        ),
    )
    c.add_argument(
        "which",
        choices=["production", "gmm", "tgmm", "all-gather-matmul", "matmul-reduce-scatter"],
        help="production: every kernel at the sizes it exists for; or one op at your shape",
    )
    c.add_argument("--target", type=t.compile_targets, help="comma-separated: h100, v5e, v6e, v5p")
    c.add_argument("--m", type=t.positive_int, help="gmm, tgmm: rows (tokens)")
    c.add_argument("--k", type=t.positive_int, help="gmm, tgmm: contraction size")
    c.add_argument("--n", type=t.positive_int, help="gmm, tgmm: columns")
    c.add_argument("--groups", type=t.positive_int, default=8, help="gmm, tgmm: groups")
    c.add_argument("--grad", action="store_true", help="gmm, rings: compile the gradient too")
    c.add_argument("--devices", type=t.positive_int, default=8, help="rings: chips (4 or 8)")
    c.add_argument(
        "--shard",
        type=t.positive_int,
        default=1024,
        help="rings: every per-device operand is shard x shard",
    )
    c.add_argument(
        "--dim", type=int, choices=[0, 1], default=0, help="rings: gather_dim / scatter_dim"
    )
    c.add_argument("--unidirectional", action="store_true", help="rings: one direction")
    c.add_argument(
        "--allow-refused",
        action="store_true",
        help="exit 0 when Conveyor itself refuses a case (its error is printed)",
    )
    c.add_argument(
        "--timeout", type=t.positive_float, default=600.0, help="seconds one compile may take"
    )
    c.add_argument(
        "--jobs",
        type=t.positive_int,
        default=2,
        help="compiles at a time (each in its own process; a TPU compile peaks at about 1.3 GB)",
    )
    c.add_argument("--out", type=pathlib.Path, help="also write the markdown table here")


def _compile_cases(args, fail) -> list:
    """The cases `compile-check` was asked for."""
    from conveyor import compile_check as cc

    if args.which == "production":
        return cc.production()
    if args.which in ("gmm", "tgmm"):
        missing = [f"--{d}" for d in "mkn" if getattr(args, d) is None]
        if missing:
            fail(f"argument {', '.join(missing)}: required by '{args.which}'")
        shape = dict(m=args.m, k=args.k, n=args.n, groups=args.groups)
        if args.which == "tgmm":
            return [cc.case("tgmm", **shape)]
        return [cc.case("gmm", **shape, grad=args.grad)]
    op = args.which.replace("-", "_")
    return [
        cc.case(
            "ring",
            op=op,
            devices=args.devices,
            shard=args.shard,
            dim=args.dim,
            bidirectional=not args.unidirectional,
            grad=args.grad,
        )
    ]


def _compile_check(args, fail) -> int:
    from conveyor import compile_check as cc
    from conveyor.compile_check.device import MissingToolchain, require_toolchain

    if args.target is None:
        fail("argument --target: required (comma-separated: h100, v5e, v6e, v5p)")
    targets = [cc.target(name) for name in args.target]
    cases = _compile_cases(args, fail)
    if args.which in ("all-gather-matmul", "matmul-reduce-scatter"):
        for target in targets:
            if target.platform != "tpu":
                fail(f"argument --target: {args.which} has a kernel on TPU only, got {target.name}")
            if args.devices not in target.topologies:
                fail(
                    f"argument --devices: {target.name} is compiled for "
                    f"{sorted(target.topologies)} chips, got {args.devices}"
                )
    for target in targets:
        try:
            require_toolchain(target)
        except MissingToolchain as e:
            fail(str(e))
    rows = cc.run(cases, targets, timeout_s=args.timeout, jobs=args.jobs)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(cc.markdown(rows) + "\n")
    allowed = {"ok", "refused"} if args.allow_refused else {"ok"}
    bad = [r for r in rows if cc.verdict(r) not in allowed]
    print(
        f"{len(rows) - len(bad)} of {len(rows)} kernels "
        + ("compiled or refused" if args.allow_refused else "compiled")
        + " cleanly"
    )
    return 1 if bad else 0


# The options each subcommand's variants use; any other option given is refused by name.
_SIMULATE_USES = {
    "matmul": {
        "m",
        "k",
        "n",
        "dtype",
        "hardware",
        "tiling",
        "stages",
        "delay_release",
        "warp_specialized",
        "compute_threads",
    },
    "gmm": {
        "m",
        "k",
        "n",
        "dtype",
        "hardware",
        "tiling",
        "stages",
        "groups",
        "sizes",
        "hypothetical",
    },
    "tgmm": {
        "m",
        "k",
        "n",
        "dtype",
        "hardware",
        "tiling",
        "stages",
        "groups",
        "sizes",
        "hypothetical",
    },
    "copy": {"bytes", "hardware"},
    "all-gather-matmul": {
        "m",
        "k",
        "n",
        "devices",
        "dtype",
        "hardware",
        "unidirectional",
        "unfused",
        "buffering",
    },
}
_SIMULATE_USES["matmul-reduce-scatter"] = _SIMULATE_USES["all-gather-matmul"]
_SIMULATE_USES["moe"] = {"shape", "devices", "dtype", "hardware", "buffering"}
_RING_OPTIONS = {"devices", "shard", "dim", "unidirectional", "grad"}
_COMPILE_CHECK_USES = {
    "production": set(),
    "gmm": {"m", "k", "n", "groups", "grad"},
    "tgmm": {"m", "k", "n", "groups"},
    "all-gather-matmul": _RING_OPTIONS,
    "matmul-reduce-scatter": _RING_OPTIONS,
}
_CHECK_USES = {
    "pipeline": {
        "grid",
        "inputs",
        "stages",
        "delay_release",
        "in_flight",
        "warp_specialized",
        "compute_threads",
    },
    "ring": {"devices", "buffering", "unidirectional", "scatter", "no_credits"},
    "exchange": {"devices", "buffering", "unidirectional", "no_credits", "expert_stages"},
}


def _bench_uses(args) -> set[str]:
    if args.which != "gmm":
        return set()
    if args.platform == "gpu":
        return {"platform", "groups", "m", "k", "n", "backends", "no_tgmm"}
    return {"platform", "groups", "m", "k", "n", "dtypes", "ffn_groups"}


def _unused(sub: _Parser, args, uses: set[str], always: set[str]) -> str:
    """The options given (not at their default) that this variant would ignore, as '--a, --b'."""
    defaults = sub.parse_args([args.which])
    names = [n for n in vars(args) if n not in uses | always | {"command", "which"}]
    return ", ".join(
        "--" + n.replace("_", "-") for n in names if getattr(args, n) != getattr(defaults, n)
    )


def _simulate_moe(args) -> int:
    """The expert-parallel layer's three exchanges side by side (`conveyor.sim.moe`)."""
    from conveyor.sim import moe

    for name in ("json", "png", "trace"):
        if getattr(args, name):
            raise ValueError(
                f"--{name}: 'simulate moe' prints a table of three layers; use "
                "cv.sim.simulate_moe_layer(...) for one layer's report"
            )
    print(
        moe.markdown_table(
            args.shape,
            devices=args.devices,
            hardware=args.hardware,
            dtype=args.dtype,
            buffering=args.buffering,
        )
    )
    return 0


def _simulate(args, fail) -> int:
    from conveyor import sim

    if args.which == "moe":
        return _simulate_moe(args)
    m = args.m if args.m is not None else 4096
    if args.which == "matmul":
        report = sim.simulate_matmul(
            m,
            args.k,
            args.n,
            dtype=args.dtype,
            hardware=args.hardware,
            tiling=args.tiling,
            stages=args.stages,
            warp_specialized=args.warp_specialized,
            compute_threads=args.compute_threads,
            delay_release=args.delay_release,
        )
    elif args.which in ("gmm", "tgmm"):
        simulate = sim.simulate_gmm if args.which == "gmm" else sim.simulate_tgmm
        report = simulate(
            _group_sizes(args, fail),
            args.k,
            args.n,
            dtype=args.dtype,
            hardware=args.hardware,
            tiling=args.tiling,
            stages=args.stages,
            hypothetical=args.hypothetical,
        )
    elif args.which == "copy":
        report = sim.simulate_copy(args.bytes, hardware=args.hardware)
    else:
        kind = "all_gather_matmul" if args.which == "all-gather-matmul" else "matmul_reduce_scatter"
        report = sim.simulate_collective_matmul(
            kind,
            m,
            args.k,
            args.n,
            args.devices,
            dtype=args.dtype,
            hardware=args.hardware,
            bidirectional=not args.unidirectional,
            buffering=args.buffering,
            unfused=args.unfused,
        )
    # Print first: a missing plotting extra must not lose the numbers that were asked for.
    if args.json:
        print(report.to_json())
    else:
        d = report.to_dict()
        print(
            f"{report.workload} on {report.hardware.name}: {d['time_us']:.1f} us, "
            f"{d['tflops']:.0f} TFLOP/s, {d['utilization']:.0%} of roofline, "
            f"{d['bottleneck']}-bound; config {d['config']}"
        )
        if d["timeline_coverage"]:
            print(d["timeline_coverage"])
    if args.trace:
        report.save_trace(args.trace)
    if args.png:
        report.save_png(args.png)
    return 0


def _group_sizes(args, fail) -> list[int]:
    """--sizes, --m and --groups describe one split: they must agree, nothing is silently
    dropped."""
    if args.sizes is None:
        m, groups = (
            (args.m if args.m is not None else 4096),
            (args.groups if args.groups is not None else 8),
        )
        return [m // groups + (i < m % groups) for i in range(groups)]
    sizes = list(args.sizes)
    if args.groups is not None and args.groups != len(sizes):
        fail(
            f"argument --groups: {args.groups} disagrees with --sizes ({len(sizes)} groups); give "
            "one of them"
        )
    if args.m is not None and args.m != sum(sizes):
        fail(
            f"argument --m: {args.m} disagrees with --sizes (they sum to {sum(sizes)}); give one "
            "of them"
        )
    if not sum(sizes):
        fail("argument --sizes: every group is empty; at least one size must be positive")
    return sizes


def _check(args) -> int:
    from conveyor import sim

    budget = dict(
        max_states=args.max_states,
        max_seconds=args.max_seconds,
        progress=sys.stderr.isatty() if args.progress is None else args.progress,
    )
    if args.which == "ring":
        from conveyor.plans.ring import ring_plan

        plan = ring_plan(
            collective="scatter" if args.scatter else "gather",
            num_devices=args.devices,
            bidirectional=not args.unidirectional,
            buffering=args.buffering,
        )
        report = sim.check(plan, credits=not args.no_credits, **budget)
    elif args.which == "exchange":
        from conveyor.plans.exchange import exchange_plan, staged_exchange_plan

        if args.expert_stages is not None and args.unidirectional:
            raise ValueError(
                "--unidirectional: the expert-staged exchange (--expert-stages) sends to every "
                "peer at once; it has no direction to choose"
            )
        plan = (
            staged_exchange_plan(
                num_devices=args.devices, stages=args.expert_stages, buffering=args.buffering
            )
            if args.expert_stages is not None
            else exchange_plan(
                num_devices=args.devices,
                bidirectional=not args.unidirectional,
                buffering=args.buffering,
            )
        )
        report = sim.check(plan, credits=not args.no_credits, **budget)
    else:
        from conveyor.pipeline import BlockSpec, plan as make_plan
        from conveyor.plans.warp import WarpSpecializedPlan

        grid = tuple(args.grid)
        spec = BlockSpec((1,) * len(grid), lambda *idx: idx)
        p = make_plan(
            grid=grid,
            in_specs=[spec] * args.inputs,
            out_specs=[spec],
            max_concurrent_steps=args.stages,
            delay_release=args.delay_release,
        )
        if args.warp_specialized:
            p = WarpSpecializedPlan(pipeline=p, num_compute_wgs=args.compute_threads)
        report = sim.check(p, in_flight_steps=args.in_flight, **budget)
    print(report)
    return 0 if report.ok else 1


def _bench_on_8_devices(name: str, args):
    """Run `conveyor.bench.<name>.run` on 8 simulated devices, re-launching with XLA_FLAGS if
    needed."""
    import importlib
    import os
    import subprocess
    import jax

    if jax.device_count() >= 8:
        return importlib.import_module(f"conveyor.bench.{name}").run(reps=args.reps)
    env = dict(
        os.environ,
        XLA_FLAGS=(
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip(),
    )
    code = (
        f"import sys; from conveyor.bench import {name}; "
        f"sys.stdout.write({name}.run(reps={int(args.reps)}))"
    )
    # The report comes back on stdout; progress rows and errors pass through on stderr.
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, timeout=3600
    )
    return None if proc.returncode else proc.stdout


def _bench(args) -> int:
    if args.which in ("collective", "moe"):
        report = _bench_on_8_devices(args.which, args)
        if report is None:
            return 1
    elif args.which == "mpmd":
        from conveyor.bench import mpmd as bench_mpmd

        report = bench_mpmd.run(reps=args.reps)
    elif args.which == "pipeline":
        from conveyor.bench import pipeline as bench_pipeline

        report = bench_pipeline.run(reps=args.reps)
    else:
        from conveyor.problems import BENCH_GMM, BENCH_GMM_GPU

        table = BENCH_GMM_GPU if args.platform == "gpu" else BENCH_GMM
        shape = (args.m or table[0].m, args.k or table[0].k, args.n or table[0].n)
        groups = args.groups or tuple(p.groups for p in table)
        if args.platform == "gpu":
            from conveyor.bench import gmm_gpu

            report = gmm_gpu.run(
                reps=args.reps,
                groups=groups,
                backends=args.backends,
                tgmm=not args.no_tgmm,
                shape=shape,
            )
        else:
            from conveyor.bench import gmm as bench_gmm

            report = bench_gmm.run(
                reps=args.reps,
                groups=groups,
                dtypes=args.dtypes,
                ffn_groups=args.ffn_groups,
                shape=shape,
            )
    print(report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser, subs = _parser()
    args = parser.parse_args(argv)
    sub = subs[args.command]
    if args.command == "demo":
        return _demo(sub)
    if args.command == "simulate":
        for name in ("png", "trace"):
            path = getattr(args, name)
            if path is not None and not path.parent.is_dir():
                sub.error(
                    f"argument --{name}: folder {str(path.parent)!r} does not exist (for "
                    f"{str(path)!r})"
                )
    if args.command == "simulate" and args.tile is not None:
        sub.error(
            "argument --tile: renamed --tiling, in cv.gmm's order tm,tk,tn (--tile was bm,bn,bk); "
            f"got {args.tile!r}"
        )
    uses = {
        "simulate": lambda: _SIMULATE_USES[args.which],
        "check": lambda: _CHECK_USES[args.which],
        "bench": lambda: _bench_uses(args),
        "compile-check": lambda: _COMPILE_CHECK_USES[args.which],
    }[args.command]()
    always = {
        "simulate": {"json", "png", "trace", "tile"},
        "check": {"max_states", "max_seconds", "progress"},
        "bench": {"reps", "out"},
        "compile-check": {"target", "allow_refused", "timeout", "jobs", "out"},
    }[args.command]
    if unused := _unused(sub, args, uses, always):
        variant = args.which + (
            f" --platform {args.platform}"
            if args.command == "bench" and args.which == "gmm"
            else ""
        )
        sub.error(f"{unused} not used by '{args.command} {variant}'")
    if args.command == "bench":  # a ValueError inside a benchmark is a bug: its traceback is kept
        return _run(lambda: _bench(args), sub)
    if args.command == "compile-check":
        return _run(lambda: _compile_check(args, sub.error), sub)
    run = (
        (lambda: _simulate(args, sub.error))
        if args.command == "simulate"
        else (lambda: _check(args))
    )
    return _run(run, sub, refused=ValueError)


def _demo(sub: _Parser) -> int:
    """The demo is an example, not library code: run examples/demo.py of the source tree this
    package is installed from (an editable install); an installed wheel has none."""
    import subprocess

    script = pathlib.Path(__file__).resolve().parents[2] / "examples" / "demo.py"
    if not script.is_file():
        sub.error(
            f"the demo is examples/demo.py of Conveyor's source tree, not part of the installed "
            f"package (looked for {script}); run it from a clone: `make demo`"
        )
    return subprocess.call([sys.executable, str(script)])


def _run(fn, sub: _Parser, refused: type[Exception] | tuple = ()) -> int:
    """Run a subcommand: a configuration the library refuses (`refused`) is exit 2, a missing extra
    exit 1."""
    try:
        return fn()
    except refused as e:  # unknown hardware, a tiling that does not fit, a plan the library refuses
        sub.error(str(e))
    except ModuleNotFoundError as e:
        if e.name not in EXTRAS:
            raise
        print(
            f"{sub.prog}: {e.name} is not installed; pip install 'conveyor[{EXTRAS[e.name]}]'",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print(f"{sub.prog}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
