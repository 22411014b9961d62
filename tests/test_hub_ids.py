"""A hub id loads as transformers loads it: from huggingface_hub's cache (here offline, a cache laid out as
the hub's client writes it), with huggingface_hub's error, naming the id, when it is not there."""

import shutil

import pytest
import torch


@pytest.fixture
def offline_cache(tmp_path, monkeypatch, tiny_paths):
    """huggingface_hub's cache holding the tiny llama as ``org/tiny-llama`` at one revision, the hub offline."""
    from huggingface_hub import constants

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--org--tiny-llama"
    shutil.copytree(tiny_paths["llama"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return repo / "snapshots" / revision


def test_a_cached_hub_id_loads_as_its_directory(offline_cache, tiny_paths):
    import hf_parallel
    from hf_parallel.checkpoint.hub import local_checkpoint

    assert local_checkpoint("org/tiny-llama") == str(offline_cache)
    by_id = hf_parallel.AutoModelForCausalLM.from_pretrained("org/tiny-llama", dtype=torch.float32)
    by_dir = hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_paths["llama"], dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 13]])
    assert torch.equal(by_id(ids).logits, by_dir(ids).logits)


def test_an_id_neither_cached_nor_reachable_is_refused_naming_it(offline_cache):
    import hf_parallel

    with pytest.raises(OSError, match="'org/absent' is neither a local checkpoint directory nor a hub id"):
        hf_parallel.AutoModelForCausalLM.from_pretrained("org/absent")
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        hf_parallel.AutoModelForCausalLM.from_pretrained("/no/such/dir")


def test_a_cache_holding_configs_only_is_refused_naming_the_id(offline_cache):
    """An earlier tokenizer load cached configs and tokenizer files alone: refused, not read as empty."""
    from hf_parallel.checkpoint.hub import local_checkpoint

    snapshot = offline_cache.parent.parent.parent / "models--org--configs-only" / "snapshots" / offline_cache.name
    snapshot.mkdir(parents=True)
    shutil.copy(offline_cache / "config.json", snapshot / "config.json")
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(offline_cache.name)
    with pytest.raises(OSError, match="'org/configs-only': huggingface_hub's cache holds its configs but no weights"):
        local_checkpoint("org/configs-only")
