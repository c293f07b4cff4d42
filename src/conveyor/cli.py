"""The `conveyor` command: demo | bench | simulate | check."""
from __future__ import annotations

import argparse
import pathlib
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor", description="Conveyor: pipelined kernels on JAX")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="MoE layer forward+backward through cv.gmm, checked and timed")
    b = sub.add_parser("bench", help="run a benchmark and print its table")
    b.add_argument("which", choices=["gmm", "pipeline", "collective", "mpmd"])
    b.add_argument("--reps", type=int, default=5, help="interleaved repetitions per candidate (median)")
    b.add_argument("--groups", default="1,8,64,256", help="comma-separated group counts")
    b.add_argument("--dtypes", default="float32,bfloat16")
    b.add_argument("--ffn-groups", default="8,64", help="group counts for the MoE FFN rows ('' to skip)")
    b.add_argument("--out", type=pathlib.Path, help="also write the markdown report here")
    b.add_argument("--platform", choices=["cpu", "gpu"], default="cpu",
                   help="gmm: 'gpu' runs the bf16 Mixtral-shape table on this machine's GPU")
    b.add_argument("--backends", default="mosaic_gpu,xla", help="gmm --platform gpu: cv.gmm backends to time")
    b.add_argument("--no-tgmm", action="store_true", help="gmm --platform gpu: skip the tgmm rows")
    sim = sub.add_parser("simulate", help="predict a kernel's time on a hardware model (see docs/simulator.md)")
    sim.add_argument("which", choices=["matmul", "gmm", "all-gather-matmul", "matmul-reduce-scatter", "copy"])
    sim.add_argument("--m", type=int, default=4096, help="rows (collectives: rows per device)")
    sim.add_argument("--k", type=int, default=4096)
    sim.add_argument("--n", type=int, default=4096, help="columns (all-gather-matmul: local columns)")
    sim.add_argument("--dtype", default="bf16")
    sim.add_argument("--hardware", default="h100", help="one of: h100, h200, h800, b200, v5e, v5p")
    sim.add_argument("--tile", help="bm,bn,bk (default: searched)")
    sim.add_argument("--stages", type=int, help="max_concurrent_steps (default: searched)")
    sim.add_argument("--delay-release", type=int, default=0)
    sim.add_argument("--warp-specialized", action="store_true")
    sim.add_argument("--compute-threads", type=int, default=2)
    sim.add_argument("--groups", type=int, default=8, help="gmm: number of groups")
    sim.add_argument("--sizes", help="gmm: comma-separated group sizes (default: m split evenly)")
    sim.add_argument("--devices", type=int, default=8)
    sim.add_argument("--unidirectional", action="store_true")
    sim.add_argument("--unfused", action="store_true", help="the collective, then the matmul")
    sim.add_argument("--buffering", type=int, default=2)
    sim.add_argument("--bytes", type=float, default=4e9, help="copy: bytes to copy")
    sim.add_argument("--json", action="store_true", help="print the report as JSON")
    sim.add_argument("--png", type=pathlib.Path, help="draw the timeline here")
    sim.add_argument("--trace", type=pathlib.Path, help="write a Chrome/Perfetto trace here")
    c = sub.add_parser("check", help="replay a pipeline or ring plan under every interleaving; exit 1 on a race "
                                     "or deadlock")
    c.add_argument("which", choices=["pipeline", "ring"])
    c.add_argument("--grid", default="6", help="pipeline grid, comma-separated (keep it small)")
    c.add_argument("--inputs", type=int, default=2, help="pipelined inputs (pipeline)")
    c.add_argument("--stages", type=int, default=2, help="max_concurrent_steps (pipeline)")
    c.add_argument("--delay-release", type=int, default=0)
    c.add_argument("--in-flight", type=int, default=0,
                   help="the body leaves async work reading its inputs for this many more steps")
    c.add_argument("--warp-specialized", action="store_true")
    c.add_argument("--compute-threads", type=int, default=2)
    c.add_argument("--devices", type=int, default=4, help="ring size (ring)")
    c.add_argument("--buffering", type=int, default=2, help="receive slots per device (ring)")
    c.add_argument("--unidirectional", action="store_true")
    c.add_argument("--scatter", action="store_true", help="reduce-scatter ring (partial sums travel)")
    c.add_argument("--no-credits", action="store_true", help="drop the credit protocol (expect a race)")
    c.add_argument("--max-states", type=int, default=200_000)
    return p


def _simulate(args) -> int:
    from conveyor import sim
    tile = tuple(int(v) for v in args.tile.split(",")) if args.tile else None
    if tile is not None and len(tile) != 3:
        raise SystemExit(f"--tile: expected bm,bn,bk, got {args.tile!r}")
    try:
        if args.which == "matmul":
            report = sim.simulate_matmul(args.m, args.k, args.n, dtype=args.dtype, hardware=args.hardware, tile=tile,
                                         stages=args.stages, warp_specialized=args.warp_specialized,
                                         compute_threads=args.compute_threads, delay_release=args.delay_release)
        elif args.which == "gmm":
            sizes = ([int(v) for v in args.sizes.split(",")] if args.sizes else
                     [args.m // args.groups + (i < args.m % args.groups) for i in range(args.groups)])
            report = sim.simulate_gmm(sizes, args.k, args.n, dtype=args.dtype, hardware=args.hardware, tile=tile,
                                      stages=args.stages)
        elif args.which == "copy":
            report = sim.simulate_copy(args.bytes, hardware=args.hardware)
        else:
            kind = "all_gather_matmul" if args.which == "all-gather-matmul" else "matmul_reduce_scatter"
            report = sim.simulate_collective_matmul(kind, args.m, args.k, args.n, args.devices, dtype=args.dtype,
                                                    hardware=args.hardware, bidirectional=not args.unidirectional,
                                                    buffering=args.buffering, unfused=args.unfused)
    except ValueError as e:   # unknown hardware or dtype, a configuration that does not fit
        print(f"conveyor simulate: {e}", file=sys.stderr)
        return 2
    if args.png:
        report.save_png(args.png)
    if args.trace:
        report.save_trace(args.trace)
    if args.json:
        print(report.to_json())
    else:
        d = report.to_dict()
        print(f"{report.workload} on {report.hardware.name}: {d['time_us']:.1f} us, {d['tflops']:.0f} TFLOP/s, "
              f"{d['utilization']:.0%} of roofline, {d['bottleneck']}-bound; config {d['config']}")
    return 0


def _check(args) -> int:
    from conveyor import sim
    if args.which == "ring":
        from conveyor.ops.collective_matmul.ring import RingPlan
        plan = RingPlan(args.devices, not args.unidirectional, args.buffering,
                        collective="scatter" if args.scatter else "gather")
        report = sim.check(plan, credits=not args.no_credits, max_states=args.max_states)
    else:
        from conveyor.pipeline import BlockSpec, plan as make_plan
        from conveyor.pipeline.warp import WarpSpecializedPlan
        grid = tuple(int(g) for g in args.grid.split(","))
        spec = BlockSpec((1,) * len(grid), lambda *idx: idx)
        p = make_plan(grid=grid, in_specs=[spec] * args.inputs, out_specs=[spec],
                      max_concurrent_steps=args.stages, delay_release=args.delay_release)
        if args.warp_specialized:
            p = WarpSpecializedPlan(p, "wg", args.compute_threads, args.compute_threads, 40, False)
        report = sim.check(p, in_flight_steps=args.in_flight, max_states=args.max_states)
    print(report)
    return 0 if report.ok else 1


def _bench_collective(args):
    """Run the collective benchmark on 8 simulated devices, re-launching with XLA_FLAGS if needed."""
    import os
    import subprocess
    import jax
    if jax.device_count() >= 8:
        from conveyor.bench import collective
        return collective.run(reps=args.reps)
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                      " --xla_force_host_platform_device_count=8").strip())
    code = ("import sys; from conveyor.bench import collective; "
            f"sys.stdout.write(collective.run(reps={int(args.reps)}))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        return None
    return proc.stdout


def _bench_options_ignored(args) -> str:
    """The options given that this bench would ignore (refused by name instead)."""
    defaults = _parser().parse_args(["bench", args.which])
    gpu_only, cpu_gmm_only = ("backends", "no_tgmm"), ("dtypes", "ffn_groups")
    if args.which != "gmm":
        names = ("platform", "groups", *gpu_only, *cpu_gmm_only)
    else:
        names = cpu_gmm_only if args.platform == "gpu" else gpu_only
    given = [n for n in names if getattr(args, n) != getattr(defaults, n)]
    return ", ".join("--" + n.replace("_", "-") for n in given)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from conveyor import demo
        return demo.run()
    if args.command == "check":
        return _check(args)
    if args.command == "simulate":
        return _simulate(args)
    if args.command == "bench":
        ints = lambda s: tuple(int(v) for v in s.split(",") if v)
        if (unused := _bench_options_ignored(args)):
            print(f"conveyor bench {args.which} --platform {args.platform}: {unused} not used here", file=sys.stderr)
            return 2
        if args.which == "collective":
            report = _bench_collective(args)
            if report is None:
                return 1
        elif args.which == "mpmd":
            from conveyor.bench import mpmd as bench_mpmd
            report = bench_mpmd.run(reps=args.reps)
        elif args.which == "pipeline":
            from conveyor.bench import pipeline as bench_pipeline
            report = bench_pipeline.run(reps=args.reps)
        elif args.platform == "gpu":
            from conveyor.bench import gmm_gpu
            groups = ints(args.groups) if args.groups != "1,8,64,256" else (8, 64, 256)
            report = gmm_gpu.run(reps=args.reps, groups=groups, backends=tuple(args.backends.split(",")),
                                 tgmm=not args.no_tgmm)
        else:
            from conveyor.bench import gmm as bench_gmm
            report = bench_gmm.run(reps=args.reps, groups=ints(args.groups), dtypes=tuple(args.dtypes.split(",")),
                                   ffn_groups=ints(args.ffn_groups))
        print(report)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(report)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
