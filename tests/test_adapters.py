"""LoRA (peft, unchanged) on tensor-, sequence-, pipeline- and data-parallel models against one process.

Every case loads the one-process reference's initial adapter with ``PeftModel.from_pretrained`` onto
the parallel model (so it is loaded sharded), then checks: logits and greedy tokens; the loss and
every adapter gradient (assembled from the ranks' slices) after ``train_step``; no gradient outside
the adapters; the logits after one AdamW step; the adapter ``save_pretrained`` wrote (gathered),
loaded by plain peft in one process; a second adapter loaded and switched to with ``set_adapter``;
``merge_and_unload`` and the gathered save of the merged model, bit for bit the one-process merge.
"""

from __future__ import annotations

import os

import peft  # noqa: F401 - CI installs peft: an import that fails fails the suite, never skips it
import pytest
import torch
from adapter_workers import LLAMA
from compare import assert_close, assert_within, gap
from conftest import once_per_world_size

TARGETS = {
    "llama": LLAMA,
    "qwen3": LLAMA,
    "llama_tied_kvrep": LLAMA,
    "pp_llama": LLAMA,
    "smollm2": LLAMA,
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),  # packed q|k|v (GQA blocks), gate|up
    "gpt2": ("c_attn", "c_proj", "c_fc"),  # Conv1D, fused q|k|v
    "qwen3_moe": ("q_proj", "k_proj", "v_proj", "o_proj"),  # attention of a MoE
}
CASES = {  # world size -> case -> (checkpoint, layout)
    2: {
        "tp2_llama": ("llama", dict(tp_size=2)),  # 9/3 heads: uneven KV groups
        "tp2_qwen3": ("qwen3", dict(tp_size=2)),
        "tp2_phi3_packed": ("phi3", dict(tp_size=2)),
        "tp2_gpt2_conv1d": ("gpt2", dict(tp_size=2)),
        "tp2_moe_attention": ("qwen3_moe", dict(tp_size=2)),
        "sp2": ("llama", dict(sp_size=2, tp_plan=None)),
        "fsdp2": ("llama", dict(fsdp_size=2, tp_plan=None)),
    },
    3: {
        "tp3_smollm2": ("smollm2", dict(tp_size=3)),
        "tp3_qwen3": ("qwen3", dict(tp_size=3)),  # 8/4 heads in uneven whole KV groups: q 4/2/2, kv 2/1/1
        "vtp_2_1": ("pp_llama", dict(stage_tp_sizes=[2, 1])),
    },
    4: {
        "tp2_sp2": ("llama", dict(tp_size=2, sp_size=2)),
        "tp4_kv_replicated": ("llama_tied_kvrep", dict(tp_size=4)),  # B rows of a replicated KV head summed
        "tp2_fsdp2": ("llama", dict(tp_size=2, fsdp_size=2)),
    },
}
TOLERANCE = 1e-5  # absolute, and of each tensor's scale: fp32 sums in another order


def assert_like(got, want, tolerance: float, what: str) -> None:
    assert_close(got, want, atol=tolerance, rtol=tolerance, what=what)


@pytest.fixture(scope="module")
def paths(tiny_root, smollm2):
    from tiny_models import make_checkpoint

    names = {arch for cases in CASES.values() for arch, _ in cases.values()} - {"smollm2"}
    return {**{name: make_checkpoint(name, tiny_root) for name in names}, "smollm2": smollm2}


@pytest.fixture(scope="module")
def references(paths, tmp_path_factory):
    import adapter_workers

    cache = {}

    def get(arch):
        if arch not in cache:
            out = str(tmp_path_factory.mktemp(f"lora_ref_{arch}"))
            cache[arch] = (adapter_workers.reference(paths[arch], TARGETS[arch], out), out)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def runs(paths, references, tmp_path_factory):
    import adapter_workers
    from distributed import run_ranks

    def run(world_size):
        root = str(tmp_path_factory.mktemp(f"lora{world_size}"))
        cases = {
            name: (paths[arch], sizes, os.path.join(references(arch)[1], "adapter"))
            for name, (arch, sizes) in CASES[world_size].items()
        }
        return run_ranks(world_size, adapter_workers.parallel, cases, root, out_dir=os.path.join(root, "r")), root

    return once_per_world_size(run)


def rank_slices(result: dict, whole: dict[str, torch.Tensor]) -> dict:
    """``compare.gap`` of each adapter gradient a rank reported against its slice of one process's."""
    from hf_parallel.core.layout import Layout

    out = {}
    for name, item in result["adapters"].items():
        want = Layout.from_json(item["layout"]).extract(whole[name], result["tp_rank"])
        out[name] = gap(torch.tensor(item["grad"]), want)
    return out


def assembled(results: list[dict], what: str) -> dict[str, torch.Tensor]:
    """Every adapter's ``what`` (its gradient, its trained value), whole, from the slices its TP ranks reported."""
    from hf_parallel.core.layout import Layout

    pieces: dict[str, dict] = {}
    for result in results:
        for name, item in result["adapters"].items():
            got = pieces.setdefault(name, {"item": item, "by_rank": {}})
            got["by_rank"][result["tp_rank"]] = torch.tensor(item[what])
    out = {}
    for name, got in pieces.items():
        layout = Layout.from_json(got["item"]["layout"])
        if layout.is_replicated:
            out[name] = next(iter(got["by_rank"].values()))
        else:
            out[name] = layout.assemble(torch.empty(got["item"]["full"]), lambda rank: got["by_rank"][rank])
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("world_size,case", [(w, c) for w, cases in CASES.items() for c in cases])
def test_lora_matches_one_process(runs, references, world_size, case):
    import peft
    import transformers
    from checks import assert_same_checkpoint

    arch, sizes = CASES[world_size][case]
    fsdp = sizes.get("fsdp_size", 1) > 1
    # 30 real layers summed in another order drift further than two tiny ones (the SP tests measured
    # 1.5e-4 of the scale on SmolLM2); a wrong split or a missing sum is off by O(1) of it
    tol = 1e-4 if arch == "smollm2" else TOLERANCE
    ref, ref_dir = references(arch)
    results, root = runs(world_size)
    mine = [r[case] for r in results]
    for rank, result in enumerate(mine):
        where = f"{case} rank {rank}"
        assert_like(result["logits"], ref["logits"], tol, f"{where}: logits")
        assert result["tokens"] == ref["tokens"].tolist()
        assert_like(result["loss"], ref["loss"], tol, f"{where}: loss")
        assert result["outside"] == [], f"gradients outside the adapters: {result['outside']}"
        assert_like(result["trained_logits"], ref["trained_logits"], 1e-4, f"{where}: logits after a step")
        assert_like(result["other_logits"], ref["logits"], tol, f"{where}: logits of the second adapter")
        if fsdp:  # FSDP's slices are DTensors: merging is refused, by name, before anything changes
            assert "merging adapters into a model sharded by FSDP" in result["merge_error"]
        else:
            assert_like(result["merged_logits"], ref["logits"], tol, f"{where}: merged logits")
        # every rank's slice of every adapter gradient it holds (its stage's), each copy (SP, data-parallel
        # replicas) on its own
        assert set(result["adapters"]) <= set(ref["grads"]), where
        assert_within(rank_slices(result, ref["grads"]), atol=tol, rtol=tol, where=f"{where}: adapter gradients")
    assert set().union(*(result["adapters"] for result in mine)) == set(ref["grads"])  # every adapter held somewhere

    # the gathered adapter is peft's standard one: plain peft loads it onto the one-process base
    saved = os.path.join(root, case, "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(saved))
    base = transformers.AutoModelForCausalLM.from_pretrained(references_path(ref_dir), dtype=torch.float32)
    plain = peft.PeftModel.from_pretrained(base, saved)
    trained = assembled(mine, "trained")
    for name, param in plain.named_parameters():
        if "lora_" in name:  # the gathered save writes the ranks' slices exactly
            assert torch.equal(param, trained[name.removeprefix("base_model.model.")].to(param.dtype)), name
    with torch.no_grad():
        logits = plain(input_ids=batch_ids(base)).logits
    assert_like(logits, ref["trained_logits"], 1e-4, "logits of the saved adapter in one process")
    if not fsdp:
        assert_same_checkpoint(os.path.join(ref_dir, "merged"), os.path.join(root, case, "merged"))


def references_path(ref_dir: str) -> str:
    """The base checkpoint the reference's adapter was made for (peft records it)."""
    import json

    with open(os.path.join(ref_dir, "adapter", "adapter_config.json")) as f:
        return json.load(f)["base_model_name_or_path"]


def batch_ids(model) -> torch.Tensor:
    import adapter_workers

    return adapter_workers.batch(model.config.vocab_size)["input_ids"]


@pytest.fixture(scope="module")
def refused(paths, tmp_path_factory):
    import adapter_workers
    from distributed import run_ranks

    root = str(tmp_path_factory.mktemp("lora_refused"))
    return run_ranks(2, adapter_workers.refusals, paths, root, out_dir=os.path.join(root, "r")), root


@pytest.mark.distributed
def test_get_peft_model_on_a_parallel_model_gives_one_process_adapter(refused, references):
    """peft's get_peft_model, unchanged, on the TP=2 model: with the same seed, the adapter it makes
    (saved gathered) is bit for bit the one one process makes."""
    _, root = refused
    _, ref_dir = references("llama")
    from safetensors.torch import load_file

    want = load_file(os.path.join(ref_dir, "adapter", "adapter_model.safetensors"))
    got = load_file(os.path.join(root, "initial", "adapter_model.safetensors"))
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.distributed
@pytest.mark.parametrize(
    "what, names",
    [
        ("dora", ["model.layers.0.self_attn.q_proj", "DoRA", "leave it out of target_modules"]),
        ("dora_after_load", ["model.layers.0.self_attn.q_proj", "DoRA", "leave it out of target_modules"]),
        ("experts", ["model.layers.0.mlp.experts", "moe_tp_experts", "has no adapter split"]),
        ("ia3", ["model.layers.0.self_attn.q_proj", "ia3.layer.Linear around a module split by colwise", "LoraConfig"]),
        ("modules_to_save", ["lm_head.modules_to_save.default.weight", "trainable parameter(s) added after"]),
        ("parameter", ["model.layers.0.mlp.scale", "trainable parameter(s) added after"]),
        ("module", ["model.norm.1.weight, model.norm.1.bias:", "trainable parameter(s) added after"]),
    ],
)
def test_what_cannot_be_placed_is_refused_by_name(refused, what, names):
    """Never a wrong result: an adapter that cannot follow its module, a trainable copy peft makes, a
    parameter or module added by hand; each refused, naming it, before a gradient is used."""
    results, _ = refused
    for result in results:
        assert result["peft_before_load"] is False  # dora_after_load imported peft after loading
        error = result[what]
        assert error is not None, what
        for name in names:
            assert name in error, (what, error)


@pytest.mark.distributed
def test_trainer_trains_lora_on_tp_and_fsdp(paths, references, tmp_path):
    """transformers' Trainer, unchanged, on a PeftModel around a TP=2 x FSDP=2 model: one process's
    losses and grad norms; save_model writes the adapter (one process's trained adapter, loaded by
    plain peft); a run resumed from the step-3 checkpoint logs the uninterrupted steps 4-5, at this
    layout and at TP=4."""
    import adapter_workers
    import training_workers
    from distributed import run_ranks
    from safetensors.torch import load_file

    global_batch = 4
    _, ref_dir = references("llama")
    adapter = os.path.join(ref_dir, "adapter")
    want = adapter_workers.one_process_trainer(paths["llama"], adapter, global_batch, str(tmp_path / "one"))
    root = str(tmp_path / "run")
    results = run_ranks(
        4, adapter_workers.trainer, paths["llama"], adapter, dict(tp_size=2, fsdp_size=2), global_batch, root,
        dict(tp_size=4), out_dir=str(tmp_path / "r"),
    )  # fmt: skip
    assert len(want["losses"]) == training_workers.STEPS
    for rank, result in enumerate(results):
        # at TP=4 (resumed_elsewhere): the adapters' pieces and moments resharded
        for run in ("uninterrupted", "resumed_elsewhere"):
            for key in ("losses", "norms"):
                assert_like(result[run][key], want[key], 1e-5, f"rank {rank} {run}: {key}")
        assert result["resumed"] == result["uninterrupted"], result
    assert "adapter_model.safetensors" in results[0]["files"], results[0]["files"]
    saved = load_file(os.path.join(root, "final", "adapter_model.safetensors"))
    one = load_file(os.path.join(str(tmp_path / "one"), "final", "adapter_model.safetensors"))
    assert sorted(saved) == sorted(one)
    for key in one:
        assert_like(saved[key], one[key], 1e-4, key)


def test_plan_shows_each_adapter_split(tiny_paths):
    """``hf-parallel plan --lora``: each adapter pair splits as its module (tiny Llama, 9/3 heads at
    tp=2 in whole KV groups: q rows 48/24, k 16/8), the whole matrix's gradient summed over TP."""
    from hf_parallel.commands.report import parse_lora, plan_report

    text = plan_report(tiny_paths["llama"], 2, lora=parse_lora("r=4,target=q_proj,k_proj,o_proj"))
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith("  model.layers.0.")}
    q, k, o = (lines[f"model.layers.0.self_attn.{name}"] for name in ("q_proj", "k_proj", "o_proj"))
    assert "A 4x72 replicated (gradient summed over TP)" in q and "B 72x4 chunks(dim=0, sizes=[48,24])" in q, q
    assert "B 24x4 chunks(dim=0, sizes=[16,8])" in k, k
    assert "A 4x72 chunks(dim=1, sizes=[48,24])" in o and "B 72x4 replicated (gradient summed over TP)" in o, o
    assert q.endswith(f"/ [{(4 * 72 + 48 * 4) * 4}, {(4 * 72 + 24 * 4) * 4}]"), q  # fp32 A + B rows
    assert "6 adapter pairs" in text


@pytest.mark.parametrize("text", ["r=8", "target=q_proj", "r=x,target=q_proj", "q_proj,r=8"])
def test_plan_lora_argument_is_checked(text):
    from hf_parallel.commands.report import parse_lora

    with pytest.raises(ValueError, match="expected r=N,target=name"):
        parse_lora(text)


def test_plan_lora_refuses_targets_the_model_lacks(tiny_paths):
    from hf_parallel.commands.report import parse_lora, plan_report

    with pytest.raises(ValueError, match="no module of the model is named qkv_proj"):
        plan_report(tiny_paths["llama"], 2, lora=parse_lora("r=4,target=qkv_proj"))
