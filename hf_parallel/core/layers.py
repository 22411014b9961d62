"""Where a transformers model keeps its repeated layers: one owner for the discovery of plans, the
sequence split, the pipeline's stages and ``verify``'s per-layer comparison."""

from __future__ import annotations

from torch import nn


def repeated_layers(model: nn.Module) -> list[str]:
    """Paths of the repeated layers: children of outermost ModuleLists of one module class."""
    found, lists = [], []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or any(path.startswith(outer + ".") for outer in lists):
            continue
        if len(module) and len({type(child) for child in module}) == 1:
            lists.append(path)
            found += [f"{path}.{i}" for i in range(len(module))]
    return found


def find_layer_list(model: nn.Module) -> str:
    """The path of the decoder layers' ModuleList: from ``base_model_pp_plan`` where the model has
    one, else the module tree's outermost list of identical layers."""
    base_prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, base_prefix, model) if base_prefix else model
    prefix = f"{base_prefix}." if base is not model else ""
    config = getattr(model, "config", None)
    pp_plan = getattr(config, "base_model_pp_plan", None) if config is not None else None
    if not pp_plan and config is not None and hasattr(config, "get_text_config"):
        pp_plan = getattr(config.get_text_config(), "base_model_pp_plan", None)
    for name in pp_plan or {}:  # transformers' plan names the base model's children in forward order
        if isinstance(getattr(base, name, None), nn.ModuleList):
            return prefix + name
    layers = repeated_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no list of repeated layers (no base_model_pp_plan, no nn.ModuleList of "
            "identical blocks): there is nothing to split into pipeline stages"
        )
    return layers[0].rpartition(".")[0]
