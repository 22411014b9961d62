"""Mixture-of-experts with expert tensor parallelism: per-expert checkpoint keys (Qwen's
gate_proj/up_proj/down_proj, Mixtral's w1/w3/w2) read into transformers' fused 3-D experts, each rank
reading only its slice of every expert; saved back to the per-expert keys, bit for bit. GPT-OSS:
transposed experts with interleaved gate/up, expert biases and per-head attention sinks."""

from __future__ import annotations

import json

import pytest
import torch
import tp_workers
from checks import assert_like_one_process, assert_same_checkpoint
from compare import assert_within
from conftest import once_per_world_size
from distributed import run_ranks
from tiny_models import MOE, make_checkpoint

import hf_parallel
from hf_parallel.checkpoint.loading import checkpoint_files
from hf_parallel.commands.report import plan_report

# per forward, 2 layers: attention output + experts per layer, + the vocab-parallel embedding; Qwen2-MoE's
# shared expert adds one per layer; DeepSeek-V3 (transformers' plan: MLA attention replicated) has a
# dense first layer (1), then routed + shared experts (2), + the embedding
ALL_REDUCES = {"qwen2_moe": 7, "deepseek_v3": 4}


@pytest.fixture(scope="module")
def moe_paths(tiny_root):
    return {name: make_checkpoint(name, tiny_root) for name in MOE}


@pytest.fixture(scope="module")
def moe_results(moe_paths, tmp_path_factory):
    def run(world_size):
        root = tmp_path_factory.mktemp(f"moe{world_size}")
        cases = {name: (path, "auto") for name, path in moe_paths.items()}
        ranks = run_ranks(world_size, tp_workers.compare_tp, cases, str(root / "saved"), out_dir=str(root / "r"))
        dist = run_ranks(
            world_size, tp_workers.compare_tp, cases, str(root / "dist"), False, True, out_dir=str(root / "d")
        )
        return ranks, dist, root

    return once_per_world_size(run)


def test_checkpoints_hold_per_expert_keys(moe_paths):
    """What transformers writes, and what hub MoE checkpoints hold: one tensor per expert (GPT-OSS
    alone keeps its experts stacked: [E, in, out], gate and up interleaved, with biases)."""
    for name, path in moe_paths.items():
        keys = list(checkpoint_files(path))
        if name == "gpt_oss":
            assert "model.layers.0.mlp.experts.gate_up_proj" in keys and not any(".experts.3." in k for k in keys)
            continue
        expert_key = "w1" if name == "mixtral" else "gate_proj"
        assert any(f"experts.3.{expert_key}.weight" in key for key in keys), name
        assert not any(key.endswith("experts.gate_up_proj") for key in keys), name


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_expert_tp_matches_single_process_and_saves_per_expert_keys(moe_results, moe_paths, world_size):
    ranks, dist, root = moe_results(world_size)
    for name, path in moe_paths.items():
        for rank, out in enumerate(ranks):
            r = out[name]
            assert_like_one_process(r, rank, 1e-5, name)
            assert r["counts"]["all_reduce"] == ALL_REDUCES.get(name, 5), (name, r["counts"])
        assert_same_checkpoint(path, str(root / "saved" / name))
        consolidated = str(root / "consolidated" / name)
        hf_parallel.consolidate(str(root / "dist" / name), consolidated, progress=False)
        assert_same_checkpoint(path, consolidated)


def test_plan_report_shows_each_expert_parameter(moe_paths):
    report = plan_report(moe_paths["qwen3_moe"], 2)
    line = next(line for line in report.splitlines() if line.startswith("model.layers.0.mlp.experts.gate_up_proj"))
    assert "packed_colwise" in line and "packed(dim=1, sizes=[32,32])" in line and "4x32x48 4x32x48" in line
    line = next(line for line in report.splitlines() if line.startswith("model.layers.0.mlp.experts.down_proj"))
    assert "rowwise" in line and "chunks(dim=2, sizes=[16,16])" in line and "4x48x16 4x48x16" in line
    # GPT-OSS at 3: [E, in, out] experts split on their last dim in whole (gate, up) pairs, in the same
    # multiples of 8 intermediate columns as the down projection; sinks follow the query heads (6 -> 2,1,3)
    report = plan_report(moe_paths["gpt_oss"], 3).splitlines()
    expected = {
        "model.layers.0.mlp.experts.gate_up_proj ": ("packed_colwise", "chunks(dim=2, sizes=[32,16,16])"),
        "model.layers.0.mlp.experts.gate_up_proj_bias ": ("packed_colwise", "chunks(dim=1, sizes=[32,16,16])"),
        "model.layers.0.mlp.experts.down_proj ": ("rowwise", "chunks(dim=1, sizes=[16,8,8])"),
        "model.layers.0.mlp.experts.down_proj_bias ": ("moe_tp_experts", "replicated"),
        "model.layers.0.self_attn.sinks ": ("colwise", "chunks(dim=0, sizes=[2,1,3])"),
    }
    for start, words in expected.items():
        line = next(line for line in report if line.startswith(start))
        assert all(word in line for word in words), line


@pytest.mark.distributed
def test_saved_at_4_loads_at_2_and_saves_per_expert_keys_again(moe_results, moe_paths, tmp_path):
    """The manifest remembers the per-expert form, so a model loaded from a distributed save writes it."""
    _, _, root4 = moe_results(4)
    cases = {name: (str(root4 / "dist" / name), "auto", path) for name, path in moe_paths.items()}
    ranks = run_ranks(2, tp_workers.compare_tp, cases, str(tmp_path / "saved"), out_dir=str(tmp_path / "r"))
    for rank, out in enumerate(ranks):
        for name in moe_paths:
            assert_like_one_process(out[name], rank, 1e-5, name)
    for name, path in moe_paths.items():
        assert_same_checkpoint(path, str(tmp_path / "saved" / name))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("tp_plan", ["auto", None], ids=["ep_with_tp", "ep_alone"])
def test_expert_parallel_matches_single_process(moe_paths, tiny_root, tmp_path, world_size, tp_plan):
    """ep_plan="auto": E/ws whole experts per rank (4 experts: 2+2 at EP=2, 1 each at EP=4); also Granite-4's
    MoE hybrid (Mamba-2 mixers beside the experts, its fused experts stored whole per layer)."""
    moe_paths = {**moe_paths, "granitemoehybrid": make_checkpoint("granitemoehybrid", tiny_root)}
    cases = {name: (path, tp_plan) for name, path in moe_paths.items()}
    ranks = run_ranks(world_size, tp_workers.compare_ep, cases, str(tmp_path / "saved"), out_dir=str(tmp_path / "r"))
    for rank, out in enumerate(ranks):
        for name in moe_paths:
            r = out[name]
            assert_like_one_process(r, rank, 1e-5, name)  # an expert's gradient missing on its rank fails
            assert set(r["experts"].values()) == {4 // world_size}, (name, r["experts"])
    for name, path in moe_paths.items():
        assert_same_checkpoint(path, str(tmp_path / "saved" / name))


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 3])
def test_ep_size_exchanges_tokens_like_one_process_for_every_family(moe_paths, tmp_path, world_size):
    """``ep_size`` over as many data-parallel replicas (each the same batch here: their gradients average to one
    process's): every family's 4 routed experts 2 + 2 per rank (at 3: 2 + 1 + 1, spread unevenly), shared
    experts (Qwen2-MoE, DeepSeek-V3) and attention data-parallel, GPT-OSS's expert biases once per routed token;
    the world's tokens per expert counted; saved back bitwise."""
    moe_paths = moe_paths if world_size == 2 else {"qwen3_moe": moe_paths["qwen3_moe"]}
    cases = {name: (path, None) for name, path in moe_paths.items()}
    sizes = dict(dp_replicate_size=world_size, ep_size=world_size, count_expert_tokens=True)
    ranks = run_ranks(world_size, tp_workers.compare_ep, cases, str(tmp_path / "saved"), sizes,
                      out_dir=str(tmp_path / "r"))  # fmt: skip
    for rank, out in enumerate(ranks):
        for name, path in moe_paths.items():
            assert_like_one_process(out[name], rank, 1e-5, name)
            held = [2, 2] if world_size == 2 else [2, 1, 1]
            assert set(out[name]["experts"].values()) == {held[rank]}, (name, out[name]["experts"])
            # the world's tokens per expert in the one forward: every rank routed the same batch
            want = {p: [world_size * n for n in c] for p, c in tp_workers.routed_per_expert(path).items()}
            assert out[name]["tokens_per_expert"] == want, name
    for name, path in moe_paths.items():
        assert_same_checkpoint(path, str(tmp_path / "saved" / name))


@pytest.mark.distributed
def test_a_rank_whose_experts_receive_no_token_still_joins_the_backward(tmp_path):
    """The token exchange with every token routed to rank 0's expert: rank 1's receives none, yet both ranks run
    both exchanges' backward (a rank skipping one would leave the other waiting); values and gradients are one
    process's (the idle expert's gradient zero, not missing)."""
    for rank, out in enumerate(run_ranks(2, tp_workers.exchange_with_an_idle_rank, out_dir=str(tmp_path))):
        assert_within(out, atol=1e-6, rtol=1e-6, where=f"rank {rank}")


def test_the_plan_shows_how_ep_size_spreads_the_experts(moe_paths):
    """``hf-parallel plan --ep``: the EP groups, the experts per EP rank (unevenly where they do not divide), and
    each rank's bytes at rest with the experts split over EP, not over FSDP's group."""
    report = plan_report(moe_paths["qwen3_moe"], 1, dp_replicate_size=3, ep_size=3)
    line = next(line for line in report.splitlines() if line.startswith("experts (ep_size=3"))
    assert "EP groups [[0, 1, 2]]" in line and "each 4 experts held [2, 1, 1] per EP rank" in line, line
    # every rank's own: the experts' rows, the bytes, those at rest and the largest rank's memory (rank 0 holds
    # two experts of each module, ranks 1 and 2 one)
    row = next(line for line in report.splitlines() if line.startswith("model.layers.0.mlp.experts.gate_up_proj"))
    assert "2x64x48 1x64x48 1x64x48 / [24576, 12288, 12288]" in row, row
    totals = next(line for line in report.splitlines() if line.startswith("bytes per rank: "))
    first, second, third = json.loads(totals.removeprefix("bytes per rank: ").partition(" (")[0])
    assert first - second == 2 * (12288 + 6144) and second == third, totals  # an expert more in each of 2 layers
    assert "(formula, rank 0, the largest)" in report
    report = plan_report(moe_paths["qwen3_moe"], 2, fsdp_size=2, ep_size=4)
    line = next(line for line in report.splitlines() if line.startswith("model.layers.0.mlp.experts.gate_up_proj"))
    assert "moe_ep_tokens" in line and "chunks(dim=0, sizes=[1,1,1,1])" in line, line
    assert "1x64x48 1x64x48 1x64x48 1x64x48 / [12288, 12288, 12288, 12288]" in line, line  # EP ranks 0-3
    rest = next(line for line in report.splitlines() if line.startswith("at rest under FSDP2"))
    assert rest.count(",") >= 3 and "(rank 0's EP group: each EP rank holds its own experts)" in rest, rest
    with pytest.raises(ValueError, match=r"ep_size must be tp_size \(2\) times a divisor"):
        plan_report(moe_paths["qwen3_moe"], 2, fsdp_size=2, ep_size=2 * 4)
    report = plan_report(moe_paths["qwen3_moe"], 1, dp_replicate_size=4, ep_size=2)  # two EP groups of 2
    line = next(line for line in report.splitlines() if line.startswith("model.layers.0.mlp.experts.gate_up_proj"))
    assert line.endswith("2x64x48 2x64x48 / [24576, 24576]"), line  # rank 0's EP group: the other holds the same


@pytest.mark.parametrize("model, tp, ep, local, shared", [("qwen3_moe", 1, 2, 2, 0), ("qwen3_moe", 2, 4, 1, 0),
                                                           ("qwen2_moe", 1, 2, 2, 40)])  # fmt: skip
def test_the_step_formula_counts_the_pairs_arriving_under_ep_size(moe_paths, model, tp, ep, local, shared):
    """A training step's activations under ``ep_size`` (``memory.step_memory``, the plan's memory line), counted by
    hand for the tiny Qwen3-MoE and Qwen2-MoE (hidden 48, 2 layers of 4 experts of 32, top-2, vocabulary 101;
    Qwen2-MoE's shared expert 40 wide; float32, sdpa) at 1 x 2048 tokens: GPT's layer (34 bytes per token and hidden
    unit in 16-bit, 24 of them over TP) and the logits, less each experts layer's dense MLP part (16 over TP), plus
    per experts layer the pairs that may arrive (every EP rank's TP share of its tokens, ``min(top_k, experts
    here)`` pairs each: 2 at EP=2, 1 at EP=4) with their input row and four intermediate-wide tensors, the pairs
    this rank sends (``top_k`` a token) with their output row, and a shared expert's four tensors per token."""
    hidden, inner, vocab, layers, tokens, top_k = 48, 32, 101, 2, 2048, 2
    share = tokens // tp
    arriving, sent = ep * share * min(top_k, local), share * top_k
    dense = layers * tokens * hidden * (10 + 24 // tp) * 2 + tokens * vocab * (4 + 2 * 4)
    pairs = arriving * (hidden + 4 * inner) + sent * hidden + tokens * 4 * shared // tp
    experts = layers * (pairs * 4 - tokens * hidden * 16 // tp * 2)
    line = plan_report(moe_paths[model], tp, dp_replicate_size=ep // tp, ep_size=ep).splitlines()[-1]
    assert line.endswith(
        f"activations {(dense + experts) / 2**20:,.2f} at batch 1 x seq 2048, up to {arriving:,} (token, expert) pairs "
        "arriving per experts layer; hf_parallel/memory.py)"
    ), line


@pytest.mark.distributed
def test_ep_size_ranks_generate_their_own_prompts_stepping_together(moe_paths, tmp_path):
    """Data-parallel attention at inference: each rank its own prompt (of another length, for another number
    of tokens); the rank done first keeps joining the exchanges until the other is (transformers' synced_gpus);
    each rank's greedy tokens equal one process's on its prompt."""
    import transformers

    path = moe_paths["qwen3_moe"]
    prompts, new_tokens = [[5, 9, 14, 3, 7, 21], [11, 4, 8]], [7, 3]
    sizes = dict(dp_replicate_size=2, ep_size=2)
    ranks = run_ranks(2, tp_workers.own_prompts_generated, path, sizes, prompts, new_tokens, out_dir=str(tmp_path))
    single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for got in ranks:
        ids = torch.tensor([prompts[got["prompt"]]])
        want = single.generate(ids, max_new_tokens=new_tokens[got["prompt"]], do_sample=False, eos_token_id=None)
        assert got["tokens"] == want[0].tolist(), got
    assert sorted(got["prompt"] for got in ranks) == [0, 1]


@pytest.mark.distributed
def test_expert_parallel_peak_memory_per_rank_is_half_the_experts_plus_the_rest(tiny_root, moe_paths, tmp_path):
    """Measured, not assumed: a Qwen3-MoE with 192 MiB of fp32 experts (32 per layer, per-expert keys
    on disk) under EP=2. Each rank's peak RSS over loading and a forward, above a baseline taken after
    warming the same code on a tiny model, is its 96 MiB of experts plus the replicated rest, plus
    little more (activations, allocator); not the whole experts, nor the experts twice (the pages of
    the per-expert keys it copied from are released with each fused parameter)."""
    import transformers

    path = str(tmp_path / "moe_192mib")
    config = transformers.Qwen3MoeConfig(
        vocab_size=101, hidden_size=256, intermediate_size=256, moe_intermediate_size=512, num_experts=32,
        num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    all_experts = 4 * 32 * 3 * 256 * 512 * 4
    for rank, r in enumerate(run_ranks(2, tp_workers.expert_parallel_memory, path, moe_paths["qwen3_moe"], True,
                                       out_dir=str(tmp_path / "r"))):  # fmt: skip
        assert r["local_expert_bytes"] == all_experts // 2, (rank, r)
        expected = r["local_expert_bytes"] + r["rest_bytes"]
        assert expected <= r["resident"] <= r["peak"], (rank, r)  # the experts really are held
        assert r["peak"] <= 1.2 * expected + (8 << 20), (rank, r["peak"] / expected, r)
