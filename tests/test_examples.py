"""The examples run as scripts (they assert their own results)."""

import pathlib
import runpy

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def test_pipelined_matmul_example_on_every_backend(capsys):
    runpy.run_path(str(EXAMPLES / "pipelined_matmul.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert (
        "xla" in out
        and "mosaic_tpu" in out
        and "mosaic_gpu" in out
        and "exported for ('tpu',)" in out
    )
    assert "warp-specialized xla" in out and "warp-specialized mosaic_gpu" in out
    assert (
        "matmul exported for ('cuda',)" in out
        and "matmul_warp_specialized exported for ('cuda',)" in out
    )


def test_moe_dispatch_example(capsys):
    runpy.run_path(str(EXAMPLES / "moe_dispatch.py"), run_name="__main__")
    assert "max |error| vs unfused float64" in capsys.readouterr().out


def test_moe_nnx_example(capsys):
    runpy.run_path(str(EXAMPLES / "moe_nnx.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "nnx MoE block: loss" in out and "max |error| vs the dense reference" in out


def test_moe_equinox_example(capsys):
    runpy.run_path(str(EXAMPLES / "moe_equinox.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "equinox MoE block: loss" in out and "max |error| vs the dense reference" in out
