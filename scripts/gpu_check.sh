#!/usr/bin/env bash
# `make gpu-check`: every mosaic_gpu test of the suite, run as real kernels on this machine's GPU
# (CONVEYOR_TEST_PLATFORM=gpu turns their interpreter off), then a pass/fail line per kernel.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh
"$PY" - <<'PYEOF' || exit 2
import jax, jaxlib
devs = jax.devices()
print(f"gpu-check: jax {jax.__version__}, jaxlib {jaxlib.__version__}, devices {devs}")
if devs[0].platform != "gpu":
    raise SystemExit("gpu-check: no GPU visible to JAX (is the CUDA plugin installed?)")
PYEOF
bash scripts/gpu_tests.sh "$PY" -rA --timeout 600 "$@" 2>&1 | tee "${GPU_CHECK_LOG:-/tmp/gpu-check.log}" \
  | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed"
exit "${PIPESTATUS[0]}"
