#!/usr/bin/env bash
# Create the environment of one real compiler for `conveyor compile-check` (deviceless AOT):
#   scripts/compile_env.sh cuda   -> .venv-compile-cuda (Mosaic GPU + ptxas/nvJitLink for H100)
#   scripts/compile_env.sh tpu    -> .venv-compile-tpu  (libtpu: Mosaic TPU, v5e/v6e/v5p)
# Each toolchain lives in its own venv (libtpu prints warnings into every jax process that can
# see it), with jax at the newest end of the supported range and Conveyor installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."
which=${1:-}
case "$which" in
  cuda) packages=("jax-cuda12-plugin==JAX" "jax-cuda12-pjrt==JAX" nvidia-cuda-nvcc-cu12 nvidia-nvjitlink-cu12);;
  tpu) packages=("jax[tpu]==JAX");;
  *) echo "compile_env: expected 'cuda' or 'tpu', got '${which}'" >&2; exit 2;;
esac
VENV=.venv-compile-$which
export VENV EXTRAS=""
bash scripts/bootstrap.sh
jax_version=$("$VENV/bin/python" -c 'import jax; print(jax.__version__)')
stamp="$VENV/.installed-compile-$which-$jax_version"
if [ ! -f "$stamp" ]; then
  echo "compile_env: installing the $which compiler for jax $jax_version into $VENV"
  "$VENV/bin/python" -m pip install -q "${packages[@]//JAX/$jax_version}"
  touch "$stamp"
fi
