"""hf_parallel: tensor-, sequence- and pipeline-parallel from_pretrained / generate / save_pretrained for transformers models.

Names are imported on first use (PEP 562): ``import hf_parallel`` alone loads neither torch nor
transformers, so ``hf-parallel --help`` answers at once and a program pays only for what it uses.
"""

from __future__ import annotations

import importlib

_EXPORTS = {  # public name -> the module that owns it
    "AutoModel": ".api",
    "AutoModelForCausalLM": ".api",
    "AutoModelForSeq2SeqLM": ".api",
    "AutoModelForSpeechSeq2Seq": ".api",
    "from_pretrained": ".api",
    "save_pretrained": ".api",
    "ParallelState": ".state",
    "parallel_state": ".state",
    "train_step": ".training.step",
    "clip_grad_norm_": ".training.clipping",
    "save_training_state": ".training.resume",
    "load_training_state": ".training.resume",
    "consolidate": ".checkpoint.consolidate",
    "CheckpointError": ".core.errors",
    "RankFailure": ".distributed.faults",
    "Mesh": ".distributed.mesh",
    "Layout": ".core.layout",
    "register_plan": ".tensor.plan",
    "ParallelStyle": ".tensor.styles",
    "STYLES": ".tensor.registry",
    "register_style": ".tensor.registry",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_parallel' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
