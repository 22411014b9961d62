"""Every tiny architecture at TP=2, 3, 4 against single-process transformers (fp32)."""

import os
import sys

import pytest
import tp_workers
from checks import assert_like_one_process, assert_same_checkpoint
from distributed import run_ranks
from tiny_models import ARCHS, DISCOVERED, variant_plans
from tp_workers import INPUT_IDS

pytestmark = pytest.mark.distributed

TOL = 1e-5
# all-reduces per forward beyond the 2 per decoder layer (o_proj, down_proj) + 1 (vocab-parallel embedding)
EXTRA_ALL_REDUCES_PER_LAYER = {"olmo2": 2}  # q_norm / k_norm reduce their mean of squares


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("arch", sorted(ARCHS) + sorted(variant_plans()))
def test_logits_and_grads_match_single_process(tp_results, arch, world_size):
    ranks, _ = tp_results(world_size)
    for rank, results in enumerate(ranks):
        assert_like_one_process(results[arch], rank, TOL)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_collectives_per_forward(tp_results, arch, world_size):
    ranks, _ = tp_results(world_size)
    for results in ranks:
        r = results[arch]
        per_layer = 2 + EXTRA_ALL_REDUCES_PER_LAYER.get(arch, 0)
        assert r["counts"]["all_reduce"] == per_layer * r["layers"] + 1
        assert r["counts"]["all_gather"] == 1  # the logits
        tokens = INPUT_IDS.numel()  # each sum is of the hidden states (OLMo-2's norms': one number a token)
        extra = per_layer - 2
        assert r["moved"]["all_reduce"] == 4 * tokens * ((2 * r["layers"] + 1) * r["hidden"] + extra * r["layers"])
        assert r["moved"]["all_gather"] == 4 * tokens * -(-r["vocab"] // world_size)  # the largest vocab piece


def test_tp_plan_none_keeps_the_whole_model_on_every_rank_without_collectives(tp_results):
    for rank, results in enumerate(tp_results(2)[0]):
        r = results["llama_replicated"]
        assert r["plan_source"] == "tp_plan=None (every parameter replicated)"
        assert r["counts"] == {"all_reduce": 0, "all_gather": 0}
        assert_like_one_process(r, rank, TOL)  # the full gradients, on every rank


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("case", sorted(ARCHS) + sorted(variant_plans()))
def test_save_is_bitwise_equal_to_source(tp_results, tiny_paths, case, world_size):
    _, save_root = tp_results(world_size)
    arch = variant_plans()[case][0] if case in variant_plans() else case
    assert_same_checkpoint(tiny_paths[arch], f"{save_root}/{case}")


@pytest.mark.parametrize("arch", DISCOVERED)
def test_plan_sources_curated_file_and_discovery(tp_results, arch):
    """The same checkpoints ran once with plans/ (what "auto" picks) and once with discovery."""
    ranks, _ = tp_results(2)
    assert ranks[0][arch]["plan_source"] == f"plans/{arch.split('_')[0]}.toml"
    assert ranks[0][f"{arch}_discovered"]["plan_source"].startswith("discovered from the")


def test_norm_inside_the_vocab_parallel_embedding_gets_summed_gradients(tmp_path):
    """Inkling's embed_tokens holds a norm applied before the vocab-parallel reduce: each rank's
    norm sees only its own tokens, so its gradient must be summed (the sweep caught a 5e-4 error)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from discovery_report import build

    path = build("inkling_text", str(tmp_path))
    ranks = run_ranks(2, tp_workers.compare_tp, {"inkling": (path, "discover")}, None, out_dir=str(tmp_path / "r"))
    for rank, out in enumerate(ranks):
        assert_like_one_process(out["inkling"], rank, 1e-5, "inkling")
