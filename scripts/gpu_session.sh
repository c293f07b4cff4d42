#!/usr/bin/env bash
# One lent-GPU session in one call (device time is short): the machine's state, the GPU benchmark
# (`make gpu-bench`), then `make gpu-check` with pytest-xdist workers. Each step has its own time
# cap so that one slow step cannot eat the others; logs and the table go to $1 (default $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${1:-${OUT:?give a folder or set OUT}}
mkdir -p "$dest"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv | tee "$dest/machine.txt"
source scripts/gpu_env.sh
"$PY" -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices())" \
  | tee -a "$dest/machine.txt"
# The SM clock and power every 250 ms while the benchmark runs: a matmul on normal data can hold
# the clocks under the power limit (docs/simulator.md), which the simulator's model does not know.
fields=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu
if nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv >/dev/null 2>&1; then
  fields=$fields,clocks_event_reasons.active
fi
nvidia-smi --query-gpu=$fields --format=csv -lms 250 > "$dest/clocks.csv" 2>&1 &
sampler=$!
timeout "${BENCH_CAP_S:-170}" "$PY" -m conveyor bench gmm --platform gpu --reps "${REPS:-10}" \
  --out "$dest/gmm-gpu.md" 2>&1 | tee "$dest/bench.log" | grep -v "^  "
echo "bench exit ${PIPESTATUS[0]}"
kill "$sampler" 2>/dev/null
# SM clock (MHz) and power (W) over the samples drawing over half the power limit: under load
awk -F', ' 'NR > 1 && $3 + 0 > ($4 + 0) / 2 { n++; c += $2; p += $3; if (!lo || $2 + 0 < lo) lo = $2 + 0 }
  END { if (n) printf "under load: %d samples, mean SM clock %.0f MHz (min %d), mean power %.0f W\n",
    n, c / n, lo, p / n }' "$dest/clocks.csv" | tee -a "$dest/machine.txt"
# -v: each result line names its xdist worker ("[gw3] PASSED ..."), in the order the worker ran
# them, so a sticky CUDA error is traced to the kernel that ran before it on that worker.
GPU_CHECK_LOG="$dest/gpu-check.log" timeout "${CHECK_CAP_S:-240}" \
  bash scripts/gpu_check.sh -n "${WORKERS:-8}" -v --durations=15 | tail -40
echo "gpu-check exit ${PIPESTATUS[0]}"
