"""Every internal of peft hf_parallel uses, and why.

peft has no hook for "this base layer is split": its LoRA layers size, initialise, merge and save
adapters as if the base were whole. So on hf_parallel's models only (``wrap_peft``):
- ``update_layer`` (where an adapter is built) refuses, by name, a variant that cannot follow a split
  (DoRA, lora_bias) before peft's own initialisation fails with a bare size mismatch;
- ``PeftModel.save_pretrained`` receives the gathered adapters as its ``state_dict``;
- merging (``merge_adapter``, ``_unload_and_optionally_merge``) first places every adapter;
- on pipeline stages the adapter file is rewritten under peft's key names
  (``_remove_adapter_name_from_key``), since peft walks only the modules rank 0 holds.
The LoRA layer's containers (``lora_A`` ...) are read to place each matrix like its base module.
"""

from __future__ import annotations

import functools

from . import Seam

ADAPTER_LAYER_NAMES = Seam("peft", "peft.tuners.lora.layer:LoraLayer.adapter_layer_names",
                           "(the containers of an adapter's trainable matrices)")
LORA_LAYER = Seam(
    "peft", "peft.tuners.lora.layer:LoraLayer.__init__", "(the containers of a LoRA layer's matrices and variants)",
    reads=("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_variant", "lora_bias"),
)  # fmt: skip
UPDATE_LAYER = Seam("peft", "peft.tuners.lora.layer:LoraLayer.update_layer", "(where an adapter is built)",
                    parameters=("adapter_name", "r", "lora_alpha", "config"))  # fmt: skip
RESOLVE_VARIANT = Seam("peft", "peft.tuners.lora.layer:LoraLayer.resolve_lora_variant",
                       "(the variant, DoRA or another, a config asks for)", parameters=("config",))  # fmt: skip
SAVE_PRETRAINED = Seam("peft", "peft:PeftModel.save_pretrained", "(saves the gathered adapters)",
                       parameters=("save_directory", "selected_adapters", "is_main_process", "kwargs"))  # fmt: skip
MERGE_ADAPTER = Seam("peft", "peft.tuners.tuners_utils:BaseTuner.merge_adapter", "(merges adapters in place)",
                     parameters=("adapter_names", "safe_merge"))  # fmt: skip
UNLOAD = Seam("peft", "peft.tuners.tuners_utils:BaseTuner._unload_and_optionally_merge",
              "(merge_and_unload and unload go through it)", parameters=("merge",))  # fmt: skip
TUNERS = Seam("peft", "peft.mapping:PEFT_TYPE_TO_TUNER_MAPPING", "(a peft type's tuner class)")
ADAPTER_KEY = Seam("peft", "peft.tuners.tuners_utils:BaseTuner._remove_adapter_name_from_key",
                   "(peft's saved key of an adapter matrix)", parameters=("key", "adapter_name"))  # fmt: skip


def lora_layer_classes() -> list[type]:
    """peft's LoRA layer classes that define their own ``update_layer``."""
    from peft.tuners.lora import layer

    LORA_LAYER.get(), ADAPTER_LAYER_NAMES.get()
    return [cls for cls in vars(layer).values() if isinstance(cls, type) and issubclass(cls, layer.LoraLayer)
            and "update_layer" in vars(cls)]  # fmt: skip


def lora_variant(layer, config):
    """The variant (DoRA, ...) ``config`` asks ``layer`` for, or None for plain LoRA."""
    RESOLVE_VARIANT.get()
    return layer.resolve_lora_variant(config=config)


def saved_adapter_key(peft_type, key: str, adapter: str) -> str:
    ADAPTER_KEY.get()
    return TUNERS.get()[peft_type]._remove_adapter_name_from_key(key, adapter)


def _replace(cls, name: str, seam: Seam, replacement, applies) -> None:
    """``cls.name`` runs ``replacement(original, self, ...)`` where ``applies(self)``, else as before."""
    seam.get()
    original = vars(cls)[name]

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if applies(self):
            return replacement(original, self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(cls, name, method)


def wrap_peft(*, update_layer, save_pretrained, merge, unload, is_parallel, is_ours) -> None:
    """Install the replacements above (call once per process): ``update_layer`` for layers around one of
    hf_parallel's modules (``is_ours(layer)``), the others for hf_parallel's models (``is_parallel``)."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    for cls in lora_layer_classes():
        _replace(cls, "update_layer", UPDATE_LAYER, update_layer, is_ours)
    _replace(PeftModel, "save_pretrained", SAVE_PRETRAINED, save_pretrained, is_parallel)
    _replace(BaseTuner, "merge_adapter", MERGE_ADAPTER, merge, is_parallel)
    _replace(BaseTuner, "_unload_and_optionally_merge", UNLOAD, unload, is_parallel)
