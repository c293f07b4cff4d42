"""The `conveyor` command: demo | bench | check."""
from __future__ import annotations

import argparse
import pathlib
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conveyor", description="Conveyor: pipelined kernels on JAX")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="MoE layer forward+backward through cv.gmm, checked and timed")
    b = sub.add_parser("bench", help="run a benchmark and print its table")
    b.add_argument("which", choices=["gmm", "pipeline", "collective"])
    b.add_argument("--reps", type=int, default=5, help="interleaved repetitions per candidate (median)")
    b.add_argument("--groups", default="1,8,64,256", help="comma-separated group counts")
    b.add_argument("--dtypes", default="float32,bfloat16")
    b.add_argument("--ffn-groups", default="8,64", help="group counts for the MoE FFN rows ('' to skip)")
    b.add_argument("--out", type=pathlib.Path, help="also write the markdown report here")
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from conveyor import demo
        return demo.run()
    if args.command == "check":
        return _check(args)
    if args.command == "bench":
        if args.which == "collective":
            report = _bench_collective(args)
            if report is None:
                return 1
        elif args.which == "pipeline":
            from conveyor.bench import pipeline as bench_pipeline
            report = bench_pipeline.run(reps=args.reps)
        else:
            from conveyor.bench import gmm as bench_gmm
            ints = lambda s: tuple(int(v) for v in s.split(",") if v)
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
