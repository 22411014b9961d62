"""hf_parallel: tensor-, sequence- and pipeline-parallel from_pretrained / generate / save_pretrained for transformers models."""

from .api import AutoModel, AutoModelForCausalLM, from_pretrained, save_pretrained
from .checkpoint.consolidate import consolidate
from .checkpoint.errors import CheckpointError
from .distributed.faults import RankFailure
from .distributed.mesh import Mesh
from .pipeline import train_step
from .tensor.layout import Layout
from .tensor.plan import register_plan
from .tensor.styles import STYLES, ParallelStyle, register_style

__all__ = [
    "AutoModel",
    "AutoModelForCausalLM",
    "CheckpointError",
    "Layout",
    "Mesh",
    "ParallelStyle",
    "RankFailure",
    "STYLES",
    "consolidate",
    "from_pretrained",
    "register_plan",
    "register_style",
    "save_pretrained",
    "train_step",
]
