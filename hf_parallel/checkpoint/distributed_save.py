"""``save_pretrained(out, distributed=True)``: every rank writes its own shards, in parallel, with no
gather; ``hf-parallel consolidate`` or ``from_pretrained`` (any world size) reads them back.

Commit order, so that an interrupted save never damages the checkpoint already at ``out``:
1. each rank stages its file under a temporary name; all ranks confirm (a dead rank fails the rest);
2. each rank renames its file to a final name that includes this save's id (no older file is hit);
3. rank 0 renames the manifest into place: the commit point; then removes the older save's files.
"""

from __future__ import annotations

import json
import os
import uuid

import torch.distributed as dist

from ..distributed.faults import collective
from .kept_saves import saved_pieces
from ..distributed.fsdp import LayerwiseUnshard, reshard_all
from .files import MANIFEST_FILE, rank_file_name
from .keys import FusedSource
from .manifest import FORMAT, VERSION, manifest_entry, pieces_entry
from .saving import save_config, saved_entries, stage_owners, tensor_of
from .staging import Staging, remove_stale
from ..core.dtypes import SAFETENSORS_DTYPES
from .writer import SafetensorsWriter


def _save_id(mesh) -> str:
    ids = [uuid.uuid4().hex[:12]]
    if mesh.world.group is not None:
        with collective(f"agreeing on a save id (rank {mesh.rank})"):
            dist.broadcast_object_list(ids, group_src=0, group=mesh.world.group)
    return ids[0]


def _manifest_key(source, name: str) -> str:
    """A tensor is stored under its checkpoint key; a fused expert parameter under its own name."""
    return name if isinstance(source, FusedSource) else source


def _fused(state, entry) -> FusedSource | None:
    source = state.source_keys[entry.name]
    return source if isinstance(source, FusedSource) else None


def save_distributed(model, state, out_dir: str) -> None:
    """Each rank writes its local tensors (replicated ones only on its stage's first rank) plus
    rank 0's manifest; a pipeline stage's files follow the previous stage's. Weights kept quantized
    are written as their stored parts, each rank its pieces (``kept_saves.saved_pieces``)."""
    mesh = state.mesh
    if mesh.shape.ep > 1:  # before anything is written
        raise ValueError(
            f"save_pretrained(distributed=True) with ep_size={mesh.shape.ep}: per-rank files are written per TP "
            "rank, and experts are spread over ranks of the data dimensions; save without distributed=True"
        )
    entries = {_manifest_key(state.source_keys[e.name], e.name): e for e in saved_entries(model, state)
               if e.name not in state.kept}  # fmt: skip
    save_id = _save_id(mesh)
    tp = mesh.tp  # the layouts are written in TP ranks: one file per TP rank of each pipeline stage
    stage_sizes = mesh.shape.stage_tp_sizes
    first_file = sum(stage_sizes[: mesh.stage])  # this stage's files start here
    names = [rank_file_name(rank, sum(stage_sizes), save_id) for rank in range(sum(stage_sizes))]
    if state.compute_dtype is not None:  # the float32 masters described and written, not FSDP's bf16 copies
        reshard_all(model)
    described = {
        key: manifest_entry(
            e.full_shape, SAFETENSORS_DTYPES[tensor_of(model, e.name).dtype], e.layout, _fused(state, e), first_file
        )
        for key, e in entries.items()
    }
    kept, kept_described = saved_pieces(list(state.kept.values()), tp, first_file)
    described.update({key: pieces_entry(shape, SAFETENSORS_DTYPES[dtype], pieces)
                      for key, (shape, dtype, pieces) in kept_described.items()})  # fmt: skip
    owners = dict.fromkeys(described, mesh.stage)
    if mesh.num_stages > 1:  # a tied weight of the first and last stage is written by the first
        owners, described = stage_owners(mesh, described)
    written = {key: e for key, e in entries.items()
               if owners[key] == mesh.stage and (tp.rank == 0 or not e.layout.is_replicated)}  # fmt: skip
    tensors = {key: tensor_of(model, e.name) for key, e in written.items()}  # FSDP's: sharded, their shape whole
    shapes = {key: (tuple(t.shape), t.dtype) for key, t in tensors.items()}
    shapes.update({key: (tuple(t.shape), t.dtype) for key, t in kept.items()})
    os.makedirs(out_dir, exist_ok=True)
    with LayerwiseUnshard(model, masters=state.compute_dtype is not None) as unsharding:  # one layer at a time
        if mesh.holds_copy:  # a sequence- or data-parallel copy of the TP shards another rank writes
            for e in written.values():
                unsharding.need(e.name)
            mesh.barrier()
        else:
            with Staging(out_dir) as staging:
                writer = SafetensorsWriter(staging.new_file(names[first_file + tp.rank]), shapes)
                for key, e in written.items():
                    unsharding.need(e.name)
                    writer.write(key, unsharding.tensor(e.name).detach())
                for key, tensor in kept.items():
                    writer.write(key, tensor)
                writer.close()
                mesh.barrier()  # every rank's file is complete; a rank that died makes this raise on the others
                staging.commit()
    mesh.barrier()
    if mesh.is_main:
        _write_manifest(model, state, out_dir, names, save_id, described)
    mesh.barrier()


def _write_manifest(model, state, out_dir: str, names: list[str], save_id: str, described: dict) -> None:
    """Rank 0's part, once every rank's file is in place: the manifest that says where each tensor's
    pieces are, files of earlier saves removed, and the config."""
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": len(names),
        "save_id": save_id,
        "files": names,
        "tensors": described,
    }
    with Staging(out_dir) as staging:
        with open(staging.new_file(MANIFEST_FILE), "w") as f:
            json.dump(manifest, f, indent=1)
        remove_stale(out_dir, set(staging.commit()) | set(names))
    save_config(model, out_dir, state.quantization_config if state.keep_quantized else None)
