"""Per-rank training state, so a run can stop and resume, at the same layout or any other, with the
losses an uninterrupted run gives.

The gathered checkpoint (``save_pretrained``) is the model for everyone else; resuming needs the
trainable parameters' exact values and the optimizer's state for them, which no rank holds whole.
Each rank writes its own pieces with where they sit in the full tensors (``state_tiles.py``): no
rank ever gathers, and any layout reads back just its pieces, bit for bit. transformers'
``optimizer.pt`` (a one-process run's) resumes on a parallel layout the same way, and
``hf-parallel consolidate`` turns a parallel run's state into one for plain transformers.
"""

from __future__ import annotations

import json
import os

from safetensors import safe_open
from safetensors.torch import save_file

from ..adapters.seams import place_and_check
from ..checkpoint.files import TRAINING_STATE_PREFIX, training_state_file
from ..state import parallel_model, parallel_state
from ..checkpoint.training_state import (
    LAYOUT_KEY,
    METADATA_KEY,
    OPTIMIZER_FILE,
    SavedState,
    StateError,
    state_files,
)
from .state_tiles import (
    PlainOptimizerState,
    optimizer_names,
    param_tiles,
    read_state,
    state_file_contents,
)

def save_training_state(model, optimizer, directory: str) -> None:
    """This rank's pieces of the trainable parameters and of ``optimizer``'s state (may be None)
    under ``directory``, with the layout that wrote them (every rank calls)."""
    mesh = parallel_state(parallel_model(model)).mesh
    tensors, metadata = state_file_contents(model, optimizer)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, training_state_file(mesh.rank, mesh.world_size)),
              metadata={LAYOUT_KEY: str(mesh.shape), METADATA_KEY: json.dumps(metadata)})  # fmt: skip


def _plain_state(model, optimizer, directory: str) -> PlainOptimizerState:
    """A one-process checkpoint: the weights by the checkpoint keys the model was loaded from, and
    transformers' ``optimizer.pt`` when there is an optimizer to fill."""
    from ..checkpoint.loading import checkpoint_files

    state = parallel_state(parallel_model(model))
    if state.stage is not None:
        raise StateError(f"{directory}: a one-process checkpoint resumes on layouts without pipeline stages")
    tiles = param_tiles(model)
    order = list(tiles)
    if optimizer is not None:
        order = [name for names in optimizer_names(optimizer, tiles) for name in names]
    files = checkpoint_files(directory)
    weights, unreadable = {}, []
    for name in tiles:
        key = state.source_keys.get(name)
        if isinstance(key, str) and key in files:
            weights[name] = safe_open(files[key], "pt").get_slice(key)
        else:
            unreadable.append(name)
    if unreadable:
        raise StateError(
            f"{directory}: a one-process checkpoint's trainable parameter(s) {', '.join(unreadable[:5])} are not "
            "under the keys this model was loaded from (an adapter, or fused experts): load the model from this "
            "checkpoint, or resume at the layout that wrote it"
        )
    shapes = {name: full for name, (_, full, _) in tiles.items()}
    optimizer_file = os.path.join(directory, OPTIMIZER_FILE) if optimizer is not None else None
    return PlainOptimizerState(optimizer_file, order, shapes, weights)


def load_training_state(model, optimizer, directory: str, weights: bool = True) -> None:
    """What ``save_training_state`` wrote at any layout (or a one-process checkpoint: its weights and
    transformers' ``optimizer.pt``) into the trainable parameters (``weights``) and ``optimizer``
    (may be None), each rank reading its own pieces."""
    state = parallel_state(parallel_model(model))
    layout = str(state.mesh.shape)
    place_and_check(model)  # adapters added since loading: cut to this rank's slices first
    files = state_files(directory) if os.path.isdir(directory) else []
    if files:
        saved = SavedState(files)
    elif optimizer is None or os.path.isfile(os.path.join(directory, OPTIMIZER_FILE)):
        saved = _plain_state(model, optimizer, directory)
    else:
        raise FileNotFoundError(
            f"{directory}: no optimizer state to resume (neither hf_parallel's {TRAINING_STATE_PREFIX}* files nor "
            f"transformers' {OPTIMIZER_FILE})"
        )
    read_state(model, optimizer, saved, layout, on_stages=state.stage is not None, weights=weights)
