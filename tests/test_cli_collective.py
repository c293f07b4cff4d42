"""`conveyor bench collective` re-launches itself on 8 simulated devices and checks its rings."""
import subprocess
import sys


def test_bench_collective_runs():
    r = subprocess.run([sys.executable, "-m", "conveyor", "bench", "collective", "--reps", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "| all_gather_matmul |" in r.stdout and "| matmul_reduce_scatter |" in r.stdout
