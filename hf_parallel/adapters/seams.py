"""How hf_parallel learns what peft (or a user) does to a loaded model, and answers peft's own calls.

- torch's global module registration hook (every submodule ``setattr`` / ``add_module``) says when
  peft puts a wrapper where one of the model's modules was, or puts the module back (``unload``,
  ``merge_and_unload``): its hooks move (``placement.wrap`` / ``unwrap``). Any other module added to
  the model is watched: a trainable parameter in it is refused by name on its first forward that
  records gradients.
- ``place_and_check``: before gradients are used (``train_step``, the Trainer, a save), every
  adapter placed, and any trainable parameter hf_parallel did not place refused by name.
- ``PeftModel.save_pretrained`` on a parallel model gathers every adapter (every stage's) to rank 0,
  which writes peft's standard adapter; every rank calls it.
peft itself is never imported here: its methods are replaced (``compat/peft.py``) when a program
first imports it, before or after loading, so the refusals below do not depend on import order.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from ..compat import when_imported
from ..compat import peft as peft_internals
from ..compat.torch import on_module_registered
from ..state import is_parallel, parallel_model, parallel_state
from . import placement

_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (weakref to its state, its path)


def watch(model: nn.Module, state) -> None:
    """Follow every module of ``model`` (loaded by hf_parallel, with ``state``) as peft changes it."""
    _install_registration_hook()
    when_imported("peft", _wrap_peft)
    ref = weakref.ref(state)
    for path, module in model.named_modules():
        _WATCHED[module] = (ref, path)


@functools.cache
def _install_registration_hook() -> None:
    on_module_registered(_on_registered)


def _on_registered(parent: nn.Module, name: str, module):
    if torch.compiler.is_compiling():  # a traced forward registers only transformers' fresh slices of its
        return None  # layer list; looking them up would guard on every watched module (ms per call)
    watched = _WATCHED.get(parent)
    if watched is None or not isinstance(module, nn.Module):
        return None
    state = watched[0]()
    if state is None:
        return None
    path = f"{watched[1]}.{name}" if watched[1] else name
    known = _WATCHED.get(module)
    if hasattr(module, "get_base_layer"):  # a peft layer around one of the model's modules
        base = module.get_base_layer()
        held = [f"{path}.{attr}" for attr in base._parameters if f"{path}.{attr}" in state.kept]
        if held:
            raise ValueError(
                f"{path}: {type(module).__name__} around a weight held quantized ({held[0]}, keep_quantized=True): "
                "peft would build and merge on its placeholder; load without keep_quantized to add adapters"
            )
        if _WATCHED.get(base, (None, None))[1] == path:
            # refuses modules whose split adapters cannot follow
            site = placement.site_for(state.layout, path, base, state.hooks)
            if hasattr(module, "lora_A"):
                _wrap_peft()  # a second line of defence: in place since peft's import
                placement.wrap(state, site, module)
                _WATCHED[module] = (watched[0], path)
                return None
            if site.split != placement.WHOLE:
                raise ValueError(
                    f"{path}: {type(module).__module__}.{type(module).__name__} around a module split by "
                    f"{site.rule.style_name}: "
                    "hf_parallel places LoRA adapters on split modules, not this kind; use LoraConfig, or leave "
                    "it out of target_modules"
                )
    if known is not None and known[1] == path:  # one of the model's own modules put back
        placement.unwrap(state, path, module)
        return None
    module.register_forward_pre_hook(_refuse_trainable(watched[0], path))
    for sub, child in module.named_modules():
        _WATCHED.setdefault(child, (watched[0], f"{path}.{sub}" if sub else path))
    return None


def named_entries(model: nn.Module, state, prefix: str = ""):
    """(name, parameter, entry) for every parameter of ``model`` (each once): the entry found by
    the module that holds it under the path it had when loaded (peft's ``base_layer`` moved it),
    or by its name (an adapter); None: hf_parallel did not place it."""
    seen: set[int] = set()
    for name, module in model.named_modules(prefix=prefix):
        watched = _WATCHED.get(module)
        path = watched[1] if watched is not None else name
        for attr, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                yield f"{name}.{attr}" if name else attr, param, state.entry(f"{path}.{attr}" if path else attr)


def _refuse_trainable(state_ref, path: str):
    """A forward pre-hook for a module added to the model after loading: refuse, when gradients
    are recorded, the trainable parameters in it that hf_parallel did not place."""

    def hook(module, args):
        state = state_ref()
        if state is None or not torch.is_grad_enabled():
            return
        unplaced = [n for n, p, entry in named_entries(module, state, path) if p.requires_grad and entry is None]
        if unplaced:
            raise ValueError(_unplaced_message(unplaced))

    return hook


def _unplaced_message(names: list[str]) -> str:
    return (
        f"{', '.join(names[:5])}: trainable parameter(s) added after hf_parallel.from_pretrained placed the model, "
        "in no TP, SP or data-parallel gradient sum (hf_parallel places peft's LoRA adapters, nothing else it did "
        "not load); add them to the checkpoint, or freeze them with requires_grad=False"
    )


def place_and_check(model: nn.Module) -> None:
    """Every adapter placed, and every trainable parameter placed by hf_parallel or refused by name
    (every rank of the model calls it: placing broadcasts)."""
    model = parallel_model(model)
    state = parallel_state(model)
    placement.place(state, state.adapters.pending(model))
    unplaced = [name for name, p, entry in named_entries(model, state) if p.requires_grad and entry is None]
    if unplaced:
        raise ValueError(_unplaced_message(unplaced))


def _merge_on_shards(merge, tuner, *args, **kwargs):
    """peft merges each adapter into its base's weight in place: on a TP shard its slice of
    B A is that shard's (``placement``); FSDP's slices of the shards are DTensors it cannot add to."""
    state = parallel_state(tuner)
    if state.mesh.shape.dp > 1:
        raise ValueError(
            f"merging adapters into a model sharded by FSDP ({state.mesh.shape}): save the adapter, load the "
            "base without fsdp_size / dp_replicate_size, load the adapter onto it and merge there"
        )
    place_and_check(tuner)
    return merge(tuner, *args, **kwargs)


def _around_our_module(layer) -> bool:
    """Whether a peft layer is built around one of the modules of a model hf_parallel loaded."""
    watched = _WATCHED.get(layer.get_base_layer())
    return watched is not None and watched[0]() is not None


def _refuse_unsplittable(update_layer, layer, adapter_name, *args, **kwargs):
    """peft's ``update_layer`` (it builds and initialises an adapter) for a layer around one of the
    model's modules: an adapter that cannot follow the module's split is refused first, by name
    (peft's own initialisation of DoRA would fail on the shard with a bare size mismatch)."""
    base = layer.get_base_layer()
    state_ref, path = _WATCHED[base]
    site = placement.site_for(state_ref().layout, path, base)
    config = kwargs.get("config", args[2] if len(args) > 2 else None)
    variant = peft_internals.lora_variant(layer, config) if config is not None else None
    if site.split.side is not None and (variant is not None or getattr(config, "lora_bias", False)):
        used = type(variant).__name__ if variant is not None else "lora_bias"
        raise placement.variant_refused(path, adapter_name, used, site.rule.style_name)
    return update_layer(layer, adapter_name, *args, **kwargs)


def _unload(unload, tuner, merge=True, *args, **kwargs):
    if merge:
        return _merge_on_shards(unload, tuner, merge, *args, **kwargs)
    return unload(tuner, merge, *args, **kwargs)


@functools.cache
def _wrap_peft() -> None:
    peft_internals.wrap_peft(
        update_layer=_refuse_unsplittable, save_pretrained=save_adapters, merge=_merge_on_shards, unload=_unload,
        is_parallel=is_parallel, is_ours=_around_our_module,
    )  # fmt: skip


def save_adapters(save, peft_model, save_directory: str, *args, is_main_process: bool = True, **kwargs) -> None:
    """peft's ``save`` on rank 0 with every adapter matrix gathered whole; the other ranks send
    theirs. ``is_main_process`` is accepted and has no effect: rank 0 writes."""
    from ..checkpoint.saving import gathered_tensors

    if kwargs.get("state_dict") is not None:
        raise TypeError("save_pretrained(state_dict=...): hf_parallel gathers the adapters' own shards to save them")
    model = parallel_model(peft_model)
    state = parallel_state(model)
    place_and_check(model)
    entries = [state.adapters.entries[name] for name in sorted(state.adapters.entries)]
    full = gathered_tensors(model, state, entries)
    if full is not None:
        prefix = next(name for name, module in peft_model.named_modules() if module is model)
        kwargs["state_dict"] = {f"{prefix}.{name}": tensor for name, tensor in full.items()}
        save(peft_model, save_directory, *args, is_main_process=True, **kwargs)
        if state.mesh.num_stages > 1:
            write_every_stage(peft_model, save_directory, kwargs["state_dict"], kwargs.get("selected_adapters"))
    state.mesh.barrier()


def write_every_stage(peft_model, save_directory: str, gathered: dict, selected) -> None:
    """peft keeps only the adapters of the layers rank 0 holds (it walks its own modules): on
    pipeline stages each adapter's file is written again with every stage's matrices, under
    peft's own key names, replacing the file peft wrote only once complete."""
    import os

    from safetensors.torch import save_file

    for adapter in selected or list(peft_model.peft_config):
        peft_type = peft_model.peft_config[adapter].peft_type
        mine = {
            peft_internals.saved_adapter_key(peft_type, key, adapter): tensor.contiguous()
            for key, tensor in gathered.items()
            if f".{adapter}." in key or key.endswith(f".{adapter}")
        }
        directory = save_directory if adapter == "default" else os.path.join(save_directory, adapter)
        path = os.path.join(directory, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise ValueError(f"{path}: hf_parallel writes adapters of pipeline stages as safetensors only")
        save_file(mine, path + ".tmp", metadata={"format": "pt"})
        os.replace(path + ".tmp", path)
