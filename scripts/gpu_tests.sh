#!/usr/bin/env bash
# The tests `make gpu-check` runs as real kernels on a GPU and `make gpu-lowering-check` lowers for
# CUDA on a CPU: every test module that names mosaic_gpu, and of its tests those whose names say
# GPU (mosaic_gpu, gpu) or the GPU's warp-specialized pipeline.
# Usage: bash scripts/gpu_tests.sh PYTHON [pytest options...]
set -uo pipefail
cd "$(dirname "$0")/.."
py=$1
shift
mapfile -t files < <(grep -rl --include='test_*.py' mosaic_gpu tests | sort)
exec "$py" -m pytest -q -p no:cacheprovider -k "mosaic_gpu or gpu or warp" "$@" "${files[@]}"
