"""Published measurements on real hardware, and the simulator's prediction of each.

Design notes: docs/internals/simulator.md, section `sim/validation.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from conveyor.sim.hardware import get as get_hardware
from conveyor.sim.simulate import simulate_collective_matmul, simulate_copy, simulate_matmul

TOLERANCE = 0.10
# A calibration row fitted a constant: it reproduces its measurement to the fit's precision.
CALIBRATION_TOLERANCE = 0.01
ROLES = ("validation", "calibration", "miss")


@dataclasses.dataclass(frozen=True)
class Measurement:
    name: str
    hardware: str
    measured: float  # in `unit`
    unit: str  # "us" or "TFLOP/s" or "TB/s"
    source: str
    predict: Callable[[], float]
    role: str = "validation"  # or "calibration", or "miss"
    # A "miss": a measurement the model is known to miss by more than TOLERANCE, and the named
    # effect it lacks that explains it (a row within TOLERANCE is a validation row instead).
    effect: str = ""

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {self.role!r}")
        if (self.role == "miss") != bool(self.effect):
            raise ValueError(f"{self.name}: a miss names its effect, and only a miss does")


def _matmul_tflops(hw):
    r = simulate_matmul(8192, 8192, 8192, dtype="bf16", hardware=hw)
    return r.flops / r.time_s / 1e12


def _matmul_shape_tflops(hw, m, k, n):
    r = simulate_matmul(m, k, n, dtype="bf16", hardware=hw)
    return r.flops / r.time_s / 1e12


# OpenXLA's matmul performance table for sm_90 ("NVIDIA H100 80GB HBM3"): an XLA-compiled bf16
# dot, its median CUDA kernel time over 5 traced runs on random arguments (no launch in it),
# published as FLOP/s per (b, m, n, k).
XLA_PERF_TABLE = (
    "OpenXLA xla/service/gpu/model/matmul_interpolator_data.h, sm_90 (H100 80GB HBM3): "
    "XLA-compiled bf16 dot, median kernel time of 5 traced runs (xla/tools/"
    "matmul_perf_table_gen), b=1"
)


def _copy_tbs(hw):
    r = simulate_copy(4e9, hardware=hw)
    return r.hbm_bytes / r.time_s / 1e12


def _flux(kind, unfused):
    # 8 x H800, TP=8, fp16, M=4096, K=12288, N=49152: all-gather x GEMM gathers 512 rows per
    # device of a [4096, 12288] lhs against a local [12288, 6144] slice; GEMM x reduce-scatter
    # multiplies a local [4096, 6144] slice by [6144, 12288] and scatters 512 rows per device.
    if kind == "all_gather_matmul":
        r = simulate_collective_matmul(
            kind,
            512,
            12288,
            6144,
            8,
            dtype="f16",
            hardware="h800",
            bidirectional=False,
            unfused=unfused,
        )
    else:
        r = simulate_collective_matmul(
            kind,
            512,
            6144,
            12288,
            8,
            dtype="f16",
            hardware="h800",
            bidirectional=False,
            unfused=unfused,
        )
    return r.time_us


FLUX = "ByteDance Flux README: 8xH800, TP=8, fp16, M=4096, K=12288, N=49152 (shared FACTS)"
SCALING_BOOK = (
    "How To Scale Your Model, 'Programming TPUs in JAX': TPU v5e-8, mesh 2x4, B, D, F = 1024, "
    "2048, 8192, int32 (arange) data, all-gather over the 4-chip Y axis (shared FACTS)"
)


def _scaling_book(kind: str) -> float:
    # Per chip: A[B/X, D/Y] = [512, 512] travels round the 4-chip Y ring (contraction-sharded);
    # W[D, F/Y] = [2048, 2048] stays; out [512, 2048]. As rows x K-block x n: 512, 512, 2048.
    if kind == "unsharded":
        return simulate_matmul(512, 2048, 2048, dtype="int32", hardware="v5e").time_us
    return simulate_collective_matmul(
        "all_gather_matmul",
        512,
        512,
        2048,
        4,
        dtype="int32",
        hardware="v5e",
        bidirectional=False,
        unfused=kind == "blocking",
    ).time_us


PALLAS_GUIDE = (
    "JAX docs, Pallas TPU 'Matrix Multiplication' guide: TPU v5e, bf16 in and out, timeit over "
    "100 awaited calls (host dispatch included)"
)
# The guide's timings (seconds) of its own pipelined matmul (grid m/bm x n/bn x k/bk, two buffers
# per operand, a float32 accumulator), by (bm, bk, bn) and m = k = n, and of jnp.matmul.
PALLAS_GUIDE_S = {
    ((128, 128, 128), 1024): 297.66e-6,
    ((128, 128, 128), 4096): 11.7715e-3,
    ((128, 128, 128), 8192): 91.8358e-3,
    ((512, 1024, 1024), 1024): 127.087e-6,
    ((512, 1024, 1024), 4096): 889.088e-6,
    ((512, 1024, 1024), 8192): 6.09943e-3,
}
PALLAS_GUIDE_XLA_1024_S = 119.430e-6


def _guide_dispatch_s() -> float:
    """The host's cost per call in the guide's timings: jnp.matmul's 1024^3 time less its device
    time, taken as its FLOPs at v5e's sustained MXU rate (XLA's kernel has no replay here)."""
    return PALLAS_GUIDE_XLA_1024_S - 2.0 * 1024**3 / get_hardware("v5e").matrix_rate("bf16")


def _guide_xla_1024_us() -> float:
    return (_guide_dispatch_s() + 2.0 * 1024**3 / get_hardware("v5e").matrix_rate("bf16")) * 1e6


def _guide_matmul_us(tiling: tuple[int, int, int], size: int) -> float:
    """The guide's kernel as the simulator replays it, plus the dispatch (calls awaited)."""
    r = simulate_matmul(size, size, size, dtype="bf16", hardware="v5e", tiling=tiling, stages=2)
    return r.call_time_s(_guide_dispatch_s()) * 1e6


def _guide_rows() -> tuple[Measurement, ...]:
    calibrating = {((128, 128, 128), 8192), ((512, 1024, 1024), 8192)}
    rows = [
        Measurement(
            "jnp.matmul 1024^3 (host dispatch)",
            "v5e",
            PALLAS_GUIDE_XLA_1024_S * 1e6,
            "us",
            PALLAS_GUIDE,
            _guide_xla_1024_us,
            role="calibration",
        )
    ]
    for (tiling, size), seconds in PALLAS_GUIDE_S.items():
        rows.append(
            Measurement(
                f"pipelined matmul {size}^3, blocks {'x'.join(map(str, tiling))}",
                "v5e",
                seconds * 1e6,
                "us",
                PALLAS_GUIDE,
                lambda tiling=tiling, size=size: _guide_matmul_us(tiling, size),
                role="calibration" if (tiling, size) in calibrating else "validation",
            )
        )
    return tuple(rows)


def _xla_perf_table_rows() -> tuple[Measurement, ...]:
    """The H100 table's b=1 rows kept: two square ones, and one the model misses by a named
    effect (an output of few tiles, whose contraction the compiled kernel splits)."""
    rows = []
    for (m, n, k), flops in (
        ((4096, 4096, 4096), 783328793548203),
        ((2048, 2048, 2048), 631984593290170),
    ):
        rows.append(
            Measurement(
                f"{m}x{k}x{n} bf16 matmul (m x k x n)",
                "h100",
                round(flops / 1e12, 1),
                "TFLOP/s",
                XLA_PERF_TABLE,
                lambda m=m, k=k, n=n: _matmul_shape_tflops("h100", m, k, n),
            )
        )
    rows.append(
        Measurement(
            "256x4096x2048 bf16 matmul (m x k x n)",
            "h100",
            round(285873755058572 / 1e12, 1),
            "TFLOP/s",
            XLA_PERF_TABLE,
            lambda: _matmul_shape_tflops("h100", 256, 4096, 2048),
            role="miss",
            effect=(
                "split-K: the output has 16 tiles for 132 SMs, so the compiled kernel splits the "
                "contraction over more blocks and sums them; the model runs one block per output "
                "tile"
            ),
        )
    )
    return tuple(rows)


MEASUREMENTS: tuple[Measurement, ...] = (
    Measurement(
        "8192^3 bf16 matmul",
        "h100",
        798.0,
        "TFLOP/s",
        "shared FACTS (H100 SXM, PyTorch, 2026)",
        lambda: _matmul_tflops("h100"),
        role="calibration",
    ),
    Measurement(
        "device-to-device copy",
        "h100",
        3.0,
        "TB/s",
        "shared FACTS (H100 SXM, read + write)",
        lambda: _copy_tbs("h100"),
        role="calibration",
    ),
    Measurement(
        "8192^3 bf16 matmul",
        "h200",
        790.0,
        "TFLOP/s",
        "shared FACTS (H200, about 790 TFLOP/s)",
        lambda: _matmul_tflops("h200"),
    ),
    Measurement(
        "device-to-device copy",
        "h200",
        4.3,
        "TB/s",
        "shared FACTS (H200, about 4.3 TB/s)",
        lambda: _copy_tbs("h200"),
    ),
    Measurement(
        "all-gather then GEMM (unfused)",
        "h800",
        1429.0,
        "us",
        FLUX,
        lambda: _flux("all_gather_matmul", True),
    ),
    Measurement(
        "all-gather x GEMM, fused ring",
        "h800",
        957.0,
        "us",
        FLUX,
        lambda: _flux("all_gather_matmul", False),
        role="calibration",
    ),
    Measurement(
        "GEMM then reduce-scatter (unfused)",
        "h800",
        1408.0,
        "us",
        FLUX,
        lambda: _flux("matmul_reduce_scatter", True),
    ),
    Measurement(
        "GEMM x reduce-scatter, fused ring",
        "h800",
        932.0,
        "us",
        FLUX,
        lambda: _flux("matmul_reduce_scatter", False),
    ),
    Measurement(
        "matmul without the sharded contraction",
        "v5e",
        224.0,
        "us",
        SCALING_BOOK,
        lambda: _scaling_book("unsharded"),
        role="calibration",
    ),
    Measurement(
        "blocking all-gather then matmul",
        "v5e",
        311.0,
        "us",
        SCALING_BOOK,
        lambda: _scaling_book("blocking"),
    ),
    Measurement(
        "collective matmul, unidirectional ring",
        "v5e",
        244.0,
        "us",
        SCALING_BOOK,
        lambda: _scaling_book("ring"),
    ),
    Measurement(
        "lax.ppermute, 64 MiB per device, one hop",
        "v5p",
        781.98,
        "us",
        "marin-community/marin issue 6736: TPU v5p-8, barriered lax.ppermute, repeat-count "
        "slope (no host launch)",
        lambda: get_hardware("v5p").hop_s(64 * 2**20) * 1e6,
        role="calibration",
    ),
    Measurement(
        "lax.ppermute, 64 MiB per device, one hop",
        "v6e",
        776.34,
        "us",
        "marin-community/marin issue 6736: TPU v6e-8, barriered lax.ppermute, repeat-count "
        "slope (no host launch)",
        lambda: get_hardware("v6e").hop_s(64 * 2**20) * 1e6,
        role="calibration",
    ),
    *_guide_rows(),
    *_xla_perf_table_rows(),
)


def compare() -> list[dict]:
    rows = []
    for m in MEASUREMENTS:
        predicted = m.predict()
        err = predicted / m.measured - 1.0
        rows.append(
            {
                "name": m.name,
                "hardware": m.hardware,
                "measured": m.measured,
                "predicted": predicted,
                "unit": m.unit,
                "error": err,
                "role": m.role,
                "within": _within(m.role, err),
                "effect": m.effect,
                "source": m.source,
            }
        )
    return rows


def _within(role: str, err: float) -> bool:
    """Whether a row is as its role says: a calibration row reproduces its measurement, a
    validation row is within TOLERANCE, a miss is beyond it (else it would validate)."""
    if role == "calibration":
        return abs(err) <= CALIBRATION_TOLERANCE
    if role == "miss":
        return abs(err) > TOLERANCE
    return abs(err) <= TOLERANCE


def _number(x: float) -> str:
    """Four significant digits, without an exponent for values up to a million."""
    return f"{x:.1f}" if 1e3 <= abs(x) < 1e6 else f"{x:.4g}"


def markdown(rows: list[dict] | None = None) -> str:
    """The comparison as the table in docs/simulator.md (`rows`: compare()'s, computed here if not
    given)."""
    lines = [
        "| measurement | hardware | measured | predicted | error | role | source |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = compare() if rows is None else rows
    for r in rows:
        flag = "" if r["within"] or r["role"] == "miss" else " **miss**"
        role = f"miss: {r['effect']}" if r["role"] == "miss" else r["role"]
        lines.append(
            f"| {r['name']} | {r['hardware']} | {r['measured']:g} {r['unit']} | "
            f"{_number(r['predicted'])} {r['unit']} | {r['error']:+.1%}{flag} | {role} | "
            f"{r['source']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown())
