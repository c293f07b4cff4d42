"""The benchmarks' own set-up: floors compute what they claim (a wrong floor would flatter every
ratio), and every kernel a benchmark builds is one the backend accepts (checked by tracing only)."""

import jax
import numpy as np
import jax.numpy as jnp
import pytest

from conveyor.bench import pipeline as bench_pipeline
from conveyor.bench.gmm import (
    equal_split_gmm,
    equal_split_loop_gmm,
    equal_split_loop_tgmm,
    equal_split_tgmm,
)
from conveyor.bench.pipeline import slab_loop_matmul, step_loop_matmul, thread_slab_loop_matmul


@pytest.mark.parametrize(
    "floor",
    [
        lambda: step_loop_matmul(64, 32, 48, 16, 8, 16),
        lambda: slab_loop_matmul(64, 32, 48, 8),
        lambda: thread_slab_loop_matmul(64, 32, 48, 16, 8, 2),
    ],
    ids=["step loop", "k slabs", "per-thread k slabs"],
)
def test_matmul_floors_are_matmuls(floor):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((64, 32)), rng.standard_normal((32, 48))
    got = floor()(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    # f32 accumulation over k=32 of unit normals: a few ulps of values of size ~sqrt(32).
    np.testing.assert_allclose(got, x @ y, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "gmm_floor, tgmm_floor",
    [(equal_split_gmm, equal_split_tgmm), (equal_split_loop_gmm, equal_split_loop_tgmm)],
    ids=["batched", "loop"],
)
def test_equal_split_floors_are_grouped_matmuls(gmm_floor, tgmm_floor):
    rng = np.random.default_rng(1)
    g, rows, k, n = 4, 6, 5, 7
    x, w = rng.standard_normal((g * rows, k)), rng.standard_normal((g, k, n))
    out = gmm_floor(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    want = np.concatenate([x[i * rows : (i + 1) * rows] @ w[i] for i in range(g)])
    # f32 sums of 5 (or 6) products of unit normals: well inside 1e-5.
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    y = rng.standard_normal((g * rows, n))
    t = tgmm_floor(jnp.asarray(x.T, jnp.float32), jnp.asarray(y, jnp.float32), g)
    want_t = np.stack(
        [x[i * rows : (i + 1) * rows].T @ y[i * rows : (i + 1) * rows] for i in range(g)]
    )
    np.testing.assert_allclose(t, want_t, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", bench_pipeline.CASES, ids=lambda c: f"{c[0]}-{c[2]}")
def test_pipeline_bench_kernels_trace_on_every_backend_they_time(case):
    """A block config over the shared-memory budget made `conveyor bench pipeline` fail at its
    second row (2026-11-24): trace each case's kernels as the benchmark builds them."""
    c = bench_pipeline.build_case(*case)
    x = jax.ShapeDtypeStruct(c.x_shape, jnp.float32)
    y = jax.ShapeDtypeStruct(c.y_shape, jnp.float32)
    assert case[3] == (c.interp is not None) or c.steps > bench_pipeline.INTERPRETER_MAX_STEPS
    for f in (c.ours, c.ref, c.floor, c.interp):
        if f is not None:
            assert jax.eval_shape(f, x, y).shape == (x.shape[0], y.shape[1])


def test_gpu_table_puts_the_simulator_next_to_the_measured_kernel():
    from conveyor.bench import gmm_gpu
    from conveyor.problems import GmmProblem

    assert gmm_gpu.hardware_model("NVIDIA H100 80GB HBM3") == "h100"
    assert gmm_gpu.hardware_model("NVIDIA H200") == "h200"
    assert gmm_gpu.hardware_model("cpu") is None
    p = GmmProblem(name="t", m=8192, k=4096, n=14336, groups=8)
    rows = [
        dict(name="dense jnp.dot", t=1.0e-3, err=None, config="", sim=0.9e-3, sim_run="fitted"),
        dict(name="dense jnp.dot, zero operands", t=0.9e-3, err=None, config=""),
        dict(name="cv.gmm mosaic_gpu", t=2.0e-3, err=1e-3, config="", sim=1.6e-3, sim_run=1.8e-3),
    ]
    lines = gmm_gpu._table("gmm", p, rows, 1.0e-3, "floor")
    assert lines[-4].startswith("| dense jnp.dot | 1.000 |")
    assert "| 0.900 | 1.11 | fitted | - |" in lines[-4]
    assert "| 0.90x | - | - | - | - |" in lines[-3]
    assert "| 2.000 | 481 | 2.00x | 1.600 | 1.25 | 1.11 | 1.0e-03 |" in lines[-2]


def test_a_model_at_a_runs_measured_rates_reproduces_them():
    """The bench's second simulated column: the matrix fraction is fitted so that the simulator's
    dense matmul takes the time measured, the HBM fraction is the measured copy over the
    datasheet; anything the datasheet cannot reach is refused by name."""
    import conveyor as cv
    from conveyor.sim.calibrate import at_measured_rates

    hw = at_measured_rates("h200", matmul=(8192, 4096, 14336, 1.338e-3), copy_bytes_per_s=3.85e12)
    got = cv.sim.simulate_matmul(8192, 4096, 14336, dtype="bf16", hardware=hw).time_s
    assert abs(got / 1.338e-3 - 1) < 1e-3, got  # the fit's tolerance is 1e-4; the search may retile
    assert hw.hbm_efficiency.value == pytest.approx(3.85e12 / 4.8e12)
    assert hw.matrix_efficiency.source == "measured-run" and hw.matrix_efficiency.value < 0.902
    with pytest.raises(ValueError, match="faster than H200 SXM at its datasheet peak"):
        at_measured_rates("h200", matmul=(8192, 4096, 14336, 0.5e-3), copy_bytes_per_s=3e12)
    with pytest.raises(ValueError, match="copy_bytes_per_s: .* past H200 SXM's datasheet"):
        at_measured_rates("h200", matmul=(8192, 4096, 14336, 1.4e-3), copy_bytes_per_s=5e12)
    with pytest.raises(ValueError, match="matmul: the measured seconds must be positive"):
        at_measured_rates("h200", matmul=(8192, 4096, 14336, 0.0), copy_bytes_per_s=3e12)


def test_gpu_benchmark_runs_end_to_end_on_cpu_through_the_interpreter(monkeypatch):
    """`make gpu-bench` has never had a GPU: run its whole table on CPU at a tiny shape, the Mosaic
    GPU rows through the interpreter, so the first run on an H100 does not die in the harness."""
    from conveyor.bench import gmm_gpu

    # the simulator's column too
    monkeypatch.setattr(gmm_gpu, "hardware_model", lambda kind: "h100")
    # one timed call each: the interpreted kernels are slow, and the numbers are not the point
    table = gmm_gpu.run(reps=1, calls=1, groups=(2,), shape=(256, 128, 128), interpret=True)
    rows = {
        line.split(" | ")[0].lstrip("| "): line.split(" | ")
        for line in table.splitlines()
        if line.startswith("| ") and not line.startswith("| candidate")
    }
    for op in ("gmm", "tgmm"):
        default = rows[f"cv.{op} mosaic_gpu"]
        assert float(default[1]) > 0 and float(default[4]) > 0, default  # measured and simulated ms
        assert float(default[6]) > 0, default  # at the run's rates (fitted to this CPU's dot)
        # the other tiling's row is priced as the same kernel with its tiles
        other = next(r for name, r in rows.items() if name.startswith(f"cv.{op} mosaic_gpu tiling"))
        assert float(other[4]) > 0 and float(other[6]) > 0, other
        assert rows["dense jnp.dot"][6] == "fitted" and float(rows["dense jnp.dot"][5]) > 0
        assert float(rows["dense jnp.dot, zero operands"][1]) > 0
        # bf16 output of a k=128 (or m=256) f32-accumulated dot: rounding to bf16 dominates (2^-9).
        assert float(default[7]) < 5e-3, default
        assert float(rows[f"cv.{op} xla"][1]) > 0
    # GPU-only kernels: said, not blank
    for upstream in (
        "ragged_dot_mgpu",
        "transposed_ragged_dot_mgpu",
    ):
        assert "failed" in rows[upstream][8], rows[upstream]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_moe_ffn_bench_candidates_agree(dtype):
    """The FFN rows' candidates (cv.gmm, the xla backend, ragged_dot, the floors) run in both dtypes
    at a tiny shape and cv.gmm's gradients match ragged_dot's: float32 to ~1e-6; bfloat16 to the
    rounding of the hidden activation to bf16 (relative 2^-8 per element, a few of them summed)."""
    from conveyor.bench.gmm import bench_moe_ffn

    r = bench_moe_ffn(3, 1, m=48, d=16, f=32, dtype=dtype)
    assert set(r["t"]) == {"batched", "loop", "gmm", "xla", "ragged_dot"}
    assert r["rel"] < (1e-5 if dtype == jnp.float32 else 2e-2)


def test_settle_pause_setting_is_checked(monkeypatch):
    """CONVEYOR_BENCH_SETTLE_S takes seconds >= 0; anything else is refused by name."""
    from conveyor.bench import timing

    monkeypatch.setenv("CONVEYOR_BENCH_SETTLE_S", "0.05")
    assert timing._settle_seconds() == 0.05
    for bad in ("abc", "-1", "nan"):
        monkeypatch.setenv("CONVEYOR_BENCH_SETTLE_S", bad)
        with pytest.raises(
            ValueError, match=f"CONVEYOR_BENCH_SETTLE_S: expected seconds >= 0, got '{bad}'"
        ):
            timing._settle_seconds()


def test_each_timed_call_follows_an_untimed_one_unless_the_candidate_is_slow(monkeypatch):
    """interleaved_medians: one warm-up call per candidate, then per repetition a warm call and the
    timed call; a candidate whose last timed call took over WARM_CALL_MAX_S gets no warm call."""
    from conveyor.bench import timing

    calls = {"fast": 0, "slow": 0}

    def counting(name):
        def fn():
            calls[name] += 1
            return jnp.zeros(())

        return fn

    monkeypatch.setattr(timing, "WARM_CALL_MAX_S", 60.0)
    timing.interleaved_medians({"fast": counting("fast")}, 3)
    assert calls["fast"] == 1 + 3 * 2
    # Every call counts as slow: only the first repetition (no time yet) gets a warm call.
    monkeypatch.setattr(timing, "WARM_CALL_MAX_S", -1.0)
    timing.interleaved_medians({"slow": counting("slow")}, 3)
    assert calls["slow"] == 1 + 2 + 1 + 1


def test_a_committed_gpu_table_is_repriced_from_its_own_rows(tmp_path, capsys):
    """scripts/reprice_gpu_run.py reads a committed GPU table's dense and mosaic_gpu rows and
    prices the kernel at the datasheet model and at the run's rates (one section here: each fit
    replays the dense matmul some twenty times)."""
    import importlib.util
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("reprice", root / "scripts/reprice_gpu_run.py")
    reprice = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reprice)
    text = (root / "benchmarks/results/gmm-gpu-2026-11-30.md").read_text()
    section = text[text.index("### gmm, G=8") : text.index("### tgmm, G=8")]
    table = tmp_path / "t.md"
    table.write_text(section)
    assert reprice.measured(str(table)) == {
        ("gmm", 8): {
            "dense jnp.dot": 1.338,
            "lax.ragged_dot": 9.943,
            "ragged_dot_mgpu": 1.811,
            "cv.gmm mosaic_gpu": 1.753,
            "cv.gmm mosaic_gpu tiling=(128, 64, 128)": 1.984,
            "cv.gmm xla": 5.704,
        }
    }
    assert reprice.main([str(table), "--hardware", "h200", "--copy-tbs", "3.85"]) == 0
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[:4] for r in rows] == [
        ["gmm", "8", "default", "1.753"],
        ["gmm", "8", "(128, 64, 128)", "1.984"],
    ]
    for row in rows:
        # the run's dense matmul was slower than the datasheet model's: its rates predict more
        assert float(row[6]) > float(row[4]) and 0.5 < float(row[8]) < 0.902
