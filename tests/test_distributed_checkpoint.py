"""save_pretrained(distributed=True), hf-parallel consolidate, and loading a per-rank checkpoint at any
world size: round trips bit-exact, reshard logits equal to one process, interrupted saves harmless."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import checkpoint_workers
import pytest
import torch
import tp_workers
from checks import assert_like_one_process, assert_same_checkpoint, read_checkpoint
from distributed import run_ranks

import hf_parallel
from hf_parallel import CheckpointError
from hf_parallel.checkpoint.files import MANIFEST_FILE

pytestmark = pytest.mark.distributed


def _distributed_save(source: str, world_size: int, out: str, tmp_path) -> dict:
    return run_ranks(
        world_size, checkpoint_workers.save_as_loaded, source, out, True, out_dir=str(tmp_path / f"r{world_size}")
    )


def _file_digests(path: str) -> dict[str, str]:
    return {
        name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
        for name in os.listdir(path)
        if not name.endswith(".tmp")
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt_neox", "falcon_new"])
def test_distributed_save_consolidates_to_the_source(tiny_paths, tmp_path, arch, world_size):
    """Dense, packed gate_up/qkv (Phi-3), per-head interleaved (GPT-NeoX) and grouped qkv (Falcon)."""
    import transformers

    saved = str(tmp_path / "dist")
    _distributed_save(tiny_paths[arch], world_size, saved, tmp_path)
    manifest = json.load(open(os.path.join(saved, MANIFEST_FILE)))
    assert manifest["world_size"] == world_size and len(manifest["files"]) == world_size
    assert all(os.path.isfile(os.path.join(saved, name)) for name in manifest["files"])
    assert any(not entry["layout"]["dim"] is None for entry in manifest["tensors"].values())
    out = str(tmp_path / "full")
    done = hf_parallel.consolidate(saved, out, progress=False)
    assert_same_checkpoint(tiny_paths[arch], out)
    assert done["bytes"] == sum(t.numel() * t.element_size() for t in read_checkpoint(out).values())
    assert transformers.AutoModelForCausalLM.from_pretrained(out) is not None  # plain transformers reads it


@pytest.mark.parametrize("world_size", [2, 4])
def test_smollm2_distributed_save_consolidates_bit_exact(smollm2, tmp_path, world_size):
    import transformers

    saved, out = str(tmp_path / "dist"), str(tmp_path / "full")
    _distributed_save(smollm2, world_size, saved, tmp_path)
    transformers.AutoTokenizer.from_pretrained(smollm2).save_pretrained(saved)  # as a user would, beside it
    hf_parallel.consolidate(saved, out, progress=False)
    assert_same_checkpoint(smollm2, out)
    tokenizer = open(os.path.join(saved, "tokenizer.json"), "rb").read()
    assert open(os.path.join(out, "tokenizer.json"), "rb").read() == tokenizer  # non-weight files are copied


def test_saved_at_4_loads_at_1_2_3_and_4_with_single_process_logits(tiny_paths, tmp_path):
    """Resharding: every rank reads only the saved pieces that overlap its own slice."""
    import transformers

    cases = {"llama": "llama", "phi3": "phi3", "kvrep": "llama_tied_kvrep"}
    saved = {}
    for name, arch in cases.items():
        saved[name] = str(tmp_path / f"dist_{name}")
        _distributed_save(tiny_paths[arch], 4, saved[name], tmp_path)
    for world_size in (2, 3, 4):
        runs = {name: (saved[name], "auto", tiny_paths[arch]) for name, arch in cases.items()}
        for rank, out in enumerate(
            run_ranks(world_size, tp_workers.compare_tp, runs, None, out_dir=str(tmp_path / f"load{world_size}"))
        ):
            for name in cases:
                assert_like_one_process(out[name], rank, 1e-5, f"{name} at {world_size}")
    for name, arch in cases.items():  # one process, no torchrun: the whole model from four files
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(saved[name], tp_plan="auto", dtype=torch.float32)
        ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_paths[arch], dtype=torch.float32)
        assert torch.equal(model(tp_workers.INPUT_IDS).logits, ref(tp_workers.INPUT_IDS).logits), name


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_same_world_size_load_maps_each_ranks_own_file(tiny_paths, tmp_path, arch):
    """No copy and nothing else read: every parameter is a view of the saved file (packed ones too)."""
    saved = str(tmp_path / "dist")
    _distributed_save(tiny_paths[arch], 2, saved, tmp_path)
    for rows in run_ranks(2, checkpoint_workers.count_bytes_read, saved, out_dir=str(tmp_path / "bytes")):
        assert all(row["read"] == row["local"] and row["contiguous"] and row["file_view"] for row in rows.values()), (
            rows
        )


def test_distributed_save_then_standard_save_in_the_same_directory(tiny_paths, tmp_path):
    """Each form replaces the other's files; nothing stale is left for a loader to pick up."""
    out = str(tmp_path / "out")
    _distributed_save(tiny_paths["llama"], 2, out, tmp_path)
    first = json.load(open(os.path.join(out, MANIFEST_FILE)))["files"]
    _distributed_save(tiny_paths["llama"], 2, out, tmp_path)  # a second distributed save: new ids
    second = json.load(open(os.path.join(out, MANIFEST_FILE)))["files"]
    assert not set(first) & set(os.listdir(out)) and set(second) <= set(os.listdir(out))
    run_ranks(2, checkpoint_workers.save_as_loaded, tiny_paths["llama"], out, False, out_dir=str(tmp_path / "std"))
    assert sorted(n for n in os.listdir(out) if "safetensors" in n or n.endswith(".json")) == [
        "config.json", "generation_config.json", "model.safetensors"
    ]  # fmt: skip
    assert_same_checkpoint(tiny_paths["llama"], out)


@pytest.mark.parametrize("earlier", ["standard", "distributed"])
def test_rank_killed_mid_save_leaves_the_earlier_checkpoint(tiny_paths, tmp_path, earlier):
    """SIGKILL on rank 1 after its first tensor: OUT still holds, byte for byte, the earlier
    checkpoint, which still loads; no file under a final name is partial."""
    import transformers

    source, out = tiny_paths["llama"], str(tmp_path / "out")
    if earlier == "standard":
        shutil.copytree(source, out)
    else:
        _distributed_save(source, 2, out, tmp_path)
    before = _file_digests(out)
    with pytest.raises(Exception, match="process 1 terminated with signal SIGKILL|rank 1|process 0"):
        run_ranks(2, checkpoint_workers.save_killed_midway, source, out, out_dir=str(tmp_path / "killed"))
    assert any(n.endswith(".tmp") for n in os.listdir(out))  # rank 1 really died inside its file
    assert _file_digests(out) == before
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(out, tp_plan="auto", dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    assert torch.equal(model(tp_workers.INPUT_IDS).logits, ref(tp_workers.INPUT_IDS).logits)
    _distributed_save(source, 2, out, tmp_path)  # the next save succeeds and sweeps the leftovers
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    assert len(json.load(open(os.path.join(out, MANIFEST_FILE)))["files"]) == 2


def test_consolidate_cli_shards_and_reports_throughput(tiny_paths, tmp_path):
    saved, out = str(tmp_path / "dist"), str(tmp_path / "full")
    _distributed_save(tiny_paths["qwen2"], 2, saved, tmp_path)
    run = subprocess.run(
        [sys.executable, "-m", "hf_parallel", "consolidate", saved, out, "--max-shard-size", "20KB"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "MB/s" in run.stdout
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1
    assert_same_checkpoint(tiny_paths["qwen2"], out)


def test_bad_distributed_checkpoints_are_named(tiny_paths, tmp_path):
    saved = str(tmp_path / "dist")
    _distributed_save(tiny_paths["llama"], 2, saved, tmp_path)
    manifest_path = os.path.join(saved, MANIFEST_FILE)
    manifest = json.load(open(manifest_path))
    missing = os.path.join(saved, manifest["files"][1])
    os.rename(missing, missing + ".away")
    with pytest.raises(CheckpointError, match=rf"{manifest['files'][1]}: listed in the manifest, but missing"):
        hf_parallel.consolidate(saved, str(tmp_path / "never"), progress=False)
    assert not os.path.exists(tmp_path / "never")  # refused before anything was written
    os.rename(missing + ".away", missing)
    key = next(k for k, e in manifest["tensors"].items() if e["layout"]["dim"] is not None)
    manifest["tensors"][key]["dtype"] = "BF16"
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(
        CheckpointError, match=rf"{manifest['files'][0]}: '{key}' is F32 .* but the manifest says rank 0"
    ):
        hf_parallel.AutoModelForCausalLM.from_pretrained(saved, tp_plan="auto")
    open(manifest_path, "w").write("{not json")
    with pytest.raises(CheckpointError, match=rf"{MANIFEST_FILE}: not an hf_parallel"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(saved, tp_plan="auto")
