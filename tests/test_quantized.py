"""Quantized checkpoints: FP8 with block scales (DeepSeek-V3 / Qwen3-FP8's format), compressed-tensors' FP8
(per channel, per tensor) and pack-quantized integers (W4A16 per group, W8A16 per channel, zero points),
gpt-oss's MXFP4 experts, GPTQ (4 / 8 bits, v1 and v2 zero points, act-order) and AWQ (GEMM), read per rank,
each rank its slice of the weights and of their scales, dequantized into the dtype asked for; against plain
transformers in one process. Other formats are refused by name."""

import json
import os
import re

import pytest
import torch
from compare import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

TOLERANCE = 1e-5


MOE = {"qwen3_moe_fp8", "qwen3_moe_w4_group", "gpt_oss_mxfp4", "qwen3_moe_gptq", "qwen3_moe_awq"}  # also loaded
# with their experts spread whole (EP)
READABLE = {"llama_w4_group", "llama_w8_channel"}  # compressed-tensors checkpoints plain transformers decompresses:
# the reference is transformers reading them (for zero points, packed along the rows, and MoE per-expert keys it is
# not: the same weights dequantized as floats)


@pytest.fixture(scope="module")
def quantized_paths(tiny_root):
    """FP8 with block scales, compressed-tensors' per-channel and per-tensor FP8 and pack-quantized integers,
    gpt-oss's MXFP4 experts, GPTQ and AWQ."""
    from tiny_models import (
        COMPRESSED,
        FP8,
        GROUPED,
        MXFP4,
        PACKED,
        make_compressed_checkpoint,
        make_fp8_checkpoint,
        make_grouped_checkpoint,
        make_mxfp4_checkpoint,
        make_packed_checkpoint,
    )

    paths = {name: make_fp8_checkpoint(name, tiny_root) for name in FP8}
    paths.update({name: make_compressed_checkpoint(name, tiny_root)[0] for name in COMPRESSED})
    paths.update({name: make_packed_checkpoint(name, tiny_root)[0] for name in PACKED})
    paths.update({name: make_grouped_checkpoint(name, tiny_root)[0] for name in GROUPED})
    return {**paths, **{name: make_mxfp4_checkpoint(name, tiny_root) for name in MXFP4}}


def plain_logits(path: str) -> torch.Tensor:
    import transformers
    from tp_workers import INPUT_IDS

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(INPUT_IDS).logits


@pytest.fixture(scope="module")
def references(quantized_paths):
    """Plain transformers in one process: the quantized checkpoint itself (it dequantizes on a CPU), or, where
    it cannot read it, the same weights dequantized and saved as floats."""
    out = {}
    for name, path in quantized_paths.items():
        twin = path + "_dequantized"
        out[name] = plain_logits(twin if os.path.isdir(twin) and name not in READABLE else path)
    return out


def _saved_plainly(path: str, want: torch.Tensor) -> None:
    """A dequantized model saves plain floats, without quantization_config; plain transformers reads them."""
    from safetensors import safe_open

    from hf_parallel.quant.formats import PARTS

    with open(os.path.join(path, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as saved:
        assert not [key for key in saved.keys() if key.endswith(PARTS)]
        assert {saved.get_slice(key).get_dtype() for key in saved.keys()} == {"F32"}
    assert_close(plain_logits(path), want, atol=TOLERANCE, rtol=TOLERANCE, what=f"{path} read plainly")


def _saved_as_stored(path: str, source: str) -> None:
    """A model holding its weights quantized saves them as the source stored them: the same keys, each tensor
    bitwise equal (quantized weights, scales, zero points, packed shapes), the same quantization_config."""
    from safetensors.torch import load_file

    for name in ("config.json",):
        with open(os.path.join(path, name)) as f, open(os.path.join(source, name)) as g:
            assert json.load(f)["quantization_config"] == json.load(g)["quantization_config"]
    saved, stored = (load_file(os.path.join(p, "model.safetensors")) for p in (path, source))
    assert sorted(saved) == sorted(stored)
    for key, tensor in stored.items():
        assert (saved[key].dtype, saved[key].shape) == (tensor.dtype, tensor.shape), key
        assert torch.equal(saved[key].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), key


CT_REFUSES = {"llama_w4_zero_point": "divisble by the given group_size"}  # sic: its partial group (144 = 4 x 32 + 16)


def test_the_twins_are_compressed_tensors_own_decompression(quantized_paths):
    """The floats the references read where transformers cannot read a compressed-tensors checkpoint are the
    tests' own dequantization: compressed-tensors' own decompression of every quantized weight (its format's
    compressor, the checkpoint's scheme, scales widened to fp32 as the twins') gives the same floats. A format
    it cannot read (a partial group) is refused by it, named here, so its twin stays the one reference."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    checked = []
    for name, path in quantized_paths.items():
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)["quantization_config"]
        if config.get("quant_method") != "compressed-tensors":
            continue
        (group,) = config["config_groups"].values()
        scheme = QuantizationScheme.model_validate(group)
        compressor = BaseCompressor.load_from_registry(config["format"])
        stored = load_file(os.path.join(path, "model.safetensors"))
        twin = load_file(os.path.join(path + "_dequantized", "model.safetensors"))
        modules = sorted({key.rsplit(".", 1)[0] for key in stored if key.endswith(("weight_packed", "weight_scale"))})
        assert modules, name
        for module in modules:
            parts = {key.rsplit(".", 1)[1]: t for key, t in stored.items() if key.rsplit(".", 1)[0] == module}
            parts["weight_scale"] = parts["weight_scale"].float()
            if name in CT_REFUSES:
                with pytest.raises(ValueError, match=CT_REFUSES[name]):
                    compressor.decompress(parts, scheme)
                break
            weight = compressor.decompress(parts, scheme)["weight"]
            assert_close(weight, twin[module + ".weight"], atol=0, rtol=1e-6, what=f"{name}: {module}")
        checked.append(name)
    from tiny_models import COMPRESSED, PACKED

    assert sorted(checked) == sorted({*COMPRESSED, *PACKED}), checked


@pytest.mark.slow  # loads whole models: outside the pure tier
def test_quantized_weights_are_dequantized_as_read_in_one_process(quantized_paths, references, tmp_path):
    from tp_workers import INPUT_IDS

    import hf_parallel

    for name, path in quantized_paths.items():
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            assert_close(model(INPUT_IDS).logits, references[name], atol=TOLERANCE, rtol=TOLERANCE, what=name)
        model.save_pretrained(str(tmp_path / name))
        _saved_plainly(str(tmp_path / name), references[name])
        kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_quantized=True)
        with torch.no_grad():
            assert_close(kept(INPUT_IDS).logits, references[name], atol=TOLERANCE, rtol=TOLERANCE, what=f"{name} kept")
            greedy = dict(max_new_tokens=4, do_sample=False)
            assert torch.equal(kept.generate(INPUT_IDS, **greedy), model.generate(INPUT_IDS, **greedy)), name
        kept.save_pretrained(str(tmp_path / "kept" / name))
        _saved_as_stored(str(tmp_path / "kept" / name), path)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, sizes",
    [
        (2, dict(tp_size=2)),
        (3, dict(tp_size=3)),
        (2, dict(pp_size=2, tp_plan=None)),
        (2, dict(sp_size=2)),
        (2, dict(tp_size=2, ep_plan="auto")),  # the MoE's experts spread whole, attention split
    ],
    ids=["tp2", "tp3", "pp2", "sp2", "ep2"],
)
def test_quantized_weights_split_inside_a_block_match_one_process(
    quantized_paths, references, tmp_path, world_size, sizes
):
    """32-row blocks split 80/80 (TP=2) and 54/53/53 (TP=3) in the MLP, 48/48 in attention, an expert's 32
    rows 16/16 and 11/11/10; dims that end in a partial block (80, 144, a 16-row KV head); power-of-two
    scales stored as e8m0; Phi-3's packed q|k|v and gate|up each part with its own scale rows; Qwen3-MoE's
    per-expert weights and scales read into fused experts, split (expert TP) or spread whole (EP); a KV head
    replicated at TP=3; pipeline stages (each reads its layers' weights and scales) and SP. Packed integers:
    shards that cut 32-column groups and int32 words (160 at TP=3: 54/53/53), zero points packed 8 rows a
    word cut with the rows, Qwen3-MoE's per-expert W4A16. MXFP4: gpt-oss's transposed experts, down_proj's
    96 inputs (3 groups of 32) cut 48/48 at TP=2, interleaved gate|up pairs. GPTQ: qweight's words (8 inputs) cut
    by row splits at TP=3, act-order's groups read as the run its inputs name, v1's zero - 1 and v2's zero, 8 bits
    with partial groups, one group (group_size -1) on Phi-3's packed q|k|v; AWQ: words of 8 outputs in AWQ's order
    cut by column splits at TP=3, a module left as floats (``modules_to_not_convert``); both on Qwen3-MoE's
    per-expert keys. Every rank's logits within 1e-5 of plain transformers', and the gathered save is plain
    floats it reads back."""
    import tp_workers
    from distributed import run_ranks

    paths = {name: path for name, path in quantized_paths.items() if name in MOE or "ep_plan" not in sizes}
    if "sp_size" in sizes:  # gpt-oss's per-head sinks: SP refuses it by name (test_sequence_parallel)
        paths.pop("gpt_oss_mxfp4")
    results = run_ranks(world_size, tp_workers.quantized_logits, paths, str(tmp_path / "saved"), sizes,
                        out_dir=str(tmp_path / "out"))  # fmt: skip
    for rank, result in enumerate(results):
        for name in paths:
            assert_close(result[name], references[name], atol=TOLERANCE, rtol=TOLERANCE, what=f"{name} rank {rank}")
    if world_size == 4:  # every kept FP8 linear through the kernel (Triton's interpreter), its shards inside blocks;
        # ("int4") act-order GPTQ, AWQ and compressed-tensors' W4A16 with zero points through torch's int4 kernel
        # (inputs spread to their groups' slots where a shard cuts groups)
        kinds = {name: [result["kinds:" + name] for result in results] for name in paths}
        assert kinds["llama_fp8"] == [["FP8WeightOnlyKernel"]] * 4, kinds
        int4 = ("llama_gptq", "llama_awq", "llama_w4_zero_point")
        assert [kinds[name] for name in int4] == [[["Int4TorchKernel"]] * 4] * 3, kinds
    for name in paths:
        _saved_plainly(str(tmp_path / "saved" / name), references[name])


def _copy(path: str, target) -> str:
    import shutil

    shutil.copytree(path, target)
    return str(target)


def test_fp8_weights_without_their_scales_are_refused_by_name(quantized_paths, tmp_path):
    """A float8 weight whose scale is missing, or FP8 in a checkpoint whose config declares no quantization:
    its values would load wrong, so the load is refused naming the tensor, before any weight is read."""
    from safetensors.torch import load_file, save_file

    import hf_parallel
    from hf_parallel import CheckpointError

    target = _copy(quantized_paths["llama_fp8"], tmp_path / "no_scale")
    tensors = load_file(os.path.join(target, "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' is F8_E4M3 with no "
                       r"'model\.layers\.1\.mlp\.down_proj\.weight_scale_inv' beside it"):  # fmt: skip
        hf_parallel.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    target = _copy(quantized_paths["llama_fp8"], tmp_path / "no_config")
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match=r"weight_scale_inv' \(and 13 more\) are parts of quantized weights .* "
                       "no quantization_config"):  # fmt: skip
        hf_parallel.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, sizes",
    [(2, dict(tp_size=2)), (3, dict(tp_size=3)), (4, dict(tp_size=4)), (2, dict(pp_size=2, tp_plan=None)),
     (2, dict(tp_size=2, ep_plan="auto"))],
    ids=["tp2", "tp3", "tp4", "pp2", "ep2"],
)  # fmt: skip
def test_weights_kept_quantized_match_one_process_and_save_back_bitwise(
    quantized_paths, references, tmp_path, monkeypatch, world_size, sizes
):
    """``keep_quantized=True``: each rank holds its slices as stored (FP8 and the scales of its blocks, packed
    words and the groups' scales and zero points, MXFP4 blocks; experts stored one key per expert, each
    expert's box, under expert TP and EP) and dequantizes module by module; logits within 1e-5 of plain
    transformers' at every layout above (shards inside blocks, groups and words), what each rank holds is
    what ``hf-parallel plan`` said, and the save gathers every part back: the source's keys, bitwise, with
    its quantization_config (pipeline stages: each stage's parts through rank 0). The per-rank save
    (``distributed=True``: each rank its pieces, overlapping where ranks share a block) consolidates to the
    same bitwise checkpoint and loads back in one process. At TP=4, under Triton's interpreter, FP8 linears
    multiply through the package's kernel (``tensor/fp8_kernel.py``), reading the scales from inside blocks,
    and with ``keep_quantized="int4"`` GPTQ, AWQ and compressed-tensors' W4A16 linears through torch's int4
    kernel (``int4_kernel.py``); Qwen3-MoE's FP8 experts (8 of each expert's 32-row blocks a rank) take the
    gathered FP8 kernel in a one-token step (``kept_experts.py``), and at EP=2 too (other ranks' experts:
    EP's sentinel)."""
    import tp_workers
    from distributed import run_ranks
    from tp_workers import INPUT_IDS

    import hf_parallel
    from hf_parallel.commands.report import plan_report

    paths = {name: path for name, path in quantized_paths.items() if name in MOE or "ep_plan" not in sizes}
    if world_size == 4:  # one of each format: 6 / 2 heads replicated unevenly, 32-row blocks cut 40 / 40 / 40 / 40
        paths = {name: paths[name] for name in ("llama_fp8", "llama_w4_zero_point", "gpt_oss_mxfp4", "llama_gptq",
                                                "llama_awq", "qwen3_moe_fp8", "qwen3_moe_gptq")}
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # FP8 linears multiply through the package's kernel
    if "ep_plan" in sizes:  # FP8 experts through the gathered kernel, other ranks' experts as EP's sentinel
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    # int4: GPTQ and AWQ through torch's int4 kernel (linears; gated experts, at EP=2 with other ranks' sentinels)
    keep = "int4" if world_size == 4 or "ep_plan" in sizes else True
    results = run_ranks(world_size, tp_workers.quantized_logits, paths, str(tmp_path / "saved"), sizes, keep,
                        out_dir=str(tmp_path / "out"))  # fmt: skip
    for rank, result in enumerate(results):
        for name in paths:
            assert_close(result[name], references[name], atol=TOLERANCE, rtol=TOLERANCE, what=f"{name} rank {rank}")
            step = references[name][:1, :1]  # causal: the first token's logits alone
            assert_close(result["step:" + name], step, atol=TOLERANCE, rtol=TOLERANCE, what=f"{name} step {rank}")
            if name in MOE and "pp_size" not in sizes:  # every expert weight: its two experts gathered by id
                kernel = (world_size == 4 or "ep_plan" in sizes) and "fp8" in name  # under Triton's interpreter
                kernel = kernel or (keep == "int4" and "qwen3" in name)  # torch's int4 kernel (CPU; gated experts)
                how = "as stored" if kernel else "dequantized"
                assert result["experts:" + name] == [how] * 4, (name, rank, result["experts:" + name])
    if world_size == 4:  # every kept FP8 linear through the kernel (Triton's interpreter), its shards inside blocks;
        # ("int4") act-order GPTQ, AWQ and compressed-tensors' W4A16 with zero points through torch's int4 kernel
        # (inputs spread to their groups' slots where a shard cuts groups)
        kinds = {name: [result["kinds:" + name] for result in results] for name in paths}
        assert kinds["llama_fp8"] == [["FP8WeightOnlyKernel"]] * 4, kinds
        int4 = ("llama_gptq", "llama_awq", "llama_w4_zero_point")
        assert [kinds[name] for name in int4] == [[["Int4TorchKernel"]] * 4] * 3, kinds
    for name, path in paths.items():
        _saved_as_stored(str(tmp_path / "saved" / name), path)
        per_rank = str(tmp_path / "saved" / (name + "_per_rank"))
        hf_parallel.consolidate(per_rank, str(tmp_path / "consolidated" / name), progress=False)
        _saved_as_stored(str(tmp_path / "consolidated" / name), path)
        again = hf_parallel.AutoModelForCausalLM.from_pretrained(per_rank, dtype=torch.float32, keep_quantized=True)
        with torch.no_grad():  # the per-rank files read back in one process, held as stored again
            again_logits = again(INPUT_IDS).logits
            assert_close(again_logits, references[name], atol=TOLERANCE, rtol=TOLERANCE, what=f"{name} again")
        if "tp_size" in sizes and "ep_plan" not in sizes:
            line = next(line for line in plan_report(path, tp=world_size).splitlines() if "held as read" in line)
            planned = json.loads(re.search(r"held as read: (\[[\d, ]+\])", line).group(1))
            assert planned == [result["held:" + name] for result in results], name
            int4 = re.search(r"load check\): (\[[\d, ]+\]) bytes per rank on CPU", line)
            packed = [result["int4:" + name] for result in results]  # 0 but where keep="int4" takes the kernel
            if keep == "int4":  # every format: the plan's figure (none for FP8 and MXFP4) is what the ranks hold
                assert (json.loads(int4.group(1)) if int4 else [0] * world_size) == packed, (name, line, packed)
            if keep == "int4" and name in ("llama_gptq", "llama_awq", "llama_w4_zero_point", "qwen3_moe_gptq"):
                assert min(packed) > 0, (name, packed)


def test_keep_quantized_is_refused_where_it_cannot_hold(quantized_paths, tiny_paths, tmp_path):
    """A checkpoint that is not quantized, peft adapters on a kept weight, a static activation scale (it
    would not be saved back), a scale beside a weight stored as floats: refused by name, before anything is
    read or written; a kept weight used outside its module's call raises."""
    from safetensors.torch import load_file, save_file

    import hf_parallel
    from hf_parallel import CheckpointError

    with pytest.raises(ValueError, match="keep_quantized=True: .* is not a quantized checkpoint"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], keep_quantized=True)
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(quantized_paths["llama_fp8"], keep_quantized=True)
    with pytest.raises(RuntimeError, match="linear on a weight held quantized"):  # outside its module's call
        torch.nn.functional.linear(torch.ones(96), model.model.layers[0].mlp.up_proj.weight)
    import peft

    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: .* around a weight held quantized"):
        peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    target = _copy(quantized_paths["llama_ct_channel"], tmp_path / "static")  # a static activation scale beside it
    tensors = load_file(os.path.join(target, "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.input_scale"] = torch.ones(1)
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    hf_parallel.AutoModelForCausalLM.from_pretrained(target)  # dequantized: moot

    with pytest.raises(CheckpointError, match=r"up_proj\.weight has 'model\.layers\.0\.mlp\.up_proj\.input_scale'"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(target, keep_quantized=True)
    stray = _copy(quantized_paths["llama_fp8"], tmp_path / "stray")  # a scale beside a weight stored as floats
    tensors = load_file(os.path.join(stray, "model.safetensors"))
    tensors["model.norm.weight_scale_inv"] = torch.ones(1)
    save_file(tensors, os.path.join(stray, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight_scale_inv' .* beside weights stored as floats"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(stray)


class _Stored:
    """A tensor read like a safetensors slice."""

    def __init__(self, tensor):
        self.tensor = tensor

    def get_shape(self):
        return list(self.tensor.shape)

    def get_dtype(self):
        return self.tensor.dtype

    def __getitem__(self, index):
        return self.tensor[index]


def _formats(bits: int):
    """(name, Dequantized, the whole weight dequantized by the formats' definitions) for FP8 blocks, packed
    integers with zero points, MXFP4 (exponents as bytes and as e8m0), GPTQ (act-order; v2's zero points, 37
    outputs: a partial zero-point word, and no g_idx; one group of all inputs) and AWQ (50 inputs: a partial
    group; one group), with partial blocks / groups / words."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from tiny_models import FP4_VALUES, quantize_grouped

    from hf_parallel.quant.compressed_tensors import DequantizedIntegers, PackedIntegers
    from hf_parallel.quant.gptq_awq import DequantizedGrouped, GroupedIntegers
    from hf_parallel.quant.mxfp4 import DequantizedMXFP4
    from hf_parallel.quant.scaled_fp8 import DequantizedFP8, ScaledFP8

    torch.manual_seed(bits)
    weight, scale = torch.randn(37, 50).to(torch.float8_e4m3fn), torch.rand(5, 4) + 0.5
    fp8 = DequantizedFP8("w", _Stored(weight), _Stored(scale), ScaledFP8("block", (8, 16), "_scale_inv"))
    whole = weight.float() * scale.repeat_interleave(8, 0)[:37].repeat_interleave(16, 1)[:, :50]
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    values, zero = torch.randint(low, high + 1, (37, 50), dtype=torch.int8), torch.randint(low, high + 1, (37, 4))
    scales = torch.rand(37, 4).to(torch.bfloat16)
    parts = {"_packed": pack_to_int32(values, bits), "_scale": scales, "_shape": torch.tensor([37, 50]),
             "_zero_point": pack_to_int32(zero.to(torch.int8), bits, packed_dim=0)}  # fmt: skip
    ints = DequantizedIntegers("w", lambda s: _Stored(parts[s]) if s in parts else None,
                                 PackedIntegers(bits, "group", 16, False))  # fmt: skip
    spread = lambda t: t.float().repeat_interleave(16, 1)[:, :50]  # noqa: E731
    blocks, exponents = torch.randint(0, 256, (2, 5, 3, 16), dtype=torch.uint8), torch.randint(120, 130, (2, 5, 3))
    codes = torch.stack((blocks & 15, blocks >> 4), -1).flatten(-2).long()  # [E, out, group, 32]
    fp4 = torch.tensor(FP4_VALUES)[codes] * torch.exp2(exponents.float() - 127)[..., None]
    mxfp4 = DequantizedMXFP4("w", _Stored(blocks), _Stored(exponents.to(torch.uint8)))
    e8m0 = DequantizedMXFP4("w", _Stored(blocks), _Stored(exponents.to(torch.uint8).view(torch.float8_e8m0fnu)))
    experts = fp4.flatten(-2).transpose(1, 2)
    grouped = []
    for method, form, shape, act_order, group, g_idx in (
        ("gptq", "gptq", (40, 48), True, 16, True), ("gptq", "gptq_v2", (37, 48), False, 16, False),
        ("gptq", "gptq", (40, 48), True, -1, True), ("awq", "gemm", (40, 50), False, 16, False),
        ("awq", "gemm", (40, 50), False, -1, False),
    ):  # fmt: skip
        width = 4 if method == "awq" else bits
        stored, dense = quantize_grouped(torch.randn(shape), method, width, form, group, act_order, form == "gptq")
        if not g_idx:
            stored.pop("g_idx", None)  # GPTQ without it: consecutive groups, as without act-order
        described = GroupedIntegers(method, width, group, int(form == "gptq"))
        read = DequantizedGrouped("m.weight", lambda p, s=stored: _Stored(s[p]) if p in s else None, described)
        grouped.append((f"{method} {form} group {group}", read, dense))
    return [("fp8", fp8, whole), ("ints", ints, (values.float() - spread(zero)) * spread(scales)),
            ("mxfp4", mxfp4, experts), ("mxfp4 e8m0", e8m0, experts), *grouped]  # fmt: skip


@given(st.data())
@settings(max_examples=40, deadline=None)
def test_any_box_of_a_quantized_weight_is_that_box_of_the_whole(data):
    """Every box a layout can ask for (rows and columns cut anywhere: inside a block, a group, an int32 word)
    dequantizes to that box of the whole weight, bit for bit, and the plan's count of the bytes it reads
    (no data read) is what reading it takes."""
    from hf_parallel.quant.base import box_of

    for name, weight, whole in _formats(data.draw(st.sampled_from([4, 8]))):
        box = []
        for n in weight.shape:
            start = data.draw(st.integers(0, n - 1))
            box.append((start, data.draw(st.integers(start + 1, n))))
        index = tuple(slice(a, b) for a, b in box)
        assert torch.equal(weight[index], whole[index]), (name, box)
        assert box_of(index, weight.shape) == box
        assert weight.keep(box, meta=True).nbytes == weight.keep(box).nbytes, (name, box)
        empty = (slice(0, 0), *(slice(None),) * (len(weight.shape) - 1))  # a rank with none of a small dim
        assert weight[empty].shape == whole[empty].shape, name
