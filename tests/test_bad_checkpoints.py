"""Malformed checkpoints fail before any weight is read, with an error naming the file (and key)."""

import json
import os
import shutil

import pytest

import hf_parallel
from hf_parallel import CheckpointError
from hf_parallel.checkpoint.files import INDEX_FILE


@pytest.fixture(scope="module")
def sharded(tiny_paths, tmp_path_factory):
    """The tiny llama saved as several files plus an index."""
    out = str(tmp_path_factory.mktemp("sharded") / "llama")
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], tp_plan="auto")
    model.save_pretrained(out, max_shard_size="40KB")
    assert os.path.isfile(os.path.join(out, INDEX_FILE))
    return out


def copy_of(source, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    return target


def edit_index(target, edit):
    index = json.loads((target / INDEX_FILE).read_text())
    edit(index["weight_map"])
    (target / INDEX_FILE).write_text(json.dumps(index))


def load(path):
    return hf_parallel.AutoModelForCausalLM.from_pretrained(str(path), tp_plan="auto")


def test_truncated_file(tiny_paths, tmp_path):
    target = copy_of(tiny_paths["llama"], tmp_path)
    data = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file.*not fully covered"):
        load(target)


def test_header_offsets_past_the_end_of_the_file(tmp_path, tiny_paths):
    target = copy_of(tiny_paths["llama"], tmp_path)
    data = (target / "model.safetensors").read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    first = next(k for k in header if k != "__metadata__")
    header[first]["data_offsets"][1] += 10**9
    raw = json.dumps(header).encode()
    (target / "model.safetensors").write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + size :])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file"):
        load(target)


def test_header_that_is_not_json(tmp_path, tiny_paths):
    target = copy_of(tiny_paths["llama"], tmp_path)
    (target / "model.safetensors").write_bytes((9).to_bytes(8, "little") + b"{not json" + b"\0" * 64)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors file.*JSON"):
        load(target)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors"])
def test_index_pointing_outside_the_directory_is_refused(sharded, tmp_path, name):
    target = copy_of(sharded, tmp_path)
    edit_index(target, lambda wm: wm.update({"model.norm.weight": name}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' points to .*outside the checkpoint directory"):
        load(target)


def test_missing_shard_file_named_in_the_index(sharded, tmp_path):
    target = copy_of(sharded, tmp_path)
    victim = sorted(f for f in os.listdir(target) if f.endswith(".safetensors"))[-1]
    os.remove(target / victim)
    with pytest.raises(CheckpointError, match=rf"is in '{victim}', which does not exist"):
        load(target)


def test_duplicate_key_across_shards(sharded, tmp_path):
    from safetensors.torch import load_file, save_file

    target = copy_of(sharded, tmp_path)
    first, second = sorted(f for f in os.listdir(target) if f.endswith(".safetensors"))[:2]
    tensors = load_file(str(target / second))
    extra_key = next(iter(load_file(str(target / first))))
    tensors[extra_key] = load_file(str(target / first))[extra_key]
    save_file(tensors, str(target / second), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{extra_key.replace('.', '[.]')}' is in both .*{first}.*{second}"):
        load(target)


def test_index_that_is_not_json(sharded, tmp_path):
    target = copy_of(sharded, tmp_path)
    (target / INDEX_FILE).write_text("{ weight_map: ")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not a checkpoint index"):
        load(target)


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "fp8", "activation_scheme": "static"},  # per-tensor scales: not read yet
        {"quant_method": "gptq", "bits": 3, "group_size": 128},  # 3-bit values cross words
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},  # repacked for a kernel
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": False},
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
        {"quant_method": "hqq", "quant_config": {"weight_quant_params": {"nbits": 4}}},
        {"quant_method": "torchao", "quant_type": "int4_weight_only"},
        {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {  # g_idx
            "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                               "actorder": "group"}}}},
        {"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
        {"quant_method": "compressed-tensors", "format": "float-quantized", "kv_cache_scheme": {"num_bits": 8},
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
             "num_bits": 8, "type": "float", "strategy": "channel"}}}},  # its k_scale / v_scale: not read
    ],
)
def test_a_quantized_checkpoint_is_refused_by_name_before_any_weight_is_read(tiny_paths, tmp_path, quantization):
    """Its weights would load without their scales (logits garbage, and a save of the unscaled values):
    refused, naming the method and what hf_parallel reads, in from_pretrained and in the plan dry run."""
    from hf_parallel.commands.report import plan_report

    target = copy_of(tiny_paths["llama"], tmp_path)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    (target / "model.safetensors").write_bytes(b"")  # never opened: refused before any weight is read
    for run in (lambda: load(target), lambda: plan_report(str(target), tp=2)):
        with pytest.raises(ValueError, match=f"quant_method={quantization['quant_method']!r}") as error:
            run()
        assert "quantization_config" in str(error.value) and "dequantized" in str(error.value)
        assert "hf_parallel reads fp8 (block-wise" in str(error.value)
