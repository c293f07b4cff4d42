"""The simulator's expert-parallel layer (`cv.sim.simulate_moe_layer`, `conveyor simulate moe`):
the three exchanges priced from the same parts, the overlapped one by running its plan's event
program."""

import dataclasses

import pytest

import conveyor as cv
from conveyor import cli
from conveyor.sim.hardware import HARDWARE, Value
from conveyor.sim.moe import MoeShape

SMALL = MoeShape(name="small", tokens=1024, d=1024, f=2048, experts=16, top_k=2)
# an H100 whose experts do not slow down beside transfers: what is left exposed is only time
NO_SLOWDOWN = dataclasses.replace(HARDWARE["h100"], overlap_slowdown=Value(0.0, "est-overlap-tpu"))


def test_the_unfused_layers_add_their_parts():
    exact = cv.sim.simulate_moe_layer(SMALL, exchange="exact")
    dense = cv.sim.simulate_moe_layer(SMALL, exchange="dense")
    for r in (exact, dense):
        assert r.time_us == pytest.approx(sum(b.end - b.start for b in r.boxes) * 1e6)
    parts = ("experts_us", "exchange_us", "xla_passes_us")
    assert exact.time_us == pytest.approx(sum(exact.config[p] for p in parts))
    # dropless dense buffers reserve tokens * top_k rows per peer: devices times the exact rows
    assert dense.link_bytes == pytest.approx(8 * exact.link_bytes)
    assert dense.time_s > exact.time_s


def test_the_overlap_leaves_only_the_last_return_exposed():
    """8 chips, two links: the first dispatches fly during the local chunk's experts and each
    return during the next chunk's, so only the last return is exposed: 1 of the 8 transfer
    times on a link (4 peers out and 4 back per link)."""
    r = cv.sim.simulate_moe_layer(SMALL, exchange="peers", hardware=NO_SLOWDOWN)
    assert r.config["hidden"] == pytest.approx(1 - 1 / 8)
    per_chunk = r.config["experts_us"] / 8
    hop = r.config["exchange_us"] / 8
    assert hop < per_chunk  # the case the claim is about
    assert r.time_us == pytest.approx(r.config["experts_us"] + hop + r.config["xla_passes_us"])


def test_a_slowdown_beside_transfers_costs_the_overlap():
    slow = cv.sim.simulate_moe_layer(SMALL, exchange="peers", hardware="h100")
    fast = cv.sim.simulate_moe_layer(SMALL, exchange="peers", hardware=NO_SLOWDOWN)
    assert slow.time_s > fast.time_s
    assert slow.config["hidden"] < fast.config["hidden"]


def test_the_overlapped_experts_reread_the_weights_per_chunk():
    """Per-peer chunks run the grouped matmuls devices times on fewer rows: never cheaper than
    once on all rows (the price the report shows for small experts)."""
    exact = cv.sim.simulate_moe_layer("deepseek", exchange="exact")
    over = cv.sim.simulate_moe_layer("deepseek", exchange="peers")
    assert over.config["experts_us"] > 1.5 * exact.config["experts_us"]


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"exchange: expected one of .*got 'ragged'"):
        cv.sim.simulate_moe_layer(SMALL, exchange="ragged")
    with pytest.raises(ValueError, match=r"devices: the 16 experts of 'small' must divide .*got 6"):
        cv.sim.simulate_moe_layer(SMALL, devices=6)
    with pytest.raises(ValueError, match=r"shape: expected a MoeShape or one of .*got 'gpt'"):
        cv.sim.simulate_moe_layer("gpt")
    with pytest.raises(ValueError, match=r"stages: only the 'experts' exchange\(s\) take it; "):
        cv.sim.simulate_moe_layer(SMALL, exchange="peers", stages=2)
    with pytest.raises(ValueError, match=r"buffering: .*exchange='exact' would ignore buffering=3"):
        cv.sim.simulate_moe_layer(SMALL, exchange="exact", buffering=3)
    with pytest.raises(ValueError, match=r"MoeShape: top_k must be at most experts=4, got 5"):
        MoeShape(name="x", tokens=8, d=8, f=8, experts=4, top_k=5)


def test_the_cli_prints_the_three_layers(capsys):
    assert cli.main(["simulate", "moe", "--shape", "deepseek", "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert "MoE layer 'deepseek' on 8 x H100 SXM" in out
    for exchange in ("dense", "exact", "overlapped, per peer", "overlapped, per expert"):
        assert f"| {exchange} |" in out
    with pytest.raises(SystemExit):
        cli.main(["simulate", "moe", "--json"])
    assert "--json: 'simulate moe' prints a table" in capsys.readouterr().err


def test_the_cli_checks_the_exchange_plan(capsys):
    assert cli.main(["check", "exchange", "--devices", "3", "--unidirectional"]) == 0
    assert "no race, no deadlock" in capsys.readouterr().out
    # 4 devices, one stream of 3 peers on 2 slots: without credits a slot is overwritten
    args = ["--devices", "4", "--unidirectional", "--no-credits", "--max-states", "3000"]
    assert cli.main(["check", "exchange", *args]) == 1
    assert "RACE" in capsys.readouterr().out


def test_the_expert_staged_layer_reads_each_experts_weights_once():
    """Stages of whole experts: the experts' time stays near the one-pass layer's (unlike per-peer
    chunks), and stages must divide the local experts; one local expert cannot be staged."""
    exact = cv.sim.simulate_moe_layer("deepseek", exchange="exact")
    staged = cv.sim.simulate_moe_layer("deepseek", exchange="experts")
    assert staged.config["experts_us"] < 1.1 * exact.config["experts_us"]
    # but XLA's passes run over every stage's receive buffer: 8 stages of 4 local experts each,
    # a buffer of 8 chips x 4096 tokens x min(top_k=8, 4) rows, where the exact exchange has one
    # of 8 x 4096 x 8 rows: four times the bytes, and on H100 the slower layer (the SiLU
    # product's three passes over the hidden rows, f=2048 wide)
    hidden = 2048 * 2
    silu = "SiLU product"
    assert staged.config["xla_passes"][silu] == 8 * 3 * (8 * 4096 * 4) * hidden
    assert exact.config["xla_passes"][silu] == 3 * 8 * 4096 * 8 * hidden
    # the exact exchange's forward pass leaves its receive buffer unfilled, the staged one not
    filled = staged.config["xla_passes"]["receive buffer zero-filled"]
    assert filled == 8 * (8 * 4096 * 4) * 7168 * 2
    assert "receive buffer zero-filled" not in exact.config["xla_passes"]
    assert staged.time_s > exact.time_s
    with pytest.raises(ValueError, match=r"stages: expected an int that divides the 32 local"):
        cv.sim.simulate_moe_layer("deepseek", exchange="experts", stages=5)
    with pytest.raises(ValueError, match=r"'experts' stages by local expert .* has 1 on each"):
        cv.sim.simulate_moe_layer("mixtral", exchange="experts")


def test_the_cli_checks_the_staged_plan(capsys):
    assert cli.main(["check", "exchange", "--devices", "2", "--expert-stages", "3"]) == 0
    assert "moe staged exchange D=2 stages=3" in capsys.readouterr().out
    args = ["--devices", "2", "--expert-stages", "3", "--no-credits"]
    assert cli.main(["check", "exchange", *args]) == 1
    assert "RACE" in capsys.readouterr().out


def test_xla_passes_price_the_layers_buffers():
    """The XLA ops between the kernels: the exact exchange's passes run over its receive buffer
    (devices x tokens x min(top_k, local experts) rows, whole), the TPU exchange kernel's only
    over this chip's rows; GPU adds the row gathers and the float32 product XLA does there."""
    shape = cv.sim.MoeShape(name="s", tokens=512, d=256, f=512, experts=8, top_k=4)
    tpu, gpu = cv.sim.hardware.get("v5e"), cv.sim.hardware.get("h100")
    passes = lambda e, hw, devices=4: cv.sim.moe.xla_passes(shape, e, devices=devices, hw=hw)
    rows, a = 4 * 512 * 2, 512 * 4  # 2 local experts < top_k: 2 rows a token at most
    exact = passes("exact", tpu)
    assert "receive buffer zero-filled" not in exact  # a forward pass leaves it unfilled
    assert exact["results' receive buffer zero-filled"] == a * 256 * 2
    assert passes("dense", tpu)["receive buffer zero-filled"] == 4 * a * 256 * 2
    assert exact["SiLU product"] == 3 * rows * 512 * 2
    assert exact["rows gathered into send order"] == 2 * a * 256 * 2
    assert "rows gathered into expert order" not in exact  # the kernels gather on TPU
    assert passes("exact", gpu)["rows gathered into expert order"] == 2 * rows * 256 * 2
    peers = passes("peers", tpu)
    assert "SiLU product" not in peers and "receive buffer zero-filled" not in peers
    assert "results' receive buffer zero-filled" not in passes("exact", tpu, devices=1)
    with pytest.raises(ValueError, match="exchange: expected one of"):
        passes("exactly", tpu)
    with pytest.raises(ValueError, match="devices: must divide the 8 experts, got 3"):
        passes("exact", tpu, devices=3)
    report = cv.sim.simulate_moe_layer(shape, exchange="exact", devices=4, hardware=tpu)
    assert report.config["xla_passes"] == exact
    assert report.config["xla_passes_us"] == pytest.approx(
        sum(exact.values()) / (tpu.hbm_bandwidth.value * tpu.hbm_efficiency.value) * 1e6
    )
