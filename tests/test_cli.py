"""The command line: each subcommand's happy path, and every bad input is one line and exit 2."""

import json
import re
import subprocess
import sys

import pytest

from conveyor import cli


def _run(*args, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "conveyor", *args], capture_output=True, text=True, timeout=timeout
    )


def _main(capsys, *args):
    """cli.main in-process (fast): (exit status, stdout, stderr)."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_demo_checks_trains_and_simulates():
    r = _run("demo")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "lax.ragged_dot" in out and "MISMATCH" not in out and "NOT FALLING" not in out
    assert "gradients vs the dense reference" in out and "adam steps" in out
    assert "simulated on H100 SXM" in out and "simulated on TPU v5e" in out


def test_demo_without_a_source_tree_says_where_it_lives(capsys, monkeypatch, tmp_path):
    # An installed wheel has no examples/: the demo is refused in one line naming the way to run it.
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "conveyor" / "cli.py"))
    code, _, err = _main(capsys, "demo")
    assert code == 2
    assert "examples/demo.py" in err and "make demo" in err and "Traceback" not in err


def test_bench_gmm_small_with_its_own_shape(tmp_path):
    # A reduced table (G=8, f32 given by its short name, a small shape, no FFN rows) runs the whole
    # benchmark.
    out = tmp_path / "gmm.md"
    r = _run(
        "bench",
        "gmm",
        "--reps",
        "1",
        "--groups",
        "8",
        "--dtypes",
        "f32",
        "--ffn-groups",
        "",
        "--m",
        "512",
        "--k",
        "128",
        "--n",
        "256",
        "--out",
        str(out),
    )
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "| float32 | 8 |" in text and "cv.tgmm" in text and "m=512, k=128, n=256" in text


BAD = [
    # (argv, the text the one-line error must contain)
    (("simulate", "matmul", "--m", "0"), "argument --m: must be a positive integer, got '0'"),
    (("simulate", "matmul", "--m", "-5"), "argument --m: must be a positive integer, got '-5'"),
    (("simulate", "matmul", "--k", "four"), "argument --k: expected an integer, got 'four'"),
    (("simulate", "matmul", "--dtype", "f64"), "argument --dtype: unknown dtype 'f64'"),
    (("simulate", "matmul", "--hardware", "a100"), "argument --hardware: unknown 'a100'"),
    (
        ("simulate", "matmul", "--tile", "128,256,64"),
        "argument --tile: renamed --tiling, in cv.gmm's order tm,tk,tn",
    ),
    (("simulate", "matmul", "--tiling", "128,64"), "argument --tiling: expected tm,tk,tn"),
    (
        ("simulate", "matmul", "--tiling", "1024,1024,1024", "--stages", "4"),
        "needs 18432 KiB of on-chip memory",
    ),
    (
        ("simulate", "matmul", "--dtype", "f32", "--hardware", "v5e"),
        "no matrix rate for dtype 'float32'",
    ),
    (
        ("simulate", "gmm", "--m", "4096", "--groups", "4", "--sizes", "100,200"),
        "argument --groups: 4 disagrees with --sizes (2 groups)",
    ),
    (
        ("simulate", "gmm", "--m", "4096", "--sizes", "100,200"),
        "argument --m: 4096 disagrees with --sizes (they sum to 300)",
    ),
    (
        ("simulate", "gmm", "--sizes", "100,-1"),
        "argument --sizes: every value must be >= 0, got -1",
    ),
    (("simulate", "gmm", "--sizes", "0,0"), "argument --sizes: every group is empty"),
    (
        ("simulate", "gmm", "--sizes", "100,900,..."),
        "argument --sizes: expected an integer, got '...'",
    ),
    (("simulate", "copy", "--m", "5"), "--m not used by 'simulate copy'"),
    (("simulate", "matmul", "--sizes", "1,2"), "--sizes not used by 'simulate matmul'"),
    (("simulate", "copy", "--bytes", "0"), "argument --bytes: must be positive, got '0'"),
    (
        ("check", "pipeline", "--grid", "3,0"),
        "argument --grid: every value must be >= 1, got 0 in '3,0'",
    ),
    (
        ("check", "pipeline", "--grid", ""),
        "argument --grid: expected comma-separated integers, got nothing",
    ),
    (
        ("check", "pipeline", "--stages", "2", "--delay-release", "2"),
        "max_concurrent_steps=2 must be greater than",
    ),
    (("check", "pipeline", "--devices", "8"), "--devices not used by 'check pipeline'"),
    (("check", "ring", "--max-seconds", "0"), "argument --max-seconds: must be positive, got '0'"),
    (("bench", "gmm", "--dtypes", "float64"), "argument --dtypes: 'float64' is not benchmarked"),
    (("bench", "gmm", "--dtypes", "f32,int8"), "argument --dtypes: 'int8' is not benchmarked"),
    (("bench", "gmm", "--groups", "0"), "argument --groups: every value must be >= 1, got 0"),
    (("bench", "gmm", "--reps", "0"), "argument --reps: must be a positive integer"),
    (("bench", "pipeline", "--platform", "gpu"), "--platform not used by 'bench pipeline'"),
    (
        ("bench", "gmm", "--platform", "gpu", "--dtypes", "float32"),
        "--dtypes not used by 'bench gmm --platform gpu'",
    ),
    (("bench", "gmm", "--no-tgmm"), "--no-tgmm not used by 'bench gmm --platform cpu'"),
    (("bench", "mpmd", "--m", "64"), "--m not used by 'bench mpmd'"),
    (
        ("bench", "gmm", "--platform", "gpu", "--backends", "cuda"),
        "argument --backends: unknown backend 'cuda'",
    ),
    (("bench", "nothing"), "argument which: invalid choice: 'nothing'"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = _main(capsys, *argv)
    assert code == 2, (argv, code, out, err)
    assert message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line, no traceback
    assert err.startswith(f"conveyor {argv[0]}: error: "), err


def test_bad_input_through_the_real_entry_point():
    # The same rule through `python -m conveyor` (what users run), for the cases the issue listed.
    for argv in (
        ("simulate", "matmul", "--m", "0"),
        ("simulate", "matmul", "--dtype", "f64"),
        ("check", "pipeline", "--grid", "3,0"),
        ("bench", "gmm", "--dtypes", "float64"),
    ):
        r = _run(*argv, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, (
            argv,
            r.stderr,
        )


def test_one_dtype_vocabulary(capsys):
    short = _main(capsys, "simulate", "matmul", "--dtype", "bf16", "--json")
    long = _main(capsys, "simulate", "matmul", "--dtype", "bfloat16", "--json")
    assert short[0] == long[0] == 0
    assert json.loads(short[1]) == json.loads(long[1])
    assert json.loads(short[1])["config"]["dtype"] == "bfloat16"


def test_simulate_matmul_tiling_is_gmm_order(capsys):
    code, out, _ = _main(
        capsys,
        "simulate",
        "matmul",
        "--m",
        "4096",
        "--k",
        "4096",
        "--n",
        "4096",
        "--tiling",
        "128,64,256",
        "--stages",
        "3",
        "--json",
    )
    assert code == 0
    cfg = json.loads(out)["config"]
    assert cfg["tiling"] == [128, 64, 256]  # tm, tk, tn as given
    assert cfg["tiles"] == (4096 // 128) * (4096 // 256)  # output tiles are tm x tn


def test_simulate_gmm_sizes_define_m_and_groups(capsys):
    code, out, _ = _main(
        capsys,
        "simulate",
        "gmm",
        "--k",
        "2048",
        "--n",
        "1024",
        "--sizes",
        "100,900,300,700,0,1200,396,500",
        "--json",
    )
    assert code == 0
    cfg = json.loads(out)["config"]
    assert cfg["m"] == 4096 and cfg["groups"] == 8
    # Consistent --m/--groups are accepted with --sizes; the default split is even.
    assert (
        _main(capsys, "simulate", "gmm", "--m", "300", "--groups", "2", "--sizes", "100,200")[0]
        == 0
    )
    code, out, _ = _main(capsys, "simulate", "gmm", "--m", "10", "--groups", "4", "--json")
    assert code == 0 and json.loads(out)["config"]["m"] == 10


def test_simulate_png_without_matplotlib_keeps_the_json(capsys, monkeypatch, tmp_path):
    # A plain install has no matplotlib: --png says what to install, and the --json asked for still
    # prints.
    # makes `import matplotlib` raise ModuleNotFoundError
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = _main(capsys, "simulate", "copy", "--json", "--png", str(tmp_path / "t.png"))
    assert code == 1
    assert json.loads(out)["workload"] == "copy"
    assert "pip install 'conveyor[plot]'" in err and "Traceback" not in err
    assert not (tmp_path / "t.png").exists()


@pytest.mark.parametrize("option", ["--png", "--trace"])
def test_simulate_output_in_a_missing_folder_is_one_line(capsys, tmp_path, option):
    target = tmp_path / "missing" / "t.out"
    code, _, err = _main(capsys, "simulate", "copy", option, str(target))
    assert code == 2 and f"argument {option}: folder" in err and "does not exist" in err
    assert err.count("\n") == 1 and not target.parent.exists()


def test_simulate_png_and_trace(capsys, tmp_path):
    code, out, _ = _main(
        capsys,
        "simulate",
        "matmul",
        "--m",
        "8192",
        "--k",
        "8192",
        "--n",
        "8192",
        "--png",
        str(tmp_path / "t.png"),
        "--trace",
        str(tmp_path / "t.json"),
    )
    assert code == 0 and "matmul on H100 SXM" in out
    # Only some tiles are replayed at this size: the text says what the timeline shows.
    assert re.search(
        r"timeline shows the first [\d.]+ us of the [\d.]+ us run \(replayed \d+ of \d+ tiles", out
    ), out
    assert (tmp_path / "t.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]


def test_check_happy_paths(capsys):
    code, out, _ = _main(capsys, "check", "pipeline", "--grid", "4", "--stages", "2")
    assert code == 0 and "every interleaving" in out and "no race, no deadlock" in out
    # Without credits a 3-device one-way ring races, found in an exhaustive search (about 1 s).
    code, out, _ = _main(
        capsys, "check", "ring", "--devices", "3", "--unidirectional", "--no-credits"
    )
    assert code == 1 and "RACE" in out and "every interleaving" in out


def test_check_stops_at_its_time_budget(capsys):
    # The case that once ran 10 minutes in silence: now it stops at the budget and says so.
    code, out, _ = _main(
        capsys,
        "check",
        "pipeline",
        "--grid",
        "100",
        "--stages",
        "4",
        "--max-seconds",
        "2",
        "--no-progress",
    )
    assert code == 0
    assert "stopped at the 2 s time budget with what was found so far" in out


def test_check_progress_bar_on_request(capsys):
    code, out, err = _main(
        capsys, "check", "pipeline", "--grid", "12", "--stages", "3", "--progress"
    )
    assert code == 0 and "states" in err  # tqdm's bar counts states on stderr


def test_docs_command_lines_run_as_written(capsys, tmp_path, monkeypatch):
    # Every `conveyor simulate/check ...` line in the README and the guides runs and exits 0.
    import pathlib
    import shlex

    root = pathlib.Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)  # where their --png / --trace files land
    lines = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        lines += [
            (doc.name, m)
            for m in re.findall(
                r"^\s*conveyor ((?:simulate|check) [^\n#]*)", doc.read_text(), flags=re.M
            )
        ]
    assert len(lines) >= 5, lines
    for doc, line in lines:
        code, out, err = _main(
            capsys, *shlex.split(line), *(["--no-progress"] if line.startswith("check") else [])
        )
        assert code == 0 or (line.startswith("check") and "RACE" in out), (doc, line, err)
