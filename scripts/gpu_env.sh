#!/usr/bin/env bash
# Source this on a GPU machine whose preinstalled JAX has the CUDA plugin (see ../shared/FACTS.md):
# it puts Conveyor's src/ on PYTHONPATH. The preinstalled jax 0.11.2 is the oldest end of the
# supported range, so nothing needs installing (tqdm, absent there, is imported only to draw a
# bar). Optionally, a carried pure-Python jax wheel in .whl/ is installed into /tmp/site (the CUDA
# plugin checks its version against jaxlib, which stays as it is).
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if ls "$ROOT"/.whl/jax-*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$ROOT"/.whl/jax-*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}
export CONVEYOR_TEST_PLATFORM=gpu
export PY
