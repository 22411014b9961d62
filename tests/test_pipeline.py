"""Pipeline parallelism: stages of contiguous layers, each with its own TP size, on real
gloo groups, against one process of the same checkpoint (fp32)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from checks import assert_same_checkpoint, read_checkpoint
from compare import assert_within, largest_scale
from conftest import once_per_world_size
from distributed import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import PIPELINE, make_checkpoint

import hf_parallel
from hf_parallel.pipeline.schedule import order
from hf_parallel.pipeline.split import balanced_layers, split_stages

# layout name -> (world size, from_pretrained keywords, the checkpoints it runs, per-case keywords)
LAYOUTS = {
    "pp2": (2, dict(pp_size=2, tp_plan=None), ["pp_llama", "pp_qwen3", "pp_qwen2_moe", "pp_tied"], {}),
    "pp3": (3, dict(pp_size=3, tp_plan=None), ["pp_llama", "pp_tied"], dict(micro_batches=3)),  # decode split too
    "vtp21": (3, dict(stage_tp_sizes=[2, 1]), ["pp_llama", "pp_qwen3", "pp_tied"], {}),
    "vtp12": (3, dict(stage_tp_sizes=[1, 2]), ["pp_tied", "pp_qwen2_moe"], {}),
    "pp2tp2": (4, dict(pp_size=2, tp_size=2), ["pp_llama", "pp_qwen2_moe"], {}),
    "pp2ep2": (4, dict(pp_size=2, tp_size=2, tp_plan=None), ["pp_qwen2_moe"], dict(ep_plan="auto")),
    "pp2sp2": (4, dict(pp_size=2, sp_size=2, tp_plan=None), ["pp_llama", "pp_tied"], {}),
    "pp2cp2": (4, dict(pp_size=2, cp_size=2, tp_plan=None), ["pp_tied"], {}),  # the ring on each stage
}
CASES = [(layout, name) for layout, (_, _, names, _) in LAYOUTS.items() for name in names]


@pytest.fixture(scope="module")
def pp_paths(tiny_root):
    return {name: make_checkpoint(name, tiny_root) for name in PIPELINE}


@pytest.fixture(scope="module")
def pp_results(pp_paths, tmp_path_factory):
    import pipeline_workers

    def run(layout):
        world, sizes, names, kwargs = LAYOUTS[layout]
        root = str(tmp_path_factory.mktemp(layout))
        cases = {name: (pp_paths[name], kwargs) for name in names}
        save_root = os.path.join(root, "saved")
        results = run_ranks(
            world, pipeline_workers.compare_pp, cases, sizes, save_root, out_dir=os.path.join(root, "out")
        )
        return results, save_root

    return once_per_world_size(run)


@pytest.mark.distributed
@pytest.mark.parametrize("layout,name", CASES)
def test_pipeline_matches_one_process(pp_results, pp_paths, layout, name):
    results, save_root = pp_results(layout)
    check_against_one_process(results, save_root, pp_paths, layout, name)


@pytest.mark.distributed
def test_pipeline_over_gloo_matches_one_process(pp_paths, tmp_path, monkeypatch):
    """Stages on several hosts talk over gloo (forced: HF_PARALLEL_SHM=0): sends and receives, the
    TP broadcast inside a stage, the last stage's output, the tied gradients, the save's blocks."""
    import pipeline_workers

    monkeypatch.setenv("HF_PARALLEL_SHM", "0")  # inherited by the spawned ranks
    world, sizes, _, kwargs = LAYOUTS["vtp21"]
    save_root = str(tmp_path / "saved")
    cases = {"pp_tied": (pp_paths["pp_tied"], kwargs)}
    results = run_ranks(world, pipeline_workers.compare_pp, cases, sizes, save_root, out_dir=str(tmp_path / "out"))
    for rank, result in enumerate(results):  # no shared memory anywhere: gloo carried it all
        assert result["pp_tied"]["transport"] == {"pipes": 0, "tp_shm": False}, (rank, result["pp_tied"]["transport"])
    check_against_one_process(results, save_root, pp_paths, "vtp21 over gloo", "pp_tied")


def assert_against_one_process(got: dict, where: str, tol: float, whole_scale: bool = False) -> None:
    """``compare_pp``'s logits within ``tol``, each schedule's loss and every gradient this rank holds within
    1e-5 (``whole_scale``: of the largest gradient of any parameter, not each parameter's own)."""
    assert_within({"logits": got["logits"]}, atol=tol, rtol=tol, where=where)
    for schedule in ("gpipe", "1f1b"):
        grads = got[schedule]["grads"]
        atol = 1e-5 * max(1.0, largest_scale(grads)) if whole_scale else 1e-5
        assert_within({"loss": got[schedule]["loss"]}, atol=1e-5, rtol=0, where=f"{where} {schedule}")
        assert_within(grads, atol=atol, rtol=0 if whole_scale else 1e-5, where=f"{where} {schedule} gradients")


def check_against_one_process(results, save_root, pp_paths, layout, name):
    for rank, result in enumerate(results):
        got = result[name]
        where = f"{layout}/{name} rank {rank} (stage {got['stage']}, layers {got['layers']})"
        assert got["greedy"] and got["sampled"], where
        assert_against_one_process(got, where, 1e-5)
        assert_within(got["step"], atol=1e-5, rtol=1e-5, where=f"{where}: weights after an SGD step")
        assert "hf_parallel.train_step(model" in got["plain_backward"], where
    stages = {}
    for result in results:
        stages.setdefault(result[name]["stage"], result[name]["layers"])
    layers = [layer for stage in sorted(stages) for layer in stages[stage]]
    assert layers == list(range(len(layers))), layers  # every layer built exactly once, in order
    for result in results:  # each rank read its own stage's tensors, its TP slice of each, nothing more
        got = result[name]
        assert got["read"]["layers"] == got["layers"] and got["read"]["bytes"] == got["read"]["local"], got["read"]
    tied = [(r[name]["tied"], r[name]["tied_bits"]) for r in results if r[name]["tied"]]
    if name == "pp_tied":  # the first and last stage's copies, bitwise equal after the step
        assert len(tied) >= 2 and all(t == tied[0] for t in tied), tied
    assert_same_checkpoint(pp_paths[name], os.path.join(save_root, name, "gathered"))
    consolidated = os.path.join(save_root, name, "consolidated")
    hf_parallel.consolidate(os.path.join(save_root, name, "distributed"), consolidated, progress=False)
    assert_same_checkpoint(pp_paths[name], consolidated)


@pytest.mark.distributed
def test_distributed_pipeline_save_loads_at_another_layout(pp_results, pp_paths, tmp_path):
    """Saved per rank at VTP [2, 1]; read back in one process (TP 1, no stages), and at PP=3."""
    import pipeline_workers

    _, save_root = pp_results("vtp21")
    saved = os.path.join(save_root, "pp_tied", "distributed")
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(saved, tp_plan=None, dtype=torch.float32)
    source = read_checkpoint(pp_paths["pp_tied"])
    for key, tensor in source.items():
        assert torch.equal(model.get_parameter(key), tensor), key
    sizes = dict(pp_size=3, tp_plan=None)
    results = run_ranks(3, pipeline_workers.pipeline_logits, saved, pp_paths["pp_tied"], sizes, out_dir=str(tmp_path))
    assert [r["stage"] for r in results] == [0, 1, 2], results
    for rank, result in enumerate(results):
        assert_within({"logits": result["logits"]}, atol=1e-5, rtol=1e-5, where=f"PP=3 rank {rank}")


def test_stage_split_balances_and_checks(pp_paths, monkeypatch):
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(pp_paths["pp_llama"]))
    split = split_stages(model, 2)
    assert split.layer_list == "model.layers" and split.head == ("model.embed_tokens",)
    assert set(split.tail) == {"model.norm", "lm_head"}
    assert sum(split.stage_layers) == 5 and split.stage_layers == (3, 2)  # embedding and head both weigh
    assert split_stages(model, 2, stage_layers=[1, 4]).stage_layers == (1, 4)
    with pytest.raises(ValueError, match="adds up to 4 layers, but model.layers has 5"):
        split_stages(model, 2, stage_layers=[2, 2])
    with pytest.raises(ValueError, match="fewer than the 6 pipeline stages"):
        split_stages(model, 6)
    from hf_parallel.core.layers import find_layer_list

    gpt2 = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(n_layer=3, n_embd=32, n_head=4))
    assert transformers.GPT2Config.base_model_pp_plan is None  # no plan: the module tree's list of blocks
    gpt2_split = split_stages(gpt2, 2)
    assert gpt2_split.layer_list == "transformer.h" and set(gpt2_split.head) == {"transformer.wte", "transformer.wpe"}
    assert set(gpt2_split.tail) == {"transformer.ln_f", "lm_head"}
    neox = transformers.AutoModelForCausalLM.from_config(
        transformers.GPTNeoXConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64)
    )
    with monkeypatch.context() as patched:  # the plan alone decides: the module-tree search is not reached
        patched.setattr("hf_parallel.core.layers.repeated_layers", lambda model: [])
        assert find_layer_list(neox) == "gpt_neox.layers"  # from GPTNeoXConfig.base_model_pp_plan
        with pytest.raises(ValueError, match="no list of repeated layers"):
            find_layer_list(gpt2)
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


@pytest.mark.parametrize(
    "sizes",
    [dict(stage_tp_sizes=[2, 1]), dict(stage_tp_sizes=[1, 3], sp_size=2), dict(stage_tp_sizes=[2, 1], fsdp_size=2),
     dict(stage_tp_sizes=[3, 2, 2], fsdp_size=2, dp_replicate_size=2, sp_size=2)],
)  # fmt: skip
@pytest.mark.parametrize("by_rows", [False, True])
@pytest.mark.parametrize("first_whole", [False, True])
def test_tied_gradient_slices_trade_exactly_the_rows_each_rank_holds(sizes, by_rows, first_whole):
    """``tied.py``'s plan, run without processes: each rank of the end stages sends and receives only its
    slice's rows (its FSDP rows of its TP shard with ``by_rows``), whatever each stage's TP size or
    layout, and ends with its slice of the sum, bitwise the same on both stages."""
    from types import SimpleNamespace

    from hf_parallel.core.layout import chunks, even_sizes, replicated
    from hf_parallel.distributed.shape import MeshShape
    from hf_parallel.compat.torch import fsdp_row_range
    from hf_parallel.pipeline import tied

    shape, vocab = MeshShape.of(None, **sizes), 11
    ends = (0, shape.num_stages - 1)
    grads = {stage: torch.randn(vocab, 3) for stage in ends}
    layouts = {stage: chunks(0, even_sizes(vocab, shape.stage_tp_sizes[stage])) for stage in ends}
    layouts[0] = replicated(shape.stage_tp_sizes[0]) if first_whole else layouts[0]
    slices, plans, sent = {}, {}, {}
    for rank in range(shape.world_size):
        stage, sp, tp = shape.position(rank)
        fsdp = next(ranks for ranks in shape.groups("fsdp") if rank in ranks)
        mesh = SimpleNamespace(shape=shape, rank=rank, sp=SimpleNamespace(rank=sp), replica=shape.replica(rank))
        if stage in ends:
            whole = grads[stage] if layouts[stage].is_replicated else layouts[stage].extract(grads[stage], tp)
            start, stop = fsdp_row_range(len(whole), fsdp.index(rank), len(fsdp)) if by_rows else (0, len(whole))
            slices[rank] = (stage, tp, (start, stop), whole[start:stop].clone())
            other = ends[1] if stage == 0 else 0
            mine = tied.stage_pieces(mesh, stage, layouts[stage], vocab, by_rows)
            theirs = tied.stage_pieces(mesh, other, layouts[other], vocab, by_rows)
            plans[rank] = tied.exchange_plan(mine, theirs, rank)
            sent.update({(rank, peer): torch.cat([whole[start:stop][a : a + n] for a, n in spans])
                         for peer, spans in plans[rank][0].items()})  # fmt: skip
    for rank, (stage, tp, rows, local) in slices.items():
        receives = plans[rank][1]
        tied.add_received(local, 0, receives, {peer: sent.pop((peer, rank)) for peer in receives}, stage == 0)
        total = grads[0] + grads[ends[1]]
        want = total if layouts[stage].is_replicated else layouts[stage].extract(total, tp)
        assert torch.equal(local, want[rows[0] : rows[1]]), (rank, sizes)
    assert not sent, sorted(sent)  # every message sent was received


@pytest.mark.distributed
@pytest.mark.slow
def test_real_smollm2_vtp_tied_embeddings(smollm2, tmp_path):
    """The real SmolLM2 (30 layers, 9/3 heads, tied embeddings) at VTP [1, 2]: the tied vocabulary
    is whole on stage 0 and split in two on stage 1."""
    import pipeline_workers

    save_root = str(tmp_path / "saved")
    results = run_ranks(
        3, pipeline_workers.compare_pp, {"smollm2": (smollm2, {})}, dict(stage_tp_sizes=[1, 2]), save_root,
        out_dir=str(tmp_path / "out"),
    )  # fmt: skip
    for rank, result in enumerate(results):
        got = result["smollm2"]
        assert got["greedy"], rank
        assert_against_one_process(got, f"smollm2 rank {rank}", 1e-4, whole_scale=True)
        assert got["read"]["bytes"] == got["read"]["local"], got["read"]
    tied = [(r["smollm2"]["tied"], r["smollm2"]["tied_bits"]) for r in results if r["smollm2"]["tied"]]
    assert len(tied) == 3 and all(t == tied[0] for t in tied), tied
    assert_same_checkpoint(smollm2, os.path.join(save_root, "smollm2", "gathered"))


@pytest.mark.distributed
def test_bad_layouts_are_refused_before_any_weight_is_read(pp_paths, tmp_path):
    import pipeline_workers

    results = run_ranks(2, pipeline_workers.pipeline_refusals, pp_paths["pp_llama"], out_dir=str(tmp_path))
    for got in results:
        assert "stage_tp_sizes=[2, 1] was asked for, but the process group has world size 2" in got["world_mismatch"]
        assert "adds up to 4 layers, but model.layers has 5" in got["stage_layers_sum"]
        assert "one layer count of at least 1 for each of the 2 stages" in got["stage_layers_count"]
        assert "1 layer(s) in model.layers, fewer than the 2 pipeline stages" in got["too_few_layers"]
        assert "need a model with an LM head" in got["no_head"] and "LlamaModel has none" in got["no_head"]
        assert got["bytes_read"] == 0


@pytest.mark.distributed
@pytest.mark.parametrize("failing,how", [(0, "dies"), (1, "dies"), (0, "hangs")])
def test_a_dead_stage_fails_the_other_naming_what_it_waited_for(pp_paths, tmp_path, failing, how):
    import pipeline_workers

    results = run_ranks(
        2,
        pipeline_workers.pipeline_peer_fails,
        pp_paths["pp_llama"],
        str(tmp_path),
        5.0,
        failing,
        how,
        out_dir=str(tmp_path),
    )
    got = results[1 - failing]
    assert got["type"] == "RankFailure", got
    if failing == 0:  # stage 1 waits for stage 0's hidden states
        assert "stage 1 (rank 1) waiting for the hidden states of micro-batch 0 from stage 0 (rank 0)" in got["message"]
    else:  # stage 0's send of its hidden states, or its wait for the last stage's logits, fails
        assert (
            "stage 0 (rank 0) sending the hidden states of micro-batch 0 to stage 1 (rank 1)" in got["message"]
            or "rank 0 (stage 0) receiving the last stage's output from rank 1" in got["message"]
        ), got["message"]
    assert got["seconds"] < 60


@pytest.mark.distributed
@pytest.mark.slow
def test_cli_generate_streams_from_one_rank_at_vtp(smollm2):
    """`hf-parallel generate --stage-tp 2,1` under torchrun (3 ranks): rank 0 streams the text one
    process generates."""
    from test_cli import PROMPT, reference_text, run

    want = reference_text(smollm2, 12)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3"]
    stdout = run(torchrun, smollm2, ["--prompt", PROMPT, "--max-new-tokens", "12", "--stage-tp", "2,1"])
    assert stdout.count("pp=2 (tp per stage [2, 1])]") == 1, stdout
    assert stdout.split("[12 tokens in")[0].strip() == want.strip(), stdout


def test_cli_plan_shows_stages_ranks_bytes_and_activations(pp_paths, capsys):
    """``hf-parallel plan`` with stages (its ``main`` in this process: a fresh interpreter costs seconds; the
    module's entry runs in ``test_cli.py``)."""
    from hf_parallel.commands.cli import main

    main(["plan", pp_paths["pp_tied"], "--stage-tp", "2,1"])
    stdout = capsys.readouterr().out
    lines = stdout.splitlines()
    assert "2 stages, TP per stage [2, 1]" in lines[0]
    assert lines[1].startswith("stage 0: ranks [0, 1] (tp=2), layers 0-1 (2) + model.embed_tokens"), lines[1]
    assert lines[2].startswith("stage 1: ranks [2] (tp=1), layers 2-3 (2)"), lines[2]
    assert "bytes per rank [" in lines[1] and "tied model.embed_tokens.weight" in lines[2]
    assert "sent between stages per token: 256 bytes of hidden state (hidden 64 x 4)" in stdout


@pytest.mark.distributed
def test_train_step_accumulates_micro_batches_without_a_pipeline(pp_paths, tmp_path):
    """At TP=2 and SP=2: ``train_step``'s 3 micro-batches give one process's gradients (fp32); and in bf16
    one batch gives one process's bf16 loss, logits and gradients, within a tolerance the dtype sets."""
    import pipeline_workers
    from compare import tolerance_of

    tp2, sp2 = dict(tp_size=2), dict(sp_size=2, tp_plan=None)
    layouts = {"tp2": tp2, "sp2": sp2, "tp2_bf16": dict(tp2, dtype="bfloat16"), "sp2_bf16": dict(sp2, dtype="bfloat16")}
    results = run_ranks(
        2, pipeline_workers.accumulate_without_pipeline, pp_paths["pp_llama"], layouts, out_dir=str(tmp_path)
    )
    for rank, result in enumerate(results):
        assert sorted(result) == sorted(layouts), result.keys()
        for name, got in result.items():
            where = f"rank {rank} {name}"
            if name.endswith("_bf16"):
                assert got["dtype"] == "torch.bfloat16", (where, got["dtype"])
                tol = tolerance_of(torch.bfloat16)  # of each tensor's scale, nothing absolute
                assert_within({k: got[k] for k in ("loss", "logits") if k in got}, atol=0, rtol=tol, where=where)
                assert_within(got["grads"], atol=0, rtol=tol, where=f"{where} gradients")
                continue
            assert_within({"loss": got["loss"]}, atol=1e-5, rtol=0, where=where)
            assert_within(got["grads"], atol=1e-5, rtol=1e-5, where=f"{where} gradients")


@pytest.mark.distributed
def test_the_pipeline_example_at_3_and_8_ranks_is_one_processs_step(tiny_smollm2):
    """examples/pipeline_step.py as written, in one process, on 3 ranks (stage 0 at TP=2, stage 1 at TP=1) and on 8
    (two stages at TP=4): every rank prints one process's 1F1B loss and greedy tokens, its stage's layers."""
    from test_examples import run_example

    pattern = r"rank (\d): pp (\d)/(\d), tp \d/(\d), sp 0/1: layers (\d+)-(\d+), loss ([\d.]+), tokens (\[.*?\])"
    found = {ranks: re.findall(pattern, run_example("pipeline_step.py", ranks, MODEL=tiny_smollm2))
             for ranks in (1, 3, 8)}  # fmt: skip
    ((_, _, _, _, _, _, loss, tokens),) = found[1]
    for ranks, stage_tp in ((3, {"0": "2", "1": "1"}), (8, {"0": "4", "1": "4"})):
        assert sorted(int(rank) for rank, *_ in found[ranks]) == list(range(ranks)), found[ranks]
        for _, stage, stages, tp, first, last, got_loss, got_tokens in found[ranks]:
            assert stages == "2" and tp == stage_tp[stage] and first == last == stage, found[ranks]  # a layer each
            assert abs(float(got_loss) - float(loss)) <= 1e-5 and got_tokens == tokens, (found[ranks], loss, tokens)


@settings(max_examples=200, deadline=None)
@given(
    costs=st.lists(st.integers(1, 9), min_size=1, max_size=8),
    stages=st.integers(1, 4),
    ends=st.tuples(st.integers(0, 20), st.integers(0, 20)),
)
def test_balanced_layers_is_the_best_contiguous_split(costs, stages, ends):
    """Against every way of cutting the layers into contiguous non-empty runs."""
    from itertools import combinations

    if len(costs) < stages:
        return
    first, last = ends

    def worst(counts):
        starts = [sum(counts[:i]) for i in range(len(counts))]
        loads = [sum(costs[a : a + n]) for a, n in zip(starts, counts)]
        loads[0] += first
        loads[-1] += last
        return max(loads)

    splits = [
        [b - a for a, b in zip((0, *cuts), (*cuts, len(costs)))]
        for cuts in combinations(range(1, len(costs)), stages - 1)
    ]
    got = balanced_layers([float(c) for c in costs], stages, float(first), float(last))
    assert len(got) == stages and all(n >= 1 for n in got) and sum(got) == len(costs)
    assert worst(got) == min(worst(split) for split in splits)


@pytest.mark.distributed
def test_cli_verify_collects_every_stage(pp_paths):
    """`hf-parallel verify --stage-tp 2,1` starts its 3 ranks; rank 0 reports every stage's layers."""
    done = subprocess.run(
        [sys.executable, "-m", "hf_parallel", "verify", pp_paths["pp_llama"], "--stage-tp", "2,1"],
        capture_output=True, text=True, timeout=300, cwd="/tmp",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert "at pp=2 (tp per stage [2, 1])" in done.stdout
    rows = [line.split()[0] for line in done.stdout.splitlines() if line.endswith("  ok")]
    assert rows == ["model.embed_tokens", *[f"model.layers.{i}" for i in range(5)], "logits"], done.stdout
    assert "PASS: every output within 0.0001 of one process" in done.stdout


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_size, sizes", [(2, dict(pp_size=2, tp_plan=None)), (4, dict(pp_size=2, sp_size=2, tp_plan=None))]
)
def test_activation_checkpointing_on_pipeline_stages(pp_paths, tmp_path, world_size, sizes):
    """gradient_checkpointing_enable on stages trained by train_step (the receive and send are module
    hooks, outside the recomputed forward; under SP the recompute keeps the forward's call):
    gradients equal one process's, checkpointed the same way."""
    import pipeline_workers

    path = pp_paths["pp_llama"]
    ranks = run_ranks(world_size, pipeline_workers.checkpointed_stages, path, sizes, out_dir=str(tmp_path))
    for rank, results in enumerate(ranks):
        for schedule, r in results.items():
            assert r["checkpointed"] is True, (rank, schedule)
            assert_within({"loss": r["loss"]}, atol=1e-6, rtol=0, where=f"rank {rank} {schedule}")
            assert_within(r["grads"], atol=1e-5, rtol=1e-5, where=f"rank {rank} {schedule} gradients")
