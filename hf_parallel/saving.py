"""Save a sharded model as a standard checkpoint: gather tensor by tensor, write on rank 0.

Rank 0 streams each tensor into its safetensors file as soon as it is assembled, so its memory
stays near its own shard plus one full tensor plus one received shard. Files are written under
temporary names in the target directory and renamed only once every file is complete: an
interrupted save never leaves a half-written file with a final name, nor destroys a previous
checkpoint's files.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import torch
import torch.distributed as dist
from huggingface_hub import split_state_dict_into_shards_factory
from tqdm.auto import tqdm

from .layout import Layout
from .loading import INDEX_FILE
from .mesh import Mesh

# safetensors dtype names (https://github.com/huggingface/safetensors, format spec)
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def gather_to_main(local: torch.Tensor, layout: Layout, full_shape, mesh: Mesh) -> torch.Tensor | None:
    """The full tensor on rank 0 (None elsewhere). Rank 0 receives one shard at a time and places
    it, so it holds the full tensor plus one shard, never every shard at once."""
    if layout.is_replicated or mesh.world_size == 1:
        return local if mesh.is_main else None
    if not mesh.is_main:
        dist.send(local.detach().cpu().contiguous(), dst=0, group=mesh.group)
        return None

    def shards():
        yield local.detach().cpu()
        for rank in range(1, mesh.world_size):
            shard = torch.empty(layout.local_shape(full_shape, rank), dtype=local.dtype)
            dist.recv(shard, src=rank, group=mesh.group)
            yield shard

    return layout.assemble(shards(), full_shape)


class SafetensorsWriter:
    """Writes one safetensors file tensor by tensor, in the order the header was declared."""

    def __init__(self, path: str, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]):
        header, offset = {}, 0
        for key, (shape, dtype) in specs.items():
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[key] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.pending = list(specs.items())
        self.file = open(path, "wb")
        self.file.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        expected_key, (shape, dtype) = self.pending.pop(0)
        if key != expected_key or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RuntimeError(
                f"writer expected {expected_key} {shape} {dtype}, got {key} {tuple(tensor.shape)} {tensor.dtype}"
            )
        self.file.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # no copy

    def close(self) -> None:
        if self.pending:
            raise RuntimeError(f"safetensors file closed with {len(self.pending)} tensor(s) unwritten")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def plan_files(specs: dict, max_shard_size) -> tuple[dict[str, list[str]], dict | None]:
    """File name -> keys, and the index (None for a single file), as transformers names them."""
    split = split_state_dict_into_shards_factory(
        specs,
        get_storage_size=lambda spec: math.prod(spec[0]) * torch.empty((), dtype=spec[1]).element_size(),
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    if not split.is_sharded:
        return split.filename_to_tensors, None
    index = {
        "metadata": {
            "total_size": sum(math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in specs.values())
        },
        "weight_map": split.tensor_to_filename,
    }
    return split.filename_to_tensors, index


def _remove_stale(out_dir: str, written: set[str]) -> None:
    """Drop weight files of an earlier save that the new one does not overwrite (as transformers does)."""
    for name in os.listdir(out_dir):
        is_weights = name.startswith("model") and name.endswith(".safetensors") or name == INDEX_FILE
        if is_weights and name not in written:
            os.remove(os.path.join(out_dir, name))


def save_sharded(model, out_dir: str, max_shard_size="50GB") -> None:
    """Gather every parameter under its checkpoint name and write a standard HF checkpoint."""
    state = model._hf_parallel
    mesh = state.mesh
    entries = {state.source_keys[e.name]: e for e in state.shard.unique_params()}
    specs = {key: (e.full_shape, model.get_parameter(e.name).dtype) for key, e in entries.items()}
    files, index = plan_files(specs, max_shard_size)
    if mesh.is_main:
        os.makedirs(out_dir, exist_ok=True)
    staged = []
    progress = tqdm(total=len(specs), desc="Saving", disable=not mesh.is_main, leave=False)
    for file_name, keys in files.items():
        writer = None
        if mesh.is_main:
            fd, tmp = tempfile.mkstemp(prefix=f".{file_name}.", suffix=".tmp", dir=out_dir)
            os.close(fd)
            staged.append((tmp, os.path.join(out_dir, file_name)))
            writer = SafetensorsWriter(tmp, {key: specs[key] for key in keys})
        for key in keys:
            entry = entries[key]
            full = gather_to_main(model.get_parameter(entry.name), entry.layout, entry.full_shape, mesh)
            if writer is not None:
                writer.write(key, full)
            progress.update()
        if writer is not None:
            writer.close()
    progress.close()
    if mesh.is_main:
        if index is not None:
            fd, tmp = tempfile.mkstemp(prefix=f".{INDEX_FILE}.", suffix=".tmp", dir=out_dir)
            with os.fdopen(fd, "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
            staged.append((tmp, os.path.join(out_dir, INDEX_FILE)))
        umask = os.umask(0)
        os.umask(umask)
        for tmp, final in staged:
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give what a plain open() would
            os.replace(tmp, final)
        _remove_stale(out_dir, {os.path.basename(final) for _, final in staged})
        model.config.save_pretrained(out_dir)
        if getattr(model, "generation_config", None) is not None and model.can_generate():
            model.generation_config.save_pretrained(out_dir)
    mesh.barrier()
