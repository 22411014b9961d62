"""``hf-parallel consolidate DIR OUT``: a distributed save back to a standard checkpoint, in one
process with no process group, in row blocks of ``saving.BLOCK_BYTES`` (memory: about one block).

Keys are the checkpoint keys the model was loaded from, so the output has the source's names and
packed forms; files are split at ``max_shard_size`` with an index, as transformers writes them.
Everything else in DIR (config, generation config, tokenizer files) is copied. A Trainer
checkpoint's per-rank training state becomes transformers' ``optimizer.pt``, so plain transformers
resumes it. Writes are staged and renamed at the end, like every save.
"""

from __future__ import annotations

import os
import shutil
import time

from tqdm.auto import tqdm

from ..core.layout import box_shape
from .files import MANIFEST_FILE, MAX_SHARD_SIZE, TEMP_SUFFIX, TRAINING_STATE_PREFIX, is_weight_file
from .keys import expert_shape
from .manifest import DistributedCheckpoint
from .saving import Scratch, as_written, row_blocks, write_standard
from .staging import Staging, remove_stale
from .training_state import OPTIMIZER_FILE, write_full_optimizer, written_layout
from ..core.dtypes import nbytes


def consolidate(src: str, out: str, max_shard_size=MAX_SHARD_SIZE, progress: bool = True) -> dict:
    """Write the standard checkpoint; returns ``{"bytes": …, "seconds": …}`` of tensor data. A Trainer
    checkpoint's per-rank training state becomes transformers' ``optimizer.pt`` (whole tensors)."""
    manifest = os.path.join(src, MANIFEST_FILE)
    training = written_layout(src) is not None
    if not os.path.isfile(manifest):
        if not training:
            raise FileNotFoundError(
                f"{src}: no {MANIFEST_FILE} and no per-rank training state; not a distributed checkpoint "
                "(save_pretrained(distributed=True)) nor a Trainer checkpoint of a parallel run"
            )
        return _consolidate_training_state(src, out)
    checkpoint = DistributedCheckpoint(manifest)  # checks every rank file before anything is written
    targets = {}  # output key -> (tensor in the checkpoint, box of it or None)
    for name, (shape, _, _, _) in checkpoint.tensors.items():
        fused = checkpoint.fused.get(name)
        targets.update(((key, (name, box)) for key, box in fused.boxes(shape)) if fused else [(name, (name, None))])
    specs = {
        key: (
            checkpoint.tensors[name][0] if box is None else expert_shape(box),
            checkpoint.tensors[name][1],
        )
        for key, (name, box) in targets.items()
    }

    scratch = Scratch()  # where a block that spans ranks' pieces is assembled, block after block

    def tensors(keys):
        for key in keys:
            yield blocks(*targets[key])

    def blocks(name, box):
        """The key's row blocks: a block inside one rank's piece is a view of its file, written
        straight from the mapping; unmapped once written, so memory stays near one block."""
        tiled = checkpoint.get_slice(name)
        for block in row_blocks(tiled.get_shape(), box, tiled.get_dtype()):
            tensor = tiled.read(block, scratch.take(box_shape(block), tiled.get_dtype()))
            yield as_written(tensor, box)
            del tensor
            checkpoint.release()

    total = sum(nbytes(*spec) for spec in specs.values())
    start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    bar = tqdm(total=total, desc="Consolidating", unit="B", unit_scale=True, disable=not progress, leave=False)
    with Staging(out) as staging:
        write_standard(staging, specs, tensors, max_shard_size, bar)
        if training:
            write_full_optimizer(src, staging.new_file(OPTIMIZER_FILE))
        _copy_the_rest(src, out, staging, copy_weights=False)
        remove_stale(out, set(staging.commit()))
    bar.close()
    return {"bytes": total, "seconds": time.perf_counter() - start}


def _copy_the_rest(src: str, out: str, staging: Staging, copy_weights: bool) -> None:
    """Everything else in ``src`` (config, tokenizer, a Trainer's state and scheduler) into ``out``;
    never the per-rank files the output replaces."""
    if os.path.realpath(src) == os.path.realpath(out):
        return
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        replaced = name.startswith(TRAINING_STATE_PREFIX) or (not copy_weights and is_weight_file(name))
        if os.path.isfile(path) and not replaced and not name.endswith(TEMP_SUFFIX):
            shutil.copyfile(path, staging.new_file(name))


def _consolidate_training_state(src: str, out: str) -> dict:
    """A Trainer checkpoint whose model was saved gathered: the per-rank training state as one
    ``optimizer.pt``, everything else copied."""
    if os.path.realpath(src) == os.path.realpath(out):
        raise ValueError(f"{src}: a Trainer checkpoint is consolidated into another directory (OUT), not in place")
    start = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    with Staging(out) as staging:
        write_full_optimizer(src, staging.new_file(OPTIMIZER_FILE))
        _copy_the_rest(src, out, staging, copy_weights=True)
        written = set(staging.commit())
        remove_stale(out, written)
    for name in os.listdir(out):  # an earlier run's per-rank state would be resumed instead of optimizer.pt
        if name.startswith(TRAINING_STATE_PREFIX) and name not in written:
            os.remove(os.path.join(out, name))
    return {"bytes": os.path.getsize(os.path.join(out, OPTIMIZER_FILE)), "seconds": time.perf_counter() - start}
