"""Per-rank training state, so a run can stop and resume with the losses an uninterrupted run gives.

The gathered checkpoint (``save_pretrained``) is the model for everyone else; resuming needs each
rank's exact local shards (TP, EP, FSDP slices) and its optimizer's state for them, which no rank
holds for another. Each rank writes its own two files and reads back only those: no rank ever holds
more than its shard, and the bits come back exactly.
"""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..adapters.seams import place_and_check
from ..checkpoint.files import TRAINING_STATE_PREFIX, resume_file_names
from ..state import parallel_state
from .clipping import local_tensor


def _files(model, directory: str) -> tuple[str, str]:
    mesh = parallel_state(model).mesh
    return tuple(os.path.join(directory, name) for name in resume_file_names(mesh.rank, mesh.world_size))


def _trainable(model) -> dict:
    """What training changes: the trainable parameters (a LoRA run's adapters, not the frozen base)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


LAYOUT_KEY = "layout"  # in each rank's training-state file: the layout whose ranks wrote it


def _recorded_layout(path: str) -> str | None:
    """The layout a training-state file records (None: written before layouts were recorded)."""
    with safe_open(path, "pt") as saved:
        return (saved.metadata() or {}).get(LAYOUT_KEY)


def written_layout(directory: str) -> str | None:
    """The layout whose ranks wrote the per-rank training state in ``directory`` (None: there is none)."""
    found = sorted(name for name in os.listdir(directory) if name.startswith(TRAINING_STATE_PREFIX))
    if not found:
        return None
    ranks = found[0].rpartition("-of-")[2].split(".")[0]
    return _recorded_layout(os.path.join(directory, found[0])) or f"{ranks} ranks"


def save_training_state(model, optimizer, directory: str) -> None:
    """This rank's trainable parameter shards and optimizer state under ``directory`` (every rank calls),
    with the layout that wrote them."""
    weights, optimizer_file = _files(model, directory)
    os.makedirs(directory, exist_ok=True)
    tensors = {name: local_tensor(p.detach()).contiguous() for name, p in _trainable(model).items()}
    save_file(tensors, weights, metadata={LAYOUT_KEY: str(parallel_state(model).mesh.shape)})
    state = optimizer.state_dict()
    state["state"] = {
        index: {key: local_tensor(value) if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
        for index, entry in state["state"].items()
    }
    torch.save(state, optimizer_file)


def load_training_state(model, optimizer, directory: str) -> None:
    """What ``save_training_state`` wrote for this rank, back into ``model`` and ``optimizer``
    (either may be None)."""
    weights, optimizer_file = _files(model, directory)
    layout = str(parallel_state(model).mesh.shape)
    for path in (weights, optimizer_file):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} is missing: resuming needs the per-rank training state a checkpoint of the same layout "
                f"({layout}) wrote"
            )
    written = _recorded_layout(weights)  # None: written before layouts were recorded, at this world size
    if written is not None and written != layout:  # the same world size, another split: other slices
        raise ValueError(
            f"{directory}: its per-rank training state was written at {written}, and this "
            f"model is {layout}; hf_parallel resumes a checkpoint at the layout that wrote it (resharding the "
            "optimizer state is not done yet): resume at that layout"
        )
    if model is not None:
        place_and_check(model)  # adapters added since loading: cut to the slices this rank saved
        saved = load_file(weights)
        params = _trainable(model)
        if saved.keys() != params.keys():
            raise ValueError(
                f"{weights} holds other parameters than the model: {sorted(saved.keys() ^ params.keys())[:5]}"
            )
        with torch.no_grad():
            for name, param in params.items():
                local_tensor(param).copy_(saved[name])
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(optimizer_file, weights_only=True))
        for group in optimizer.param_groups:  # FSDP's parameters are DTensors: so must their moments be
            for param in group["params"]:
                if hasattr(param, "to_local") and param in optimizer.state:
                    entry = optimizer.state[param]
                    for key, value in entry.items():
                        if isinstance(value, torch.Tensor) and not hasattr(value, "to_local") and value.dim():
                            entry[key] = type(param).from_local(
                                value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                            )
