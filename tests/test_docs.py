"""The README's and the guides' Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
GUIDES = sorted((README.parent / "docs").glob("*.md"))


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


def test_readme_starts_with_the_two_commands():
    text = README.read_text()
    first_block = re.search(r"```\n(.*?)```", text, flags=re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make demo", "make test"]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci


@pytest.mark.parametrize("guide", GUIDES, ids=lambda p: p.name)
def test_guide_python_blocks_run(guide):
    for code in re.findall(r"```python\n(.*?)```", guide.read_text(), flags=re.S):
        exec(compile(code, str(guide), "exec"), {})


def test_guide_figures_exist():
    for guide in GUIDES:
        for figure in re.findall(r"\]\((figures/[^)]+\.png)\)", guide.read_text()):
            assert (guide.parent / figure).stat().st_size > 10_000, figure
