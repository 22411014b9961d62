"""Pipeline parallelism (issue 18): stages of contiguous layers, each with its own TP size, on real
gloo groups, against one process of the same checkpoint (fp32)."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from checks import assert_same_checkpoint, read_checkpoint
from conftest import once_per_world_size
from distributed import run_ranks
from tiny_models import PIPELINE, make_checkpoint

import hf_parallel
from hf_parallel.pipeline.schedule import order
from hf_parallel.pipeline.split import balanced_layers, split_stages

# layout name -> (world size, from_pretrained keywords, the checkpoints it runs, per-case keywords)
LAYOUTS = {
    "pp2": (2, dict(pp_size=2, tp_plan=None), ["pp_llama", "pp_qwen3", "pp_qwen2_moe", "pp_tied"], {}),
    "pp3": (3, dict(pp_size=3, tp_plan=None), ["pp_llama", "pp_tied"], {}),
    "vtp21": (3, dict(stage_tp_sizes=[2, 1]), ["pp_llama", "pp_qwen3", "pp_tied"], {}),
    "vtp12": (3, dict(stage_tp_sizes=[1, 2]), ["pp_tied", "pp_qwen2_moe"], {}),
    "pp2tp2": (4, dict(pp_size=2, tp_size=2), ["pp_llama", "pp_qwen2_moe"], {}),
    "pp2ep2": (4, dict(pp_size=2, tp_size=2, tp_plan=None), ["pp_qwen2_moe"], dict(ep_plan="auto")),
}
CASES = [(layout, name) for layout, (_, _, names, _) in LAYOUTS.items() for name in names]


@pytest.fixture(scope="module")
def pp_paths(tiny_root):
    return {name: make_checkpoint(name, tiny_root) for name in PIPELINE}


@pytest.fixture(scope="module")
def pp_results(pp_paths, tmp_path_factory):
    import workers

    def run(layout):
        world, sizes, names, kwargs = LAYOUTS[layout]
        root = str(tmp_path_factory.mktemp(layout))
        cases = {name: (pp_paths[name], kwargs) for name in names}
        save_root = os.path.join(root, "saved")
        results = run_ranks(world, workers.compare_pp, cases, sizes, save_root, out_dir=os.path.join(root, "out"))
        return results, save_root

    return once_per_world_size(run)


@pytest.mark.parametrize("layout,name", CASES)
def test_pipeline_matches_one_process(pp_results, pp_paths, layout, name):
    results, save_root = pp_results(layout)
    for rank, result in enumerate(results):
        got = result[name]
        where = f"{layout}/{name} rank {rank} (stage {got['stage']}, layers {got['layers']})"
        assert got["logits"] < 1e-5, where
        assert got["greedy"] and got["sampled"], where
        for schedule in ("gpipe", "1f1b"):
            assert got[schedule]["loss"] < 1e-5, (where, schedule)
            assert got[schedule]["grads"] < 1e-5 * max(1.0, got[schedule]["scale"]), (where, schedule, got[schedule])
        assert got["step"] < 1e-5, where
    stages = {}
    for result in results:
        stages.setdefault(result[name]["stage"], result[name]["layers"])
    layers = [layer for stage in sorted(stages) for layer in stages[stage]]
    assert layers == list(range(len(layers))), layers  # every layer built exactly once, in order
    tied = [(r[name]["tied"], r[name]["tied_bits"]) for r in results if r[name]["tied"]]
    if name == "pp_tied":  # the first and last stage's copies, bitwise equal after the step
        assert len(tied) >= 2 and all(t == tied[0] for t in tied), tied
    assert_same_checkpoint(pp_paths[name], os.path.join(save_root, name, "gathered"))
    consolidated = os.path.join(save_root, name, "consolidated")
    hf_parallel.consolidate(os.path.join(save_root, name, "distributed"), consolidated, progress=False)
    assert_same_checkpoint(pp_paths[name], consolidated)


def test_distributed_pipeline_save_loads_at_another_layout(pp_results, pp_paths):
    """Saved per rank at VTP [2, 1]; read back in one process (TP 1, no stages)."""
    _, save_root = pp_results("vtp21")
    saved = os.path.join(save_root, "pp_tied", "distributed")
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(saved, tp_plan=None, dtype=torch.float32)
    source = read_checkpoint(pp_paths["pp_tied"])
    for key, tensor in source.items():
        assert torch.equal(model.get_parameter(key), tensor), key


def test_stage_split_balances_and_checks(pp_paths):
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(pp_paths["pp_llama"])
    )
    split = split_stages(model, 2)
    assert split.layer_list == "model.layers" and split.head == ("model.embed_tokens",)
    assert set(split.tail) == {"model.norm", "lm_head"}
    assert sum(split.stage_layers) == 5 and split.stage_layers == (3, 2)  # embedding and head both weigh
    assert split_stages(model, 2, stage_layers=[1, 4]).stage_layers == (1, 4)
    with pytest.raises(ValueError, match="adds up to 4 layers, but model.layers has 5"):
        split_stages(model, 2, stage_layers=[2, 2])
    with pytest.raises(ValueError, match="fewer than the 6 pipeline stages"):
        split_stages(model, 6)
    # 30 equal layers on 4 stages, heavy ends: every layer once, the ends lighter
    counts = balanced_layers([1.0] * 30, 4, first_extra=3.0, last_extra=3.0)
    assert sum(counts) == 30 and counts[0] < counts[1] and counts[3] < counts[2], counts


def test_schedules_hold_every_step_once():
    for stages in (1, 2, 3, 4):
        for stage in range(stages):
            for count in (1, 4, 7):
                for schedule in ("gpipe", "1f1b"):
                    steps = order(schedule, stage, stages, count)
                    assert sorted(steps) == sorted([("F", m) for m in range(count)] + [("B", m) for m in range(count)])
                    assert all(steps.index(("F", m)) < steps.index(("B", m)) for m in range(count))
                in_flight = peak = 0
                for step, _ in order("1f1b", stage, stages, count):
                    in_flight += 1 if step == "F" else -1
                    peak = max(peak, in_flight)
                assert peak <= min(count, stages - stage)  # 1F1B holds at most stages - stage activations
