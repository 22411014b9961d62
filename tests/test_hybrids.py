"""Hybrid decoders: Mamba-1/2 mixers, Gated DeltaNet and short convolutions beside (gated) attention,
split by their heads at TP=2 and 3 against one process: logits, every gradient's slice, greedy tokens
through the conv and recurrent caches, the share of the weights a rank holds, and a save bitwise equal
to the source; pipeline stages on two ranks; sequence parallelism refused by name."""

import os

import hybrid_workers
import pytest
from checks import assert_like_one_process, assert_same_checkpoint, assert_steps_like_one_process
from compare import assert_within
from conftest import once_per_world_size
from distributed import run_ranks
from tiny_models import HYBRIDS, make_checkpoint

TOL = 1e-5
# stages: layers whose kind the model's loop reads (Nemotron-H's block_type), layers returning tuples
# (Bamba), a recurrent layer's cache slot (LFM2), a layer list of two kinds (Qwen3-Next)
PIPELINED = ["bamba", "nemotron_h", "lfm2", "qwen3_next"]


@pytest.fixture(scope="session")
def hybrid_paths(tiny_root):
    return {name: make_checkpoint(name, tiny_root) for name in HYBRIDS}


@pytest.fixture(scope="session")
def hybrid_results(hybrid_paths, tmp_path_factory):
    def run(world_size):
        root = str(tmp_path_factory.mktemp(f"hybrids{world_size}"))
        cases = {name: (path, "auto") for name, path in hybrid_paths.items()}
        pipelined = PIPELINED if world_size == 2 else []
        ranks = run_ranks(
            world_size, hybrid_workers.tensor_and_pipeline, cases, os.path.join(root, "saved"), pipelined,
            out_dir=os.path.join(root, "results"),
        )  # fmt: skip
        return ranks, os.path.join(root, "saved")

    return once_per_world_size(run)


PLAN_FILE = {"bamba": "falcon_h1", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_next", "falcon_mamba": "mamba"}


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("family", sorted(HYBRIDS))
def test_hybrid_matches_one_process_and_saves_its_source(hybrid_results, hybrid_paths, family, world_size):
    ranks, saved = hybrid_results(world_size)
    for rank, results in enumerate(ranks):
        r = results["tp"][family]
        assert_like_one_process(r, rank, TOL)
        assert r["tokens"]["parallel"] == r["tokens"]["single"]
        assert r["held"] <= (0.6 if world_size == 2 else 0.45), f"rank {rank} holds {r['held']:.2f} of the weights"
    source = ranks[0]["tp"][family]["plan_source"]
    if family == "hunyuan_v1_dense":  # transformers ships only its LM head's rule: discovery splits the layers
        assert source == "discovered from the HunYuanDenseV1ForCausalLM module tree"
    else:
        assert source == f"plans/{PLAN_FILE.get(family, family)}.toml"
    assert_same_checkpoint(hybrid_paths[family], os.path.join(saved, family))


@pytest.mark.distributed
def test_lora_on_a_projection_inside_a_mixer_block_is_refused_by_name(hybrid_results):
    for results in hybrid_results(2)[0]:
        assert results["lora"] == (
            "ValueError: model.layers.0.mamba.in_proj: its weight is split by the block rule 'layers.*.mamba' "
            "(mamba2_mixer) together with the rest of that block, which a LoRA adapter cannot follow; leave it out "
            "of target_modules"
        )


@pytest.mark.distributed
def test_attention_weights_of_local_heads_are_refused_at_the_call(hybrid_results):
    for results in hybrid_results(2)[0]:  # every rank
        assert results["output_attentions"].startswith("output_attentions=True: under tensor parallelism each rank's")


@pytest.mark.distributed
@pytest.mark.parametrize("family", PIPELINED)
def test_hybrid_in_pipeline_stages_matches_one_process(hybrid_results, family):
    for rank, results in enumerate(hybrid_results(2)[0]):
        r = results["pp"][family]
        assert_within({"logits": r["logits"]}, atol=TOL, rtol=TOL, where=f"{family} stages, rank {rank}")
        assert r["tokens"][0] == r["tokens"][1]


def test_plan_dry_run_shows_a_mixer_split_by_heads_and_refuses_sequence_parallelism(hybrid_paths):
    """Bamba at TP=3: 8 SSM heads of 12 channels split 3/3/2, its one B/C group of 8 on every rank (in_proj's
    z|x|B|C|dt rows: 36+36+8+8+3 = 91, and 24+24+8+8+2 = 66); Ulysses cannot split its recurrence, refused
    by name."""
    from hf_parallel.commands.report import plan_report

    report = plan_report(hybrid_paths["bamba"], tp=3)
    line = next(row for row in report.splitlines() if "layers.0.mamba.in_proj.weight" in row)
    assert "mamba2_mixer" in line and "heads(dim=0, sizes=[91,91,66])" in line, line
    with pytest.raises(ValueError, match=r"sp_size=2: model.layers.0.mamba \(BambaMixer, and 0 more like it\) carries"):
        plan_report(hybrid_paths["bamba"], tp=1, sp=2)


def test_what_hybrids_cannot_combine_is_refused_by_name_before_any_weight_is_read(hybrid_paths):
    """A rule under a mixer's block rule (the block computes with its own split: the other would be ignored
    silently), and TP with FSDP on a recurrent mixer (FSDP's gradient hooks run with a module's forward, and
    a mixer reads its conv weight without calling its module)."""
    from hf_parallel.commands.report import plan_report

    path = hybrid_paths["bamba"]
    rules = {"layers.*.mamba": "mamba2_mixer", "layers.*.mamba.in_proj": "colwise", "lm_head": "colwise_gather_output"}
    both = r"model.layers.0.mamba.in_proj.weight: rule 'layers.\*.mamba.in_proj' \(colwise\) names a parameter that"
    with pytest.raises(ValueError, match=both + r" the block rule 'layers.\*.mamba'"):
        plan_report(path, tp=2, tp_plan=rules)
    with pytest.raises(
        ValueError, match=r"fsdp_size=2 with tp_size=2: model.layers.0.mamba \(BambaMixer\) is a recurrent"
    ):
        plan_report(path, tp=2, fsdp_size=2)
    assert "at rest under FSDP2" in plan_report(path, tp=1, fsdp_size=2)  # FSDP alone shards it like any layer


@pytest.mark.parametrize(
    "family, block, style",
    [("falcon_h1", "model.layers.*.mamba", "mamba2_mixer"), ("lfm2", "model.layers.*.conv", "short_conv"),
     ("mamba", "backbone.layers.*.mixer", "mamba1_mixer")],
)  # fmt: skip
def test_discovery_gives_a_known_mixer_class_its_block_style(hybrid_paths, family, block, style):
    import torch
    import transformers

    from hf_parallel.build import build_empty
    from hf_parallel.tensor.discover import discover_plan

    config = transformers.AutoConfig.from_pretrained(hybrid_paths[family])
    found = discover_plan(build_empty(transformers.AutoModelForCausalLM, config, torch.float32))
    assert found.rules[block] == style
    assert not any(block.rsplit(".", 1)[-1] + "." in rule for rule in found.rules)  # nothing under it ruled apart


# 5 AdamW steps with clipping: Bamba's one B/C group shared by both ranks (summed rows, a shared norm) and
# Jamba's x_proj (partial products summed, gradients summed back) at TP=2; FSDP=2 alone on Bamba
TRAINED = {
    "bamba_tp": ("bamba", {"tp_size": 2}, "backward"),
    "bamba_fsdp": ("bamba", {"fsdp_size": 2, "tp_plan": None}, "backward"),
    "jamba_tp": ("jamba", {"tp_size": 2}, "train_step"),
}


@pytest.fixture(scope="module")
def hybrid_training(hybrid_paths, tmp_path_factory):
    import training_workers

    root = str(tmp_path_factory.mktemp("hybrid_training"))
    cases = {name: (hybrid_paths[family], sizes, loop) for name, (family, sizes, loop) in TRAINED.items()}
    ranks = run_ranks(2, training_workers.train, cases, root, out_dir=os.path.join(root, "results"))
    references = {family: training_workers.one_process(hybrid_paths[family]) for family in {"bamba", "jamba"}}
    return ranks, root, references


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(TRAINED))
def test_hybrid_training_steps_match_one_process(hybrid_training, case):
    """Losses, clipped global gradient norms and the gathered weights after 5 steps, as test_training's."""
    ranks, root, references = hybrid_training
    assert_steps_like_one_process(ranks, case, references[TRAINED[case][0]], os.path.join(root, case), TOL)
