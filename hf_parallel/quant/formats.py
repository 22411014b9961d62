"""Which quantization formats hf_parallel reads, chosen from the config before any weight is read, and the
dispatch to each format's module (``scaled_fp8``, ``compressed_tensors``, ``mxfp4``, ``gptq_awq``): its
key names, and its weights read like safetensors slices. By default the model holds plain floats in the dtype
asked for (as transformers does on a CPU) and saves them so, without ``quantization_config``; with
``keep_quantized=True`` each rank holds its boxes as stored (``quant/kept.py``) and saves them back as the
checkpoint had them. A new format is a new module and a line in ``read_quantization`` and ``readable``."""

from __future__ import annotations

from ..core.dtypes import torch_dtype
from ..core.errors import CheckpointError
from . import compressed_tensors, gptq_awq
from .base import Dequantized, config_text, refused
from .compressed_tensors import DequantizedIntegers, PackedIntegers
from .gptq_awq import DequantizedGrouped, GroupedIntegers
from .mxfp4 import MXFP4, DequantizedMXFP4
from .scaled_fp8 import FP8, DequantizedFP8, ScaledFP8

ACTIVATION_SCALE = "input_scale"  # static activation scales: unused once the weights are dequantized


PARTS = ("_scale_inv", "_scale", "_blocks", "_scales", "_packed", "_zero_point", "_shape",  # every format's parts
         ".qweight", ".qzeros", ".scales", ".g_idx")


Quantization = ScaledFP8 | PackedIntegers | MXFP4 | GroupedIntegers


def _config_getter(quantization):
    """``get(key, default)`` on a ``quantization_config`` as a dict or as transformers' config object."""
    if isinstance(quantization, dict):
        return quantization.get
    return lambda key, default=None: getattr(quantization, key, default)


def quant_method(config) -> str | None:
    """The ``quant_method`` a config declares, lower-case (None: no quantization_config)."""
    quantization = getattr(config, "quantization_config", None)
    return config_text(_config_getter(quantization)("quant_method")) if quantization else None


def read_quantization(config) -> Quantization | None:
    """The quantization a config declares (None: none), removed from the config (a model holding floats
    saves none; one holding its weights kept quantized saves the original back); anything hf_parallel does
    not read is refused by name, before any weight is read."""
    method = quant_method(config)
    if method is None:
        return None
    get = _config_getter(config.quantization_config)
    block = get("weight_block_size")
    if method == "compressed-tensors":
        found = compressed_tensors.read_config(config, get)
    elif method in ("gptq", "awq"):
        found = gptq_awq.read_config(config, get, method)
    elif method == "fp8" and block:
        found = ScaledFP8("block", tuple(int(n) for n in block), "_scale_inv")
    elif method == "mxfp4":
        found = MXFP4()
    else:
        raise refused(config, f"quant_method={method!r}" + (", per-tensor (no weight_block_size)" * (method == "fp8")))
    del config.quantization_config
    return found


def stored_in_parts(key: str, files, quantization: Quantization | None) -> bool:
    """Whether the weight ``key`` is stored in parts in ``files`` (``<name>_packed``, ``<name>_blocks``,
    ``<module>.qweight``): its format's marking part is there, and it is this key's (a GPTQ module's bias shares
    the module, not the qweight)."""
    stored_as = getattr(quantization, "stored_as", None)
    if not stored_as:
        return False
    stored = quantization.part_key(key, stored_as)
    return stored in files and quantization.weight_key(stored) == key


def with_stored_keys(files: dict[str, str], quantization: Quantization | None) -> dict[str, str]:
    """``files`` (checkpoint key -> file) with each weight stored in parts under its own key too
    (``<name>_packed`` / ``<name>_blocks`` -> ``<name>``, ``<module>.qweight`` -> ``<module>.weight``), so it
    maps to its parameter like any key."""
    if not getattr(quantization, "stored_as", None):
        return files
    out = dict(files)
    for key, file in files.items():
        weight = quantization.weight_key(key)
        if quantization.part_key(weight, quantization.stored_as) == key:  # key is a weight's marking part
            out.setdefault(weight, file)
    return out


def activation_scale(key: str) -> str:
    """The static activation scale of the module whose weight is ``key``."""
    return f"{key.rpartition('.')[0]}.{ACTIVATION_SCALE}"


def companion_keys(key: str, quantization: Quantization | None) -> set[str]:
    """The keys read with the weight ``key`` in the checkpoint's format (its scales, zero points, packed
    parts) or made moot by its dequantization (an FP8 module's activation scale); none without one."""
    if quantization is None:
        return set()
    moot = {activation_scale(key)} if isinstance(quantization, ScaledFP8) else set()
    return {quantization.part_key(key, part) for part in quantization.parts} | moot


def readable(handle, files: dict[str, str], key: str, quantization: Quantization | None):
    """``key``'s safetensors slice (``handle(file)``: the file opened), or, stored quantized, a
    ``Dequantized`` of it. A float8 weight without its scale, or FP8 in a checkpoint whose config
    declares no quantization, is refused by name."""
    if stored_in_parts(key, files, quantization):

        def part(name):
            found = quantization.part_key(key, name)
            return handle(files[found]).get_slice(found) if found in files else None

        if isinstance(quantization, GroupedIntegers):
            return DequantizedGrouped(key, part, quantization)
        if isinstance(quantization, MXFP4):
            if part("_scales") is None:
                _missing(files, key, "_scales")
            return DequantizedMXFP4(key, part("_blocks"), part("_scales"))
        for needed in ("_scale", "_shape"):
            if part(needed) is None:
                _missing(files, key, needed)
        return DequantizedIntegers(key, part, quantization)
    weight = handle(files[key]).get_slice(key)
    dtype = weight.get_dtype()  # safetensors' code, or a torch dtype (a pickle checkpoint's)
    if torch_dtype(dtype) not in FP8:
        return weight
    scale = key + quantization.suffix if isinstance(quantization, ScaledFP8) else None
    if scale not in files:
        missing = f"{scale!r} beside it" if scale else "quantization_config in the config"
        if quantization is not None and scale is None:
            missing = f"FP8 in its quantization_config ({type(quantization).__name__})"
        raise CheckpointError(
            f"{files[key]}: {key!r} is {weight.get_dtype()} with no {missing}: its scales are unknown, so its values "
            "would load wrong"
        )
    return DequantizedFP8(key, weight, handle(files[scale]).get_slice(scale), quantization)


def _missing(files: dict[str, str], key: str, suffix: str):
    raise CheckpointError(f"{files[key]}: {key!r} is stored quantized with no {key + suffix!r} beside it")


def dequantized_sources(files: dict[str, str], sources: dict, handle, quantization: Quantization | None) -> dict:
    """Parameter name -> ``Dequantized`` for every parameter read from one key stored quantized
    (per-expert keys are dequantized tile by tile: ``ShardReader.fused``)."""
    out = {}
    for name, key in sources.items():
        if isinstance(key, str):
            found = readable(handle, files, key, quantization)
            if isinstance(found, Dequantized):
                out[name] = found
    return out
