#!/usr/bin/env bash
# Build the sdist and the wheel, install the wheel (runtime dependencies only, no extras, no
# editable install) into a fresh virtual environment, and from outside the source tree:
#   - run the README's quick start,
#   - check `conveyor` is the installed copy (not src/),
#   - run the CLI, including `--png` without the plot extra (a one-line hint, the JSON still printed).
# Usage: bash scripts/wheel_test.sh   (uses .venv's `build`, from the dev extra; make wheel-test)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "wheel-test: building sdist and wheel into $WORK/dist"
"$PY" -m build --sdist --wheel --outdir "$WORK/dist" . >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/conveyor-*.whl)
SDIST=$(ls "$WORK"/dist/conveyor-*.tar.gz)
echo "wheel-test: built $(basename "$WHEEL") and $(basename "$SDIST")"

# The sdist carries the sources, the README (the package's long description) and pyproject.
CONTENTS=$(tar -tzf "$SDIST")
for f in src/conveyor/__init__.py src/conveyor/cli.py README.md pyproject.toml; do
  grep -qx "conveyor-[^/]*/$f" <<<"$CONTENTS" || { echo "wheel-test: the sdist lacks $f" >&2; exit 1; }
done
# The wheel carries every module of the package and nothing of the tests.
"$PY" - "$WHEEL" <<'EOF'
import pathlib, sys, zipfile
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
src = pathlib.Path("src")
missing = [str(p.relative_to(src)) for p in src.rglob("*.py") if str(p.relative_to(src)) not in names]
assert not missing, f"wheel-test: modules missing from the wheel: {missing}"
assert not [n for n in names if n.startswith("tests/")], "wheel-test: the wheel carries tests/"
EOF

BASE=$("$PY" -c 'import sys; print(sys._base_executable)')
"$BASE" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
echo "wheel-test: installing the wheel (runtime dependencies only) into a fresh venv"
"$WORK/venv/bin/python" -m pip install -q "$WHEEL" 2>&1 | grep -v "^WARNING: Location" || true
"$WORK/venv/bin/python" -c "import conveyor" || { echo "wheel-test: the installed wheel does not import" >&2; exit 1; }

# The README's quick start: the first python block after '## Quick start'.
"$PY" - "$ROOT/README.md" >"$WORK/quickstart.py" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
section = text[text.index("## Quick start"):]
print(re.search(r"```python\n(.*?)```", section, flags=re.S).group(1))
EOF

cd "$WORK"   # outside the source tree: nothing of src/ is importable from here
"$WORK/venv/bin/python" - "$ROOT" <<'EOF'
import pathlib, sys
import conveyor
where = pathlib.Path(conveyor.__file__).resolve()
assert "site-packages" in where.parts and pathlib.Path(sys.argv[1]) not in where.parents, where
import importlib.util
assert importlib.util.find_spec("matplotlib") is None, "a plain install must not pull matplotlib"
print(f"wheel-test: conveyor {conveyor.__version__} imported from {where.parent}")
EOF
JAX_PLATFORMS=cpu "$WORK/venv/bin/python" quickstart.py
echo "wheel-test: README quick start ran"

"$WORK/venv/bin/conveyor" simulate copy --json >copy.json
"$WORK/venv/bin/python" -c "import json; assert json.load(open('copy.json'))['workload'] == 'copy'"
set +e
"$WORK/venv/bin/conveyor" simulate copy --json --png t.png >png.json 2>png.err
status=$?
set -e
[ "$status" = 1 ] || { echo "wheel-test: --png without matplotlib exited $status, expected 1" >&2; cat png.err; exit 1; }
grep -q "pip install 'conveyor\[plot\]'" png.err || { echo "wheel-test: no install hint:" >&2; cat png.err; exit 1; }
"$WORK/venv/bin/python" -c "import json; assert json.load(open('png.json'))['workload'] == 'copy'"
"$WORK/venv/bin/conveyor" check pipeline --grid 4 >/dev/null
echo "wheel-test: CLI ok (--png without the plot extra: hint and JSON kept)"
echo "wheel-test: passed"
