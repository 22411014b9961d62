"""A loaded model's every tensor on this rank's device: the buffers and tensor attributes the checkpoint
did not hold moved there after the load, and the load's last check that nothing was left behind."""

from __future__ import annotations

import torch
from torch import nn

from .quant.kept import KeptPlaceholder


def _tensor_attributes(module: nn.Module):
    """A module's tensors that are neither parameters nor buffers (a cached table kept as an attribute)."""
    for name, value in vars(module).items():
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            yield name, value


def move_module_state(model: nn.Module, device: torch.device) -> None:
    """Every buffer (RoPE tables, position ids, BERT's token types, Gemma's embedding scale, Falcon-H1's
    ``mup_vector``, a bias the checkpoint did not hold) and tensor attribute of ``model`` onto ``device``.
    Parameters are read there already; a buffer left on the host is copied to the GPU by every forward
    that uses it (a host sync), or fails ("index is on cpu"), and keeps inductor from CUDA graphs."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta and buffer.device != device:
                module._buffers[name] = buffer.to(device)
        for name, value in list(_tensor_attributes(module)):
            if not value.is_meta and value.device != device:
                setattr(module, name, value.to(device))


def left_behind(model: nn.Module, device: torch.device, parameters: bool = True) -> list[str]:
    """The names of ``model``'s parameters, buffers and tensor attributes that are not on ``device``
    (meta placeholders of weights kept quantized excepted: their data lives beside them, on ``device``).
    ``parameters=False``: buffers and attributes only (FSDP keeps offloaded shards on the host)."""
    names = []
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        params = module._parameters.items() if parameters else ()
        held = [*params, *module._buffers.items(), *_tensor_attributes(module)]
        for name, tensor in held:
            if tensor is None or isinstance(tensor, KeptPlaceholder):
                continue
            if tensor.device != device:
                names.append(f"{prefix}{name} ({tensor.device})")
    return names


def check_on_device(model: nn.Module, device: torch.device, parameters: bool = True) -> None:
    """Refuse a model with anything off this rank's device, naming it (the load's last check)."""
    stray = left_behind(model, device, parameters)
    if stray:
        raise RuntimeError(
            f"hf_parallel: after loading, {len(stray)} tensor(s) are not on this rank's device {device}: "
            f"{', '.join(stray[:8])}{' ...' if len(stray) > 8 else ''}"
        )
