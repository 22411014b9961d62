"""Config traps: heads come from what the model computes with, so a config attribute the model
never reads (GPT-2 with num_key_value_heads), aliases, explicit head sizes, num_key_value_heads=None,
multi-query and partial rotary all give single-process logits and a bitwise save, never a wrong number."""

import os
import warnings

import pytest
import torch
from checks import assert_like_one_process, assert_same_checkpoint
from conftest import compare_tp_runs
from tiny_models import TRAPS, make_checkpoint

from hf_parallel.build import build_empty
from hf_parallel.distributed.mesh import Mesh
from hf_parallel.tensor.geometry import ConfigIgnoredWarning
from hf_parallel.tensor.parallelize import model_layout
from hf_parallel.tensor.plan import resolve_plan

TOL = 1e-5


@pytest.fixture(scope="module")
def trap_paths(tiny_root):
    return {name: make_checkpoint(name, tiny_root) for name in TRAPS}


@pytest.fixture(scope="module")
def trap_results(trap_paths, tmp_path_factory):
    return compare_tp_runs(tmp_path_factory, "traps", {name: (path, "auto") for name, path in trap_paths.items()})


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("trap", sorted(TRAPS))
def test_config_trap_gives_single_process_logits_and_a_bitwise_save(trap_results, trap_paths, trap, world_size):
    ranks, saved = trap_results(world_size)
    for rank, results in enumerate(ranks):
        assert_like_one_process(results[trap], rank, TOL)
    assert_same_checkpoint(trap_paths[trap], os.path.join(saved, trap))


@pytest.mark.parametrize(
    "trap, ignored",
    [
        ("gpt2_stray_kv", "config.num_key_value_heads=2 (the model uses 6)"),
        ("bloom_stray_kv", "config.num_key_value_heads=2"),
    ],
)
def test_an_attribute_the_model_never_reads_is_named_once(trap_paths, trap, ignored):
    import transformers

    config = transformers.AutoConfig.from_pretrained(trap_paths[trap])
    model = build_empty(transformers.AutoModelForCausalLM, config, torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shard = model_layout(model, resolve_plan(model, "auto"), Mesh.dry_run(tp_size=2))
    said = [str(w.message) for w in caught if issubclass(w.category, ConfigIgnoredWarning)]
    assert len(said) == 1 and ignored in said[0], said
    assert (shard.heads.num_heads, shard.heads.num_kv_heads) == (6, 6)


def test_no_warning_when_the_config_agrees(trap_paths):
    import transformers

    config = transformers.AutoConfig.from_pretrained(trap_paths["llama_head_dim_not_hidden_over_heads"])
    model = build_empty(transformers.AutoModelForCausalLM, config, torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigIgnoredWarning)
        shard = model_layout(model, resolve_plan(model, "auto"), Mesh.dry_run(tp_size=3))
    assert (shard.heads.num_heads, shard.heads.num_kv_heads, shard.heads.head_dim) == (4, 2, 16)
