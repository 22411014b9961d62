"""What the tests' fork server imports once, so that each rank forked from it (``distributed.run_ranks``) starts
with torch, transformers, the tiny models' modeling code and the package already imported: the seconds of CPU
a fresh interpreter paid per rank for them. Only imports happen here, nothing is built or run (no thread, no
process group, no RNG draw), so a forked rank starts as a fresh one that has imported these modules. peft, trl
and the Trainer are left out: tests assert that loading a model imports none of them."""

import importlib

import safetensors.torch  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import transformers
import transformers.generation.utils  # noqa: F401
import transformers.modeling_utils  # noqa: F401

from tiny_models import ARCHS, ENCODERS, MOE

import hf_parallel.api  # noqa: F401  (every module a load and a forward use)

for _class_name, _ in {**ARCHS, **MOE, **ENCODERS}.values():
    _model_type = getattr(transformers, _class_name).model_type
    importlib.import_module(f"transformers.models.{_model_type}.modeling_{_model_type}")
