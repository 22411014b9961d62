"""The loader: only a rank's slice is ever read, bad checkpoints fail early, TP=1 needs no torchrun."""

import json
import os
import shutil

import checkpoint_workers
import pytest
import torch
import tp_workers
from distributed import run_ranks
from safetensors.torch import load_file, save_file

import hf_parallel
from hf_parallel import CheckpointError
from hf_parallel.checkpoint.loading import BYTES_READ
from hf_parallel.tensor.registry import register_style
from hf_parallel.tensor.splits import out_dim, packed_layout
from hf_parallel.tensor.styles import PackedColwise


@pytest.mark.distributed
def test_a_sharded_tensor_is_never_fully_read(tiny_paths, tmp_path):
    for rank, rows in enumerate(
        run_ranks(2, checkpoint_workers.count_bytes_read, tiny_paths["llama"], out_dir=str(tmp_path))
    ):
        sharded = [key for key, row in rows.items() if row["sharded"]]
        assert len(sharded) >= 15
        for key, row in rows.items():
            assert row["read"] == row["local"], f"rank {rank} read {row['read']} bytes of {key}, holds {row['local']}"
            assert row["contiguous"], f"{key}: a strided view of the file would slow every matmul"
            if row["sharded"]:
                assert row["read"] < row["full"]


def test_world_size_one_runs_in_a_plain_process(tiny_paths, tmp_path):
    import transformers

    path = tiny_paths["phi3"]
    ids = torch.tensor([tp_workers.INPUT_IDS[0].tolist()])
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    want = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(ids).logits
    assert torch.allclose(model(ids).logits, want, atol=1e-6, rtol=0)
    model.save_pretrained(str(tmp_path / "out"))
    from checks import assert_same_checkpoint

    assert_same_checkpoint(path, str(tmp_path / "out"))


def test_sharded_index_and_max_shard_size_round_trip(tiny_paths, tmp_path):
    path = tiny_paths["llama"]
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.save_pretrained(str(tmp_path / "split"), max_shard_size="100KB")
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = hf_parallel.AutoModelForCausalLM.from_pretrained(str(tmp_path / "split"), dtype=torch.float32)
    from checks import assert_same_checkpoint

    assert_same_checkpoint(path, str(tmp_path / "split"))
    ids = tp_workers.INPUT_IDS
    assert torch.equal(reloaded(ids).logits, model(ids).logits)
    # saving again as one file removes the now-stale shards and index
    model.save_pretrained(str(tmp_path / "split"))
    assert sorted(p for p in os.listdir(tmp_path / "split") if "safetensors" in p) == ["model.safetensors"]


def edited_checkpoint(source: str, target, edit) -> str:
    """A copy of ``source`` whose tensors went through ``edit(dict)`` before being saved again."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return str(target)


def test_missing_keys_are_an_error_naming_them(tiny_paths, tmp_path):
    broken = edited_checkpoint(
        tiny_paths["llama"], tmp_path / "broken", lambda t: t.pop("model.layers.1.mlp.down_proj.weight")
    )
    with pytest.raises(ValueError, match=r"missing 1 parameter.*model\.layers\.1\.mlp\.down_proj\.weight"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(broken)


def test_unexpected_keys_are_an_error_naming_them(tiny_paths, tmp_path):
    """A tensor no parameter reads would be dropped silently (a layer of another class, a quantized part of a
    format not declared): refused, naming it; keys transformers itself ignores for the class still load."""
    extra = edited_checkpoint(
        tiny_paths["llama"], tmp_path / "extra", lambda t: t.update({"model.layers.7.surprise.weight": torch.zeros(2)})
    )
    with pytest.raises(CheckpointError, match=r"1 checkpoint key\(s\) match no parameter .*layers\.7\.surprise"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(extra)
    rope = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}  # an old checkpoint's: transformers
    old = edited_checkpoint(tiny_paths["llama"], tmp_path / "old", lambda t: t.update(rope))  # ignores it, so do we
    hf_parallel.AutoModelForCausalLM.from_pretrained(old)
    hf_parallel.AutoModel.from_pretrained(tiny_paths["llama"])  # a base model from a task model's: its head's keys
    import transformers

    base = tmp_path / "base"  # a base model's own checkpoint (no prefix): a stray key there is still an error
    transformers.AutoModel.from_pretrained(tiny_paths["llama"]).save_pretrained(base)
    stray = edited_checkpoint(str(base), tmp_path / "base_extra", lambda t: t.update({"extra.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"match no parameter .*extra\.weight"):
        hf_parallel.AutoModel.from_pretrained(stray)


def test_shape_mismatch_names_key_and_file(tiny_paths, tmp_path):
    bad = edited_checkpoint(
        tiny_paths["llama"], tmp_path / "bad", lambda t: t.update({"model.norm.weight": torch.zeros(5)})
    )
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has shape \(5,\)"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(bad)


def test_bfloat16_cast_on_load(tiny_paths):
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["qwen2"], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(tp_workers.INPUT_IDS).logits.shape == (2, 7, 101)


def test_device_map_with_tp_plan_is_refused(tiny_paths):
    with pytest.raises(ValueError, match="device_map"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], device_map="auto")


class ThreeBlockColwise(PackedColwise):
    """A user style: the output dim is three equal packed blocks."""

    def _layout(self, module, ctx, name):
        return packed_layout(out_dim(module), module.weight.shape[0], ctx, name, num_blocks=3)


def test_impossible_split_fails_before_reading_weights(tiny_paths):
    register_style("three_block_colwise", ThreeBlockColwise(), overwrite=True)
    BYTES_READ.clear()
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.gate_proj: packed dim of 100 does not split into 3 equal blocks"
    ):
        hf_parallel.AutoModelForCausalLM.from_pretrained(
            tiny_paths["llama"], tp_plan={"layers.*.mlp.gate_proj": "three_block_colwise"}
        )
    assert sum(BYTES_READ.values()) == 0


@pytest.mark.distributed
def test_save_gathers_blocks_instead_of_assembling_the_largest_tensors(tmp_path):
    """A 64k vocabulary and a 64k intermediate size make the embedding, LM head (row splits) and
    the MLP (column split down_proj) the largest tensors, 64 MiB each in fp32. Rank 0 gathers each
    in 16 MiB row blocks and writes them as they come: it never holds a full one (assembling would
    add 1.5x the largest tensor: full + a received shard)."""
    import transformers

    path = str(tmp_path / "big_vocab")
    config = transformers.LlamaConfig(
        vocab_size=65536, hidden_size=256, intermediate_size=65536, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    out = str(tmp_path / "out")
    rank0 = run_ranks(2, checkpoint_workers.save_memory, path, out, out_dir=str(tmp_path / "r"))[0]
    assert rank0["largest_full_tensor"] == 65536 * 256 * 4
    assert rank0["added"] <= 0.5 * rank0["largest_full_tensor"], rank0  # a block and a received part
    source, saved = (
        load_file(os.path.join(path, "model.safetensors")),
        load_file(os.path.join(out, "saved", "model.safetensors")),
    )
    assert source.keys() == saved.keys() and all(torch.equal(source[k], saved[k]) for k in source)
    # consolidation streams the same way, in a fresh process: its peak above its imports is a block
    # and its pages (assembling whole tensors measured 3x the largest)
    done = checkpoint_workers.consolidate_in_fresh_process(
        os.path.join(out, "distributed"), str(tmp_path / "consolidated")
    )
    assert done["peak_rss"] - done["import_rss"] <= 0.75 * rank0["largest_full_tensor"], done
    consolidated = load_file(str(tmp_path / "consolidated" / "model.safetensors"))
    assert source.keys() == consolidated.keys() and all(torch.equal(source[k], consolidated[k]) for k in source)
