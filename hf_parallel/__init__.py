"""hf_parallel: tensor-parallel from_pretrained / generate / save_pretrained for transformers models."""

from .api import AutoModel, AutoModelForCausalLM, from_pretrained, save_pretrained
from .consolidate import consolidate
from .errors import CheckpointError, RankFailure
from .layout import Layout
from .plan import register_plan
from .styles import STYLES, ParallelStyle, register_style

__all__ = [
    "AutoModel",
    "AutoModelForCausalLM",
    "CheckpointError",
    "Layout",
    "ParallelStyle",
    "RankFailure",
    "STYLES",
    "consolidate",
    "from_pretrained",
    "register_plan",
    "register_style",
    "save_pretrained",
]
