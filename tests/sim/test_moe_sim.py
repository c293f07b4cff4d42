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
    assert exact.time_us == pytest.approx(exact.config["experts_us"] + exact.config["exchange_us"])
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
    assert r.time_us == pytest.approx(r.config["experts_us"] + hop)


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
    assert staged.time_s < exact.time_s
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
