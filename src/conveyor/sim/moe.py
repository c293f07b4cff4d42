"""The expert-parallel MoE layer on a hardware model: its three exchanges side by side.

Design notes: docs/internals/simulator.md, section `sim/moe.py`.
"""

from __future__ import annotations

import dataclasses

from conveyor.ints import cdiv
from conveyor import dtypes
from conveyor.ops.gmm.tiling import tpu_default
from conveyor.moe.exchange import most_received
from conveyor.plans.exchange import default_stages, exchange_plan, staged_exchange_plan
from conveyor.sim import timed
from conveyor.sim.hardware import Hardware, get as get_hardware
from conveyor.sim.report import Box, Report
from conveyor.sim.simulate import simulate_gmm
from conveyor.sim.timed import Timing

EXCHANGES = ("dense", "exact", "peers", "experts")
LABELS = {
    "dense": "dense",
    "exact": "exact",
    "peers": "overlapped, per peer",
    "experts": "overlapped, per expert",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoeShape:
    """One MoE layer: tokens per chip, model width d, expert hidden size f, experts, top-k."""

    name: str
    tokens: int
    d: int
    f: int
    experts: int
    top_k: int

    def __post_init__(self):
        for field in ("tokens", "d", "f", "experts", "top_k"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoeShape: {field} must be an int >= 1, got {v!r}")
        if self.top_k > self.experts:
            raise ValueError(
                f"MoeShape: top_k must be at most experts={self.experts}, got {self.top_k}"
            )


# Mixtral 8x7B (its paper and config: hidden 4096, intermediate 14336, 8 experts, top-2) and
# DeepSeek-V3 (its config: hidden 7168, moe_intermediate_size 2048, 256 routed experts, top-8; the
# shared expert is not part of the exchange); 4096 tokens per chip for both.
SHAPES = {
    "mixtral": MoeShape(name="mixtral", tokens=4096, d=4096, f=14336, experts=8, top_k=2),
    "deepseek": MoeShape(name="deepseek", tokens=4096, d=7168, f=2048, experts=256, top_k=8),
}


def simulate_moe_layer(
    shape: MoeShape | str,
    *,
    exchange: str = "exact",
    devices: int = 8,
    hardware: str | Hardware = "h100",
    dtype: str = "bf16",
    buffering: int | None = None,
    stages: int | None = None,
) -> Report:
    """One forward pass of the expert-parallel layer with `exchange` (see the design notes);
    `buffering`: "peers" and "experts" only, receive slots (default 2); `stages`: "experts" only,
    a divisor of the local experts (default: the layer's). Given to another exchange, each is
    refused by name.

    The report's config holds the parts: `experts_us` (the layer's expert matmuls alone),
    `exchange_us` (the exact exchange's transfers, both ways, alone), `xla_passes_us` and
    `xla_passes` (the XLA ops between the kernels: `xla_passes`) and, for "peers" and "experts",
    `hidden`: 1 - (time - experts_us - xla_passes_us) / exchange_us, the fraction of the transfer
    time the overlap hides (the experts' slowdown beside transfers counts as exposed)."""
    s = SHAPES.get(shape, shape) if isinstance(shape, str) else shape
    if not isinstance(s, MoeShape):
        raise ValueError(f"shape: expected a MoeShape or one of {sorted(SHAPES)}, got {shape!r}")
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices: expected an int >= 1, got {devices!r}")
    if s.experts % devices:
        raise ValueError(
            f"devices: the {s.experts} experts of {s.name!r} must divide evenly over the chips, "
            f"got {devices}"
        )
    hw = get_hardware(hardware)
    b = dtypes.itemsize(dtype)
    local = s.experts // devices
    assignments = s.tokens * s.top_k
    chunk_rows = assignments // devices  # balanced routing: per peer, itself included
    slowdown = hw.overlap_slowdown.value if devices > 1 else 0.0

    def transfer_s(rows: int) -> float:
        return hw.hop_s(rows * s.d * b)

    def experts_s(rows: int, local: int = local) -> float:
        return _experts_s(s, local, rows, dtype=dtype, hw=hw)

    all_experts = experts_s(chunk_rows * devices)
    # the exact exchange's transfers, one way: the peers' chunks over two links
    per_link = cdiv(devices - 1, 2)
    exact_one_way = per_link * transfer_s(chunk_rows) if devices > 1 else 0.0
    boxes: list[Box] = []
    for name, value, takes in (
        ("buffering", buffering, ("peers", "experts")),
        ("stages", stages, ("experts",)),
    ):
        if value is not None and exchange not in takes:
            raise ValueError(
                f"{name}: only the {' and '.join(repr(t) for t in takes)} exchange(s) take it; "
                f"exchange={exchange!r} would ignore {name}={value!r}"
            )
    buffering = 2 if buffering is None else buffering
    if exchange == "experts" and local < 2:
        raise ValueError(
            f"exchange: 'experts' stages by local expert and needs at least 2 per chip; "
            f"{s.name!r} has {local} on each of {devices} chips"
        )
    if exchange == "experts":
        stages = default_stages(local) if stages is None else stages
        if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1 or local % stages:
            raise ValueError(
                f"stages: expected an int that divides the {local} local experts, got {stages!r}"
            )
        plan = staged_exchange_plan(num_devices=devices, stages=stages, buffering=buffering)
        stage_rows = assignments // stages
        stage_s = experts_s(stage_rows, local=local // stages)
        hop = transfer_s(stage_rows // devices)
        # a stage's dispatches (but the last's) and the previous stage's returns, per link
        beside = {
            r.step: min(stage_s, ((r.step + 1 < stages) + (r.step > 0)) * per_link * hop)
            for r in plan.steps()
        }
        time, boxes = _run_on_dev0(
            plan.program(), hop, lambda a: stage_s + slowdown * beside[a.step]
        )
        moved = 2 * (devices - 1) * chunk_rows * s.d * b
        experts_total = stages * stage_s
    elif exchange == "peers":
        plan = exchange_plan(num_devices=devices, buffering=buffering)
        chunk_s, hop = experts_s(chunk_rows), transfer_s(chunk_rows)
        beside = _transfer_beside(plan, hop, chunk_s)
        time, boxes = _run_on_dev0(
            plan.program(), hop, lambda a: chunk_s + slowdown * beside[(a.step, a.stream)]
        )
        moved = 2 * (devices - 1) * chunk_rows * s.d * b
        experts_total = devices * chunk_s
    else:
        peer_rows = assignments if exchange == "dense" else chunk_rows
        one_way = per_link * transfer_s(peer_rows) if devices > 1 else 0.0
        time, t = 0.0, 0.0
        for label, dur, row in (
            ("dispatch", one_way, "link right"),
            ("experts", all_experts, "compute"),
            ("return", one_way, "link left"),
        ):
            boxes.append(Box(row, "link" if row != "compute" else "compute", label, t, t + dur))
            t += dur
        time = t
        moved = 2 * (devices - 1) * peer_rows * s.d * b
        experts_total = all_experts
    passes = xla_passes(s, exchange, devices=devices, hw=hw, dtype=dtype, stages=stages)
    passes_s = sum(passes.values()) / (hw.hbm_bandwidth.value * hw.hbm_efficiency.value)
    boxes.append(Box("compute", "compute", "XLA passes", time, time + passes_s))
    time += passes_s
    comm = 2 * exact_one_way
    config = {
        "shape": s.name,
        "exchange": exchange,
        "devices": devices,
        "tokens": s.tokens,
        "d": s.d,
        "f": s.f,
        "experts": s.experts,
        "top_k": s.top_k,
        "dtype": dtype,
        "bidirectional": devices > 2,
        "experts_us": experts_total * 1e6,
        "exchange_us": comm * 1e6,
        "xla_passes_us": passes_s * 1e6,
        "xla_passes": passes,
    }
    if exchange in ("peers", "experts"):
        config["buffering"] = plan.buffering
        # exposed: what the layer takes beyond its own (per-chunk) expert matmuls
        exposed = time - experts_total
        config["hidden"] = max(0.0, min(1.0, 1.0 - (exposed - passes_s) / comm)) if comm else 0.0
    flops = 2.0 * assignments * 3 * s.d * s.f
    hbm = (local * 3 * s.d * s.f + 4 * assignments * s.d) * b + sum(passes.values())
    return Report(
        f"moe layer ({LABELS[exchange]} exchange)",
        hw,
        time,
        flops,
        hbm,
        moved,
        0,
        config,
        tuple(boxes),
    )


# Passes over a stage's receive buffer that libtpu's program of the expert-staged layer adds
# around each stage's exchanges and kernels (layout copies, slices): fitted on its compiles of the
# DeepSeek-like layer at 1024 and 4096 tokens per chip on v5e, v6e and v5p
# (docs/internals/simulator.md).
TPU_STAGE_COPIES = 7


def xla_passes(
    s: MoeShape,
    exchange: str,
    *,
    devices: int,
    hw: Hardware,
    dtype: str = "bf16",
    stages: int | None = None,
) -> dict[str, int]:
    """Bytes of device memory per chip that the layer's XLA ops between its kernels read and
    write in a forward pass, by pass: what Conveyor's layer code asks XLA for with the default
    backend of `hw` (on TPU the row-moving gmm kernels and, for "peers", the exchange kernel; on
    GPU the gmm kernels, rows gathered and results set by XLA). Balanced routing; the buffers a
    plan sizes for the worst case count whole, since XLA's ops run over all of them. Checked
    against the compiled programs by `conveyor compile-check` (design notes)."""
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange: expected one of {EXCHANGES}, got {exchange!r}")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ValueError(f"devices: expected an int >= 1, got {devices!r}")
    if s.experts % devices:
        raise ValueError(f"devices: must divide the {s.experts} experts, got {devices}")
    b = dtypes.itemsize(dtype)
    d, f, t = s.d, s.f, s.tokens
    local = s.experts // devices
    a = t * s.top_k  # assignments on this chip
    gpu = hw.kind != "tpu"

    def experts(rows: int) -> dict[str, int]:
        """The SwiGLU experts on a buffer of `rows` rows (the gate and up outputs' rows past
        the groups are not filled: `unwritten_rows="unspecified"`)."""
        out = {"SiLU product": 3 * rows * f * b}
        if gpu:  # gathered in XLA; the product in float32 (rows past the groups left
            # unwritten), gathered back into the received order by XLA, rounded
            out["rows gathered into expert order"] = 2 * rows * d * b
            out["results gathered back into received order"] = rows * d * (4 + b)
        # on TPU the kernel writes the results into rows nobody zero-fills (padding is not read)
        return out

    def add(into: dict[str, int], more: dict[str, int], times: int = 1) -> None:
        for name, nbytes in more.items():
            into[name] = into.get(name, 0) + times * nbytes

    # XLA:GPU fuses the gathers with what reads them (the tokens read once; the results gathered
    # as they are summed); libtpu writes each gathered copy first
    gathered = t * d * b if gpu else a * d * b
    passes = {
        "rows gathered into send order": gathered + a * d * b,
        "results gathered into token order and summed": gathered + a * d * b + t * d * b,
    }
    if devices == 1:
        add(passes, experts(a))
    elif exchange in ("exact", "dense"):
        rows = most_received(t, s.top_k, devices, local) if exchange == "exact" else devices * a
        if exchange == "exact":  # a forward pass's receive buffer is not filled (padding unread);
            # the results' way back lands in a zero-filled buffer of its own
            add(passes, {"results' receive buffer zero-filled": a * d * b})
        else:
            add(passes, {"receive buffer zero-filled": rows * d * b})
        add(passes, experts(rows))
        if exchange == "dense":  # packed into [devices, capacity] blocks and unpacked
            add(passes, {"rows packed and unpacked": devices * a * d * b + 4 * a * d * b})
        elif not gpu and b == 2:  # 16-bit rows travel as [rows, 1, d]: copies either side
            add(passes, {"rows viewed as [rows, 1, d] and back": 4 * a * d * b})
    elif exchange == "experts":
        stages = default_stages(local) if stages is None else stages
        rows = most_received(t, s.top_k, devices, cdiv(local, stages))
        add(passes, {"receive buffer zero-filled": rows * d * b}, stages)
        add(passes, experts(rows), stages)
        add(passes, {"results zero-filled": a * d * b})
        if not gpu:  # fitted: libtpu copies each stage's rows between layouts (design notes)
            add(passes, {"rows copied between layouts": TPU_STAGE_COPIES * rows * d * b}, stages)
    elif gpu:  # "peers" in XLA: every chunk padded to `a` rows, packed, received and placed
        add(passes, {"chunks packed and placed": 4 * a * d * b}, devices)
        add(passes, {"receive buffer zero-filled": a * d * b}, devices - 1)
        add(passes, experts(a), devices)
    else:  # "peers" as one TPU kernel: rows packed into its regions and results unpacked
        add(passes, {"rows packed into the kernel's regions and unpacked": 6 * a * d * b})
    return passes


def _run_on_dev0(prog, hop_s: float, compute_s) -> tuple[float, list[Box]]:
    """Run an exchange's event program, every copy taking `hop_s` and each compute
    `compute_s(action)`; device 0's timeline: its experts on "compute", its links' copies."""
    timing = Timing(copy_s=lambda c: hop_s, compute_s=lambda a, actor: compute_s(a))
    time, raw = timed.run(prog, timing)
    rows = {"dev0": "compute", **{f"link {d} dev0": f"link {d}" for d in ("right", "left")}}
    return time, [dataclasses.replace(x, actor=rows[x.actor]) for x in raw if x.actor in rows]


def _transfer_beside(plan, hop_s: float, chunk_s: float) -> dict[tuple[int, str], float]:
    """Per (step, stream): the transfer time running beside that compute, shared among the step's
    computes: the step's dispatches and the previous step's returns, on the busier of the two
    links, at most the step's compute time."""
    back = {"right": "left", "left": "right"}
    out = {}
    for t, records in enumerate(plan.steps()):
        per_link = {"right": 0, "left": 0}
        for r in records:
            per_link[r.direction] += r.dispatches
        for r in plan.steps()[t - 1] if t else ():
            per_link[back[r.direction]] += r.returns
        computes = [r for r in records if r.computes]
        busy = min(max(per_link.values()) * hop_s, len(computes) * chunk_s)
        for r in computes:
            out[(t, r.direction)] = busy / len(computes)
    return out


def _experts_s(s: MoeShape, local: int, rows: int, *, dtype: str, hw: Hardware) -> float:
    """The SwiGLU experts' three grouped matmuls on `rows` rows spread evenly over `local`
    experts. On TPU every layer's experts run `tiling.tpu_default` tiles of their rows: the
    row-moving gmm kernels (`fuse_permutation`) and the per-peer exchange kernel's own grouped
    matmuls (`moe/mosaic_tpu.py`, whose gate and up projections share one pipeline, one fetch of
    each row block: priced here as two grouped matmuls)."""
    sizes = [rows // local + (1 if e < rows % local else 0) for e in range(local)]

    def tiles(k: int, n: int):
        return tpu_default(rows, k, n, local) if hw.kind == "tpu" else None

    up = simulate_gmm(sizes, s.d, s.f, dtype=dtype, hardware=hw, tiling=tiles(s.d, s.f)).time_s
    down = simulate_gmm(sizes, s.f, s.d, dtype=dtype, hardware=hw, tiling=tiles(s.f, s.d)).time_s
    return 2 * up + down


def markdown_table(
    shape: MoeShape | str,
    *,
    devices: int = 8,
    hardware: str | Hardware = "h100",
    dtype: str = "bf16",
    buffering: int = 2,
) -> str:
    """The three exchanges of one layer as a markdown table (`conveyor simulate moe`)."""
    reports = {}
    for e in EXCHANGES:
        try:
            reports[e] = simulate_moe_layer(
                shape,
                exchange=e,
                devices=devices,
                hardware=hardware,
                dtype=dtype,
                buffering=buffering if e in ("peers", "experts") else None,
            )
        except ValueError as err:  # "experts" with one local expert per chip
            if e != "experts":
                raise
            skipped = str(err)
    first = reports["dense"]
    c = first.config
    exact = reports["exact"].time_s
    rows = [
        f"MoE layer {c['shape']!r} on {devices} x {first.hardware.name}: {c['tokens']} tokens per "
        f"chip, d={c['d']}, f={c['f']}, {c['experts']} experts, top-{c['top_k']}, {c['dtype']}; "
        "balanced routing, forward pass",
        "",
        "| exchange | time (us) | vs exact | expert matmuls (us) | XLA passes (us) | "
        "bytes sent per chip (MB) | transfer time hidden |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in EXCHANGES:
        if e not in reports:
            rows.append(f"| {LABELS[e]} | - | - | - | - | - | not priced: {skipped} |")
            continue
        r = reports[e]
        hidden = f"{r.config['hidden']:.0%}" if "hidden" in r.config else "0%"
        rows.append(
            f"| {LABELS[e]} | {r.time_us:.0f} | {r.time_s / exact:.2f}x | "
            f"{r.config['experts_us']:.0f} | {r.config['xla_passes_us']:.0f} | "
            f"{r.link_bytes / 1e6:.1f} | {hidden} |"
        )
    return "\n".join(rows) + "\n"
