"""Compile cases for targets, each in a child process, and tabulate the verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Iterable

from conveyor.compile_check.cases import Case
from conveyor.compile_check.targets import Target

MiB = 2**20


def run_one(case: Case, target: Target, *, timeout_s: float) -> dict:
    """`case` compiled for `target` in a fresh Python (this interpreter): its report, or a
    "failed" report when the child died or ran past `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix="conveyor-compile-") as dump:
        env = dict(os.environ, MOSAIC_GPU_DUMP_TO=dump, JAX_PLATFORMS="cpu")
        env.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no cloud metadata server to ask
        env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no TPU lock: nothing runs
        request = json.dumps(
            {"kind": case.kind, "params": case.params, "target": target.name, "dump": dump}
        )
        cmd = [sys.executable, "-m", "conveyor.compile_check.child", request]
        t0 = time.perf_counter()
        try:
            child = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {
                "status": "failed",
                "error": f"no verdict within {timeout_s:.0f} s",
                "kernels": [],
                "seconds": round(time.perf_counter() - t0, 1),
            }
        lines = [ln for ln in child.stdout.splitlines() if ln.startswith("{")]
        if child.returncode == 0 and lines:
            return json.loads(lines[-1])
        tail = child.stderr.strip().splitlines()[-3:]
        return {
            "status": "failed",
            "kernels": [],
            "error": f"compiling process died (exit {child.returncode}): " + " | ".join(tail),
            "seconds": round(time.perf_counter() - t0, 1),
        }


def run(
    cases: Iterable[Case],
    targets: Iterable[Target],
    *,
    timeout_s: float = 600,
    jobs: int = 2,
    progress=print,
) -> list[dict]:
    """Every case on every target it applies to, `jobs` compiles at a time; one row dict per
    (case, target), in the order of `targets`, then `cases`."""
    from concurrent.futures import ThreadPoolExecutor

    from conveyor.compile_check.cases import applies, simulated_onchip, simulated_xla_op_bytes

    cases = list(cases)
    work = [(c, t) for t in targets for c in cases if applies(c, t.platform)]

    def one(pair):
        case, target = pair
        row = {
            "target": target.name,
            "case": case.name,
            "simulated_onchip": simulated_onchip(case, target.name),
            "simulated_xla_op_bytes": simulated_xla_op_bytes(case, target.name),
            **run_one(case, target, timeout_s=timeout_s),
        }
        progress(line(row))
        return row

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, work))


# How far the simulator's on-chip count may fall below the compiler's report: the GPU report adds
# the kernel's barriers (tens of bytes), libtpu 56 KiB of its own to a float32 gmm's 3.75 MiB.
# Counting more than the compiler is reported, not failed: with a single k tile, or a problem
# smaller than one tile, libtpu holds fewer buffers than the kernel's blocks
# (docs/compile-check.md).
ONCHIP_TOLERANCE = 0.02
# How far the simulator's price of an MoE layer's XLA passes may be from the compiled program's
# count, either way: the model counts what the layer asks for, the compiler adds copies and keeps
# small arrays on chip (at the production shapes, see benchmarks/results/compile-check-*.md).
PASSES_TOLERANCE = 0.25


def onchip(kernel: dict) -> int:
    """The on-chip bytes the compiler reported for a kernel (TPU scoped VMEM, GPU shared memory)."""
    return kernel["vmem"] if "vmem" in kernel else kernel["smem"]


def verdict(row: dict) -> str:
    """ "ok", or what is wrong: the compiler refused it, an aliased Mosaic GPU kernel sits in a
    dynamic-slice fusion ("alias lost": its writes would be lost), a kernel spills, a kernel is
    over the chip's on-chip memory, or the simulator counts less of a kernel's on-chip memory
    than the compiler reported ("sim onchip": it would call fitting what the chip may refuse), or
    the bytes it prices for the XLA ops between an MoE layer's kernels differ from the compiled
    program's by more than PASSES_TOLERANCE ("sim passes"). A case Conveyor refused itself is
    "refused" (not wrong)."""
    if row["status"] != "compiled":
        return row["status"]
    if row.get("lost_aliases"):
        return "alias lost"
    for k in row["kernels"]:
        if k.get("spill_stores") or k.get("spill_loads"):
            return "spills"
        if "smem" in k and k["smem"] > k["smem_limit"]:
            return "smem over"
    sim = row.get("simulated_onchip")
    if sim is not None and (
        len(row["kernels"]) != 1 or onchip(row["kernels"][0]) - sim > ONCHIP_TOLERANCE * sim
    ):
        return "sim onchip"
    priced, moved = row.get("simulated_xla_op_bytes"), row.get("xla_op_bytes")
    if priced is not None and moved and abs(priced / moved - 1) > PASSES_TOLERANCE:
        return "sim passes"
    return "ok"


def line(row: dict) -> str:
    """One line for a terminal: target, case, verdict, then the kernels or the error."""
    head = f"{row['target']:5s} {row['case']:80s} {verdict(row):8s} {row['seconds']:6.1f}s"
    if row["status"] != "compiled":
        return f"{head}  {row['error'].splitlines()[0][:200]}"
    return f"{head}  " + "; ".join(
        [kernel_summary(k) for k in row["kernels"]] + exchanges(row) + simulated(row)
    )


def simulated(row: dict) -> list[str]:
    """The simulator's count of the kernel's on-chip memory, where it models the case."""
    sim = row.get("simulated_onchip")
    return [f"cv.sim counts {sim / MiB:.2f} MiB"] if sim is not None else []


def exchanges(row: dict) -> list[str]:
    """The compiled program's all-to-all exchanges, its temporaries in device memory and the
    bytes it accesses (XLA's cost analysis) and those XLA's own ops move (`device.xla_op_bytes`),
    when the case runs on several chips."""
    found = row.get("collectives")
    out = [", ".join(f"{name} x{n}" for name, n in sorted(found.items()))] if found else []
    if row.get("hbm_temp") is not None:
        out.append(f"temporaries {row['hbm_temp'] / 1e9:.2f} GB per chip")
    if row.get("bytes_accessed") is not None:
        out.append(f"accesses {row['bytes_accessed'] / 1e9:.2f} GB per chip")
    if row.get("xla_op_bytes") is not None:
        sim = row.get("simulated_xla_op_bytes")
        priced = f" (cv.sim prices {sim / 1e9:.2f})" if sim is not None else ""
        out.append(f"XLA's own ops move {row['xla_op_bytes'] / 1e9:.2f} GB per chip{priced}")
    if row.get("largest_xla_ops"):
        out.append("largest: " + ", ".join(row["largest_xla_ops"]))
    return out


def kernel_summary(k: dict) -> str:
    if "vmem" in k:
        return f"VMEM {k['vmem'] / MiB:.2f} MiB (default limit {k['vmem_default'] / MiB:.0f})"
    split = "dropped" if k["split_dropped"] else ("kept" if k["split_in_ptx"] else "none")
    text = (
        f"{k['registers']} regs, spills {k['spill_stores']}/{k['spill_loads']} B, smem "
        f"{k['smem']}/{k['smem_limit']} B, split {split}"
    )
    s = k.get("standalone")
    if s:
        text += (
            f" (ptxas alone: {s['registers']} regs, spills {s['spill_stores']}/{s['spill_loads']} "
            "B)"
        )
    return text


def markdown(rows: list[dict]) -> str:
    """The table committed under benchmarks/results/."""
    out = ["| target | case | verdict | s | kernels or error |", "|---|---|---|---|---|"]
    for r in rows:
        if r["status"] == "compiled":
            what = (
                "<br>".join([kernel_summary(k) for k in r["kernels"]] + exchanges(r) + simulated(r))
                or "no Mosaic kernel"
            )
        else:
            what = r["error"].splitlines()[0][:160].replace("|", "/")
        out.append(f"| {r['target']} | {r['case']} | {verdict(r)} | {r['seconds']:.1f} | {what} |")
    return "\n".join(out)
