"""The `conveyor` command: demo | bench."""
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
    return p


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
