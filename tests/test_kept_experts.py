"""Kept fused experts dequantize only the experts a call's tokens go to (``tensor/kept_experts.py``): in one
process, against the same checkpoint dequantized as read, for per-expert FP8 and pack-quantized keys (stacked
at load, the pieces keeping views of the stack) and MXFP4's one box of every expert; compiled whole. Under TP,
EP (sentinels for other ranks' experts) and PP, a one-token step is checked against plain transformers in
``test_quantized.py``'s kept case."""

from __future__ import annotations

import pytest
import torch

from hf_parallel.checkpoint.quantized import KeptFP8
from hf_parallel.tensor import kept_experts

MODELS = ("qwen3_moe_fp8", "qwen3_moe_w4_group", "gpt_oss_mxfp4")  # 2 layers of 4 experts, 2 a token


def _paths(tiny_root) -> dict:
    from tiny_models import make_fp8_checkpoint, make_mxfp4_checkpoint, make_packed_checkpoint

    return {"qwen3_moe_fp8": make_fp8_checkpoint("qwen3_moe_fp8", tiny_root),
            "qwen3_moe_w4_group": make_packed_checkpoint("qwen3_moe_w4_group", tiny_root)[0],
            "gpt_oss_mxfp4": make_mxfp4_checkpoint("gpt_oss_mxfp4", tiny_root)}  # fmt: skip


def _counting(monkeypatch) -> list:
    gathered, rows = [], kept_experts.ExpertRows.rows
    monkeypatch.setattr(kept_experts.ExpertRows, "rows", lambda self, ids: gathered.append(len(ids)) or rows(self, ids))
    return gathered


@pytest.mark.parametrize("name", MODELS)
def test_a_step_dequantizes_only_the_experts_its_tokens_go_to(tiny_root, monkeypatch, name):
    """Kept (float32): one token and two (2 and 4 (token, expert) pairs, at most the 4 experts a layer
    holds) gather their pairs' experts by id, every kept expert weight of both layers once a call; seven
    tokens (14 pairs) dequantize every expert; the logits are the checkpoint's dequantized as read within
    1e-5. Per-expert keys are stacked once: each expert's piece holds views of one tensor per part
    (gate and up: two)."""
    import hf_parallel

    path = _paths(tiny_root)[name]
    kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_quantized=True)
    read = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    experts = [m for m in kept.modules() if isinstance(m, kept_experts.KeptExperts)]
    assert len(experts) == 2 and all(None not in m.kept_rows.values() for m in experts), name
    for rows in (rows for module in experts for rows in module.kept_rows.values()):  # gate|up: a stack per part
        storages = {next(iter(p.kept.tensors().values())).untyped_storage().data_ptr() for p in rows.weight.pieces}
        assert len(storages) == len(rows.stacks) and len(rows.weight.pieces) >= (1 if "mxfp4" in name else 4), name
    gathered = _counting(monkeypatch)
    steps = ((torch.tensor([[5]]), 2), (torch.tensor([[5], [9]]), 4), (torch.tensor([[5, 9, 3, 8, 1, 4, 7]]), 0))
    for ids, pairs in steps:
        gathered.clear()
        with torch.no_grad():
            want = read(ids).logits
            got = kept(ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
        assert gathered == [pairs] * (4 if pairs else 0), (name, ids.shape, gathered)


def test_boxes_that_differ_but_in_their_values_do_not_stack(tiny_root):
    """Experts' boxes stack where only their tensors' values (and where they were read) differ; a box that
    starts elsewhere inside its blocks leaves its weight on the whole path (every expert dequantized)."""
    weight = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    boxes = [KeptFP8({"weight": (f"e{e}", ())}, weight, torch.ones(1, 1), (4, 8), (0, 0)) for e in range(3)]
    stacked = kept_experts._stacked(boxes)
    assert stacked.weight.shape == (3, 4, 8) and stacked.scales.shape == (3, 1, 1)
    assert kept_experts._stacked([*boxes, KeptFP8({}, weight, torch.ones(1, 1), (4, 8), (2, 0))]) is None
    assert kept_experts._stacked([*boxes, KeptFP8({}, weight[:2], torch.ones(1, 1), (4, 8), (0, 0))]) is None


@pytest.mark.slow
def test_kept_experts_compile_whole(tiny_root, monkeypatch):
    """``torch.compile(fullgraph=True)`` of a kept Qwen3-MoE FP8 model: a one-token step (experts gathered
    by id) and a seven-token prefill (every expert dequantized) give eager's logits."""
    import hf_parallel

    path = _paths(tiny_root)["qwen3_moe_fp8"]
    kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_quantized=True)
    gathered = _counting(monkeypatch)
    forward = torch.compile(kept.forward, fullgraph=True)
    for ids in (torch.tensor([[5]]), torch.tensor([[5, 9, 3, 8, 1, 4, 7]])):
        with torch.no_grad():
            eager = kept(ids).logits
            compiled = forward(ids).logits
        torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5 * eager.abs().max().item())
    assert gathered and set(gathered) == {2}, gathered  # the step's gathers, traced and run eagerly
