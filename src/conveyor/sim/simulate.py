"""Replaying plans against a hardware model to predict time and draw the timeline.

Design notes: docs/internals/simulator.md, section `sim/simulate.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

from conveyor import dtypes
from conveyor.plans.ring import RingBlocks, RingPlan, ring_plan
from conveyor.ops.gmm.metadata import count_row_blocks, count_shared_blocks, count_visits
from conveyor.ops.gmm import backend_impls, gpu_blocks, tpu_blocks
from conveyor.ops.gmm.tiling import MOSAIC_GPU, tpu_default
from conveyor.plans.pipeline import PipelinePlan, plan as make_plan
from conveyor.plans.program import Copy
from conveyor.plans.sequence import as_sequence, operand_sizes, Prefetched, sequence_program
from conveyor.plans.specs import BlockSpec
from conveyor.plans.warp import as_chain, chain_program, WarpSpecializedPlan
from conveyor.sim.hardware import Hardware, get as get_hardware
from conveyor.sim import timed
from conveyor.sim.report import Box, Report
from conveyor.sim.timed import Timing

REPLAYED_TILES = 4


def _check_positive(where: str, **values: float) -> None:
    """Sizes are positive numbers: a zero or negative one is a ValueError naming it."""
    for name, v in values.items():
        if v is not None and not v > 0:
            raise ValueError(f"{where}: {name} must be positive, got {v}")


def _tiling_to_tile(tiling: Sequence[int] | None, where: str) -> tuple[int, int, int] | None:
    """cv.gmm's tiling order (tm, tk, tn) -> the matmul model's (bm, bn, bk)."""
    if tiling is None:
        return None
    if len(tiling) != 3:
        raise ValueError(f"{where}: tiling must be (tm, tk, tn), got {tuple(tiling)}")
    tm, tk, tn = (int(x) for x in tiling)
    _check_positive(where, tm=tm, tk=tk, tn=tn)
    return tm, tn, tk


class DoesNotFit(ValueError):
    """A configuration needs more on-chip memory than a core has, or than the kernel may hold."""


def check_fits(what: str, used: float, hw: Hardware, vmem_limit_bytes: int | None) -> None:
    """Raise DoesNotFit when `used` bytes are over what a kernel may hold per core on `hw`
    (`Hardware.onchip_limit`: its `vmem_limit_bytes`, else the chip's default limit)."""
    _check_vmem_limit(vmem_limit_bytes)
    limit = hw.onchip_limit(vmem_limit_bytes)
    if used <= limit:
        return
    physical = int(hw.onchip_bytes.value)
    message = f"{what} needs {used / 1024:.0f} KiB of on-chip memory per core; "
    if used > physical:
        message += f"{hw.name} has {physical / 1024:.0f} KiB"
    elif vmem_limit_bytes is not None:
        message += f"vmem_limit_bytes allows {limit / 1024:.0f} KiB"
    else:
        message += (
            f"{hw.name}'s default limit is {limit / 1024:.0f} KiB (a kernel may ask for up to "
            f"{physical / 1024:.0f} KiB with vmem_limit_bytes: pass it here too)"
        )
    raise DoesNotFit(message)


def _check_vmem_limit(vmem_limit_bytes: Any) -> None:
    if vmem_limit_bytes is not None and (
        isinstance(vmem_limit_bytes, bool)
        or not isinstance(vmem_limit_bytes, int)
        or vmem_limit_bytes <= 0
    ):
        raise ValueError(f"vmem_limit_bytes: expected an int > 0 or None, got {vmem_limit_bytes!r}")


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What one pipeline step moves and computes, per operand (bytes) and in total (flops)."""

    in_bytes: tuple[float, ...]
    out_bytes: tuple[float, ...]
    flops: float
    compute_rate: float  # FLOP/s of one core
    load_bandwidth: float  # B/s of one core's loads
    store_bandwidth: float  # B/s of one core's stores


def _timing(
    p: PipelinePlan,
    costs: StepCosts,
    hw: Hardware,
    warp_specialized: bool,
    sizes: dict[str, float] | None = None,
) -> Timing:
    """The cost of each action of a pipeline's program on one core. A step's body costs its flops
    at the core's rate plus one synchronization; a warp-specialized step's work is split over the
    compute threads, which run at once (each at its share of the rate), so each takes as long. A
    warp-specialized memory thread spends a quarter synchronization issuing each copy. `sizes`:
    bytes per copied operand (default: `p`'s blocks, from `costs`)."""
    if sizes is None:
        sizes = dict(
            zip([op.name for op in p.inputs + p.outputs], costs.in_bytes + costs.out_bytes)
        )
    step_s = costs.flops / costs.compute_rate + hw.sync_latency.value
    block_elements = {op.name: math.prod(op.block_dims) for op in p.inputs + p.outputs}

    def copy_bytes(c: Copy) -> float:  # a partial window moves its share of the block
        share = 1.0 if c.elements is None else c.elements / block_elements[c.operand]
        return sizes[c.operand] * share

    return Timing(
        copy_s=lambda c: (
            copy_bytes(c) / (costs.store_bandwidth if c.queue == "stores" else costs.load_bandwidth)
        ),
        compute_s=lambda action, actor: step_s,
        latency_s=hw.copy_latency.value,
        issue_s=hw.sync_latency.value / 4 if warp_specialized else 0.0,
        signal_latency_s=hw.sync_latency.value,
    )


def run_plan(
    plan: PipelinePlan | WarpSpecializedPlan, costs: StepCosts, hw: Hardware
) -> tuple[float, list[Box]]:
    """Run a pipeline's (or warp-specialized pipeline's) event program on one core."""
    warp = isinstance(plan, WarpSpecializedPlan)
    return timed.run(plan.program(), _timing(plan.pipeline if warp else plan, costs, hw, warp))


# ---- workloads --------------------------------------------------------------------------------
def _matmul_plan(
    tiles: int, k_steps: int, tile: tuple[int, int, int], stages: int, delay_release: int = 0
) -> PipelinePlan:
    bm, bn, bk = tile
    return make_plan(
        grid=(tiles, k_steps),
        in_specs=[
            BlockSpec((bm, bk), lambda t, kk: (t, kk)),
            BlockSpec((bk, bn), lambda t, kk: (t, kk)),
        ],
        out_specs=[BlockSpec((bm, bn), lambda t, kk: (t, 0))],
        max_concurrent_steps=stages,
        delay_release=delay_release,
    )


def _onchip(tile, stages, in_b, out_b, staging_bytes=None, kind: str = "gpu") -> int:
    """Input slots plus the output's on-chip blocks. GPU: one output staging block (the
    accumulator lives in registers), or the kernel's own `staging_bytes` when it stages less
    (cv.gmm's mosaic_gpu epilogue: 64-row parts). TPU: the output's two pipeline slots, plus a
    float32 accumulator scratch when the output is narrower than float32 (a pipelined matmul
    accumulates in VMEM)."""
    bm, bn, bk = tile
    inputs = stages * (bm * bk + bk * bn) * in_b
    if kind == "tpu":
        return inputs + 2 * bm * bn * out_b + (bm * bn * 4 if out_b < 4 else 0)
    return inputs + (bm * bn * out_b if staging_bytes is None else staging_bytes)


def simulate_matmul(
    m: int,
    k: int,
    n: int,
    *,
    dtype: str = "bf16",
    hardware: str | Hardware = "h100",
    tiling: Sequence[int] | None = None,
    stages: int | None = None,
    warp_specialized: bool = False,
    compute_threads: int = 2,
    delay_release: int = 0,
    vmem_limit_bytes: int | None = None,
) -> Report:
    """A pipelined matmul [m, k] @ [k, n]: output tiles spread over the cores, K pipelined.

    `tiling` is (tm, tk, tn), the order of `cv.gmm`'s tiling; without `tiling`/`stages` a small
    search picks the fastest configuration that fits (reported in `config["searched"]`). A
    configuration fits when its on-chip memory is within the chip's default limit (TPU: scoped
    VMEM) or the kernel's `vmem_limit_bytes`.
    """
    _check_positive(
        "simulate_matmul", m=m, k=k, n=n, stages=stages, compute_threads=compute_threads
    )
    return _matmul(
        m,
        k,
        n,
        dtype=dtype,
        hardware=hardware,
        tile=_tiling_to_tile(tiling, "simulate_matmul"),
        stages=stages,
        warp_specialized=warp_specialized,
        compute_threads=compute_threads,
        delay_release=delay_release,
        vmem_limit_bytes=vmem_limit_bytes,
    )


def _matmul(
    m: int,
    k: int,
    n: int,
    *,
    dtype: str,
    hardware: str | Hardware,
    tile: tuple[int, int, int] | None,
    stages: int | None,
    warp_specialized: bool = False,
    compute_threads: int = 2,
    delay_release: int = 0,
    tiles: int | None = None,
    cores: int | None = None,
    staging_bytes: int | None = None,
    onchip_bytes: int | None = None,
    vmem_limit_bytes: int | None = None,
) -> Report:
    """simulate_matmul on the model's own tile order (bm, bn, bk); `tiles` overrides the tile count
    (gmm), `staging_bytes` the output staging buffer's size (see `_onchip`), `onchip_bytes` the
    whole on-chip footprint where a kernel states its own (cv.gmm's mosaic_tpu kernel, which sets
    its `vmem_limit_bytes` to it)."""
    hw = get_hardware(hardware)
    if tile is None or stages is None:
        return _search(
            m,
            k,
            n,
            dtype=dtype,
            hw=hw,
            tile=tile,
            stages=stages,
            warp_specialized=warp_specialized,
            compute_threads=compute_threads,
            tiles=tiles,
            cores=cores,
            delay_release=delay_release,
            vmem_limit_bytes=vmem_limit_bytes,
        )
    bm, bn, bk = (int(x) for x in tile)
    in_b = out_b = dtypes.itemsize(dtype)
    used = onchip_bytes or _onchip((bm, bn, bk), stages, in_b, out_b, staging_bytes, hw.kind)
    check_fits(
        f"tiling (tm, tk, tn)=({bm}, {bk}, {bn}) with {stages} stages",
        used,
        hw,
        onchip_bytes if onchip_bytes is not None else vmem_limit_bytes,
    )
    ncores = cores or int(hw.cores.value)
    total_tiles = tiles if tiles is not None else math.ceil(m / bm) * math.ceil(n / bn)
    per_core = max(1, math.ceil(total_tiles / ncores))
    active = min(ncores, total_tiles)
    k_steps = math.ceil(k / bk)
    rate = hw.matrix_rate(dtype) / int(hw.cores.value)
    load_bw = hw.reuse_bandwidth.value / active
    store_bw = hw.hbm_bandwidth.value * hw.hbm_efficiency.value / active
    costs = StepCosts(
        ((bm * bk) * in_b, (bk * bn) * in_b),
        (bm * bn * out_b,),
        2.0 * bm * bn * bk,
        rate,
        load_bw,
        store_bw,
    )

    def replay(n_tiles):
        p = _matmul_plan(n_tiles, k_steps, (bm, bn, bk), stages, delay_release)
        if warp_specialized:
            return run_plan(
                WarpSpecializedPlan(pipeline=p, num_compute_wgs=compute_threads), costs, hw
            )
        return run_plan(p, costs, hw)

    notes = []
    if per_core > REPLAYED_TILES:
        # After the fill, every tile repeats the same schedule: replay a few and extrapolate.
        before, _ = replay(REPLAYED_TILES - 1)
        time, boxes = replay(REPLAYED_TILES)
        time += (per_core - REPLAYED_TILES) * (time - before)
        notes.append(
            f"replayed {REPLAYED_TILES} of {per_core} tiles per core, the rest extrapolated "
            "(periodic)"
        )
    else:
        time, boxes = replay(per_core)
    # Every operand crosses HBM at least once: a chip-wide floor under the per-core replay.
    hbm_bytes = (m * k + k * n) * in_b + m * n * out_b
    time = _under_hbm_floor(time, hbm_bytes, hw, notes, boxes)
    flops = 2.0 * m * n * k
    config = {
        "m": m,
        "k": k,
        "n": n,
        "dtype": dtype,
        "tiling": [bm, bk, bn],
        "stages": stages,
        "delay_release": delay_release,
        "warp_specialized": warp_specialized,
        "compute_threads": compute_threads if warp_specialized else 0,
        "tiles": total_tiles,
        "tiles_per_core": per_core,
        "waves_efficiency": total_tiles / (per_core * ncores),
        "cores": ncores,
    }
    return Report(
        "matmul", hw, time, flops, hbm_bytes, 0.0, used, config, tuple(boxes), tuple(notes)
    )


def _under_hbm_floor(time: float, hbm_bytes: float, hw: Hardware, notes: list, boxes: list):
    """`time`, or the chip-wide floor of moving `hbm_bytes` once when that is longer (then said
    in `notes` and drawn in `boxes`)."""
    floor = hbm_bytes / (hw.hbm_bandwidth.value * hw.hbm_efficiency.value)
    if floor <= time:
        return time
    notes.append(f"HBM floor {floor * 1e6:.1f} us exceeds the core replay {time * 1e6:.1f} us")
    boxes.append(Box("copy engine (loads)", "copy", "HBM-bound remainder", time, floor))
    return floor


TILES = (
    (128, 128, 64),
    (128, 256, 64),
    (256, 128, 64),
    (128, 256, 128),
    (256, 256, 64),
    (64, 256, 64),
    (512, 512, 512),
    (256, 512, 512),
    (512, 1024, 512),
)


def _search(
    m,
    k,
    n,
    *,
    dtype,
    hw,
    tile,
    stages,
    warp_specialized,
    compute_threads,
    tiles,
    cores,
    delay_release=0,
    vmem_limit_bytes=None,
):
    best, tried = None, []
    for t in [tuple(tile)] if tile else TILES:
        for st in [stages] if stages else tuple(s for s in (2, 3, 4, 5) if s > delay_release):
            try:
                r = _matmul(
                    m,
                    k,
                    n,
                    dtype=dtype,
                    hardware=hw,
                    tile=t,
                    stages=st,
                    warp_specialized=warp_specialized,
                    compute_threads=compute_threads,
                    tiles=tiles,
                    cores=cores,
                    delay_release=delay_release,
                    vmem_limit_bytes=vmem_limit_bytes,
                )
            except DoesNotFit:
                continue
            tried.append((t, st, r.time_s))
            if best is None or r.time_s < best.time_s:
                best = r
    if best is None:
        raise DoesNotFit(
            f"no searched configuration fits {hw.name}'s on-chip limit "
            f"({hw.onchip_limit(vmem_limit_bytes) / 1024:.0f} KiB per core)"
        )
    config = dict(best.config, searched=len(tried))
    return dataclasses.replace(best, config=config)


def simulate_copy(
    nbytes: float,
    *,
    hardware: str | Hardware = "h100",
    block_bytes: float = 64 * 1024,
    stages: int = 4,
) -> Report:
    """A pipelined device-to-device copy of `nbytes` (read + write), spread over the cores."""
    hw = get_hardware(hardware)
    ncores = int(hw.cores.value)
    blocks = math.ceil(nbytes / block_bytes)
    per_core = max(1, math.ceil(blocks / ncores))
    bw = hw.hbm_bandwidth.value * hw.hbm_efficiency.value / min(ncores, blocks)
    # reads and writes share HBM
    costs = StepCosts((block_bytes,), (block_bytes,), 0.0, 1.0, bw / 2, bw / 2)
    p = make_plan(
        grid=(per_core,),
        in_specs=[BlockSpec((1,), lambda i: (i,))],
        out_specs=[BlockSpec((1,), lambda i: (i,))],
        max_concurrent_steps=stages,
    )
    time, boxes = run_plan(p, costs, hw)
    config = {"bytes": nbytes, "block_bytes": block_bytes, "stages": stages, "dtype": "bf16"}
    return Report(
        "copy", hw, time, 0.0, 2 * nbytes, 0.0, int(2 * stages * block_bytes), config, tuple(boxes)
    )


def _grouped_kernel(
    hw: Hardware,
    tiling,
    stages,
    *,
    gpu_kernel: Callable[[Sequence[int] | None], tuple[tuple[int, int, int], int, int]],
    itemsize: int,
    tpu_kernel: Callable[[Sequence[int] | None], tuple[tuple[int, int, int], int]],
) -> dict[str, Any]:
    """The kernel configuration a grouped-matmul simulation replays: on GPU hardware without
    `stages`, the cv.gmm/tgmm mosaic_gpu kernel's (`gpu_kernel(tiling)`: the given or default
    tiles as the kernel takes them, a step's operand elements and its output staging elements;
    its warpgroups, delay_release, and the slots that fit beside that staging buffer, as the
    kernel counts them); on TPU hardware without `stages`, the mosaic_tpu kernel's
    (`tpu_kernel(tiling)`: the given or default tiles, clamped as the kernel clamps them, and its
    VMEM working set, both from `ops.gmm.tpu_blocks`, double-buffered as Pallas TPU pipelines
    are); otherwise the given or searched tiles and slots of a plain pipeline."""
    if hw.kind == "tpu" and stages is None:
        kernel_tiling, working_set = tpu_kernel(tiling)
        return dict(
            tiling=kernel_tiling,
            stages=2,
            warp_specialized=False,
            staging_bytes=None,
            onchip_bytes=working_set,
            compute_threads=2,
            delay_release=0,
            kernel="cv mosaic_tpu",
        )
    if hw.kind == "gpu" and stages is None:
        kernel_tiling, block_elems, staging_elems = gpu_kernel(tiling)
        staging = staging_elems * itemsize
        kernel_stages = MOSAIC_GPU.stages_that_fit(
            block_bytes=block_elems * itemsize,
            staging_bytes=staging,
            budget_bytes=int(hw.onchip_bytes.value),
        )
        return dict(
            tiling=kernel_tiling,
            stages=kernel_stages,
            warp_specialized=True,
            staging_bytes=staging,
            onchip_bytes=None,
            compute_threads=MOSAIC_GPU.compute_threads,
            delay_release=MOSAIC_GPU.delay_release,
            kernel="cv mosaic_gpu",
        )
    return dict(
        tiling=tiling,
        stages=stages,
        warp_specialized=False,
        compute_threads=2,
        delay_release=0,
        staging_bytes=None,
        onchip_bytes=None,
        kernel="searched" if tiling is None or stages is None else "given",
    )


def _tpu_kernel(
    op: str, m: int, k: int, n: int, groups: int, dtype: str, tiling: Sequence[int] | None
) -> tuple[tuple[int, int, int], int]:
    """cv.gmm / cv.tgmm's mosaic_tpu kernel for this problem: its (tm, tk, tn) (`tiling`, or the
    default for `groups` groups, clamped as the kernel clamps it; a tile the kernel refuses
    raises its ValueError) and its VMEM working set, the output in the operands' dtype (as the
    simulator's HBM traffic assumes)."""
    dt = dtypes.canonical(dtype)
    tiles = tuple(int(t) for t in (tpu_default(m, k, n, groups) if tiling is None else tiling))
    if op == "gmm":
        tiles = tpu_blocks.gmm_tiles(m, k, n, tiles, dt)
        blocks = tpu_blocks.gmm_blocks(*tiles)
    else:
        tiles = tpu_blocks.tgmm_tiles(m, k, n, tiles, dt)
        blocks = tpu_blocks.tgmm_blocks(*tiles)
    # cv.tgmm without existing_out (the simulated call) takes no existing_out block
    return tiles, tpu_blocks.working_set(*blocks, dt, dt, existing_out=op == "gmm")


# The operand dtypes the cv.gmm / cv.tgmm kernels take, per hardware kind: mosaic_gpu multiplies
# with wgmma's 16-bit floats, mosaic_tpu takes float32 and bfloat16.
GROUPED_KERNEL_DTYPES = {"gpu": ("bfloat16", "float16"), "tpu": ("float32", "bfloat16")}


def _grouped_dtype(where: str, dtype: str, hw: Hardware, hypothetical: bool) -> bool:
    """Whether the simulation prices a kernel that does not exist (an operand dtype no cv.gmm kernel
    takes on this hardware): refused by name unless `hypothetical`."""
    name = dtypes.canonical(dtype)
    if name in GROUPED_KERNEL_DTYPES[hw.kind]:
        return False
    if not hypothetical:
        raise ValueError(
            f"{where}: no cv.gmm/cv.tgmm kernel takes {name} operands on {hw.name} (its kernels "
            f"take {', '.join(GROUPED_KERNEL_DTYPES[hw.kind])}); pass hypothetical=True (the CLI's "
            "--hypothetical) to price a kernel that does not exist, labelled as one"
        )
    return True


def _check_sizes(where: str, group_sizes: Sequence[int]) -> int:
    if any(int(g) < 0 for g in group_sizes) or not sum(int(g) for g in group_sizes) > 0:
        raise ValueError(
            f"{where}: group_sizes must be non-negative with a positive sum, got "
            f"{list(group_sizes)}"
        )
    return int(sum(int(g) for g in group_sizes))


def _grouped(
    where: str,
    m: int,
    k: int,
    n: int,
    *,
    dtype: str,
    hw: Hardware,
    cfg: dict[str, Any],
    tiles_for,
    hbm_bytes: float,
    workload: str,
    extra: dict[str, Any],
) -> Report:
    """The best (or the given) configuration's replay with `tiles_for(bm, bn)` output tiles, held
    under the floor of moving `hbm_bytes` once."""
    tile = _tiling_to_tile(cfg["tiling"], where)
    best = None
    for t in [tuple(tile)] if tile else TILES:
        try:
            r = _matmul(
                m,
                k,
                n,
                dtype=dtype,
                hardware=hw,
                tile=t,
                stages=cfg["stages"],
                tiles=tiles_for(t[0], t[1]),
                warp_specialized=cfg["warp_specialized"],
                compute_threads=cfg["compute_threads"],
                delay_release=cfg["delay_release"],
                staging_bytes=cfg["staging_bytes"],
                onchip_bytes=cfg["onchip_bytes"],
            )
        except DoesNotFit:
            continue
        if best is None or r.time_s < best.time_s:
            best = r
    if best is None:
        raise DoesNotFit(f"no configuration fits {hw.name}")
    time = max(best.time_s, hbm_bytes / (hw.hbm_bandwidth.value * hw.hbm_efficiency.value))
    config = dict(best.config, kernel=cfg["kernel"], **extra)
    return dataclasses.replace(
        best, workload=workload, time_s=time, hbm_bytes=hbm_bytes, config=config
    )


def simulate_gmm(
    group_sizes: Sequence[int],
    k: int,
    n: int,
    *,
    dtype: str = "bf16",
    hardware: str | Hardware = "h100",
    tiling: Sequence[int] | None = None,
    stages: int | None = None,
    hypothetical: bool = False,
) -> Report:
    """Grouped matmul over the tile schedule every Conveyor backend runs (`make_group_metadata`):
    one visit per (row tile, group) pair that intersect, so a tile shared by two groups is computed
    twice and a partial tile costs a whole one; visits times column tiles spread over the cores;
    each group's [k, n] weights cross HBM once. `tiling` is cv.gmm's (tm, tk, tn). On GPU
    hardware without `tiling`/`stages` it is the mosaic_gpu kernel (`config["kernel"]`): its
    tiles, 4 slots, two compute warpgroups and delay_release=1; otherwise tiles are searched.
    An operand dtype no cv.gmm kernel takes on the hardware is refused unless `hypothetical`
    (then `config["kernel"]` says "hypothetical")."""
    hw = get_hardware(hardware)
    m = _check_sizes("simulate_gmm", group_sizes)
    _check_positive("simulate_gmm", k=k, n=n, stages=stages)
    imagined = _grouped_dtype("simulate_gmm", dtype, hw, hypothetical)
    b = dtypes.itemsize(dtype)

    def gpu_kernel(given):
        tm, tk, tn = (
            MOSAIC_GPU.gmm_tiles_for(k, n, out_itemsize=b)
            if given is None
            else backend_impls.mosaic_gpu_given_tiles(
                "gmm", m, k, n, dtypes.canonical(dtype), tuple(given)
            )
        )
        return (tm, tk, tn), tm * tk + tk * tn, math.prod(MOSAIC_GPU.staging_shape(tm, tn))

    cfg = _grouped_kernel(
        hw,
        tiling,
        stages,
        gpu_kernel=gpu_kernel,
        itemsize=b,
        tpu_kernel=lambda t: _tpu_kernel("gmm", m, k, n, len(group_sizes), dtype, t),
    )
    groups = sum(1 for g in group_sizes if g)
    hbm = (m * k + groups * k * n) * b + m * n * b
    report = None
    if cfg["onchip_bytes"] is not None:  # the mosaic_tpu kernel, on its own grid
        report = _tpu_kernel_replay("gmm", group_sizes, m, k, n, dtype=dtype, hw=hw, cfg=cfg)
    elif cfg["kernel"] == "cv mosaic_gpu":  # its thread blocks, as the kernel launches them
        report = _gpu_kernel_replay(group_sizes, m, k, n, dtype=dtype, hw=hw, cfg=cfg)
    if imagined:
        cfg["kernel"] = f"hypothetical ({cfg['kernel']} with {dtypes.canonical(dtype)} operands)"
    if report is not None:
        return dataclasses.replace(report, config=dict(report.config, kernel=cfg["kernel"]))
    return _grouped(
        "simulate_gmm",
        m,
        k,
        n,
        dtype=dtype,
        hw=hw,
        cfg=cfg,
        hbm_bytes=hbm,
        workload="gmm",
        tiles_for=lambda bm, bn: count_visits(group_sizes, bm) * math.ceil(n / bn),
        extra=dict(groups=len(group_sizes), m=m),
    )


def _gpu_kernel_replay(group_sizes, m, k, n, *, dtype, hw, cfg) -> Report:
    """cv.gmm's Mosaic GPU kernel as it launches (`ops/gmm/gpu_blocks.py`): a thread block per
    (column tile, visit), each running its own warp-specialized pipeline over k (filled and
    drained per block) and then storing its output tile from shared memory, awaited before the
    block ends. A block holds most of an SM's shared memory, so blocks run one per SM, in waves.
    Blocks past the real visits (the grid is sized for traced group sizes) exit at once: one
    synchronization each."""
    from conveyor.ops.gmm.metadata import max_visits

    tm, tk, tn = cfg["tiling"]
    b = dtypes.itemsize(dtype)
    visits = count_visits(group_sizes, tm)
    column_tiles = math.ceil(n / tn)
    blocks, sms = column_tiles * visits, int(hw.cores.value)
    active = min(sms, blocks)
    plan = gpu_blocks.block_plan(
        gpu_blocks.gmm_block_pipeline(k, (tm, tk, tn), transpose_rhs=False, stages=cfg["stages"])
    )
    costs, store = _gpu_block_costs(
        hw, dtype, (tm * tk, tk * tn), 2.0 * tm * tk * tn, tm * tn, active
    )
    pipeline_time, boxes = run_plan(plan, costs, hw)
    boxes.append(
        Box("copy engine (stores)", "copy", "output tile", pipeline_time, pipeline_time + store)
    )
    waves = math.ceil(blocks / sms)
    padded = (max_visits(m, tm, len(group_sizes)) - visits) * column_tiles
    time = waves * (pipeline_time + store) + math.ceil(padded / sms) * hw.sync_latency.value
    notes = [f"{blocks} thread blocks in {waves} waves of {sms} SMs; one block replayed"]
    groups = sum(1 for g in group_sizes if g)
    hbm = (m * k + groups * k * n) * b + m * n * b
    extra = dict(tiles=blocks, waves=waves, padded_blocks=padded, groups=len(group_sizes))
    onchip = cfg["stages"] * (tm * tk + tk * tn) * b + cfg["staging_bytes"]
    return _gpu_blocks_report(
        "gmm", (m, k, n), dtype, hw, cfg, time, hbm, onchip, boxes, notes, extra
    )


def _gpu_tgmm_replay(group_sizes, m, k, n, *, dtype, hw, cfg) -> Report:
    """cv.tgmm's Mosaic GPU kernel as it launches (`ops/gmm/gpu_blocks.py`): a thread block per
    (group, k tile, n tile), each running a pipeline over the `tm`-row blocks its group's rows
    touch and then storing its [tk, tn] output tile (an empty group's block stores zeros). Blocks
    differ in length with their group, so they are scheduled as the hardware does, in grid order
    (groups fastest), each onto the SM that frees first, one block per SM. A row block shared
    with a neighbouring group (`metadata.shares_its_block`, the kernel's own test) adds the pass
    that masks it (`_mask_pass_s`)."""
    import heapq

    tm, tk, tn = cfg["tiling"]
    b = dtypes.itemsize(dtype)
    counts = count_row_blocks(group_sizes, tm)
    shared = count_shared_blocks(group_sizes, tm)
    groups, k_tiles, n_tiles = gpu_blocks.tgmm_grid(len(group_sizes), math.ceil(k / tk), n // tn)
    sms = int(hw.cores.value)
    active = min(sms, groups * k_tiles * n_tiles)
    costs, store = _gpu_block_costs(
        hw, dtype, (tm * tk, tm * tn), 2.0 * tm * tk * tn, tk * tn, active
    )
    mask_s = _mask_pass_s(hw, (tm * tk + tm * tn) * b)
    pipeline_s, boxes = {0: 0.0}, []
    for rows in sorted(set(counts) - {0}):
        args = gpu_blocks.tgmm_block_pipeline(rows, (tm, tk, tn), stages=cfg["stages"])
        plan = gpu_blocks.block_plan(args, dynamic=True)
        pipeline_s[rows], replayed = run_plan(plan, costs, hw)
        if rows == max(counts):
            boxes = replayed
    block_s = {
        (rows, masked): pipeline_s[rows] + masked * mask_s + store
        for rows, masked in set(zip(counts, shared))
    }
    free = [0.0] * sms  # when each SM is next free
    for _ in range(k_tiles * n_tiles):
        for key in zip(counts, shared):
            heapq.heappush(free, heapq.heappop(free) + block_s[key])
    time = max(free)
    notes = [
        f"{groups * k_tiles * n_tiles} thread blocks on {sms} SMs, each SM taking the next block "
        f"when it frees; one block replayed per row-block count ({len(pipeline_s) - 1}); "
        f"{sum(shared)} row blocks shared with a neighbouring group, each masked in "
        f"{mask_s * 1e6:.2f} us per block"
    ]
    hbm = (sum(counts) * tm * (k + n) + groups * k * n) * b  # row blocks read, outputs written
    extra = dict(
        tiles=groups * k_tiles * n_tiles,
        row_blocks=sum(counts),
        shared_row_blocks=sum(shared),
        groups=groups,
    )
    onchip = cfg["stages"] * (tm * tk + tm * tn) * b + cfg["staging_bytes"]
    return _gpu_blocks_report(
        "tgmm", (m, k, n), dtype, hw, cfg, time, hbm, onchip, boxes, notes, extra
    )


def _mask_pass_s(hw: Hardware, block_bytes: int) -> float:
    """The tgmm GPU kernel's pass over a shared row block before its matmul: its operand blocks
    read from shared memory into registers, the rows outside the group zeroed, written back
    (`block_bytes` each way, split over the compute warpgroups but through one SM's shared
    memory), then the warpgroups' barrier; the step's matmul waits for it."""
    if hw.onchip_bandwidth is None:
        raise ValueError(f"hardware {hw.name}: no on-chip bandwidth to price a masking pass")
    return 2 * block_bytes / hw.onchip_bandwidth.value + hw.sync_latency.value


def _gpu_block_costs(hw, dtype, in_elems, flops, out_elems, active) -> tuple[StepCosts, float]:
    """One thread block's step costs on its SM, and the time of its output tile's store: loads
    and the store go through L2 at the SM's share of it (the HBM write-back of the stored tile is
    not on the block's path)."""
    b = dtypes.itemsize(dtype)
    l2 = hw.reuse_bandwidth.value / active
    sm_rate = hw.matrix_rate(dtype) / int(hw.cores.value)
    costs = StepCosts(tuple(e * b for e in in_elems), (), flops, sm_rate, l2, l2)
    return costs, hw.copy_latency.value + out_elems * b / l2


def _gpu_blocks_report(op, mkn, dtype, hw, cfg, time, hbm, onchip, boxes, notes, extra) -> Report:
    """A GPU kernel's thread-block replay as a Report: its configuration, `extra` beside it, the
    time held under the floor of moving `hbm` bytes once."""
    m, k, n = mkn
    time = _under_hbm_floor(time, hbm, hw, notes, boxes)
    config = {
        "m": m,
        "k": k,
        "n": n,
        "dtype": dtype,
        "tiling": list(cfg["tiling"]),
        "stages": cfg["stages"],
        "delay_release": MOSAIC_GPU.delay_release,
        "warp_specialized": True,
        "compute_threads": MOSAIC_GPU.compute_threads,
        "cores": int(hw.cores.value),
        "kernel": cfg["kernel"],
        **extra,
    }
    flops = 2.0 * m * k * n
    return Report(op, hw, time, flops, hbm, 0.0, onchip, config, tuple(boxes), tuple(notes))


# The Mosaic TPU gmm/tgmm kernels' copied operands, in their pallas_calls' order; the output last.
# cv.gmm's kernel takes existing_out (its rows outside the groups); cv.tgmm's, called without one,
# does not: its sums start from zeros and it visits each empty group once to write them.
TPU_KERNEL_OPERANDS = {
    "gmm": ("lhs", "rhs", "existing_out", "out"),
    "tgmm": ("lhs", "rhs", "out"),
}


class _Table:
    """A scalar-prefetched table (the visits' group ids, row tiles) for index maps the plan calls
    with Python ints (each step's block) and with tracers (its invariance check)."""

    def __init__(self, values):
        self.values = [int(x) for x in values]
        self.array = None

    def __getitem__(self, i):
        if isinstance(i, int):
            return self.values[i]
        import jax.numpy as jnp

        if self.array is None:
            self.array = jnp.asarray(self.values, jnp.int32)
        return self.array[i]


# Grid columns replayed per core before the rest is extrapolated: every column of the kernel's
# grid repeats the same visits, so after the first the columns cost the same.
REPLAYED_COLUMNS = 2


def _tpu_kernel_replay(op: str, group_sizes, m, k, n, *, dtype, hw, cfg) -> Report:
    """cv.gmm's or cv.tgmm's Mosaic TPU kernel replayed on its own grid with its own index maps
    (`ops/gmm/tpu_blocks.py`) over the real visits of its metadata (`make_group_metadata`). gmm's
    grid is (n tiles, visits, k tiles), tgmm's (k tiles, n tiles, visits); the leading tiles
    ("columns") are shared by the cores. A step whose block index equals the previous step's
    copies nothing (Pallas TPU's rule, the plan's too), so gmm re-reads a group's weight block per
    visit unless k is one tile. Visits padded past the last real one (the grid is sized for
    traced group sizes) do no copy and no matmul: each costs one step's sync."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from conveyor.ops.gmm.metadata import make_group_metadata, max_visits

    tm, tk, tn = cfg["tiling"]
    b = dtypes.itemsize(dtype)
    # One compiled program instead of a few dozen eagerly dispatched ops (each compiled once).
    metadata = jax.jit(
        functools.partial(make_group_metadata, visit_empty_groups=op == "tgmm"),
        static_argnums=(1, 2),
    )
    meta = metadata(jnp.asarray(group_sizes, jnp.int32), m, tm)
    visits = int(meta.num_visits)
    gids = _Table(np.asarray(meta.group_ids)[:visits])
    tids = _Table(np.asarray(meta.tile_ids)[:visits])
    if op == "gmm":
        maps, blocks = tpu_blocks.gmm_index_maps(), tpu_blocks.gmm_blocks(tm, tk, tn)
        grid = tpu_blocks.gmm_grid(k, n, tk, tn, visits)
        columns, steps_per_visit = grid[0], grid[2]

        def replay_grid(shown):
            return (
                shown,
                visits,
                steps_per_visit,
            ), lambda imap: lambda j, v, kk: imap(j, v, kk, gids, tids)
    else:
        maps, blocks = tpu_blocks.tgmm_index_maps(), tpu_blocks.tgmm_blocks(tm, tk, tn)
        grid = tpu_blocks.tgmm_grid(k, n, tk, tn, visits)
        columns, steps_per_visit = grid[0] * grid[1], 1

        def replay_grid(shown):  # the (k tile, n tile) pairs flattened, in the grid's order
            return (
                shown,
                visits,
            ), lambda imap: lambda c, v: imap(c // grid[1], c % grid[1], v, gids, tids)

    operands = TPU_KERNEL_OPERANDS[op]
    lhs_bytes, rhs_bytes, out_bytes = (
        math.prod(d for d in block if d is not None) * b for block in blocks
    )
    sizes = {"lhs": lhs_bytes, "rhs": rhs_bytes, "existing_out": out_bytes, "out": out_bytes}
    cores = min(int(hw.cores.value), columns)
    per_core = math.ceil(columns / cores)

    def replay(shown: int):
        replayed, bind = replay_grid(shown)
        lhs_map, rhs_map, out_map = maps
        lhs_block, rhs_block, out_block = blocks
        in_specs = [BlockSpec(lhs_block, bind(lhs_map)), BlockSpec(rhs_block, bind(rhs_map))]
        if "existing_out" in operands:  # aliased to the output
            in_specs.append(BlockSpec(out_block, bind(out_map)))
        p = make_plan(
            grid=replayed,
            in_specs=in_specs,
            out_specs=[BlockSpec(out_block, bind(out_map))],
            max_concurrent_steps=cfg["stages"],
        )
        costs = StepCosts(
            tuple(sizes[name] for name in operands[:-1]),
            (sizes["out"],),
            2.0 * tm * tk * tn,
            hw.matrix_rate(dtype) / int(hw.cores.value),
            hw.reuse_bandwidth.value / cores,
            hw.hbm_bandwidth.value * hw.hbm_efficiency.value / cores,
        )
        prog = p.program()
        time, boxes = timed.run(prog, _timing(p, costs, hw, False))
        names = [o.name for o in p.inputs + p.outputs]
        counts = {name: 0 for name in names}
        for _, acts in prog.actors:
            for a in acts:
                if isinstance(a, Copy):
                    counts[a.operand] += 1
        return time, boxes, dict(zip(operands, (counts[name] for name in names)))

    shown = min(per_core, REPLAYED_COLUMNS)
    time, boxes, copies = replay(shown)
    notes = []
    if per_core > shown:
        before, _, copies_before = replay(shown - 1)
        time += (per_core - shown) * (time - before)
        copies = {op: c + (per_core - shown) * (c - copies_before[op]) for op, c in copies.items()}
        notes.append(f"replayed {shown} of {per_core} grid columns per core, the rest extrapolated")
    padded = max_visits(m, tm, len(group_sizes)) - visits
    time += per_core * padded * steps_per_visit * hw.sync_latency.value
    # the cores share the columns; each column copies what a replayed one does
    copies = {name: round(c * columns / per_core) for name, c in copies.items()}
    hbm = sum(sizes[name] * c for name, c in copies.items())
    time = _under_hbm_floor(time, hbm, hw, notes, boxes)
    config = {
        "m": m,
        "k": k,
        "n": n,
        "dtype": dtype,
        "tiling": [tm, tk, tn],
        "stages": cfg["stages"],
        "delay_release": 0,
        "warp_specialized": False,
        "compute_threads": 0,
        "grid": list(grid),
        "padded_visits": padded,
        "copies": copies,
        "cores": cores,
        "kernel": cfg["kernel"],
        "groups": len(group_sizes),
    }
    flops = 2.0 * m * k * n
    return Report(
        op, hw, time, flops, hbm, 0.0, cfg["onchip_bytes"], config, tuple(boxes), tuple(notes)
    )


def simulate_tgmm(
    group_sizes: Sequence[int],
    k: int,
    n: int,
    *,
    dtype: str = "bf16",
    hardware: str | Hardware = "h100",
    tiling: Sequence[int] | None = None,
    stages: int | None = None,
    hypothetical: bool = False,
) -> Report:
    """Transposed grouped matmul ([k, m] x [m, n] -> [G, k, n], the weight gradient): one output
    tile per (group, k-tile, n-tile), whose pipeline reduces over the tm-row blocks its group's
    rows touch (`metadata.count_row_blocks`: a block shared by two groups is read by both). The
    groups' block counts are averaged over the non-empty groups' tiles (the cores share them out);
    every group's [k, n] output crosses HBM once. `tiling` is cv.tgmm's (tm, tk, tn); on GPU
    hardware without `tiling`/`stages`, the mosaic_gpu kernel's configuration (as in
    `simulate_gmm`, with its dtype rule and `hypothetical`)."""
    hw = get_hardware(hardware)
    m = _check_sizes("simulate_tgmm", group_sizes)
    _check_positive("simulate_tgmm", k=k, n=n, stages=stages)
    imagined = _grouped_dtype("simulate_tgmm", dtype, hw, hypothetical)

    def gpu_kernel(given):
        tm, tk, tn = (
            MOSAIC_GPU.tgmm_tiles_for(n)
            if given is None
            else backend_impls.mosaic_gpu_given_tiles(
                "tgmm", m, k, n, dtypes.canonical(dtype), tuple(given)
            )
        )
        return (tm, tk, tn), tk * tm + tm * tn, math.prod(MOSAIC_GPU.staging_shape(tk, tn))

    cfg = _grouped_kernel(
        hw,
        tiling,
        stages,
        gpu_kernel=gpu_kernel,
        itemsize=dtypes.itemsize(dtype),
        tpu_kernel=lambda t: _tpu_kernel("tgmm", m, k, n, len(group_sizes), dtype, t),
    )
    gpu_kernel = cfg["kernel"] == "cv mosaic_gpu"
    if imagined:
        cfg["kernel"] = f"hypothetical ({cfg['kernel']} with {dtypes.canonical(dtype)} operands)"
    if cfg["onchip_bytes"] is not None:  # the mosaic_tpu kernel, on its own grid
        return _tpu_kernel_replay("tgmm", group_sizes, m, k, n, dtype=dtype, hw=hw, cfg=cfg)
    if gpu_kernel:  # its thread blocks, as the kernel launches them
        return _gpu_tgmm_replay(group_sizes, m, k, n, dtype=dtype, hw=hw, cfg=cfg)
    if cfg["tiling"] is None:
        cfg["tiling"] = (128, 128, 128)  # the tgmm reduction block is tm: no search over it
    tm = int(cfg["tiling"][0])
    blocks = count_row_blocks(group_sizes, tm)
    busy = sum(1 for c in blocks if c)
    steps = math.ceil(sum(blocks) / busy)
    b = dtypes.itemsize(dtype)
    # blocks read, outputs written
    hbm = (sum(blocks) * tm * (k + n) + len(group_sizes) * k * n) * b
    # The model's matmul is [k, steps * tm] @ [steps * tm, n] per group: rows are tgmm's k, the
    # reduction its row blocks.
    report = _grouped(
        "simulate_tgmm",
        k,
        steps * tm,
        n,
        dtype=dtype,
        hw=hw,
        cfg=dict(cfg, tiling=(cfg["tiling"][1], tm, cfg["tiling"][2])),
        hbm_bytes=hbm,
        workload="tgmm",
        tiles_for=lambda bm, bn: busy * math.ceil(k / bm) * math.ceil(n / bn),
        extra=dict(groups=len(group_sizes), m=m, row_blocks=sum(blocks), steps_per_tile=steps),
    )
    flops = 2.0 * m * k * n
    return dataclasses.replace(
        report, flops=flops, config=dict(report.config, k=k, tiling=list(cfg["tiling"]))
    )


def simulate_collective_matmul(
    kind: str,
    m: int,
    k: int,
    n: int,
    devices: int,
    *,
    dtype: str = "bf16",
    hardware: str | Hardware = "h100",
    bidirectional: bool = True,
    buffering: int = 2,
    unfused: bool = False,
) -> Report:
    """`all_gather_matmul` (gather rows: m rows per device, [k, n] local) or `matmul_reduce_scatter`
    (m output rows per device, local [devices*m, k] @ [k, n]); ring, or the unfused baseline
    (the collective, then the matmul). Each step's chunk matmul runs on the whole chip."""
    if kind not in ("all_gather_matmul", "matmul_reduce_scatter"):
        raise ValueError(
            f"kind: expected 'all_gather_matmul' or 'matmul_reduce_scatter', got {kind!r}"
        )
    if devices < 1:
        raise ValueError(f"devices: expected >= 1, got {devices}")
    hw = get_hardware(hardware)
    b = dtypes.itemsize(dtype)
    shard = m * (k if kind == "all_gather_matmul" else n) * b  # what travels per hop
    hop = hw.hop_s(shard)
    full = simulate_matmul(m * devices, k, n, dtype=dtype, hardware=hw)
    accumulate_s = 0.0
    if hw.kind == "gpu":
        # A GPU ring kernel is one persistent matmul whose tiles wait for their shard: no wave
        # barrier between steps, so a step costs its share of the whole matmul.
        chunk = dataclasses.replace(full, time_s=full.time_s / devices)
    else:
        # The TPU kernels: one step's matmul is a double-buffered pipeline over the kernel's own
        # blocks (`RingBlocks`); a reduce-scatter then adds its float32 partial into the arrived
        # accumulator in a pass over HBM (read both, write one).
        bm, bn, bk = RingBlocks().for_matmul(m, k, n, b)
        chunk = simulate_matmul(m, k, n, dtype=dtype, hardware=hw, tiling=(bm, bk, bn), stages=2)
        if kind == "matmul_reduce_scatter":
            accumulate_s = 3 * m * n * 4 / (hw.hbm_bandwidth.value * hw.hbm_efficiency.value)
    boxes: list[Box] = []
    flops = 2.0 * m * devices * k * n
    bidi = bidirectional and devices > 2
    if unfused:
        t = 0.0
        coll = "all-gather" if kind == "all_gather_matmul" else "reduce-scatter"
        if kind == "matmul_reduce_scatter":
            boxes.append(Box("compute", "compute", "matmul", 0.0, full.time_s))
            t = full.time_s
        for h in range(devices - 1):
            boxes.append(Box("link right", "link", f"{coll} hop {h + 1}", t, t + hop))
            t += hop
        if kind == "all_gather_matmul":
            boxes.append(Box("compute", "compute", "matmul", t, t + full.time_s))
            t += full.time_s
        time = t
    else:
        plan = ring_plan(
            collective="gather" if kind == "all_gather_matmul" else "scatter",
            num_devices=devices,
            bidirectional=bidirectional,
            buffering=buffering,
        )
        bidi = plan.bidirectional
        time, boxes = _run_ring(plan, chunk.time_s, hop, hw.overlap_slowdown.value, accumulate_s)
    config = {
        "kind": kind,
        "m": m,
        "k": k,
        "n": n,
        "devices": devices,
        "dtype": dtype,
        "bidirectional": bidi,
        "buffering": buffering,
        "unfused": unfused,
        "chunk_tiling": chunk.config["tiling"],
        "chunk_us": chunk.time_s * 1e6,
        "hop_us": hop * 1e6,
        "accumulate_us": accumulate_s * 1e6,
    }
    hbm = (m * devices * k + k * n + m * devices * n) * b
    return Report(
        kind, hw, time, flops, hbm, shard * (devices - 1), chunk.onchip_bytes, config, tuple(boxes)
    )


def _run_ring(
    plan: RingPlan, chunk_s: float, hop_s: float, slowdown: float = 0.0, accumulate_s: float = 0.0
) -> tuple[float, list[Box]]:
    """Run the ring's event program (every device; the TPU kernels run the same records) and keep
    device 0's timeline: its matmuls on a "compute" row and its sends on one row per link.

    A chunk matmul takes `chunk_s` (half of it per stream when a bidirectional reduce-scatter
    splits the columns), `slowdown` longer when a send of the same stream runs meanwhile
    (transfers share HBM / SMs); a reduce-scatter's accumulate takes `accumulate_s` (halved
    likewise); a hop takes `hop_s` (halved likewise) on the sender's link."""
    # each stream carries half the columns
    halves = plan.collective == "scatter" and plan.bidirectional
    share = 0.5 if halves else 1.0
    dur, hop, acc = chunk_s * share, hop_s * share, accumulate_s * share
    records = {(r.step, r.direction): r for rs in plan.steps() for r in rs}
    # gather forwards the shard it multiplies; scatter forwards the previous step's sum meanwhile
    overlapped = {
        key: (r.sends if plan.collective == "gather" else r.awaits_send_of is not None)
        for key, r in records.items()
    }

    def compute_s(action, actor):
        base = acc if action.work == "accumulate" else dur
        return base * (1.0 + slowdown) if overlapped[(action.step, action.stream)] else base

    time, boxes = timed.run(plan.program(), Timing(copy_s=lambda c: hop, compute_s=compute_s))
    rows = {"dev0": "compute", **{f"link {d} dev0": f"link {d}" for d in plan.directions}}
    return time, [dataclasses.replace(b, actor=rows[b.actor]) for b in boxes if b.actor in rows]


def _simulate_sequence(
    pipelines: list,
    hw: Hardware,
    dtype: str,
    flops_per_step: float,
    active_cores: int | None,
    vmem_limit_bytes: int | None,
) -> Report:
    """Plain pipelines one after another on one core, each on its own slots (all allocated at once,
    as nested `with_allocations` scopes hold them), some prefetched (`conveyor.plans.sequence`)."""
    plans = [getattr(x, "plan", x) for x in pipelines]
    for p in plans:
        p.require_static("cv.sim.simulate")
    b = dtypes.itemsize(dtype)
    cores = active_cores or int(hw.cores.value)
    sizes = operand_sizes(pipelines, b)
    used = sum(
        sizes[f"p{k}.{op.name}"] * op.num_slots
        for k, p in enumerate(plans)
        for op in p.inputs + p.outputs
    )
    check_fits("the sequence of pipelines (every slot)", used, hw, vmem_limit_bytes)
    costs = StepCosts(
        (),
        (),
        float(flops_per_step),
        hw.matrix_rate(dtype) / int(hw.cores.value),
        hw.reuse_bandwidth.value / cores,
        hw.hbm_bandwidth.value * hw.hbm_efficiency.value / cores,
    )
    prog = sequence_program(pipelines)
    time, boxes = timed.run(prog, _timing(plans[0], costs, hw, False, sizes))
    steps = sum(p.num_steps for p in plans)
    moved = sum(sizes[c.operand] for c in prog.copies())
    config = {
        "grid": [list(p.grid) for p in plans],
        "prefetched": [isinstance(x, Prefetched) for x in pipelines],
        "dtype": dtype,
        "flops_per_step": flops_per_step,
        "active_cores": cores,
        "warp_specialized": False,
    }
    floor = max(
        float(flops_per_step) * steps / (hw.matrix_peak_rate(dtype) / int(hw.cores.value)),
        moved / (hw.reuse_bandwidth.value / cores),
    )
    return Report(
        "pipeline",
        hw,
        time,
        float(flops_per_step) * steps,
        moved,
        0.0,
        int(used),
        config,
        tuple(boxes),
        floor_s=floor,
    )


def _operand_itemsizes(p: PipelinePlan, dtype: str, operand_dtypes: dict) -> dict[str, int]:
    """Bytes per element of every operand: its own dtype in `operand_dtypes`, else `dtype`."""
    names = [op.name for op in p.inputs + p.outputs]
    unknown = sorted(set(operand_dtypes) - set(names))
    if unknown:
        raise ValueError(
            f"operand_dtypes: {unknown} name no operand of the plan; its operands are {names}"
        )
    return {name: dtypes.itemsize(operand_dtypes.get(name, dtype)) for name in names}


def simulate(
    plan: Any,
    hardware: str | Hardware = "h100",
    *,
    dtype: str = "bf16",
    flops_per_step: float = 0.0,
    active_cores: int | None = None,
    operand_dtypes: dict[str, str] | None = None,
    scratch_bytes: int = 0,
    vmem_limit_bytes: int | None = None,
    **collective: Any,
) -> Report:
    """Replay a plan on a hardware model.

    Args:
      plan: a `PipelinePlan` / `WarpSpecializedPlan` (or the function `emit_pipeline` returned),
        run by one core; a list of warp-specialized plans chained on one set of allocations; a
        list of plain plans run one after another, some wrapped in `cv.sim.Prefetched`
        (`conveyor.plans.sequence`); or a `RingPlan` with `kind`, `m`, `k`, `n` in `collective`
        (see `simulate_collective_matmul`).
      hardware: a model name or `Hardware`.
      dtype: block bytes and the matrix rate; `operand_dtypes` ({"in[0]": "f32"}) overrides it
        per operand.
      flops_per_step: each step's compute.
      active_cores: cores sharing the load bandwidth (default: all of them).
      scratch_bytes: the kernel's own on-chip allocations beside the slots.
      vmem_limit_bytes: the kernel's on-chip limit (default: the chip's, TPU scoped VMEM).

    Returns:
      The `Report`; `DoesNotFit` is raised when the slots and scratch exceed the limit.
    """
    hw = get_hardware(hardware)
    if isinstance(scratch_bytes, bool) or not isinstance(scratch_bytes, int) or scratch_bytes < 0:
        raise ValueError(f"scratch_bytes: expected an int >= 0, got {scratch_bytes!r}")
    pipelines = as_sequence(plan)
    if pipelines is not None:
        if operand_dtypes or scratch_bytes:
            raise NotImplementedError(
                "simulate: operand_dtypes and scratch_bytes apply to one plan (or a chain of "
                "warp-specialized plans), not to a sequence of pipelines"
            )
        return _simulate_sequence(
            pipelines, hw, dtype, flops_per_step, active_cores, vmem_limit_bytes
        )
    chain = as_chain(plan)
    if chain is not None:
        plan = chain[0]
    if hasattr(plan, "plan") and not isinstance(
        plan, (PipelinePlan, WarpSpecializedPlan, RingPlan)
    ):
        plan = plan.plan
    if isinstance(plan, RingPlan):
        given = {
            "operand_dtypes": operand_dtypes,
            "scratch_bytes": scratch_bytes,
            "vmem_limit_bytes": vmem_limit_bytes,
        }
        ignored = [name for name, value in given.items() if value]
        if ignored:
            raise NotImplementedError(
                f"simulate: {', '.join(ignored)} apply to pipeline plans; a RingPlan is priced "
                "as cv.sim.simulate_collective_matmul prices its kernel (pass dtype= instead)"
            )
        return simulate_collective_matmul(
            collective.pop(
                "kind",
                "all_gather_matmul" if plan.collective == "gather" else "matmul_reduce_scatter",
            ),
            collective.pop("m"),
            collective.pop("k"),
            collective.pop("n"),
            plan.num_devices,
            dtype=dtype,
            hardware=hw,
            bidirectional=plan.bidirectional,
            buffering=plan.buffering,
            **collective,
        )
    if not isinstance(plan, (PipelinePlan, WarpSpecializedPlan)):
        raise TypeError(
            "simulate: expected a PipelinePlan, WarpSpecializedPlan or RingPlan, got "
            f"{type(plan).__name__}"
        )
    p = plan.pipeline if isinstance(plan, WarpSpecializedPlan) else plan
    for wp in chain or [plan]:
        (wp.pipeline if isinstance(wp, WarpSpecializedPlan) else wp).require_static(
            "cv.sim.simulate"
        )
    itemsize = _operand_itemsizes(p, dtype, operand_dtypes or {})
    cores = active_cores or int(hw.cores.value)
    in_bytes = tuple(math.prod(op.block_dims) * itemsize[op.name] for op in p.inputs)
    out_bytes = tuple(math.prod(op.block_dims) * itemsize[op.name] for op in p.outputs)
    slots = sum(x * op.num_slots for x, op in zip(in_bytes + out_bytes, p.inputs + p.outputs))
    used = slots + scratch_bytes
    check_fits(
        f"the plan (slots {slots / 1024:.0f} KiB, scratch {scratch_bytes / 1024:.0f} KiB)",
        used,
        hw,
        vmem_limit_bytes,
    )
    costs = StepCosts(
        in_bytes,
        out_bytes,
        float(flops_per_step),
        hw.matrix_rate(dtype) / int(hw.cores.value),
        hw.reuse_bandwidth.value / cores,
        hw.hbm_bandwidth.value * hw.hbm_efficiency.value / cores,
    )
    prog = chain_program(chain) if chain else plan.program()  # built once: run, then counted
    steps = sum(wp.pipeline.num_steps for wp in chain) if chain else p.num_steps
    time, boxes = timed.run(prog, _timing(p, costs, hw, isinstance(plan, WarpSpecializedPlan)))
    sizes = dict(zip([op.name for op in p.inputs + p.outputs], in_bytes + out_bytes))
    block = {op.name: math.prod(op.block_dims) for op in p.inputs + p.outputs}
    moved = sum(
        sizes[c.operand] * (1.0 if c.elements is None else c.elements / block[c.operand])
        for c in prog.copies()
    )
    config = {
        "grid": [list(wp.pipeline.grid) for wp in chain] if chain else list(p.grid),
        "max_concurrent_steps": p.max_concurrent_steps,
        "delay_release": p.delay_release,
        "dtype": dtype,
        "operand_dtypes": dict(operand_dtypes or {}),
        "scratch_bytes": scratch_bytes,
        "flops_per_step": flops_per_step,
        "active_cores": cores,
        "warp_specialized": isinstance(plan, WarpSpecializedPlan),
    }
    # One core's roofline: its share of the matrix peak, and its share of the load bandwidth.
    floor = max(
        float(flops_per_step) * steps / (hw.matrix_peak_rate(dtype) / int(hw.cores.value)),
        moved / (hw.reuse_bandwidth.value / cores),
    )
    return Report(
        "pipeline",
        hw,
        time,
        float(flops_per_step) * steps,
        moved,
        0.0,
        int(used),
        config,
        tuple(boxes),
        floor_s=floor,
    )
