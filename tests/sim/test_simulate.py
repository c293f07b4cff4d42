"""The simulator: cited hardware numbers, sane predictions, validation against published figures."""

import json
import pathlib
import re

import numpy as np
import pytest

import conveyor as cv
from conveyor.cli import main
from conveyor.sim import hardware, validation

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def test_every_number_has_a_known_source_and_docs_print_them_all():
    for hw in cv.sim.HARDWARE.values():
        for name, value in hw.numbers().items():
            assert value.source in hardware.SOURCES, (hw.name, name)
            assert value.value > 0 or (name == "overlap_slowdown" and value.value == 0), (
                hw.name,
                name,
            )
    assert hardware.markdown_table() in (DOCS / "hardware.md").read_text()


def test_peaks_and_achievable_rates_are_distinct():
    h100 = cv.sim.HARDWARE["h100"]
    assert h100.matrix_rate("bf16") < h100.matrix_peak["bf16"].value
    assert h100.matrix_efficiency.source.startswith("calib")
    with pytest.raises(ValueError, match="dtype: unknown 'int4'; known: bf16/bfloat16"):
        h100.matrix_rate("int4")  # not in the vocabulary at all
    with pytest.raises(ValueError, match="no matrix rate for dtype 'int8'"):
        h100.matrix_rate("int8")  # a dtype this model has no rate for
    assert h100.matrix_rate("bfloat16") == h100.matrix_rate("bf16")


@pytest.mark.slow
def test_predictions_match_published_measurements():
    # Validation rows within 10%; calibration rows reproduce what their constants were fitted to
    # (within 1%), so a constant edited without refitting fails here.
    # A miss row stays beyond 10% (predicted right, it would be a validation row) and names the
    # effect the model lacks.
    rows = validation.compare()
    checked = [r for r in rows if r["role"] == "validation"]
    assert len(checked) >= 10
    assert {r["hardware"] for r in checked} >= {"h100", "h200", "h800", "v5e"}
    for r in rows:
        assert r["within"], r
        assert (r["role"] == "miss") == bool(r["effect"]), r
    with pytest.raises(ValueError, match="a miss names its effect"):
        validation.Measurement("x", "h100", 1.0, "us", "s", lambda: 1.0, role="miss")
    with pytest.raises(ValueError, match="role: expected one of"):
        validation.Measurement("x", "h100", 1.0, "us", "s", lambda: 1.0, role="fit")
    assert validation.markdown(rows) in (DOCS / "simulator.md").read_text()


def test_bottlenecks_move_the_way_the_hardware_says():
    big = cv.sim.simulate_matmul(8192, 8192, 8192, hardware="h100")
    assert big.bottleneck == "compute" and 0.7 < big.utilization <= 1.0
    copy = cv.sim.simulate_copy(1e9, hardware="h100")
    assert copy.bottleneck == "memory"
    # writing the output dominates
    shallow = cv.sim.simulate_matmul(8192, 64, 8192, hardware="h100")
    assert shallow.bottleneck == "memory"
    # Two stages cannot hide the copy latency behind a short step; more stages can.
    two = cv.sim.simulate_matmul(4096, 4096, 4096, hardware="h100", tiling=(128, 64, 128), stages=2)
    four = cv.sim.simulate_matmul(
        4096, 4096, 4096, hardware="h100", tiling=(128, 64, 128), stages=4
    )
    assert four.time_s < 0.95 * two.time_s
    # delay_release=1 keeps one of four slots out of the lookahead: no faster than four free slots.
    held = cv.sim.simulate_matmul(
        4096, 4096, 4096, hardware="h100", tiling=(128, 64, 128), stages=4, delay_release=1
    )
    assert held.time_s >= four.time_s and held.config["delay_release"] == 1
    # Faster HBM makes a memory-bound copy faster; the matmul does not care.
    assert cv.sim.simulate_copy(1e9, hardware="h200").time_s < 0.8 * copy.time_s


def test_search_reports_its_choice_and_configurations_that_do_not_fit_are_errors():
    r = cv.sim.simulate_matmul(4096, 4096, 4096, hardware="h100")
    assert r.config["searched"] > 1 and len(r.config["tiling"]) == 3 and r.config["stages"] >= 2
    with pytest.raises(
        cv.sim.DoesNotFit, match="needs .* KiB of on-chip memory per core; H100 SXM has 227 KiB"
    ):
        cv.sim.simulate_matmul(4096, 4096, 4096, hardware="h100", tiling=(256, 128, 256), stages=4)


def test_warp_specialized_and_plan_replay():
    plain = cv.sim.simulate_matmul(
        4096, 4096, 2048, hardware="h100", tiling=(128, 64, 256), stages=3
    )
    ws = cv.sim.simulate_matmul(
        4096, 4096, 2048, hardware="h100", tiling=(128, 64, 256), stages=3, warp_specialized=True
    )
    assert {b.actor for b in ws.boxes} >= {"memory thread", "compute[0]", "compute[1]"}

    def computing(r, actor):
        return sum(b.end - b.start for b in r.boxes if b.actor == actor and b.kind == "compute")

    # Each compute thread does its half of every step at half the rate: as long as the plain
    # pipeline's one thread (the replay's sums, so equal up to float rounding); same work moved.
    for thread in ("compute[0]", "compute[1]"):
        assert computing(ws, thread) == pytest.approx(computing(plain, "thread"), rel=1e-12)
    assert (ws.flops, ws.hbm_bytes) == (plain.flops, plain.hbm_bytes)
    spec = cv.BlockSpec((128, 64), lambda i, k: (i, k))
    p = cv.pipeline.plan(
        grid=(2, 8),
        in_specs=[spec],
        out_specs=[cv.BlockSpec((128, 64), lambda i, k: (i, 0))],
        max_concurrent_steps=3,
    )
    r = cv.sim.simulate(p, "v5e", flops_per_step=2 * 128 * 64 * 64)
    assert r.utilization <= 1.0  # no replay beats the peaks
    assert sum(b.kind == "copy" for b in r.boxes) == len(p.program().copies())


@pytest.mark.slow
def test_ring_overlaps_what_unfused_serializes():
    kw = dict(dtype="f16", hardware="h800", bidirectional=False)
    ring = cv.sim.simulate_collective_matmul("all_gather_matmul", 512, 12288, 6144, 8, **kw)
    unfused = cv.sim.simulate_collective_matmul(
        "all_gather_matmul", 512, 12288, 6144, 8, unfused=True, **kw
    )
    assert ring.time_s < 0.75 * unfused.time_s  # overlap wins even with the calibrated contention
    bidi = cv.sim.simulate_collective_matmul(
        "all_gather_matmul", 512, 1024, 1024, 8, hardware="v5e"
    )
    uni = cv.sim.simulate_collective_matmul(
        "all_gather_matmul", 512, 1024, 1024, 8, hardware="v5e", bidirectional=False
    )
    assert bidi.time_s < uni.time_s and bidi.bottleneck == "interconnect" == uni.bottleneck
    with pytest.raises(ValueError, match="kind"):
        cv.sim.simulate_collective_matmul("all_reduce", 1, 1, 1, 2)


def test_gmm_pays_for_partial_tiles():
    even = cv.sim.simulate_gmm([512] * 8, 2048, 2048, hardware="h100")
    ragged = cv.sim.simulate_gmm([1] * 63 + [4096 - 63], 2048, 2048, hardware="h100")
    assert ragged.time_s > even.time_s


@pytest.mark.slow
def test_cli_json_png_trace(tmp_path, capsys):
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    assert (
        main(
            [
                "simulate",
                "matmul",
                "--m",
                "2048",
                "--k",
                "2048",
                "--n",
                "2048",
                "--hardware",
                "h100",
                "--json",
                "--png",
                str(png),
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert {"time_us", "utilization", "bottleneck"} <= set(out) and out["time_us"] > 0
    assert png.stat().st_size > 10_000
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "compute" for e in events) and any(
        e.get("cat") == "copy" for e in events
    )
    for args in (
        ["gmm", "--groups", "4", "--sizes", "100,0,900,24"],
        ["tgmm", "--sizes", "100,0,900,24"],
        ["all-gather-matmul", "--devices", "4"],
        ["matmul-reduce-scatter", "--unfused", "--hardware", "v5p"],
    ):
        assert main(["simulate", *args, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["time_us"] > 0
    with pytest.raises(SystemExit) as exit_:
        main(["simulate", "matmul", "--hardware", "a100"])
    assert exit_.value.code == 2 and "unknown 'a100'" in capsys.readouterr().err


@pytest.mark.slow
def test_gmm_tile_count_is_the_metadata_schedule():
    """The simulator counts the visits make_group_metadata schedules (sizes [10, 10, 12] with
    tm=16: 4 visits, the middle group straddling a tile boundary), on random sizes too."""
    import jax.numpy as jnp
    from conveyor.ops.gmm.metadata import count_visits

    rng = np.random.default_rng(4731)
    cases = [[10, 10, 12], [0, 16, 0, 5, 0], list(rng.integers(0, 40, size=9))]
    for sizes in cases:
        for tm in (8, 16, 64):
            meta = cv.make_group_metadata(jnp.asarray(sizes, jnp.int32), int(sum(sizes)) or 1, tm)
            assert count_visits(sizes, tm) == int(meta.num_visits), (sizes, tm)
    # a plain pipeline of these tiles (`stages`): the mosaic_gpu kernel takes tm=128 only
    report = cv.sim.simulate_gmm([10, 10, 12], 256, 256, tiling=(16, 64, 128), stages=2)
    assert report.config["tiles"] == 4 * 2  # 4 visits x 2 column tiles of 128


def test_given_gpu_tiles_replay_the_mosaic_gpu_kernel_with_them():
    """`tiling=` on GPU hardware prices what cv.gmm / cv.tgmm(..., tiling=...) runs: the
    mosaic_gpu kernel with those tiles (its slots, warpgroups and thread blocks), and a tile the
    kernel refuses is refused with the kernel's own message. The default tiles given explicitly
    price exactly as no tiling."""
    sizes = [3000, 1000, 0, 4192]
    for simulate, default, other in (
        (cv.sim.simulate_gmm, None, (128, 64, 128)),
        (cv.sim.simulate_tgmm, None, (64, 128, 128)),
    ):
        base = simulate(sizes, 4096, 14336, hardware="h200", tiling=default)
        same = simulate(sizes, 4096, 14336, hardware="h200", tiling=base.config["tiling"])
        assert same.time_s == base.time_s and same.config == base.config
        given = simulate(sizes, 4096, 14336, hardware="h200", tiling=other)
        assert given.config["kernel"] == "cv mosaic_gpu" and given.config["tiling"] == list(other)
        assert given.config["warp_specialized"] and given.time_s != base.time_s
    with pytest.raises(ValueError, match="mosaic_gpu gmm uses tm=128"):
        cv.sim.simulate_gmm(sizes, 4096, 14336, hardware="h200", tiling=(64, 64, 128))
    with pytest.raises(ValueError, match="mosaic_gpu tgmm needs tn to divide n=14336"):
        cv.sim.simulate_tgmm(sizes, 4096, 14336, hardware="h200", tiling=(64, 128, 192))


def test_chained_pipelines_simulate_shorter_than_one_after_another():
    """Three chained warp-specialized pipelines (pipeline_state): the next pipeline's first fetches
    overlap the previous one's last steps, so the chain takes less than the three run alone."""
    spec = cv.BlockSpec((128, 64), lambda i, k: (i, k))
    p = cv.pipeline.plan(
        grid=(2, 4),
        in_specs=[spec, spec],
        out_specs=[cv.BlockSpec((128, 64), lambda i, k: (i, 0))],
        max_concurrent_steps=2,
    )
    chain = [cv.pipeline.WarpSpecializedPlan(pipeline=p, num_compute_wgs=2) for _ in range(3)]
    flops = 2 * 128 * 64 * 64
    chained = cv.sim.simulate(chain, "h100", flops_per_step=flops)
    alone = [cv.sim.simulate(wp, "h100", flops_per_step=flops) for wp in chain]
    assert chained.time_s < sum(r.time_s for r in alone)
    assert chained.flops == sum(r.flops for r in alone) and chained.hbm_bytes == sum(
        r.hbm_bytes for r in alone
    )


def _brute_force_row_blocks(sizes, tm):
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [len({r // tm for r in range(bounds[i], bounds[i + 1])}) for i in range(len(sizes))]


def _brute_force_shared_blocks(sizes, tm):
    """Per group, its row blocks holding a row of another group (or past the rows)."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    out = []
    for i in range(len(sizes)):
        lo, hi = bounds[i], bounds[i + 1]
        blocks = {r // tm for r in range(lo, hi)}
        out.append(sum(any(r < lo or r >= hi for r in range(b * tm, b * tm + tm)) for b in blocks))
    return out


def test_tgmm_shared_row_blocks_are_the_ones_the_kernel_masks():
    """The simulator prices a masking pass for each row block the mosaic_gpu tgmm kernel masks
    (`shares_its_block`, the kernel's own test, on ints here and traced there): the blocks of a
    group that hold another group's rows. Each costs the pass on every (k tile, n tile) block."""
    from conveyor.ops.gmm.metadata import count_shared_blocks

    rng = np.random.default_rng(4733)
    for sizes in ([10, 10, 12], [0, 64, 0, 1, 63], list(rng.integers(0, 100, size=11))):
        for tm in (8, 64):
            assert count_shared_blocks(sizes, tm) == _brute_force_shared_blocks(sizes, tm)
    aligned = cv.sim.simulate_tgmm([1024] * 8, 1024, 512, hardware="h100")
    # the same rows, every boundary moved 32 rows into a block
    shifted = cv.sim.simulate_tgmm(
        [1024 + 32] + [1024] * 6 + [1024 - 32], 1024, 512, hardware="h100"
    )
    tm = aligned.config["tiling"][0]
    assert tm == 64 and aligned.config["shared_row_blocks"] == 0
    # each of the 7 boundaries falls mid-block: that block is masked by both its groups
    assert shifted.config["shared_row_blocks"] == 2 * 7
    assert shifted.config["row_blocks"] == aligned.config["row_blocks"] + 7
    assert shifted.time_s > aligned.time_s


def test_tgmm_row_blocks_are_the_kernel_schedule():
    """The simulator's per-group block counts (count_row_blocks) are the blocks the mosaic_gpu tgmm
    kernel loops over (row_block_span, also on traced scalars): every block a group's rows touch."""
    import jax.numpy as jnp
    from conveyor.ops.gmm.metadata import count_row_blocks, row_block_span

    rng = np.random.default_rng(4732)
    for sizes in ([10, 10, 12], [0, 64, 0, 1, 63], list(rng.integers(0, 100, size=11))):
        for tm in (8, 64):
            want = _brute_force_row_blocks(sizes, tm)
            assert count_row_blocks(sizes, tm) == want, (sizes, tm)
            bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
            traced = [
                int(row_block_span(jnp.int32(bounds[i]), jnp.int32(bounds[i + 1]), tm)[1])
                for i in range(len(sizes))
            ]
            assert traced == want
    report = cv.sim.simulate_tgmm([10, 10, 12], 256, 256, tiling=(8, 128, 128), stages=2)
    assert report.config["row_blocks"] == 2 + 2 + 2 and report.config["tiling"] == [8, 128, 128]
    assert report.config["tiles"] == 3 * 2 * 2  # non-empty groups x k tiles x n tiles


def test_grouped_simulations_on_a_gpu_model_the_mosaic_gpu_kernels():
    """Without tiling/stages, H100 runs the configuration the mosaic_gpu kernels run
    (ops/gmm/tiling.MOSAIC_GPU) and TPU hardware the mosaic_tpu kernels'; given tilings keep
    their own."""
    from conveyor.ops.gmm.tiling import MOSAIC_GPU

    sizes = [1000, 24, 0, 1024]
    for fn, tiling in (
        (cv.sim.simulate_gmm, MOSAIC_GPU.gmm_tiling),
        (cv.sim.simulate_tgmm, MOSAIC_GPU.tgmm_tiling),
    ):
        r = fn(sizes, 1024, 1024, hardware="h100")
        assert r.config["kernel"] == "cv mosaic_gpu" and tuple(r.config["tiling"]) == tiling
        assert (
            r.config["stages"] == MOSAIC_GPU.stages
            and r.config["delay_release"] == MOSAIC_GPU.delay_release
        )
        assert (
            r.config["warp_specialized"]
            and r.config["compute_threads"] == MOSAIC_GPU.compute_threads
        )
        tpu = fn(sizes, 1024, 1024, hardware="v5e").config
        # cv.gmm's TPU default for 2048 rows in 4 groups (512 a group: tm at most 256),
        # double-buffered as Pallas TPU pipelines are
        assert tpu["kernel"] == "cv mosaic_tpu" and tuple(tpu["tiling"]) == (256, 1024, 1024)
        assert tpu["stages"] == 2
        assert (
            fn(sizes, 1024, 1024, hardware="h100", tiling=(64, 128, 128), stages=3).config["kernel"]
            == "given"
        )
    # gmm's default tiles follow the weight's shape as the kernel's do: gpt-oss's n=2880 takes tn=64
    assert tuple(cv.sim.simulate_gmm(sizes, 2880, 2880, hardware="h100").config["tiling"]) == (
        128,
        64,
        64,
    )
    assert tuple(cv.sim.simulate_tgmm(sizes, 2880, 2880, hardware="h100").config["tiling"]) == (
        64,
        128,
        64,
    )
    # The slots are the kernel's own: as many as fit beside its staging buffer (gmm stages its
    # tn=256 tile in 64-row parts, which leaves room for 4)
    import jax.numpy as jnp
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from conveyor.ops.gmm.mosaic_gpu import stages_that_fit

    for dtype, jdt in (("bf16", jnp.bfloat16),):  # the kernels take 16-bit operands only
        tm, tk, tn = MOSAIC_GPU.gmm_tiles_for(4096, 14336, out_itemsize=2)
        kernel = stages_that_fit(
            block_bytes=(tm * tk + tk * tn) * jnp.dtype(jdt).itemsize,
            staging=plgpu.SMEM(MOSAIC_GPU.staging_shape(tm, tn), jdt),
        )
        assert (
            cv.sim.simulate_gmm(sizes, 4096, 14336, dtype=dtype, hardware="h100").config["stages"]
            == kernel
        )
        tm, tk, tn = MOSAIC_GPU.tgmm_tiles_for(14336)
        kernel = stages_that_fit(
            block_bytes=(tk * tm + tm * tn) * jnp.dtype(jdt).itemsize,
            staging=plgpu.SMEM(MOSAIC_GPU.staging_shape(tk, tn), jdt),
        )
        assert (
            cv.sim.simulate_tgmm(sizes, 4096, 14336, dtype=dtype, hardware="h100").config["stages"]
            == kernel
        )
    # tgmm's flops are the grouped product's, not the padded blocks'
    assert cv.sim.simulate_tgmm(sizes, 512, 256).flops == 2.0 * sum(sizes) * 512 * 256


@pytest.mark.parametrize("fn", [cv.sim.simulate_gmm, cv.sim.simulate_tgmm])
def test_a_dtype_no_grouped_kernel_takes_is_priced_only_as_hypothetical(fn):
    """cv.gmm refuses fp8 and int8 everywhere, float32 on mosaic_gpu, float16 on mosaic_tpu: the
    simulator prices them only when asked to, and says the kernel is imagined."""
    for dtype, hw in (("fp8", "h100"), ("int8", "h100"), ("f32", "h100"), ("f16", "v5e")):
        with pytest.raises(
            ValueError,
            match=r"no cv.gmm/cv.tgmm kernel takes \w+ operands on .*pass "
            r"hypothetical=True",
        ):
            fn([512] * 8, 1024, 1024, dtype=dtype, hardware=hw)
    imagined = fn([512] * 8, 1024, 1024, dtype="fp8", hardware="h100", hypothetical=True)
    assert imagined.config["kernel"] == "hypothetical (cv mosaic_gpu with float8_e4m3fn operands)"
    assert (
        fn([512] * 8, 1024, 1024, dtype="bf16", hardware="h100", hypothetical=True).config["kernel"]
        == "cv mosaic_gpu"
    )


def _compiled_onchip() -> list[tuple[str, str, dict, float]]:
    """(target, kind, params, MiB) of every single-kernel gmm / tgmm row of the newest committed
    compile-check table: the on-chip memory the real compilers reported (TPU scoped VMEM)."""
    results = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    # compile-check-<date>[-<n>].md: the date, then the day's run number (the first has none)
    newest = max(
        results.glob("compile-check-*.md"),
        key=lambda p: (p.stem[len("compile-check-") :][:10], int(p.stem[25:] or 1)),
    )
    rows = []
    for line in newest.read_text().splitlines():
        m = re.match(
            r"\| (v5e|v6e|v5p) \| (t?gmm) ([^|]*) \| ok \| [0-9.]+ \| VMEM ([0-9.]+) MiB \(", line
        )
        if m and "grad=True" not in m.group(3):
            params = dict(kv.split("=") for kv in m.group(3).split())
            rows.append((m.group(1), m.group(2), params, float(m.group(4))))
    return rows


def test_grouped_kernels_on_chip_memory_is_what_the_tpu_compiler_reported():
    """The simulator's VMEM for cv.gmm / cv.tgmm's mosaic_tpu kernel is the kernel's own count
    (ops/gmm/tpu_blocks.working_set), and that count is what libtpu's compile reported for the
    production cases (`make compile-check`) within -2% / +3%: the buffers exactly, Mosaic's
    relayout copy of a large left operand at the operand's size (docs/internals/gmm.md)."""
    rows = _compiled_onchip()
    assert len(rows) >= 12, rows  # gmm and tgmm cases on v5e, v6e and v5p
    for target, kind, p, mib in rows:
        m, k, n, groups = int(p["m"]), int(p["k"]), int(p["n"]), int(p["groups"])
        fn = cv.sim.simulate_gmm if kind == "gmm" else cv.sim.simulate_tgmm
        r = fn([m // groups] * groups, k, n, dtype="bf16", hardware=target)
        error = r.onchip_bytes / 2**20 / mib - 1
        assert -0.02 <= error <= 0.03, (target, kind, p, error)


def _kernel_copies(op, sizes, k, n, tiling):
    """The copies cv.gmm's (or cv.tgmm's) mosaic_tpu kernel issues, walked independently of the
    simulator: its grid in order over the real visits of its own metadata, with its own index
    maps, and Pallas TPU's rule (a block is copied in when its index differs from the previous
    step's, and an output block written back when the next step's differs, or at the end)."""
    import itertools

    import jax.numpy as jnp

    from conveyor.ops.gmm import tpu_blocks
    from conveyor.ops.gmm.metadata import make_group_metadata

    m = sum(sizes)
    tm, tk, tn = tiling
    # cv.tgmm without existing_out visits each empty group once (to write its zeros)
    meta = make_group_metadata(
        jnp.asarray(sizes, jnp.int32), m, tm, visit_empty_groups=op == "tgmm"
    )
    visits = int(meta.num_visits)
    gids, tids = [int(x) for x in meta.group_ids], [int(x) for x in meta.tile_ids]
    if op == "gmm":
        lhs, rhs, out = tpu_blocks.gmm_index_maps()
        grid = tpu_blocks.gmm_grid(k, n, tk, tn, visits)
    else:
        lhs, rhs, out = tpu_blocks.tgmm_index_maps()
        grid = tpu_blocks.tgmm_grid(k, n, tk, tn, visits)
    steps = list(itertools.product(*(range(d) for d in grid)))
    copies = {}
    operands = [("lhs", lhs), ("rhs", rhs), ("existing_out", out), ("out", out)]
    if op == "tgmm":  # (called without existing_out: the kernel takes none)
        del operands[2]
    for name, index_map in operands:
        keys = [tuple(int(x) for x in index_map(*s, gids, tids)) for s in steps]
        copies[name] = sum(1 for i, key in enumerate(keys) if i == 0 or key != keys[i - 1])
    return copies


@pytest.mark.parametrize(
    "sizes, k, n",
    [
        ([100, 0, 300, 37, 75], 1024, 768),  # a group mid-tile, an empty one, 2 k tiles
        ([256, 256, 0, 512], 512, 1536),  # one k tile: a group's weights stay over its visits
        ([64] * 8, 1000, 640),  # a partial k tile and a partial column
    ],
)
@pytest.mark.parametrize("op", ["gmm", "tgmm"])
def test_grouped_matmuls_on_tpu_copy_what_the_kernels_copy(op, sizes, k, n):
    """simulate_gmm / simulate_tgmm on TPU replay the mosaic_tpu kernel's own grid: their copy
    events, operand by operand, are the kernel's (the conformance approach of the pipelines)."""
    fn = cv.sim.simulate_gmm if op == "gmm" else cv.sim.simulate_tgmm
    r = fn(sizes, k, n, hardware="v5e")
    assert r.config["kernel"] == "cv mosaic_tpu"
    assert r.config["copies"] == _kernel_copies(op, sizes, k, n, r.config["tiling"])


def test_gmm_on_tpu_reads_a_groups_weights_once_when_k_is_one_tile():
    # Consecutive visits of a group keep its [k, tn] weight block: rhs is copied once per group
    # per column, not once per visit; with 4 k tiles it is copied at every step.
    tiling = (128, 512, 512)
    one = cv.sim.simulate_gmm([1024] * 4, 512, 1024, hardware="v5e", tiling=tiling).config
    assert one["copies"]["rhs"] == 4 * 2 and one["grid"] == [2, 32, 1]
    four = cv.sim.simulate_gmm([1024] * 4, 2048, 1024, hardware="v5e", tiling=tiling).config
    assert four["copies"]["rhs"] == 2 * 32 * 4


def test_a_tpu_pipelined_matmul_counts_every_buffer_it_holds():
    """bf16 blocks of 512 x 1024 x 1024 on TPU: two slots of each input (6 MiB), two of the output
    (2 MiB) and the float32 accumulator scratch (2 MiB) = 10 MiB, not the 7 MiB of inputs plus one
    output block; on GPU one output staging block (the accumulator is in registers)."""
    tpu = cv.sim.simulate_matmul(
        4096, 8192, 8192, tiling=(512, 1024, 1024), stages=2, hardware="v5e"
    )
    assert tpu.onchip_bytes == 10 * 2**20
    wide = cv.sim.simulate_matmul(
        4096, 8192, 8192, dtype="int32", tiling=(256, 512, 512), stages=2, hardware="v5e"
    )
    # a 4-byte output accumulates in its own blocks: no scratch
    assert wide.onchip_bytes == 2 * (256 * 512 + 512 * 512) * 4 + 2 * 256 * 512 * 4
    gpu = cv.sim.simulate_matmul(4096, 4096, 4096, tiling=(128, 64, 256), stages=3, hardware="h100")
    assert gpu.onchip_bytes == 3 * (128 * 64 + 64 * 256) * 2 + 128 * 256 * 2


def test_whole_call_time_adds_a_host_dispatch_cost_only_when_asked():
    r = cv.sim.simulate_matmul(256, 256, 256, tiling=(128, 128, 128), stages=2, hardware="h100")
    device = r.time_s
    assert r.call_time_s(100e-6) == pytest.approx(device + 100e-6)  # awaited call by call
    assert r.call_time_s(100e-6, overlapped=True) == 100e-6  # queued: the host sets the pace
    assert r.dispatch_bound(100e-6) and not r.dispatch_bound(0.0)
    assert r.time_s == device  # device time stays the default
    for bad in (-1e-6, float("nan"), "1us", True):
        with pytest.raises(ValueError, match="dispatch_s"):
            r.call_time_s(bad)


def test_a_tiling_on_tpu_runs_the_mosaic_tpu_kernel_with_those_tiles():
    """As cv.gmm(tiling=...) does: 512-row tiles read each group's weights a quarter as often as
    128-row ones, in 8 MiB of VMEM; a tile the kernel refuses is refused as it does."""
    sizes = [1024] * 8
    narrow = cv.sim.simulate_gmm(sizes, 4096, 14336, hardware="v5e", tiling=(128, 512, 512))
    wide = cv.sim.simulate_gmm(sizes, 4096, 14336, hardware="v5e", tiling=(512, 1024, 512))
    assert wide.config["kernel"] == "cv mosaic_tpu" and wide.config["tiling"] == [512, 1024, 512]
    # 7 MiB of buffers and Mosaic's copy of the [512, 1024] lhs block (libtpu: 8.09 MiB on v5e)
    assert wide.onchip_bytes == 8 * 2**20
    # weight bytes read: copies x block size ([tk, tn] = 1024 x 512 against 512 x 512)
    rhs_bytes = wide.config["copies"]["rhs"] * 1024 * 512
    assert rhs_bytes * 4 == narrow.config["copies"]["rhs"] * 512 * 512
    with pytest.raises(ValueError, match="tk to be a multiple of 128"):
        cv.sim.simulate_gmm(sizes, 4096, 14336, hardware="v5e", tiling=(512, 100, 512))


def test_a_plans_operands_take_their_own_dtypes_and_the_kernel_its_scratch():
    """simulate(plan) counts each operand's slots in its own dtype and adds the scratch the
    kernel allocates beside the pipeline (a float32 accumulator here); a name that is no operand
    and a negative scratch are refused by name."""
    spec = cv.BlockSpec((128, 128), lambda i, k: (i, k))
    p = cv.pipeline.plan(
        grid=(4, 4),
        in_specs=[spec, cv.BlockSpec((128, 128), lambda i, k: (k, 0))],
        out_specs=[cv.BlockSpec((128, 128), lambda i, k: (i, 0))],
        max_concurrent_steps=2,
    )
    block = 128 * 128
    plain = cv.sim.simulate(p, "v5e", dtype="bf16")
    assert plain.onchip_bytes == (2 + 2 + 2) * block * 2  # two slots each, 2 bytes
    mixed = cv.sim.simulate(
        p, "v5e", dtype="bf16", operand_dtypes={"out[0]": "f32"}, scratch_bytes=block * 4
    )
    assert mixed.onchip_bytes == (2 + 2) * block * 2 + 2 * block * 4 + block * 4
    assert mixed.config["operand_dtypes"] == {"out[0]": "f32"}
    with pytest.raises(ValueError, match=r"operand_dtypes: \['out\[1\]'\] name no operand"):
        cv.sim.simulate(p, "v5e", operand_dtypes={"out[1]": "f32"})
    with pytest.raises(ValueError, match=r"scratch_bytes: expected an int >= 0, got -1"):
        cv.sim.simulate(p, "v5e", scratch_bytes=-1)
    with pytest.raises(cv.sim.DoesNotFit, match=r"scratch 131072 KiB\).*TPU v5e has 131072 KiB"):
        cv.sim.simulate(p, "v5e", scratch_bytes=128 * 2**20)


def test_tpu_kernels_fit_the_scoped_vmem_limit_unless_they_raise_it():
    """A TPU kernel gets the chip's default scoped VMEM (16 MiB on v5e) unless it sets
    vmem_limit_bytes (up to the physical 128 MiB), as the real compiler enforces; GPU kernels
    take the SM's whole shared memory."""
    v5e = cv.sim.HARDWARE["v5e"]
    assert v5e.onchip_limit() == 16 * 2**20 and v5e.onchip_limit(1 << 40) == 128 * 2**20
    h100 = cv.sim.HARDWARE["h100"]
    assert h100.onchip_limit() == h100.onchip_bytes.value
    # bf16 blocks: 2 slots x (1024x2048 + 2048x1024) x 2 B = 16 MiB of inputs, plus the output's
    with pytest.raises(
        cv.sim.DoesNotFit, match=r"v5e's default limit is 16384 KiB .*vmem_limit_bytes"
    ):
        cv.sim.simulate_matmul(
            4096, 4096, 4096, hardware="v5e", tiling=(1024, 2048, 1024), stages=2
        )
    raised = cv.sim.simulate_matmul(
        4096,
        4096,
        4096,
        hardware="v5e",
        tiling=(1024, 2048, 1024),
        stages=2,
        vmem_limit_bytes=64 * 2**20,
    )
    assert 16 * 2**20 < raised.onchip_bytes <= 64 * 2**20
    with pytest.raises(cv.sim.DoesNotFit, match=r"vmem_limit_bytes allows 20480 KiB"):
        cv.sim.simulate_matmul(
            4096,
            4096,
            4096,
            hardware="v5e",
            tiling=(1024, 2048, 1024),
            stages=2,
            vmem_limit_bytes=20 * 2**20,
        )
    with pytest.raises(ValueError, match=r"vmem_limit_bytes: expected an int > 0 or None, got 0"):
        cv.sim.simulate_matmul(512, 512, 512, hardware="v5e", vmem_limit_bytes=0)
    # The same rule for a plan
    spec = cv.BlockSpec((2048, 2048), lambda i: (i, 0))
    p = cv.pipeline.plan(grid=(4,), in_specs=[spec], out_specs=[spec], max_concurrent_steps=2)
    with pytest.raises(cv.sim.DoesNotFit, match="default limit"):
        cv.sim.simulate(p, "v5e")
    # two slots of a 2048 x 2048 bf16 block for the input and for the output: 32 MiB
    assert cv.sim.simulate(p, "v5e", vmem_limit_bytes=100 * 2**20).onchip_bytes == 32 * 2**20


def test_a_ring_plan_is_priced_as_its_kernel_and_refuses_pipeline_options():
    from conveyor.ops.collective_matmul import ring_plan

    plan = ring_plan(collective="gather", num_devices=4, bidirectional=False, buffering=2)
    shape = dict(m=512, k=2048, n=1024)
    direct = cv.sim.simulate_collective_matmul(
        "all_gather_matmul", 512, 2048, 1024, 4, hardware="v5e", bidirectional=False, buffering=2
    )
    assert cv.sim.simulate(plan, "v5e", **shape).time_s == direct.time_s
    for option in (dict(scratch_bytes=1024), dict(vmem_limit_bytes=1 << 20)):
        with pytest.raises(NotImplementedError, match=f"simulate: {next(iter(option))} apply"):
            cv.sim.simulate(plan, "v5e", **shape, **option)


def test_gpu_gmm_thread_blocks_run_in_waves_of_one_per_sm():
    """cv.gmm's mosaic_gpu kernel launches a block per (column tile, visit), one per SM at a time:
    132 blocks fill an H100 once; 134 take a second wave for two blocks, twice the time (one group,
    so no padded blocks; k=4096 keeps each block compute-bound, above the HBM floor)."""
    one = cv.sim.simulate_gmm([128 * 66], 4096, 512, hardware="h100")
    two = cv.sim.simulate_gmm([128 * 67], 4096, 512, hardware="h100")
    assert (one.config["tiles"], one.config["waves"]) == (132, 1)
    assert (two.config["tiles"], two.config["waves"]) == (134, 2)
    assert one.config["padded_blocks"] == two.config["padded_blocks"] == 0
    assert two.time_s == pytest.approx(2 * one.time_s, rel=1e-9)


def test_gpu_tgmm_blocks_of_a_short_group_take_idle_sms():
    """cv.tgmm's mosaic_gpu blocks (one per group, k tile and n tile) are as long as their group:
    with 128 blocks on 132 SMs, a short group's blocks run beside the long group's, and the call
    takes as long as the longest block either way; an empty group's blocks only store zeros."""
    alone = cv.sim.simulate_tgmm([4096] + [0] * 7, 1024, 512, hardware="h100")
    beside = cv.sim.simulate_tgmm([4096, 64] + [0] * 6, 1024, 512, hardware="h100")
    assert alone.config["tiles"] == beside.config["tiles"] == 8 * 8 * 2
    assert beside.time_s == pytest.approx(alone.time_s, rel=1e-12)
    longer = cv.sim.simulate_tgmm([4096 + 64] + [0] * 7, 1024, 512, hardware="h100")
    assert longer.time_s > alone.time_s  # one more row block in the longest blocks
