#!/usr/bin/env bash
# Create $VENV (default .venv) with a Python >= 3.12 and install Conveyor with its test and demo extras.
# Interpreter search order: $PYTHON, python3.12/python3.13/python3 on PATH, then pyenv's versions
# (3.12 first: the version the supported JAX range was validated with here, then newer ones).
# JAX_END=newest|oldest pins jax and jaxlib to that end of pyproject's supported range
# (default newest), so CI runs the suite at both ends.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
JAX_END=${JAX_END:-newest}
EXTRAS=${EXTRAS-test,demo,dev}   # extras of Conveyor to install ("" for none)

# The supported range is written once, in pyproject.toml ("jax>=OLDEST,<=NEWEST").
jax_pin() {  # $1 = oldest|newest
  sed -n 's/^ *"jax>=\([0-9.]*\),<=\([0-9.]*\)".*/\1 \2/p' pyproject.toml | {
    read -r oldest newest || { echo "bootstrap: no 'jax>=X,<=Y' dependency in pyproject.toml" >&2; exit 1; }
    case "$1" in oldest) echo "$oldest";; newest) echo "$newest";;
      *) echo "bootstrap: JAX_END must be oldest or newest, got '$1'" >&2; exit 1;; esac
  }
}
JAX_VERSION=$(jax_pin "$JAX_END")
STAMP="$VENV/.installed-jax-$JAX_VERSION"

is_ok() {  # $1 = interpreter; succeeds when it runs and is >= 3.12
  "$1" -c 'import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  if [ -n "${PYTHON:-}" ]; then
    if is_ok "$PYTHON"; then echo "$PYTHON"; return 0; fi
    echo "bootstrap: PYTHON=$PYTHON is not a working Python >= 3.12" >&2; return 1
  fi
  for c in python3.12 python3.13 python3; do
    if command -v "$c" >/dev/null 2>&1 && is_ok "$(command -v "$c")"; then command -v "$c"; return 0; fi
  done
  local roots=()
  if command -v pyenv >/dev/null 2>&1; then roots+=("$(pyenv root)"); fi
  roots+=("${PYENV_ROOT:-}" "$HOME/.pyenv")
  for r in "${roots[@]}"; do
    [ -n "$r" ] && [ -d "$r/versions" ] || continue
    # 3.12.x first (newest patch first), then 3.13 and later
    for d in $(ls -1 "$r/versions" | grep -E '^3\.(1[2-9]|[2-9][0-9])\.[0-9]+$' | sort -t. -k2,2n -k3,3nr); do
      for exe in "$r/versions/$d/bin/python3" "$r/versions/$d/bin/python"; do
        if [ -x "$exe" ] && is_ok "$exe"; then echo "$exe"; return 0; fi
      done
    done
  done
  return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  if ! PY=$(find_python); then
    cat >&2 <<MSG
bootstrap: no Python >= 3.12 found (jax $JAX_VERSION needs it).
  Looked at: \$PYTHON, python3.13/python3.12/python3 on PATH, and pyenv versions.
  Install one, e.g. 'pyenv install 3.12' or 'apt-get install python3.12 python3.12-venv',
  or point to it: make test PYTHON=/path/to/python3.12
MSG
    exit 1
  fi
  echo "bootstrap: creating $VENV with $PY ($("$PY" --version 2>&1))"
  "$PY" -m venv "$VENV"
fi

if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  rm -f "$VENV"/.installed*
  echo "bootstrap: installing Conveyor into $VENV with jax/jaxlib $JAX_VERSION ($JAX_END end of the supported range)"
  "$VENV/bin/python" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}" "jax==$JAX_VERSION" "jaxlib==$JAX_VERSION"
  touch "$STAMP"
fi
