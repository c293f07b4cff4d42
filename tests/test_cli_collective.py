"""`conveyor bench collective` re-launches itself on 8 simulated devices and checks its rings."""

import subprocess
import sys


def test_bench_collective_runs():
    r = subprocess.run(
        [sys.executable, "-m", "conveyor", "bench", "collective", "--reps", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr
    assert "| all_gather_matmul |" in r.stdout and "| matmul_reduce_scatter |" in r.stdout


def test_bench_moe_table_on_8_devices():
    """The MoE exchange benchmark at a toy shape: every capacity row is there, dropless drops
    nothing, and a capacity factor of 1.0 reports its drops as a count of all assignments; the
    layer overlapped per peer runs, per expert says why not (one expert per device)."""
    from conveyor.bench import moe

    # in this process: the test session already has 8 CPU devices (tests/conftest.py)
    table = moe.run(reps=1, shape=moe.Shape(tokens=64, d=32, f=64, experts=8, top_k=2))
    rows = {
        line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")
    }
    assert set(rows) >= {"dropless (worst case)", "factor 2.0", "factor 1.25", "factor 1.0"}
    # 8 devices x 64 tokens x top-2
    assert rows["dropless (worst case)"].rstrip(" |").endswith("| 0 of 1024")
    assert rows["factor 1.0"].rstrip(" |").endswith(" of 1024")
    peers = "overlapped per peer, dropless (one chunk per step)"
    assert rows[peers].rstrip(" |").endswith("| 0 of 1024")
    assert "not run: needs 2 or more local experts" in rows["overlapped per expert"]


def test_bench_moe_refuses_gmm_options():
    from conveyor.cli import main
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["bench", "moe", "--m", "64"])
    assert e.value.code == 2
