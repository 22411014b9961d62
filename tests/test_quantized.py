"""Quantized checkpoints: FP8 with block scales (DeepSeek-V3 / Qwen3-FP8's format) and compressed-tensors'
FP8 (per channel, per tensor) read per rank, each rank its slice of the weights and of their scales,
dequantized into the dtype asked for; against plain transformers in one process. Other formats are
refused by name."""

import json
import os

import pytest
import torch

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def fp8_paths(tiny_root):
    """FP8 with block scales, and compressed-tensors' per-channel and per-tensor FP8."""
    from tiny_models import COMPRESSED, FP8, make_compressed_checkpoint, make_fp8_checkpoint

    paths = {name: make_fp8_checkpoint(name, tiny_root) for name in FP8}
    return {**paths, **{name: make_compressed_checkpoint(name, tiny_root)[0] for name in COMPRESSED}}


def plain_logits(path: str) -> torch.Tensor:
    import transformers
    from tp_workers import INPUT_IDS

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(INPUT_IDS).logits


@pytest.fixture(scope="module")
def references(fp8_paths):
    """Plain transformers in one process: the FP8 checkpoint itself (it dequantizes on a CPU), or, for
    compressed-tensors (whose loader is another package), the same weights dequantized and saved as floats."""
    return {name: plain_logits(path + "_dequantized" if os.path.isdir(path + "_dequantized") else path)
            for name, path in fp8_paths.items()}  # fmt: skip


def _saved_plainly(path: str, want: torch.Tensor) -> None:
    """A dequantized model saves plain floats, without quantization_config; plain transformers reads them."""
    from safetensors import safe_open

    with open(os.path.join(path, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as saved:
        assert not [key for key in saved.keys() if key.endswith(("_scale_inv", "_scale"))]
        assert {saved.get_slice(key).get_dtype() for key in saved.keys()} == {"F32"}
    assert (plain_logits(path) - want).abs().max().item() < TOLERANCE


def test_fp8_blocks_are_dequantized_as_read_in_one_process(fp8_paths, references, tmp_path):
    import hf_parallel
    from tp_workers import INPUT_IDS

    for name, path in fp8_paths.items():
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            assert (model(INPUT_IDS).logits - references[name]).abs().max().item() < TOLERANCE, name
        model.save_pretrained(str(tmp_path / name))
        _saved_plainly(str(tmp_path / name), references[name])


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
def test_fp8_blocks_split_inside_a_block_match_one_process(fp8_paths, references, tmp_path, world_size, sizes):
    """32-row blocks split 80/80 (TP=2) and 54/53/53 (TP=3) in the MLP, 48/48 in attention, an expert's 32
    rows 16/16 and 11/11/10; dims that end in a partial block (80, 144, a 16-row KV head); power-of-two
    scales stored as e8m0; Phi-3's packed q|k|v and gate|up each part with its own scale rows; Qwen3-MoE's
    per-expert weights and scales read into fused experts, split (expert TP) or spread whole (EP); a KV head
    replicated at TP=3; pipeline stages (each reads its layers' weights and scales) and SP: every rank's
    logits within 1e-5 of plain transformers', and the gathered save is plain floats it reads back."""
    import tp_workers
    from distributed import run_ranks

    paths = {name: path for name, path in fp8_paths.items() if "moe" in name or "ep_plan" not in sizes}
    results = run_ranks(world_size, tp_workers.quantized_logits, paths, str(tmp_path / "saved"), sizes,
                        out_dir=str(tmp_path / "out"))  # fmt: skip
    for rank, result in enumerate(results):
        for name in paths:
            assert (torch.tensor(result[name]) - references[name]).abs().max().item() < TOLERANCE, (rank, name)
    for name in paths:
        _saved_plainly(str(tmp_path / "saved" / name), references[name])


def _copy(path: str, target) -> str:
    import shutil

    shutil.copytree(path, target)
    return str(target)


def test_fp8_weights_without_their_scales_are_refused_by_name(fp8_paths, tmp_path):
    """A float8 weight whose scale is missing, or FP8 in a checkpoint whose config declares no quantization:
    its values would load wrong, so the load is refused naming the tensor, before any weight is read."""
    from safetensors.torch import load_file, save_file

    import hf_parallel
    from hf_parallel import CheckpointError

    target = _copy(fp8_paths["llama_fp8"], tmp_path / "no_scale")
    tensors = load_file(os.path.join(target, "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight' is F8_E4M3 with no "
                       r"'model\.layers\.1\.mlp\.down_proj\.weight_scale_inv' beside it"):  # fmt: skip
        hf_parallel.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    target = _copy(fp8_paths["llama_fp8"], tmp_path / "no_config")
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(os.path.join(target, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(CheckpointError, match="is F8_E4M3 with no quantization_config in the config"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
