"""Bad input beyond malformed files: pickles, dtype disagreements, plans that leave matrices whole,
a world size other than the one asked for, and ranks that see different checkpoints."""

import json
import os
import shutil
import warnings

import pytest
import torch
import tp_workers
from distributed import run_ranks
from safetensors.torch import load_file, save_file
from tiny_models import make_checkpoint

import hf_parallel
from hf_parallel import CheckpointError
from hf_parallel.build import build_empty
from hf_parallel.distributed.mesh import Mesh
from hf_parallel.tensor.parallelize import UnshardedWarning, model_layout
from hf_parallel.tensor.plan import resolve_plan, with_expert_parallel


def pickle_checkpoint(source, target, files=1):
    """``source`` re-saved as torch.save pickles: one pytorch_model.bin, or several plus an index."""
    os.makedirs(target)
    shutil.copy(os.path.join(source, "config.json"), target)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    if files == 1:
        torch.save(tensors, os.path.join(target, "pytorch_model.bin"))
        return str(target)
    keys = sorted(tensors)
    weight_map = {}
    for part in range(files):
        name = f"pytorch_model-{part + 1:05d}-of-{files:05d}.bin"
        chunk = {key: tensors[key] for key in keys[part::files]}
        torch.save(chunk, os.path.join(target, name))
        weight_map.update(dict.fromkeys(chunk, name))
    with open(os.path.join(target, "pytorch_model.bin.index.json"), "w") as f:
        f.write(__import__("json").dumps({"metadata": {}, "weight_map": weight_map}))
    return str(target)


def test_pickle_checkpoint_is_refused_without_opt_in(tiny_paths, tmp_path):
    path = pickle_checkpoint(tiny_paths["llama"], tmp_path / "bin")
    with pytest.raises(CheckpointError, match=r"only a pickle checkpoint \(pytorch_model\.bin\).*allow_pickle=True"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("files", [1, 3])
def test_pickle_checkpoint_with_opt_in_loads_the_same_model(tiny_paths, tmp_path, files):
    import transformers

    path = pickle_checkpoint(tiny_paths["llama"], tmp_path / "bin", files)
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, allow_pickle=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], dtype=torch.float32)
    for name, param in reference.named_parameters():
        assert torch.equal(model.get_parameter(name), param), name
    with torch.no_grad():
        assert torch.equal(model(tp_workers.INPUT_IDS).logits, reference(tp_workers.INPUT_IDS).logits)


class Payload:
    """Unpickling this would run a shell command that leaves a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_that_runs_code_is_refused_even_with_opt_in(tiny_paths, tmp_path):
    path = pickle_checkpoint(tiny_paths["llama"], tmp_path / "bin")
    marker = tmp_path / "pwned"
    tensors = torch.load(os.path.join(path, "pytorch_model.bin"), weights_only=True)
    tensors["model.norm.weight"] = Payload(marker)
    torch.save(tensors, os.path.join(path, "pytorch_model.bin"))
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: torch\.load\(weights_only=True\) refused it"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(path, allow_pickle=True)
    assert not marker.exists()


def test_integer_tensor_for_a_float_parameter_is_refused(tiny_paths, tmp_path):
    target = tmp_path / "int"
    shutil.copytree(tiny_paths["llama"], target)
    tensors = load_file(str(target / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"].to(torch.int32)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.up_proj\.weight' is I32, but the model's "
        r"model\.layers\.1\.mlp\.up_proj\.weight is torch\.float32",
    ):
        hf_parallel.AutoModelForCausalLM.from_pretrained(str(target))


def dry_shard(path, plan, world_size, expert_parallel=False):
    import transformers

    model = build_empty(transformers.AutoModelForCausalLM, transformers.AutoConfig.from_pretrained(path), torch.float32)
    plan = resolve_plan(model, plan)
    if expert_parallel:
        plan = with_expert_parallel(plan, keep_tensor_parallel=False)
    return model_layout(model, plan, Mesh.dry_run(tp_size=world_size))


def test_plan_leaving_large_matrices_unsharded_warns_with_their_size(tiny_paths):
    attention_only = {f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"} | {
        "layers.*.self_attn.o_proj": "rowwise"
    }
    with pytest.warns(UnshardedWarning) as caught:
        dry_shard(tiny_paths["llama"], attention_only, 2)
    message = str(caught[0].message)
    # llama: hidden 72, intermediate 100, vocab 101; the smallest split matrix is k_proj (24x72)
    for name, shape in [("model.layers.0.mlp.up_proj.weight", "100x72"), ("lm_head.weight", "101x72")]:
        assert f"{name} {shape} ({100 * 72 * 4 / 2**20 if 'mlp' in name else 101 * 72 * 4 / 2**20:.2f} MiB)" in message
    assert "leaves 8 matrix(es) unsharded" in message  # 2 layers x 3 MLP + embedding + lm_head


@pytest.mark.parametrize("arch", ["llama", "llama_tied_kvrep", "gemma2", "phi3", "olmo2", "gpt_neox", "starcoder2"])
def test_curated_plans_leave_no_large_matrix_unsharded(tiny_paths, arch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnshardedWarning)
        dry_shard(tiny_paths[arch], "auto", 3)


@pytest.mark.distributed
def test_tp_size_other_than_the_world_size_is_an_error(tiny_paths, tmp_path):
    with pytest.raises(ValueError, match=r"tp_size=2 was asked for, but this process was not started by torchrun"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], tp_size=2)
    paths = [tiny_paths["llama"]] * 2
    for out in run_ranks(2, tp_workers.load_expecting_error, paths, {"tp_size": 3}, out_dir=str(tmp_path)):
        assert out["type"] == "ValueError"
        assert "tp_size=3 was asked for, but the process group has world size 2" in out["message"]


@pytest.mark.distributed
def test_ranks_seeing_different_checkpoints_is_an_error(tiny_paths, tmp_path):
    """Rank 1's copy was re-saved with other header metadata: same tensors, another file."""
    other = tmp_path / "other"
    shutil.copytree(tiny_paths["llama"], other)
    tensors = load_file(str(other / "model.safetensors"))
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt", "note": "stale copy"})
    paths = [tiny_paths["llama"], str(other)]
    for out in run_ranks(2, tp_workers.load_expecting_error, paths, {}, out_dir=str(tmp_path / "ranks")):
        assert out["type"] == "CheckpointError"
        assert "rank 1 sees a different checkpoint than rank 0" in out["message"]
        assert "model.safetensors" in out["message"]


def test_tp_larger_than_the_head_count_names_the_numbers(tiny_paths):
    with pytest.raises(ValueError, match=r"tp=5 exceeds num_attention_heads=4: every rank needs at least one"):
        dry_shard(tiny_paths["gemma2"], "auto", 5)


def test_more_ranks_than_experts_or_vocab_rows_names_the_parameter_and_numbers(tiny_paths, tiny_root):
    moe = make_checkpoint("qwen3_moe", tiny_root)  # 4 experts, 6 heads
    with pytest.raises(
        ValueError,
        match=r"experts\.gate_up_proj \(4, 64, 48\): rule .*\(grouped_gemm\) splits dim 0 "
        r"\(size 4\) over 5 ranks, leaving rank\(s\) \[4\] with none of it; use at most 4 ranks",
    ):
        dry_shard(moe, "auto", 5, expert_parallel=True)
    dry_shard(moe, "auto", 3, expert_parallel=True)  # uneven (2, 1, 1) experts is fine
    vocab_only = {"embed_tokens": "embedding_rowwise"}  # llama: vocab 101; attention replicated, so
    with pytest.raises(
        ValueError,
        match=r"embed_tokens\.weight \(101, 72\): rule 'embed_tokens' \(embedding_rowwise\) "
        r"splits dim 0 \(size 101\) over 128 ranks, leaving rank\(s\) \[101, .*127\]",
    ):  # 9 heads don't matter
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dry_shard(tiny_paths["llama"], vocab_only, 128)


def test_expert_parallelism_alone_may_use_more_ranks_than_attention_heads(tiny_root):
    """Attention stays replicated without tp_plan: 8 expert ranks for a 6-head model are fine."""
    path = make_checkpoint("qwen3_moe", tiny_root)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    wide = os.path.join(tiny_root, "qwen3_moe_8_experts")
    os.makedirs(wide, exist_ok=True)
    with open(os.path.join(wide, "config.json"), "w") as f:
        json.dump({**config, "num_local_experts": 8}, f)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shard = dry_shard(wide, "auto", 8, expert_parallel=True)
    assert shard.heads is None
    experts = shard.params["model.layers.0.mlp.experts.gate_up_proj"].layout
    assert [experts.local_size(rank) for rank in range(8)] == [1] * 8


def test_per_head_modules_in_a_split_attention_are_refused_at_plan_time(tmp_path):
    """StableLM's qk_layernorm keeps one LayerNorm per head, indexed by head number."""
    import transformers

    transformers.StableLmConfig(
        hidden_size=48, intermediate_size=80, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=101, qk_layernorm=True,
    ).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match=r"StableLmAttention\.q_layernorm\.norms holds one module per head \(6\)"):
        dry_shard(str(tmp_path), "auto", 2)
    assert "q_layernorm.norms.0 is one of a list of per-head modules" in " ".join(
        resolve_plan(
            build_empty(
                transformers.AutoModelForCausalLM, transformers.AutoConfig.from_pretrained(tmp_path), torch.float32
            ),
            "discover",
        ).notes
    )


@pytest.mark.parametrize("family", ["T5Config", "BartConfig"])
def test_an_encoder_decoder_splits_by_tensor_parallelism_only(tmp_path, family):
    """T5 and BART crashed in the forward (their shared vocabulary table split, but looked up whole by
    the encoder's and decoder's own embed_tokens): now every holder is vocab-parallel and TP plans;
    the dimensions that assume one stack of layers are refused by name at plan time
    (test_encoder_decoders.py runs them)."""
    import transformers

    from hf_parallel.commands.report import plan_report

    small = dict(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=4, d_kv=8, decoder_start_token_id=0)
    if family == "BartConfig":
        small = dict(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)  # fmt: skip
    config = getattr(transformers, family)(**small)
    transformers.AutoModelForSeq2SeqLM.from_config(config).save_pretrained(str(tmp_path))
    assert "rules from plans/" in plan_report(str(tmp_path), tp=2)
    with pytest.raises(
        ValueError, match=f"{family} is an encoder-decoder .* tensor parallelism \\(tp_size\\) only, not sp_size=2"
    ):
        plan_report(str(tmp_path), tp=2, sp=2)
