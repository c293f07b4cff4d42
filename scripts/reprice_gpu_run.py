"""Re-price a committed `conveyor bench gmm --platform gpu` table with today's simulator: each
mosaic_gpu row at the device's datasheet model and at the run's own rates (the model's matrix
fraction fitted to the run's dense jnp.dot row, its HBM fraction to the run's copy bandwidth).

    python scripts/reprice_gpu_run.py benchmarks/results/gmm-gpu-2026-11-30.md --hardware h200 \
        --copy-tbs 3.85

`--copy-tbs`: the run's copy bandwidth (read + write), when its table does not print it (tables
before 2026-12 did not). Group sizes are the benchmark's (`skewed_group_sizes`, its seeds).
"""

from __future__ import annotations

import argparse
import re
import sys

import conveyor as cv
from conveyor.problems import BENCH_GMM_GPU, skewed_group_sizes
from conveyor.sim.calibrate import at_measured_rates

SECTION = re.compile(r"^### (gmm|tgmm), G=(\d+)")
KERNEL_ROW = re.compile(r"^cv\.(gmm|tgmm) mosaic_gpu(?: tiling=\((\d+), (\d+), (\d+)\))?$")


def measured(path: str) -> dict[tuple[str, int], dict[str, float]]:
    """{(op, G): {row name: ms}} from the table's sections."""
    out, key = {}, None
    for line in open(path, encoding="utf-8"):
        m = SECTION.match(line)
        if m:
            key = (m.group(1), int(m.group(2)))
            out[key] = {}
        elif key and line.startswith("| ") and not line.startswith("| candidate"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[1] not in ("-", ""):
                out[key][cells[0]] = float(cells[1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table")
    ap.add_argument("--hardware", required=True)
    ap.add_argument("--copy-tbs", type=float, required=True)
    args = ap.parse_args(argv)
    p = BENCH_GMM_GPU[0]
    m, k, n = p.m, p.k, p.n
    print(
        "| op | G | tiling | measured ms | simulated ms | measured / simulated | simulated at the "
        "run's rates ms | measured / simulated at the run's rates | fitted matrix fraction |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (op, groups), rows in sorted(measured(args.table).items()):
        if "dense jnp.dot" not in rows:
            continue
        dense_mkn = (m, k, n) if op == "gmm" else (k, m, n)
        run = at_measured_rates(
            args.hardware,
            matmul=(*dense_mkn, rows["dense jnp.dot"] / 1e3),
            copy_bytes_per_s=args.copy_tbs * 1e12,
        )
        seed = groups if op == "gmm" else 100 + groups  # the benchmark's seeds
        sizes = [int(x) for x in skewed_group_sizes(m, groups, seed=seed, alpha=p.alpha)]
        simulate = cv.sim.simulate_gmm if op == "gmm" else cv.sim.simulate_tgmm
        for name, kernel in rows.items():
            row = KERNEL_ROW.match(name)
            if row is None:
                continue
            tiling = None if row.group(2) is None else tuple(int(x) for x in row.group(2, 3, 4))
            sheet, at_run = (
                simulate(sizes, k, n, dtype="bf16", hardware=hw, tiling=tiling).time_s * 1e3
                for hw in (args.hardware, run)
            )
            print(
                f"| {op} | {groups} | {tiling or 'default'} | {kernel:.3f} | {sheet:.3f} | "
                f"{kernel / sheet:.2f} | {at_run:.3f} | {kernel / at_run:.2f} | "
                f"{run.matrix_efficiency.value:.3f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
