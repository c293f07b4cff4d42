"""The command line: demo runs and checks itself; bench runs a small table."""
import subprocess
import sys


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "conveyor", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_demo_checks_trains_and_simulates():
    r = _run("demo")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "lax.ragged_dot" in out and "MISMATCH" not in out and "NOT FALLING" not in out
    assert "gradients vs the dense reference" in out and "adam steps" in out
    assert "simulated on H100 SXM" in out and "simulated on TPU v5e" in out


def test_bench_gmm_small(tmp_path):
    # A reduced table (G=1 and 8, f32, no FFN rows) exercises the whole pipeline of the benchmark.
    out = tmp_path / "gmm.md"
    r = _run("bench", "gmm", "--reps", "1", "--groups", "8", "--dtypes", "float32", "--ffn-groups", "",
             "--out", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "| float32 | 8 |" in text and "cv.tgmm" in text


def test_bench_refuses_options_it_would_ignore():
    for args, name in [(("bench", "pipeline", "--platform", "gpu"), "--platform"),
                       (("bench", "gmm", "--platform", "gpu", "--dtypes", "float32"), "--dtypes"),
                       (("bench", "gmm", "--no-tgmm"), "--no-tgmm")]:
        r = _run(*args)
        assert r.returncode == 2 and f"{name} not used here" in r.stderr, (args, r.stderr)
