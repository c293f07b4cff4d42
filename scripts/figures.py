"""The figures of docs/pipelining.md and docs/simulator.md, drawn by the simulator.

Regenerate: `python scripts/figures.py docs/figures`.
"""

from __future__ import annotations

import pathlib
import sys

from jax.experimental import pallas as pl

from conveyor.plans.pipeline import plan
from conveyor.plans.specs import BlockSpec
from conveyor.plans.warp import WarpSpecializedPlan
from conveyor.sim.simulate import simulate, simulate_collective_matmul


def _matmul_plan(stages: int, delay_release: int = 0, steps: int = 16):
    """One core's share of a bf16 matmul: two 128x128 output tiles, K in 64-wide steps."""
    return plan(
        grid=(2, steps // 2),
        in_specs=[
            BlockSpec((128, 64), lambda i, k: (i, k)),
            BlockSpec((64, 128), lambda i, k: (k, i)),
        ],
        out_specs=[BlockSpec((128, 128), lambda i, k: (i, 0))],
        max_concurrent_steps=stages,
        delay_release=delay_release,
    )


FLOPS = 2 * 128 * 128 * 64


def _experts_plan(rule: str):
    """A grouped matmul's inner loop: 4 experts x 4 row tiles of 32 rows; x changes every step, an
    expert's (256, 128) bf16 weights every 4 steps. `rule`: "every step" (as warp-specialized
    pipelines fetch), "on change" (plain pipelines) or "lookahead" (`pl.Buffered(2,
    use_lookahead=True)`)."""
    mode = pl.Buffered(2, use_lookahead=rule == "lookahead")
    return plan(
        grid=(4, 4),
        in_specs=[
            BlockSpec((32, 256), lambda e, i: (e * 4 + i, 0)),
            pl.BlockSpec((256, 128), lambda e, i: (e, 0), pipeline_mode=mode),
        ],
        out_specs=[BlockSpec((32, 128), lambda e, i: (e * 4 + i, 0))],
        max_concurrent_steps=2,
        reuse_unchanged_blocks=rule != "every step",
    )


EXPERT_FLOPS = 2 * 32 * 256 * 128


def figures() -> dict[str, tuple]:
    """name -> (report, title)."""
    out = {}
    for stages, name in ((1, "no-pipelining"), (2, "double-buffering"), (4, "four-stages")):
        r = simulate(_matmul_plan(stages), "h100", flops_per_step=FLOPS)
        out[name] = (
            r,
            f"max_concurrent_steps={stages}: {r.time_us:.1f} us for 16 steps "
            f"({r.bottleneck}-bound)",
        )
    r = simulate(_matmul_plan(3, 1), "h100", flops_per_step=FLOPS)
    out["delay-release"] = (
        r,
        f"max_concurrent_steps=3, delay_release=1: {r.time_us:.1f} us (two fetches in flight, one "
        "slot held for the in-flight matmul)",
    )
    wp = WarpSpecializedPlan(pipeline=_matmul_plan(3), num_compute_wgs=2)
    r = simulate(wp, "h100", flops_per_step=FLOPS)
    out["warp-specialized"] = (
        r,
        f"warp-specialized, 2 compute threads, 3 slots: {r.time_us:.1f} us",
    )
    chain = [
        WarpSpecializedPlan(pipeline=_matmul_plan(2, steps=8), num_compute_wgs=2) for _ in range(3)
    ]
    r = simulate(chain, "h100", flops_per_step=FLOPS)
    alone = sum(simulate(wp, "h100", flops_per_step=FLOPS).time_us for wp in chain)
    out["chained-pipelines"] = (
        r,
        f"3 warp-specialized pipelines chained (START, STEADY, STOP): {r.time_us:.1f} us; one "
        f"after another, each alone: {alone:.1f} us",
    )
    times = {
        rule: simulate(_experts_plan(rule), "h100", flops_per_step=EXPERT_FLOPS)
        for rule in ("every step", "on change", "lookahead")
    }
    out["lookahead"] = (
        times["lookahead"],
        "expert weights with use_lookahead: {:.1f} us; fetched on change: {:.1f} us; "
        "every step: {:.1f} us".format(
            *(times[r].time_us for r in ("lookahead", "on change", "every step"))
        ),
    )
    whole = plan(
        grid=(4, 8),
        in_specs=[
            BlockSpec((128, 64), lambda i, k: (i, k)),
            BlockSpec((64, 128), lambda i, k: (k, 0)),
        ],
        out_specs=[BlockSpec((128, 128), lambda i, k: (i, 0))],
        max_concurrent_steps=2,
        dimension_semantics=("parallel", "arbitrary"),
    )
    one = simulate(whole, "v5p", flops_per_step=FLOPS, active_cores=1)
    half = simulate(whole.for_core(0, 2), "v5p", flops_per_step=FLOPS, active_cores=2)
    out["megacore"] = (
        half,
        f"megacore on TPU v5p: TensorCore 0 of 2 runs rows 0-1 of 4: {half.time_us:.1f} us; one "
        f"core running all 4 rows: {one.time_us:.1f} us",
    )
    for bidi in (False, True):
        r = simulate_collective_matmul(
            "all_gather_matmul", 1024, 2048, 1024, 8, hardware="v5e", bidirectional=bidi
        )
        out["ring-" + ("bidirectional" if bidi else "unidirectional")] = (
            r,
            f"all_gather_matmul on 8 TPU v5e, {'bidirectional' if bidi else 'unidirectional'} "
            f"ring: {r.time_us:.0f} us ({r.bottleneck}-bound)",
        )
    return out


def main(outdir: str) -> None:
    path = pathlib.Path(outdir)
    path.mkdir(parents=True, exist_ok=True)
    for name, (report, title) in figures().items():
        report.save_png(path / f"{name}.png", title=title)
        print(f"{path / name}.png: {title}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/figures")
