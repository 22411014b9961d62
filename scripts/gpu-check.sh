#!/usr/bin/env bash
# The GPU check, for a machine with one GPU and no internet (a lent device machine: torch there, the
# other dependencies carried as wheels in .whl/, e.g. transformers 5.23). Runs the `cuda` tier (every
# rank on the GPU, two ranks sharing it) and prints what passed with the card and torch version.
# Never part of CI. Usage: bash scripts/gpu-check.sh [extra pytest args]; with GPU_PRODUCTS="<fp8_products.py
# arguments>" set (" " for its defaults), benchmarks/fp8_products.py runs after the tier; with
# GPU_DECODE="<decode.py arguments>", benchmarks/decode.py then (table printed, decode.json beside the log).
# Each step is cut at its own limit (GPU_TIER_S, GPU_PRODUCTS_S, GPU_DECODE_S seconds), so one that hangs leaves the others' logs.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/hf_parallel_site . || exit 1
export PYTHONPATH=/tmp/hf_parallel_site:${PYTHONPATH:-}
echo "[$(date +%T)] the cuda tier"
python3 -c "import torch; print('card:', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 timeout "${GPU_TIER_S:-900}" python3 -P -m pytest -p no:cacheprovider -q -m cuda tests/test_cuda.py -rA "$@" 2>&1 | tee "${OUT:-/tmp}/cuda-tier.log"
if [ -n "${GPU_PRODUCTS:-}" ]; then
  echo "[$(date +%T)] fp8_products.py"
  # shellcheck disable=SC2086
  PYTHONUNBUFFERED=1 timeout "${GPU_PRODUCTS_S:-240}" python3 benchmarks/fp8_products.py $GPU_PRODUCTS 2>&1 | tee "${OUT:-/tmp}/products.log"
fi
if [ -n "${GPU_DECODE:-}" ]; then
  echo "[$(date +%T)] decode.py"
  # shellcheck disable=SC2086  # the arguments, split as given
  PYTHONUNBUFFERED=1 timeout "${GPU_DECODE_S:-1800}" python3 benchmarks/decode.py $GPU_DECODE --out /tmp/decode 2>&1 | tee "${OUT:-/tmp}/decode.log"
  cp /tmp/decode/decode.json "${OUT:-/tmp}/" 2>/dev/null
  tail -n 30 /tmp/decode/*.log > "${OUT:-/tmp}/decode-workers.log" 2>/dev/null
fi
echo "[$(date +%T)] done"
