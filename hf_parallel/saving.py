"""Save a sharded model as a standard checkpoint: gather tensor by tensor, write on rank 0.

Rank 0 streams each tensor into its safetensors file as soon as it is assembled, so its memory
stays near its own shard plus one full tensor plus one received shard; a tensor split by rows
(vocabulary embeddings, LM heads: the largest) is not even assembled, its shards go to the file
one after another as they arrive. Files are written under
temporary names in the target directory and renamed only once every file is complete: an
interrupted save never leaves a half-written file with a final name, nor destroys a previous
checkpoint's files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import nullcontext

import torch
import torch.distributed as dist
from huggingface_hub import split_state_dict_into_shards_factory
from tqdm.auto import tqdm

from .errors import collective
from .keys import FusedSource, expert_shape
from .layout import Layout, replicated
from .loading import INDEX_FILE
from .mesh import Mesh
from .parallelize import ShardedParam
from .staging import Staging, remove_stale
from .tiles import as_slices
from .writer import SafetensorsWriter, nbytes


def gather_to_main(
    local: torch.Tensor, layout: Layout, full_shape, mesh: Mesh, name: str, assemble: bool = True
) -> torch.Tensor | Iterator[torch.Tensor] | None:
    """The full tensor on rank 0 (None elsewhere). Rank 0 receives one shard at a time and places
    it, so it holds the full tensor plus one shard, never every shard at once. ``assemble=False``:
    rank 0 gets the shards themselves, in rank order, each received only when asked for."""
    if layout.is_replicated or mesh.world_size == 1:
        return local if mesh.is_main else None
    if not mesh.is_main:
        with collective(f"sending {name} from rank {mesh.rank} to rank 0"):
            dist.send(local.detach().cpu().contiguous(), dst=0, group=mesh.group)
        return None

    def shards():
        yield local.detach().cpu()
        for rank in range(1, mesh.world_size):
            shard = torch.empty(layout.local_shape(full_shape, rank), dtype=local.dtype)
            with collective(f"receiving {name} from rank {rank} on rank 0"):
                dist.recv(shard, src=rank, group=mesh.group)
            yield shard

    return layout.assemble(shards(), full_shape) if assemble else shards()


def plan_files(specs: dict, max_shard_size) -> tuple[dict[str, list[str]], dict | None]:
    """File name -> keys, and the index (None for a single file), as transformers names them."""
    split = split_state_dict_into_shards_factory(
        specs,
        get_storage_size=lambda spec: nbytes(*spec),
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    if not split.is_sharded:
        return split.filename_to_tensors, None
    index = {
        "metadata": {"total_size": sum(nbytes(*spec) for spec in specs.values())},
        "weight_map": split.tensor_to_filename,
    }
    return split.filename_to_tensors, index


def write_standard(staging: Staging, specs: dict, tensors, max_shard_size, progress=None) -> None:
    """Stage a standard checkpoint (files split at ``max_shard_size``, index when sharded) from
    ``tensors(keys)``, which yields each key's full tensor in order (None on ranks that don't write)."""
    files, index = plan_files(specs, max_shard_size)
    for file_name, keys in files.items():
        writer = SafetensorsWriter(staging.new_file(file_name), {key: specs[key] for key in keys}) if staging else None
        for key, full in zip(keys, tensors(keys)):
            if writer is not None:
                writer.write(key, full)
            if progress is not None:
                progress.update(nbytes(*specs[key]))
        if writer is not None:
            writer.close()
    if staging and index is not None:
        with open(staging.new_file(INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)


def save_config(model, out_dir: str) -> None:
    model.config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out_dir)


def _is_persistent_buffer(model, name: str) -> bool:
    module, _, attr = name.rpartition(".")
    return attr not in model.get_submodule(module)._non_persistent_buffers_set


def saved_entries(model) -> list[ShardedParam]:
    """Every parameter once, then the persistent buffers the checkpoint held (DeepSeek-V3's router
    ``e_score_correction_bias``): written back as read, whole, by rank 0. Legacy non-persistent ones
    (BERT's ``position_ids``) are dropped, as transformers' own save drops them."""
    state = model._hf_parallel
    buffers = [n for n in state.source_keys if n not in state.shard.params and _is_persistent_buffer(model, n)]
    return state.shard.unique_params() + [
        ShardedParam(name, (name,), replicated(state.mesh.world_size), None, tuple(model.get_buffer(name).shape))
        for name in buffers
    ]


def tensor_of(model, name: str) -> torch.Tensor:
    """The parameter or buffer called ``name``."""
    module, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(module), attr)


def checkpoint_tensors(model) -> dict[str, tuple]:
    """Checkpoint key -> (sharded parameter, box of it or None), in the source's form: a fused
    expert parameter loaded from per-expert keys is written back as those keys."""
    state = model._hf_parallel
    out = {}
    for entry in saved_entries(model):
        source = state.source_keys[entry.name]
        if isinstance(source, FusedSource):
            out.update((key, (entry, box)) for key, box in source.boxes(entry.full_shape))
        else:
            out[source] = (entry, None)
    return out


def piece_of(full, box):
    """One expert's tensor (leading expert dim dropped) of a fused full tensor; the tensor if no box."""
    return full if box is None else full[as_slices(box)].squeeze(0)


def save_sharded(model, out_dir: str, max_shard_size="50GB") -> None:
    """Gather every parameter under its checkpoint name and write a standard HF checkpoint."""
    mesh = model._hf_parallel.mesh
    targets = checkpoint_tensors(model)
    specs = {
        key: (
            entry.full_shape if box is None else expert_shape(box),
            tensor_of(model, entry.name).dtype,
        )
        for key, (entry, box) in targets.items()
    }

    def gathered(keys):
        last, full = None, None  # a fused parameter's keys come together: gather it once
        for key in keys:
            entry, box = targets[key]
            if entry is not last:
                last, full = entry, None
                # shards that are the full tensor's bytes back to back go to the file one by one
                assemble = box is not None or not entry.layout.tiles_in_rank_order(entry.full_shape)
                local = tensor_of(model, entry.name)
                full = gather_to_main(local, entry.layout, entry.full_shape, mesh, entry.name, assemble)
            yield None if full is None else piece_of(full, box)

    if mesh.is_main:
        os.makedirs(out_dir, exist_ok=True)
    progress = tqdm(total=sum(nbytes(*spec) for spec in specs.values()), desc="Saving", unit="B", unit_scale=True,
                    disable=not mesh.is_main, leave=False)  # fmt: skip
    with Staging(out_dir) if mesh.is_main else nullcontext() as staging:
        write_standard(staging, specs, gathered, max_shard_size, progress)
        if staging:
            remove_stale(out_dir, set(staging.commit()))
            save_config(model, out_dir)
    progress.close()
    mesh.barrier()
