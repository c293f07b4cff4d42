"""Hardware models for the simulator: every number with its source, peaks apart from achievable
rates.

Design notes: docs/internals/simulator.md, section `sim/hardware.py`.
"""

from __future__ import annotations

import dataclasses

from conveyor import dtypes

SOURCES = {
    "h100-ds": (
        "NVIDIA H100 Tensor Core GPU datasheet (SXM5 column): 989 TFLOP/s dense BF16/FP16, 1979 "
        "FP8, 67 FP32, 3.35 TB/s HBM3, NVLink 900 GB/s"
    ),
    "h200-ds": (
        "NVIDIA H200 Tensor Core GPU datasheet (SXM): same Tensor Core peaks as H100 SXM, 4.8 TB/s "
        "HBM3e, NVLink 900 GB/s"
    ),
    "h800-ds": "NVIDIA H800 SXM5 product brief: H100 SXM compute, NVLink 400 GB/s",
    "b200-ds": (
        "NVIDIA DGX B200 datasheet (8 GPUs: 72 PFLOP/s FP8 training, 144 PFLOP/s FP4 inference, 64 "
        "TB/s HBM3e, 14.4 TB/s NVLink) divided by 8, sparse figures halved for dense"
    ),
    "hopper-wp": (
        "NVIDIA H100 (Hopper) architecture whitepaper / tuning guide: 132 SMs (SXM5), 228 KB "
        "shared memory per SM (227 KB usable per block), 50 MB L2"
    ),
    "cuda-smem": (
        "CUDA C++ Programming Guide, shared memory (compute capability 5.x and later, 9.0 and 10.0 "
        "included): 32 banks, each serving one 32-bit word per clock, so 128 bytes per clock per "
        "SM; taken at the clock est-l2 takes (1.83 GHz on Hopper, 1.9 GHz on B200)"
    ),
    "blackwell-guide": (
        "NVIDIA Blackwell tuning guide: 228 KB shared memory per SM; 148 SMs on B200"
    ),
    "facts-h100": (
        "shared FACTS (one H100 SXM machine, PyTorch, 2026): 8192^3 bf16 matmul 798 TFLOP/s; "
        "device-to-device copy 3.0 TB/s (read + write)"
    ),
    "scaling-book": (
        "How To Scale Your Model (jax-ml.github.io/scaling-book), 'How to think about TPUs': TPU "
        "v5e 1.97e14 bf16 FLOP/s, 8.1e11 B/s HBM, ICI 4.5e10 B/s one way per link (2D torus, 4 "
        "links), 128 MiB VMEM; TPU v5p 4.59e14 bf16 FLOP/s, 2.8e12 B/s HBM, ICI 9e10 B/s one way "
        "per link (3D torus, 6 links)"
    ),
    "tpu-lab": (
        "accelerated-computing.academy lab 11 (TPU v5p): ~92 GB/s per ICI link per direction, ~1 "
        "us per hop"
    ),
    "tpu-v5e-ds": (
        "Google Cloud TPU v5e documentation: 197 TFLOP/s bf16, 394 TOPS int8, 16 GB HBM2 at 819 "
        "GB/s"
    ),
    "tpu-v5p-ds": (
        "Google Cloud TPU v5p documentation: 459 TFLOP/s bf16, 918 TOPS int8, 95 GB HBM2e at 2765 "
        "GB/s"
    ),
    "tpu-v6e-ds": (
        "Google Cloud TPU v6e (Trillium) documentation: one TensorCore per chip (two 256x256 "
        "MXUs), 918 TFLOP/s bf16, 1836 TOPS int8, 32 GB HBM at 1638 GB/s, 800 GB/s bidirectional "
        "ICI per chip over 4 ports (2D torus): 100 GB/s one way per port"
    ),
    "est-latency": (
        "estimate: DRAM access latency of HBM parts is 0.5-1 us from issue to first bytes; 0.7 us "
        "taken for a TMA/DMA copy"
    ),
    "triton-b200-tma": (
        "facebookexperimental/triton PR 1219 (a B200 operation-latency model derived from "
        "microbenchmarks): a TMA load takes 518-918 cycles by tile size plus 700 cycles of async "
        "overhead, 1218-1618 cycles: 0.6-1.1 us at 1.5-2.0 GHz (the source gives no clock); "
        "0.7 us taken"
    ),
    "est-sync": (
        "estimate: an mbarrier / semaphore handoff whose data is ready costs tens of cycles; 0.05 "
        "us taken per pipeline step"
    ),
    "est-l2": (
        "estimate: L2 serves the re-read matmul tiles on GPUs; taken as 64 B/clk per SM x SMs x "
        "boost clock (H100: 15.5 TB/s). Microbenchmarks of H100 PCIe report 5.5-7 TB/s, but the "
        "FACTS 798 TFLOP/s matmul needs at least 7.8 TB/s of tile loads with 128x256 tiles, so the "
        "SXM part delivers more"
    ),
    "calib-matmul": (
        "calibrated: the sustained tensor-core rate (0.902 of peak) at which the simulator's own "
        "replay of an 8192^3 bf16 matmul on H100 (its waves, fill, per-step sync) gives the FACTS "
        "measurement, 798 TFLOP/s; that measurement is therefore not used to validate. Reused for "
        "the other Hopper and Blackwell parts"
    ),
    "calib-copy": (
        "calibrated: 3.0 / 3.35 = 0.896 of HBM peak on the FACTS H100 copy (not used to validate)"
    ),
    "libtpu-vmem": (
        "libtpu's compile-only TPU topologies (../shared/FACTS.md, 'real compilers on CPU'; "
        "docs/compile-check.md): a Mosaic kernel gets a scoped-VMEM limit of 16 MiB on v5e and "
        "v5p (32 MiB on v6e) unless it sets vmem_limit_bytes, which may rise to the physical VMEM "
        "the TPU info reports: 128 MiB on v5e and v6e, 64 MiB on v5p"
    ),
    "calib-v5e-int32": (
        "calibrated: the int32 matmul rate (emulated on the MXU) at which the simulator's replay "
        "of the Scaling Book's unsharded per-chip matmul ([512, 2048] x [2048, 2048] int32 on TPU "
        "v5e) takes the measured 224 us (with the v5e step cost and MXU fraction below); "
        "20.6e12 is 0.84 of the int8 peak / 16 (24.6e12), as if an int32 product took a little "
        "more than 16 int8 passes (our reading, not a published figure)"
    ),
    "est-tpu-matmul": (
        "estimate: large bf16 matmuls on TPU v5 reach about 85% of peak (no measurement kept yet)"
    ),
    "pallas-tpu-matmul": (
        "JAX docs, Pallas TPU 'Matrix Multiplication' guide (docs.jax.dev/en/latest/pallas/tpu/"
        "matmul.html), timings printed on a TPU v5e with timeit (100 calls, each awaited, host "
        "dispatch included): bf16 m = k = n = 1024 / 4096 / 8192 with 128^3 blocks 297.7 us / "
        "11.77 ms / 91.84 ms, with 512 x 1024 x 1024 blocks 127.1 us / 889.1 us / 6.099 ms; "
        "jnp.matmul (XLA) 119.4 us / 827.3 us / 6.047 ms"
    ),
    "calib-v5e-step": (
        "calibrated: the fixed cost of one pipeline step on TPU v5e (0.248 us, beside the step's "
        "MXU work), fitted so that the simulator's replay of the guide's 8192^3 bf16 matmul with "
        "128^3 blocks (262,144 steps, 0.350 us each) plus the dispatch takes the measured 91.84 ms "
        "(pallas-tpu-matmul); that row is then not used to validate. It is fitted with the DMA "
        "latency below"
    ),
    "est-v5e-dma": (
        "estimate bounded by measurement: the guide's 128^3-block pipelines take 0.35 us a step "
        "with two buffers, so a copy lands within about two steps of its issue; every latency "
        "from 0 to 0.6 us, refitting the step cost, predicts the guide's rows within 3.5%, "
        "and 0.7 us (the GPU estimate) misses by 15%. 0.35 us taken; no published v5e DMA "
        "latency is kept"
    ),
    "calib-v5e-mxu": (
        "calibrated: the MXU's sustained fraction of the bf16 peak during a step's matmul on TPU "
        "v5e (0.974), fitted so that the replay of the guide's 8192^3 bf16 matmul with "
        "512 x 1024 x 1024 blocks plus the dispatch takes the measured 6.099 ms (91.5% of peak "
        "over the whole call; XLA's own matmul reached 92.3%); that row is then not used to "
        "validate"
    ),
    "marin-ppermute": (
        "marin-community/marin issue 6736 (June 2026): a barriered `lax.ppermute` payload sweep "
        "on TPU v5p-8 and v6e-8, timed as repeat-count slopes inside one compiled loop (no host "
        "launch): v5p 1-16 KiB 4.5-5.5 us, 1 MiB 16.94 us, 64 MiB 781.98 us per device; their "
        "large-payload fit 4.55 us + bytes / 86.3 GB/s; v6e 1-16 KiB 5.6-5.9 us, 1 MiB 17.45 us, "
        "64 MiB 776.34 us, fit 2.29 us + bytes / 86.8 GB/s"
    ),
    "calib-v6e-link": (
        "calibrated: the fraction of the v6e link rate (1e11 B/s, tpu-v6e-ds) at which one hop "
        "of 64 MiB, with the model's 1 us per hop, takes the 776.34 us marin-ppermute measured "
        "(0.8655); that measurement is then not used to validate. Its 1 MiB point (17.45 us) is "
        "25% slower than this hop model predicts (13.1 us), as on v5p: an XLA collective's fixed "
        "cost is not a remote DMA's"
    ),
    "est-v6e-from-v5e": (
        "estimate, borrowed: no published v6e per-step cost, DMA latency, sustained MXU fraction "
        "or per-hop latency is kept, so v6e (v5e's successor: one TensorCore, the same 2D-torus "
        "pod) takes v5e's calibrated step cost (0.248 us), DMA latency (0.35 us) and MXU fraction "
        "(0.974), and v5p's measured ~1 us per hop (tpu-lab); replace each when a v6e "
        "measurement appears"
    ),
    "calib-v5p-link": (
        "calibrated: the fraction of the v5p link rate (9.2e10 B/s, tpu-lab) at which one hop of "
        "64 MiB, with the model's 1 us per hop, takes the 781.98 us marin-ppermute measured "
        "(0.934); that measurement is then not used to validate. Its 1 MiB point is 22% slower "
        "than this hop model predicts: an XLA collective's fixed cost (4.55 us in the source's "
        "fit) is not a remote DMA's"
    ),
    "est-link": (
        "estimate: NCCL-class ring transfers reach about 80% of the per-direction link rate"
    ),
    "calib-overlap": (
        "calibrated: the compute slowdown during overlapped NVLink transfers that makes the "
        "simulated Flux fused all-gather x GEMM (8xH800) take the measured 957 us; that "
        "measurement is then not used to validate (the fused GEMM x reduce-scatter is)"
    ),
    "measured-run": (
        "measured in the same run as what is predicted (cv.sim.calibrate.at_measured_rates, used "
        "by `conveyor bench gmm --platform gpu`): the matrix fraction fitted to the run's dense "
        "matmul, the HBM fraction to its copy; not part of any shipped model"
    ),
    "est-overlap-tpu": (
        "estimate: no overlapped TPU measurement kept; 0 taken (DMA engines and ICI are separate "
        "from the MXU, though HBM is shared)"
    ),
}


@dataclasses.dataclass(frozen=True)
class Value:
    value: float
    source: str  # key into SOURCES

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"unknown source {self.source!r}")


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    kind: str  # "gpu" | "tpu"
    cores: Value  # SMs or TensorCores per chip
    matrix_peak: dict[str, Value]  # FLOP/s per chip by operand dtype (dense)
    hbm_bandwidth: Value  # B/s per chip
    onchip_bytes: Value  # shared memory per SM / VMEM per core
    reuse_bandwidth: Value  # B/s per chip for re-read blocks (GPU L2; TPU: HBM)
    copy_latency: Value  # s from a copy's issue to its first bytes
    link_bandwidth: Value  # B/s per direction per neighbour in a ring
    link_latency: Value  # s per hop
    sync_latency: Value  # s per barrier / semaphore handoff
    matrix_efficiency: Value  # achievable fraction of matrix_peak
    hbm_efficiency: Value  # achievable fraction of hbm_bandwidth
    link_efficiency: Value  # achievable fraction of link_bandwidth
    overlap_slowdown: Value  # compute runs this much slower while a transfer runs beside it
    # B/s per core of on-chip memory for a kernel's own passes over its blocks (GPU: shared
    # memory through registers); None where no kernel priced on the part makes one.
    onchip_bandwidth: Value | None = None
    # What a kernel may hold on chip unless it asks for more (TPU: the scoped-VMEM limit, raised
    # by `vmem_limit_bytes`); None: all of `onchip_bytes` (GPU kernels take the SM's whole
    # shared memory).
    onchip_default_bytes: Value | None = None

    def onchip_limit(self, requested: int | None = None) -> int:
        """Bytes of on-chip memory per core a kernel may hold: `requested` (its
        `vmem_limit_bytes`), at most `onchip_bytes`; without, the chip's default limit."""
        physical = int(self.onchip_bytes.value)
        if requested is not None:
            return min(int(requested), physical)
        default = self.onchip_default_bytes
        return physical if default is None else int(default.value)

    def matrix_peak_rate(self, dtype: str) -> float:
        """Peak (datasheet) matrix FLOP/s per chip for operands of `dtype`."""
        # tf32: the f32 rate (a math mode, not a dtype)
        key = "f32" if dtype == "tf32" else dtypes.short(dtype)
        if key not in self.matrix_peak:
            raise ValueError(
                f"hardware {self.name}: no matrix rate for dtype {dtype!r}; known: "
                f"{sorted(self.matrix_peak)}"
            )
        return self.matrix_peak[key].value

    def matrix_rate(self, dtype: str) -> float:
        """Achievable matrix FLOP/s per chip for operands of `dtype`."""
        return self.matrix_peak_rate(dtype) * self.matrix_efficiency.value

    def hop_s(self, nbytes: float) -> float:
        """Seconds for `nbytes` to cross one link of a ring: the achievable link rate plus the
        per-hop latency."""
        rate = self.link_bandwidth.value * self.link_efficiency.value
        return nbytes / rate + self.link_latency.value

    def numbers(self) -> dict[str, Value]:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Value):
                out[f.name] = v
            elif isinstance(v, dict):
                out.update({f"{f.name}[{k}]": x for k, x in v.items()})
        return out


KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
OVERLAP_GPU = (
    0.264  # SOURCES["calib-overlap"]: fitted once with a bisection on the Flux fused all-gather
)
KiB, MiB = 1024, 1024**2
# TPU v5e, fitted once with a bisection each; their calibration rows in conveyor.sim.validation
# must reproduce their measurements within 1% (tests/sim/test_simulate.py).
V5E_STEP_S = 0.2479e-6  # SOURCES["calib-v5e-step"]
V5E_MXU_FRACTION = 0.974  # SOURCES["calib-v5e-mxu"]
V5P_LINK_FRACTION = 0.934  # SOURCES["calib-v5p-link"]
V6E_LINK_FRACTION = 0.8655  # SOURCES["calib-v6e-link"]


def _hopper(name, hbm, hbm_src, link, link_src):
    return Hardware(
        name=name,
        kind="gpu",
        cores=Value(132, "hopper-wp"),
        matrix_peak={
            "bf16": Value(989.4e12, "h100-ds"),
            "f16": Value(989.4e12, "h100-ds"),
            "fp8": Value(1978.9e12, "h100-ds"),
            "f32": Value(494.7e12, "h100-ds"),
        },
        hbm_bandwidth=Value(hbm, hbm_src),
        onchip_bytes=Value(227 * KiB, "hopper-wp"),
        reuse_bandwidth=Value(64 * 132 * 1.83e9, "est-l2"),
        copy_latency=Value(0.7e-6, "est-latency"),
        link_bandwidth=Value(link, link_src),
        link_latency=Value(1e-6, "est-latency"),
        sync_latency=Value(0.05e-6, "est-sync"),
        matrix_efficiency=Value(0.902, "calib-matmul"),
        hbm_efficiency=Value(0.896, "calib-copy"),
        link_efficiency=Value(0.8, "est-link"),
        overlap_slowdown=Value(OVERLAP_GPU, "calib-overlap"),
        onchip_bandwidth=Value(128 * 1.83e9, "cuda-smem"),
    )


HARDWARE: dict[str, Hardware] = {
    "h100": _hopper("H100 SXM", 3.35 * TB, "h100-ds", 450 * GB, "h100-ds"),
    "h200": _hopper("H200 SXM", 4.8 * TB, "h200-ds", 450 * GB, "h200-ds"),
    "h800": _hopper("H800 SXM", 3.35 * TB, "h100-ds", 200 * GB, "h800-ds"),
    "b200": Hardware(
        name="B200",
        kind="gpu",
        cores=Value(148, "blackwell-guide"),
        matrix_peak={
            "bf16": Value(2.25e15, "b200-ds"),
            "f16": Value(2.25e15, "b200-ds"),
            "fp8": Value(4.5e15, "b200-ds"),
            "f32": Value(1.125e15, "b200-ds"),
        },
        hbm_bandwidth=Value(8 * TB, "b200-ds"),
        onchip_bytes=Value(227 * KiB, "blackwell-guide"),
        reuse_bandwidth=Value(64 * 148 * 1.9e9, "est-l2"),
        copy_latency=Value(0.7e-6, "triton-b200-tma"),
        link_bandwidth=Value(900 * GB, "b200-ds"),
        link_latency=Value(1e-6, "est-latency"),
        sync_latency=Value(0.05e-6, "est-sync"),
        matrix_efficiency=Value(0.902, "calib-matmul"),
        hbm_efficiency=Value(0.896, "calib-copy"),
        link_efficiency=Value(0.8, "est-link"),
        overlap_slowdown=Value(OVERLAP_GPU, "calib-overlap"),
        onchip_bandwidth=Value(128 * 1.9e9, "cuda-smem"),
    ),
    "v5e": Hardware(
        name="TPU v5e",
        kind="tpu",
        cores=Value(1, "scaling-book"),
        matrix_peak={
            "bf16": Value(1.97e14, "tpu-v5e-ds"),
            "int8": Value(3.94e14, "tpu-v5e-ds"),
            "int32": Value(2.06e13, "calib-v5e-int32"),
        },
        hbm_bandwidth=Value(8.19e11, "tpu-v5e-ds"),
        onchip_bytes=Value(128 * MiB, "scaling-book"),
        onchip_default_bytes=Value(16 * MiB, "libtpu-vmem"),
        reuse_bandwidth=Value(8.19e11, "tpu-v5e-ds"),
        copy_latency=Value(0.35e-6, "est-v5e-dma"),
        link_bandwidth=Value(4.5e10, "scaling-book"),
        link_latency=Value(1e-6, "tpu-lab"),
        sync_latency=Value(V5E_STEP_S, "calib-v5e-step"),
        matrix_efficiency=Value(V5E_MXU_FRACTION, "calib-v5e-mxu"),
        hbm_efficiency=Value(0.896, "calib-copy"),
        link_efficiency=Value(0.8, "est-link"),
        overlap_slowdown=Value(0.0, "est-overlap-tpu"),
    ),
    "v6e": Hardware(
        name="TPU v6e",
        kind="tpu",
        cores=Value(1, "tpu-v6e-ds"),
        matrix_peak={"bf16": Value(9.18e14, "tpu-v6e-ds"), "int8": Value(1.836e15, "tpu-v6e-ds")},
        hbm_bandwidth=Value(1.638e12, "tpu-v6e-ds"),
        onchip_bytes=Value(128 * MiB, "libtpu-vmem"),
        onchip_default_bytes=Value(32 * MiB, "libtpu-vmem"),
        reuse_bandwidth=Value(1.638e12, "tpu-v6e-ds"),
        copy_latency=Value(0.35e-6, "est-v6e-from-v5e"),
        link_bandwidth=Value(1e11, "tpu-v6e-ds"),
        link_latency=Value(1e-6, "est-v6e-from-v5e"),
        sync_latency=Value(V5E_STEP_S, "est-v6e-from-v5e"),
        matrix_efficiency=Value(V5E_MXU_FRACTION, "est-v6e-from-v5e"),
        hbm_efficiency=Value(0.896, "calib-copy"),
        link_efficiency=Value(V6E_LINK_FRACTION, "calib-v6e-link"),
        overlap_slowdown=Value(0.0, "est-overlap-tpu"),
    ),
    "v5p": Hardware(
        name="TPU v5p",
        kind="tpu",
        cores=Value(2, "tpu-lab"),
        matrix_peak={"bf16": Value(4.59e14, "tpu-v5p-ds"), "int8": Value(9.18e14, "tpu-v5p-ds")},
        hbm_bandwidth=Value(2.765e12, "tpu-v5p-ds"),
        onchip_bytes=Value(64 * MiB, "libtpu-vmem"),
        onchip_default_bytes=Value(16 * MiB, "libtpu-vmem"),
        reuse_bandwidth=Value(2.765e12, "tpu-v5p-ds"),
        copy_latency=Value(0.7e-6, "est-latency"),
        link_bandwidth=Value(9.2e10, "tpu-lab"),
        link_latency=Value(1e-6, "tpu-lab"),
        sync_latency=Value(0.05e-6, "est-sync"),
        matrix_efficiency=Value(0.85, "est-tpu-matmul"),
        hbm_efficiency=Value(0.896, "calib-copy"),
        link_efficiency=Value(V5P_LINK_FRACTION, "calib-v5p-link"),
        overlap_slowdown=Value(0.0, "est-overlap-tpu"),
    ),
}


def get(name: str | Hardware) -> Hardware:
    if isinstance(name, Hardware):
        return name
    key = name.lower().replace(" ", "").replace("-", "").replace("sxm", "").replace("tpu", "")
    if key not in HARDWARE:
        raise ValueError(f"hardware: unknown {name!r}; known: {sorted(HARDWARE)}")
    return HARDWARE[key]


def markdown_table() -> str:
    """The hardware table of docs/hardware.md: every number and its source."""
    rows = ["| hardware | quantity | value | source |", "|---|---|---|---|"]
    for key, hw in HARDWARE.items():
        for q, v in hw.numbers().items():
            rows.append(f"| {hw.name} (`{key}`) | {q} | {v.value:.4g} | `{v.source}` |")
    rows += ["", "| source | what it is |", "|---|---|"]
    rows += [f"| `{k}` | {v} |" for k, v in SOURCES.items()]
    return "\n".join(rows) + "\n"
