"""A ``pytorch_model.bin`` read like a safetensors file: ``get_slice``, shapes and dtypes, through
``torch.load(weights_only=True)`` (memory-mapped where the file is in the zip format, so a rank touches
only the pages of its own slices). Only ever opened with ``allow_pickle=True``: unpickling can run code."""

from __future__ import annotations

import torch

from ..core.errors import CheckpointError


class PickleFile:
    """A ``pytorch_model.bin`` opened like a safetensors handle (``get_slice``), via
    ``torch.load(weights_only=True)``; memory-mapped when the file is in the zip format."""

    def __init__(self, file: str):
        try:
            try:
                tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as error:
                if "mmap" not in str(error):
                    raise
                tensors = torch.load(file, map_location="cpu", weights_only=True)  # legacy format: no mmap
        except Exception as error:  # torch.load raises many types on hostile bytes; all mean "refused"
            raise CheckpointError(
                f"{file}: torch.load(weights_only=True) refused it: {type(error).__name__}: {error}"
            ) from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise CheckpointError(f"{file}: not a state dict (a dict of tensor names to tensors)")
        self.tensors = tensors

    def get_slice(self, key: str) -> "_TensorSlice":
        return _TensorSlice(self.tensors[key])


class _TensorSlice:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self):
        return list(self.tensor.shape)

    def get_dtype(self) -> torch.dtype:
        return self.tensor.dtype

    def __getitem__(self, index):
        return self.tensor[index]
