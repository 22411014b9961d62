"""Tiny random checkpoints of transformers' own classes, saved as safetensors (fp32)."""

from __future__ import annotations

import os

import torch

COMMON = dict(
    vocab_size=101, num_hidden_layers=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2
)

# name -> (config class, overrides). Head counts chosen to hit every head-split regime: uneven whole
# KV groups (9/3 at tp=2), KV heads replicated unevenly (9/3 at tp=4, 6/2 at tp=3) and evenly (8/2 at tp=4).
# fmt: off
ARCHS = {
    "llama": ("LlamaConfig", dict(hidden_size=72, intermediate_size=100, num_attention_heads=9, num_key_value_heads=3, head_dim=8, tie_word_embeddings=False)),  # noqa: E501
    "llama_tied_kvrep": ("LlamaConfig", dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)),  # noqa: E501
    "mistral": ("MistralConfig", dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4, head_dim=8, sliding_window=4)),  # noqa: E501
    "qwen2": ("Qwen2Config", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)),  # noqa: E501
    "qwen3": ("Qwen3Config", dict(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4, head_dim=8, tie_word_embeddings=False)),  # noqa: E501
    "gemma2": ("Gemma2Config", dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4, query_pre_attn_scalar=16)),  # noqa: E501
    "phi3": ("Phi3Config", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=3, original_max_position_embeddings=64)),  # noqa: E501
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, tie_word_embeddings=False)),  # noqa: E501
    "olmo2": ("Olmo2Config", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=3)),
    "starcoder2": ("Starcoder2Config", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2, use_bias=True)),  # noqa: E501
    # families transformers ships no TP plan for (curated plans/ files; discovery in variant_plans)
    "gpt2": ("GPT2Config", dict(n_embd=48, n_head=6, n_inner=80)),
    "opt": ("OPTConfig", dict(hidden_size=48, num_attention_heads=6, ffn_dim=80, word_embed_proj_dim=48)),
    "falcon_new": ("FalconConfig", dict(hidden_size=64, num_attention_heads=8, num_kv_heads=2, new_decoder_architecture=True)),  # noqa: E501
    "falcon_multi_query": ("FalconConfig", dict(hidden_size=48, num_attention_heads=6, multi_query=True, new_decoder_architecture=False, parallel_attn=True)),  # noqa: E501
    "falcon_alibi": ("FalconConfig", dict(hidden_size=48, num_attention_heads=6, multi_query=False, new_decoder_architecture=False, parallel_attn=False, alibi=True, bias=True)),  # noqa: E501
    "bloom": ("BloomConfig", dict(hidden_size=48, n_head=6)),
    "gptj": ("GPTJConfig", dict(n_embd=48, n_head=6, rotary_dim=4, n_inner=80, tie_word_embeddings=False)),
    "stablelm": ("StableLmConfig", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2, use_qkv_bias=True)),  # noqa: E501
}
MOE = {  # per-expert keys on disk, fused 3-D experts in memory
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=48, intermediate_size=80, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)),  # noqa: E501
    "qwen2_moe": ("Qwen2MoeConfig", dict(hidden_size=48, intermediate_size=80, moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2, num_attention_heads=6, num_key_value_heads=2)),  # noqa: E501
    "mixtral": ("MixtralConfig", dict(hidden_size=48, intermediate_size=40, num_local_experts=4, num_experts_per_tok=2, num_attention_heads=6, num_key_value_heads=2)),  # noqa: E501
    "gpt_oss": ("GptOssConfig", dict(hidden_size=48, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8, sliding_window=4, tie_word_embeddings=False, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, original_max_position_embeddings=2, beta_fast=32.0, beta_slow=1.0, truncate=False))),  # noqa: E501
    "deepseek_v3": ("DeepseekV3Config", dict(hidden_size=48, intermediate_size=80, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1, num_attention_heads=6, num_key_value_heads=6, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, tie_word_embeddings=False)),  # noqa: E501
    "olmoe": ("OlmoeConfig", dict(hidden_size=48, intermediate_size=40, num_experts=4, num_experts_per_tok=2, num_attention_heads=6, num_key_value_heads=6)),  # noqa: E501
}
ENCODERS = {  # AutoModel checkpoints (last hidden state compared instead of logits)
    "bert": ("BertConfig", dict(hidden_size=48, num_attention_heads=6, intermediate_size=80, max_position_embeddings=64)),  # noqa: E501
}
# Config traps: attributes a family never reads, aliases, explicit head sizes, multi-query, partial rotary.
# The heads must come from what each model computes with (hf_parallel/tensor/geometry.py), never a wrong number.
TRAPS = {
    "gpt2_stray_kv": ("GPT2Config", dict(n_embd=48, n_head=6, n_inner=80, num_key_value_heads=2, intermediate_size=128)),  # noqa: E501
    "gpt_neox_stray_kv": ("GPTNeoXConfig", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)),  # noqa: E501
    "bloom_stray_kv": ("BloomConfig", dict(hidden_size=48, n_head=6, num_key_value_heads=2, intermediate_size=128)),  # noqa: E501
    "gptj_aliases": ("GPTJConfig", dict(hidden_size=48, num_attention_heads=6, rotary_dim=4, n_inner=80, tie_word_embeddings=False)),  # noqa: E501
    "gpt2_kv_none": ("GPT2Config", dict(n_embd=48, n_head=6, n_inner=80, num_key_value_heads=None)),
    "llama_head_dim_not_hidden_over_heads": ("LlamaConfig", dict(hidden_size=48, intermediate_size=80, num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),  # noqa: E501
    "llama_kv_none": ("LlamaConfig", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=None, tie_word_embeddings=False)),  # noqa: E501
    "llama_multi_query": ("LlamaConfig", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=1, tie_word_embeddings=False)),  # noqa: E501
    "gpt_bigcode_multi_query": ("GPTBigCodeConfig", dict(n_embd=48, n_head=6, n_inner=80, multi_query=True)),
    "phi_partial_rotary": ("PhiConfig", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, partial_rotary_factor=0.5, tie_word_embeddings=False)),  # noqa: E501
    "stablelm_partial_rotary": ("StableLmConfig", dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=3, partial_rotary_factor=0.5, num_key_value_groups=7)),  # noqa: E501
}
PIPELINE = {  # more layers than stages, uneven over 2 and 3 stages; one tied embedding (first/last stage)
    "pp_llama": ("LlamaConfig", dict(ARCHS["llama"][1], num_hidden_layers=5)),
    "pp_qwen3": ("Qwen3Config", dict(ARCHS["qwen3"][1], num_hidden_layers=4)),
    "pp_qwen2_moe": ("Qwen2MoeConfig", dict(MOE["qwen2_moe"][1], num_hidden_layers=4)),
    "pp_tied": ("LlamaConfig", dict(ARCHS["llama_tied_kvrep"][1], num_hidden_layers=4)),
}
FEW_EXPERTS = {  # fewer experts per rank than ranks holding the same ones (ep_size): FSDP shards each expert's rows
    "qwen2_moe_2experts": ("Qwen2MoeConfig", dict(MOE["qwen2_moe"][1], num_experts=2, num_experts_per_tok=1)),
}
# Hybrids: recurrent mixers (Mamba-1/2, Gated DeltaNet, short convolutions) beside attention. Group regimes:
# B/C groups (Mamba-2) or key heads (DeltaNet) whole per rank, one group shared by all ranks (n_groups=1: its
# norm's sum of squares summed), and shared by some (2 groups at TP=3: subgroups); heads uneven at TP=3.
HYBRID_ATTENTION = dict(hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2,
                        tie_word_embeddings=False)
DELTANET = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"], head_dim=8)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=12, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4)
MAMBA1 = dict(hidden_size=48, state_size=8, expand=2, time_step_rank=8, conv_kernel=4)
HYBRIDS = {
    "falcon_h1": ("FalconH1Config", dict(HYBRID_ATTENTION, head_dim=8, **dict(MAMBA2, mamba_d_head=8), mamba_d_ssm=64,
                                         mamba_rms_norm=True)),
    "bamba": ("BambaConfig", dict(HYBRID_ATTENTION, **MAMBA2, attn_layer_indices=[1])),
    "nemotron_h": ("NemotronHConfig", dict(HYBRID_ATTENTION, num_hidden_layers=3, head_dim=8, mamba_num_heads=8,
                                           mamba_head_dim=8, n_groups=2, ssm_state_size=8, conv_kernel=4, chunk_size=4,
                                           layers_block_type=["mamba", "attention", "mlp"])),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(HYBRID_ATTENTION, **MAMBA2, shared_intermediate_size=80,
                                                        intermediate_size=32, num_local_experts=4,
                                                        num_experts_per_tok=2, layer_types=["mamba", "attention"])),
    "jamba": ("JambaConfig", dict(HYBRID_ATTENTION, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8,
                                  num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                  attn_layer_period=2, attn_layer_offset=1)),
    "qwen3_next": ("Qwen3NextConfig", dict(HYBRID_ATTENTION, **DELTANET, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2)),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(HYBRID_ATTENTION, **DELTANET)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(HYBRID_ATTENTION, **DELTANET, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=40, num_experts=4,
                                                      num_experts_per_tok=2)),
    "lfm2": ("Lfm2Config", dict(HYBRID_ATTENTION, conv_L_cache=3, layer_types=["conv", "full_attention"])),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", dict(HYBRID_ATTENTION, head_dim=8)),  # no shipped plan: discovery
    # attention-free, embedding tied to the LM head
    "mamba": ("MambaConfig", MAMBA1),
    "falcon_mamba": ("FalconMambaConfig", MAMBA1),
}
DISCOVERED = ["gpt2", "opt", "falcon_new", "falcon_multi_query", "falcon_alibi", "bloom", "gptj", "stablelm"]
# fmt: on


FP8_BLOCK = (32, 32)
FP8 = {  # FP8 with 32 x 32 block scales (DeepSeek-V3 / Qwen3-FP8's format): dims in whole blocks, shards not
    "llama_fp8": ("LlamaConfig", dict(hidden_size=96, intermediate_size=160, num_attention_heads=6,
                                      num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    "phi3_fp8": ("Phi3Config", dict(hidden_size=96, intermediate_size=160, num_attention_heads=6,
                                    num_key_value_heads=2)),  # packed q|k|v, gate|up
    "qwen3_moe_fp8": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                             num_experts=4, num_experts_per_tok=2, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
    # dims that are not whole blocks (80 = 2.5 blocks, 144 = 4.5, one 16-row KV head): the last block is partial
    "llama_fp8_partial": ("LlamaConfig", dict(hidden_size=80, intermediate_size=144, num_attention_heads=5,
                                              num_key_value_heads=1, head_dim=16, tie_word_embeddings=False)),
    # power-of-two scales stored as float8_e8m0fnu (DeepSeek-V3.1's scale_fmt "ue8m0")
    "llama_fp8_ue8m0": ("LlamaConfig", dict(hidden_size=96, intermediate_size=160, num_attention_heads=6,
                                            num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)),
}  # fmt: skip
# 128 x 128 blocks, as Hopper's block-scaled FP8 products take them (``tensor/fp8_matmul.py``): at TP=2 the
# query, gate, up and down shards are whole blocks with a contraction of 4 (multiplied in FP8), the output
# projection's contraction 2 blocks (in FP8 where torch reads such scales right: not 2.11), the key and value
# shards half a block each (dequantized per module)
FP8_PRODUCTS = {"llama_fp8_128": ("LlamaConfig", dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                                                      num_key_value_heads=2, head_dim=64, tie_word_embeddings=False))}
FP8_PRODUCT_BLOCK = (128, 128)


def quantize_fp8(tensors: dict, block=FP8_BLOCK, ue8m0: bool = False) -> tuple[dict, dict, bool]:
    """Every decoder matrix (the MoE router left whole) as FP8 releases store it: float8_e4m3fn with a float32
    ``weight_scale_inv`` per block (``W ~ q * s``; power-of-two scales stored as e8m0 with ``ue8m0``). Returns
    the quantized tensors, the same weights dequantized as floats, and whether a dim ends in a partial block."""
    bm, bn = block
    quantized, dequantized, partial = dict(tensors), dict(tensors), False
    matrices = [k for k, w in tensors.items() if w.dim() == 2 and ".layers." in k]
    for key in [k for k in matrices if not k.endswith("mlp.gate.weight")]:
        rows, cols = tensors[key].shape
        partial |= rows % bm != 0 or cols % bn != 0
        padded = torch.zeros(-(-rows // bm) * bm, -(-cols // bn) * bn)  # the last blocks' missing rows: zeros
        padded[:rows, :cols] = tensors[key]
        blocks = padded.reshape(padded.shape[0] // bm, bm, padded.shape[1] // bn, bn)
        scale = blocks.abs().amax(dim=(1, 3)) / torch.finfo(torch.float8_e4m3fn).max
        if ue8m0:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols].to(torch.float8_e4m3fn)
        quantized[key] = q
        quantized[key + "_scale_inv"] = scale.to(torch.float8_e8m0fnu if ue8m0 else torch.float32).contiguous()
        dequantized[key] = q.float() * scale.repeat_interleave(bm, 0).repeat_interleave(bn, 1)[:rows, :cols]
    return quantized, dequantized, partial


def fp8_config(path: str, block=FP8_BLOCK, ue8m0: bool = False) -> None:
    import json

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(block),
                                     "activation_scheme": "dynamic", **({"scale_fmt": "ue8m0"} if ue8m0 else {})}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def make_fp8_checkpoint(name: str, root: str) -> str:
    """``name`` of FP8 as its releases store it (``quantize_fp8``), and the config's ``quantization_config``.
    Where plain transformers cannot be the reference (partial blocks, e8m0 scales), the dequantized weights
    beside it as ``<path>_dequantized``."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    make_checkpoint(name, root)
    file, ue8m0 = os.path.join(path, "model.safetensors"), name.endswith("ue8m0")
    block = FP8_PRODUCT_BLOCK if name in FP8_PRODUCTS else FP8_BLOCK
    tensors, dequantized, partial = quantize_fp8(load_file(file), block=block, ue8m0=ue8m0)
    save_file(tensors, file, metadata={"format": "pt"})
    if partial or ue8m0:  # plain transformers' own FP8 loader assumes whole blocks of float32 scales: the
        plain = path + "_dequantized"  # reference is the same weights dequantized, saved as floats
        shutil.copytree(path, plain)
        save_file(dequantized, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    fp8_config(path, block=block, ue8m0=ue8m0)
    return path


def _float_twin(name: str, model: str, root: str):
    """(path, path of its dequantized twin, the float ``model``'s tensors to quantize), both directories
    made as copies of the float checkpoint; the tensors None when both exist already."""
    import shutil

    from safetensors.torch import load_file

    path, plain = os.path.join(root, name), os.path.join(root, name + "_dequantized")
    if os.path.isfile(os.path.join(plain, "config.json")):
        return path, plain, None
    source = make_checkpoint(model, os.path.join(root, "float"))
    for target in (path, plain):
        shutil.copytree(source, target, dirs_exist_ok=True)
    return path, plain, load_file(os.path.join(source, "model.safetensors"))


def _write_twins(path: str, plain: str, quantized: dict, dequantized: dict, form: str, weights: dict):
    """Both checkpoints' tensors, and the quantized one's compressed-tensors config (``form``, one group of
    ``weights`` on every Linear but the LM head): the two paths."""
    import json

    from safetensors.torch import save_file

    save_file(quantized, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": form, "ignore": ["lm_head"],
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": weights}},
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path, plain


COMPRESSED = {  # compressed-tensors' float-quantized FP8 (the *-FP8-dynamic repacks): name -> (model, strategy)
    "llama_ct_channel": ("llama_fp8", "channel"),
    "llama_ct_tensor": ("llama_fp8", "tensor"),
}


def make_compressed_checkpoint(name: str, root: str) -> tuple[str, str]:
    """``name`` as compressed-tensors stores FP8 (float8_e4m3fn weights, a bf16 ``weight_scale`` per output
    row or per tensor, the LM head left whole), and beside it the same weights dequantized as plain floats
    (what plain transformers reads as the reference): the two paths."""
    model, strategy = COMPRESSED[name]
    path, plain, tensors = _float_twin(name, model, root)
    if tensors is None:
        return path, plain
    quantized, dequantized = dict(tensors), dict(tensors)
    for key in [k for k, w in tensors.items() if w.dim() == 2 and ".layers." in k]:
        weight = tensors[key]
        amax = weight.abs().amax(dim=1, keepdim=True) if strategy == "channel" else weight.abs().amax().reshape(1)
        scale = (amax / torch.finfo(torch.float8_e4m3fn).max).to(torch.bfloat16)
        q = (weight / scale.float().reshape(-1, 1) if strategy == "channel" else weight / scale.float()).to(
            torch.float8_e4m3fn
        )
        quantized[key], quantized[key + "_scale"] = q, scale
        dequantized[key] = q.float() * (scale.float() if strategy == "tensor" else scale.float().reshape(-1, 1))
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False}
    return _write_twins(path, plain, quantized, dequantized, "float-quantized", weights)



PACKED = {  # compressed-tensors' pack-quantized integers (the *-W4A16 / *-W8A16 repacks), group size 32:
    # name -> (model, bits, strategy, symmetric); shards cut inside groups and int32 words (160 at TP=3: 54/53/53)
    "llama_w4_group": ("llama_fp8", 4, "group", True),
    "llama_w8_channel": ("llama_fp8", 8, "channel", True),
    "llama_w4_zero_point": ("llama_fp8_partial", 4, "group", False),  # asymmetric; 80 and 144: a partial group
    "qwen3_moe_w4_group": ("qwen3_moe_fp8", 4, "group", True),  # per-expert keys
}
PACKED_GROUP = 32
PACKED_INT4_KERNEL = {  # read by the int4 kernel's test alone: a scale and zero point per output row, 4 bits
    "llama_w4_channel_zero_point": ("llama_fp8", 4, "channel", False),
}


def make_packed_checkpoint(name: str, root: str) -> tuple[str, str]:
    """``name`` as compressed-tensors stores pack-quantized integer weights (its own ``pack_to_int32``: int32
    ``weight_packed``, a bf16 ``weight_scale`` per row and group, ``weight_zero_point`` packed along the rows
    where asymmetric, ``weight_shape``; the LM head left whole), and beside it the same weights dequantized as
    plain floats: the two paths."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    model, bits, strategy, symmetric = {**PACKED, **PACKED_INT4_KERNEL}[name]
    path, plain, tensors = _float_twin(name, model, root)
    if tensors is None:
        return path, plain
    quantized, dequantized, low, high = dict(tensors), dict(tensors), -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    matrices = [k for k, w in tensors.items() if w.dim() == 2 and ".layers." in k and not k.endswith("mlp.gate.weight")]
    for key in matrices:  # the router stays whole
        weight = quantized.pop(key)
        rows, cols = weight.shape
        group = PACKED_GROUP if strategy == "group" else cols
        groups = -(-cols // group)
        padded = torch.zeros(rows, groups * group)
        padded[:, :cols] = weight
        blocks = padded.reshape(rows, groups, group)
        lo, hi = blocks.amin(-1), blocks.amax(-1)
        scale = ((blocks.abs().amax(-1) / high) if symmetric else (hi - lo) / (high - low)).to(torch.bfloat16)
        zero = torch.zeros_like(lo) if symmetric else torch.round(low - lo / scale.float()).clamp(low, high)
        q = (torch.round(blocks / scale.float()[..., None]) + zero[..., None]).clamp(low, high)
        dequantized[key] = ((q - zero[..., None]) * scale.float()[..., None]).reshape(rows, -1)[:, :cols].contiguous()
        q = q.reshape(rows, -1)[:, :cols].to(torch.int8)
        quantized[key + "_packed"], quantized[key + "_scale"] = pack_to_int32(q, bits), scale.contiguous()
        quantized[key + "_shape"] = torch.tensor([rows, cols])
        if not symmetric:
            quantized[key + "_zero_point"] = pack_to_int32(zero.to(torch.int8), bits, packed_dim=0)
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy, "dynamic": False,
               "actorder": None, **({"group_size": PACKED_GROUP} if strategy == "group" else {})}
    return _write_twins(path, plain, quantized, dequantized, "pack-quantized", weights)


GROUPED = {  # GPTQ and AWQ (groups of 32 inputs): name -> (model, method, bits, checkpoint format, group_size,
    # act-order, symmetric, modules left as floats)
    "llama_gptq": ("llama_fp8", "gptq", 4, "gptq", 32, True, True, ()),  # act-order: any input in any group
    "llama_gptq_v2_w8": ("llama_fp8_partial", "gptq", 8, "gptq_v2", 32, False, False, ()),  # partial groups, zeros
    "phi3_gptq": ("phi3_fp8", "gptq", 4, "gptq", -1, False, True, ()),  # packed q|k|v, gate|up; one group
    "llama_awq": ("llama_fp8_partial", "awq", 4, "gemm", 32, False, False, ("model.layers.0.mlp.down_proj",)),
    "phi3_awq": ("phi3_fp8", "awq", 4, "gemm", 32, False, False, ()),
    "qwen3_moe_gptq": ("qwen3_moe_fp8", "gptq", 4, "gptq", 32, True, True, ()),  # per-expert keys
    "qwen3_moe_awq": ("qwen3_moe_fp8", "awq", 4, "gemm", 32, False, False, ()),
    "qwen2_gptq": ("qwen2", "gptq", 4, "gptq_v2", 32, True, False, ()),  # q/k/v biases beside their qweights
}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ / GPTQModel's pack_awq_columns: output AWQ_ORDER[i] at value i


def pack_words(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """GPTQModel 7.7's packing (``pack_original`` for qweight along the inputs, ``pack_awq_columns`` for AWQ):
    ``values`` [rows, n] unsigned, every ``32 // bits`` consecutive along the last dim one int32 word, value i
    at bit ``i * bits`` (AWQ: the run's element ``order[i]`` there); a last partial word padded with zeros, as
    GPTQModel's ``_pack_contiguous`` pads it."""
    per = 32 // bits
    padded = torch.zeros(values.shape[0], -(-values.shape[1] // per) * per, dtype=torch.int32)
    padded[:, : values.shape[1]] = values
    runs = padded.reshape(values.shape[0], -1, per)
    if order is not None:
        runs = runs[..., list(order)]
    packed = torch.zeros(runs.shape[:2], dtype=torch.int32)
    for i in range(per):
        packed |= runs[..., i] << (i * bits)
    return packed


def quantize_grouped(weight: torch.Tensor, method: str, bits: int, form: str, group: int, act_order: bool,
                     symmetric: bool) -> tuple[dict, torch.Tensor]:
    """One [out, in] matrix as GPTQ / AWQ store it (round to nearest per group; GPTQ's error feedback changes
    which codes, not the format): the parts by name, and the matrix they stand for, dequantized by the formats'
    definition, ``(q[i, o] - z[g(i), o]) * s[g(i), o]`` in float32."""
    outputs, inputs = weight.shape
    group, maxq = group if group > 0 else inputs, (1 << bits) - 1
    g_idx = torch.arange(inputs) // group
    if act_order:  # GPTQ's desc_act: the inputs quantized in another order, groups formed in it
        g_idx = torch.argsort(torch.randperm(inputs)) // group
    groups = int(g_idx.max()) + 1
    members = [weight[:, g_idx == g] for g in range(groups)]
    lo, hi = (torch.stack([m.amin(1) for m in members]), torch.stack([m.amax(1) for m in members]))  # [G, out]
    if symmetric:
        scale, zero = (2 * torch.maximum(lo.abs(), hi.abs()) / maxq), torch.full_like(lo, (maxq + 1) // 2)
    else:
        scale = (hi - lo) / maxq
        zero = torch.round(-lo / scale.half().float()).clamp(0, maxq)
    scale = scale.half()
    spread, at = scale.float()[g_idx], zero[g_idx]  # [in, out]
    q = (torch.round(weight.T / spread) + at).clamp(0, maxq)
    dequantized = ((q - at) * spread).T.contiguous()
    if method == "gptq":
        stored_zero = zero - int(form == "gptq")  # the v1 format stores zero - 1
        parts = {"qweight": pack_words(q.T, bits).T.contiguous(), "qzeros": pack_words(stored_zero, bits),
                 "scales": scale.contiguous(), "g_idx": g_idx.to(torch.int32)}  # fmt: skip
    else:
        parts = {"qweight": pack_words(q, bits, AWQ_ORDER), "qzeros": pack_words(zero, bits, AWQ_ORDER),
                 "scales": scale.contiguous()}  # fmt: skip
    return parts, dequantized


def quantize_grouped_checkpoint(tensors: dict, method: str, bits: int, form: str, group: int, act_order: bool,
                                symmetric: bool, floats=()) -> tuple[dict, dict]:
    """A float checkpoint's tensors as GPTQ / AWQ releases store them: every decoder Linear's ``qweight``,
    ``qzeros``, ``scales`` and GPTQ's ``g_idx`` (the router, the LM head and the modules ``floats`` names left as
    they are), and the same weights dequantized as floats."""
    quantized, dequantized = dict(tensors), dict(tensors)
    matrices = [k for k, w in tensors.items() if w.dim() == 2 and ".layers." in k and not k.endswith("mlp.gate.weight")
                and k.rpartition(".")[0] not in floats]  # fmt: skip
    for key in matrices:
        module = key.rpartition(".")[0]
        weight = quantized.pop(key).float()
        parts, dequantized[key] = quantize_grouped(weight, method, bits, form, group, act_order, symmetric)
        quantized.update((f"{module}.{part}", tensor) for part, tensor in parts.items())
    return quantized, dequantized


def grouped_config(path: str, method: str, bits: int, form: str, group: int, act_order: bool, symmetric: bool,
                   floats=()) -> None:
    """The checkpoint's ``quantization_config`` as GPTQModel / AutoAWQ write it."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    if method == "gptq":
        config["quantization_config"] = {
            "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": symmetric,
            "checkpoint_format": form, "pack_dtype": "int32", "damp_percent": 0.05, "true_sequential": True,
            "meta": {"quantizer": ["hf_parallel tests"]},
        }  # fmt: skip
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": bits, "group_size": group, "version": form,
                                         "zero_point": True, "modules_to_not_convert": ["lm_head", *floats]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def make_grouped_checkpoint(name: str, root: str) -> tuple[str, str]:
    """``name`` as GPTQ / AWQ releases store it (``quantize_grouped_checkpoint``, ``grouped_config``), and beside
    it the same weights dequantized as plain floats (plain transformers cannot read int4 on a CPU): the two
    paths."""
    from safetensors.torch import save_file

    model, *form = GROUPED[name]
    path, plain, tensors = _float_twin(name, model, root)
    if tensors is None:
        return path, plain
    torch.manual_seed(sum(map(ord, name)))
    quantized, dequantized = quantize_grouped_checkpoint(tensors, *form)
    save_file(quantized, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
    grouped_config(path, *form)
    return path, plain


MXFP4 = {  # gpt-oss with MXFP4 experts (32 e2m1 values per e8m0 scale along the input dim): 96 = 3 groups, so
    # TP=2's 48/48 of down_proj's input cuts a group
    "gpt_oss_mxfp4": ("GptOssConfig", dict(MOE["gpt_oss"][1], hidden_size=64, intermediate_size=96,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
}  # fmt: skip
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def make_mxfp4_checkpoint(name: str, root: str) -> str:
    """``name`` as gpt-oss ships: each expert matrix [E, in, out] stored transposed as ``<name>_blocks`` (uint8
    [E, out, in / 32, 16], two e2m1 codes a byte, low nibble first) and ``<name>_scales`` (e8m0 exponents,
    uint8 [E, out, in / 32]), the rest in floats, ``quant_method: mxfp4``: what plain transformers dequantizes."""
    import json

    from safetensors.torch import load_file, save_file

    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    make_checkpoint(name, root)
    file, codes = os.path.join(path, "model.safetensors"), torch.tensor(FP4_VALUES)
    tensors = load_file(file)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(key).transpose(1, 2)  # [E, out, in]
        groups = weight.reshape(*weight.shape[:2], -1, 32)
        exponent = torch.ceil(torch.log2(groups.abs().amax(-1, keepdim=True) / 6.0))
        code = ((groups / torch.exp2(exponent)).unsqueeze(-1) - codes).abs().argmin(-1).to(torch.uint8)
        tensors[key + "_blocks"] = (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous()
        tensors[key + "_scales"] = (exponent.squeeze(-1) + 127).to(torch.uint8).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path

def make_checkpoint(name: str, root: str) -> str:
    """Save a seeded random model of ``name`` under ``root/name`` (once) and return the path."""
    import transformers

    path = os.path.join(root, name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    every = {**ARCHS, **MOE, **ENCODERS, **TRAPS, **PIPELINE, **FEW_EXPERTS, **FP8, **FP8_PRODUCTS, **MXFP4,
             **HYBRIDS}
    class_name, overrides = every[name]
    config = getattr(transformers, class_name)(**{**COMMON, **overrides})
    torch.manual_seed(sum(map(ord, name)))
    auto = transformers.AutoModel if name in ENCODERS else transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # some families initialise biases / norms to constants: make them distinguishable
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
        persistent = model.state_dict(keep_vars=True)  # buffers the checkpoint holds (DeepSeek's router
        for name, buffer in model.named_buffers():  # bias): large enough to change which experts are chosen
            if name in persistent and buffer.is_floating_point():  # (left zero, the tiny router picks experts 2, 3)
                buffer.copy_(torch.linspace(5, -5, buffer.numel()).view_as(buffer))
    model.save_pretrained(path)
    return path


def variant_plans() -> dict[str, tuple[str, dict]]:
    """Other plans over the same checkpoints: transformers' own plans (gathered outputs, split
    inputs), a sequence-parallel / hidden-parallel-embedding plan, and none at all."""
    import transformers

    from hf_parallel.tensor.plan import curated_plan_for

    llama_rules, _ = curated_plan_for("llama")
    return {
        **{f"{name}_discovered": (name, "discover") for name in DISCOVERED},
        "phi3_transformers_plan": (
            "phi3",
            {**transformers.Phi3Config.base_model_tp_plan, "lm_head": "colwise_gather_output"},
        ),
        "olmo2_transformers_plan": (
            "olmo2",
            {**transformers.Olmo2Config.base_model_tp_plan, "lm_head": "colwise_gather_output"},
        ),
        "llama_sequence_parallel": (
            "llama",
            {
                **llama_rules,
                "embed_tokens": "embedding_colwise",
                "layers.*.input_layernorm": "sequence_parallel",
                "layers.*.post_attention_layernorm": "sequence_parallel",
                "norm": "sequence_parallel",
            },
        ),
        "llama_replicated": ("llama", None),  # tp_plan=None: no tensor parallelism, the whole model everywhere
    }


def make_tiny_smollm2(root: str, smollm2: str) -> str:
    """SmolLM2's config, tokenizer and chat template around a random model of 2 layers x 144 wide (its 9 / 3
    heads kept, 16 a head): the cookbook's scripts (``examples/``) run on it as written, at tiny size."""
    import json
    import shutil

    import transformers

    path = os.path.join(root, "tiny_smollm2")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    shutil.copytree(smollm2, path, ignore=shutil.ignore_patterns("*.safetensors*", "config.json", "benchmarks"))
    with open(os.path.join(smollm2, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=2, hidden_size=144, intermediate_size=192, head_dim=16)
    config.update(initializer_range=0.1)  # (at 0.02 greedy decoding repeats the last token: the test would be weak)
    model_config = transformers.LlamaConfig(**{k: v for k, v in config.items() if not k.startswith("_")})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.float32).save_pretrained(path)
    return path
