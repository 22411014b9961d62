"""Kept fused experts dequantize only the experts a call's tokens go to (``quant/kept_experts.py``): in one
process, against the same checkpoint dequantized as read, for per-expert FP8 and pack-quantized keys (stacked
at load, the pieces keeping views of the stack) and MXFP4's one box of every expert; compiled whole. Under TP,
EP (sentinels for other ranks' experts) and PP, a one-token step is checked against plain transformers in
``test_quantized.py``'s kept case."""

from __future__ import annotations

import operator

import pytest
import torch

from hf_parallel.quant.scaled_fp8 import KeptFP8
from hf_parallel.quant import kept_experts

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
    if name.startswith("qwen3"):  # no token at all: the whole path, as transformers' forward takes it
        hidden = torch.zeros(0, experts[0].hidden_dim)
        with torch.no_grad():
            assert experts[0](hidden, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)).shape == (0, 64)


def test_boxes_that_differ_but_in_their_values_do_not_stack(tiny_root):
    """Experts' boxes stack where only their tensors' values (and where they were read) differ; a box that
    starts elsewhere inside its blocks leaves its weight on the whole path (every expert dequantized)."""
    weight = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    boxes = [KeptFP8({"weight": (f"e{e}", ())}, weight, torch.ones(1, 1), (4, 8), (0, 0)) for e in range(3)]
    assert kept_experts._stack_together(boxes)
    stacked = kept_experts._stacked(boxes)
    assert stacked.weight.shape == (3, 4, 8) and stacked.scales.shape == (3, 1, 1)
    assert not kept_experts._stack_together([*boxes, KeptFP8({}, weight, torch.ones(1, 1), (4, 8), (2, 0))])
    assert not kept_experts._stack_together([*boxes, KeptFP8({}, weight[:2], torch.ones(1, 1), (4, 8), (0, 0))])


@pytest.mark.slow
def test_kept_experts_compile_whole(tiny_root, monkeypatch):
    """``torch.compile(fullgraph=True)`` of a kept Qwen3-MoE model (pack-quantized int4: its words read as
    bytes under ``torch.vmap``): a one-token step (experts gathered by id) and a seven-token prefill (every
    expert dequantized) give eager's logits. (FP8 experts compile in the cuda tier.)"""
    import hf_parallel

    path = _paths(tiny_root)["qwen3_moe_w4_group"]
    kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_quantized=True)
    gathered = _counting(monkeypatch)
    forward = torch.compile(kept.forward, fullgraph=True)
    for ids in (torch.tensor([[5]]), torch.tensor([[5, 9, 3, 8, 1, 4, 7]])):
        with torch.no_grad():
            eager = kept(ids).logits
            compiled = forward(ids).logits
        torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5 * eager.abs().max().item())
    assert gathered and set(gathered) == {2}, gathered  # the step's gathers, traced and run eagerly


def test_fp8_experts_multiply_as_stored_by_the_gathered_kernel(interpreted, tiny_root, monkeypatch):
    """Where the gathered FP8 kernel runs (here Triton's interpreter), a gated Qwen3-MoE step (two tokens: four
    pairs) multiplies its pairs' experts as stored: three launches a layer (gate, up, down), the logits of the
    checkpoint dequantized as read (float32 within 1e-5, bfloat16 within its rounding); a prefill and an
    input that needs a gradient take the dequantized experts; GPT-OSS (biases, its own gate) never takes it.
    Each stack's launch is worked out once a shape: a step of other tokens reuses it, bit for bit the product
    its plan worked out afresh gives."""
    import hf_parallel

    path = _paths(tiny_root)["qwen3_moe_fp8"]
    launches, product = [], interpreted.weight_only_product

    def counted(x, kept, *launch, ids=None, **plans):
        if ids is not None:  # the experts' products (the attention's linears take none)
            launches.append(len(ids))
        return product(x, kept, *launch, ids=ids, **plans)

    monkeypatch.setattr(interpreted, "weight_only_product", counted)
    for dtype, within in ((torch.float32, 1e-5), (torch.bfloat16, 2**-6)):
        kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, keep_quantized=True)
        read = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        assert [m.kernel_products for m in kept.modules() if isinstance(m, kept_experts.KeptExperts)] == [True] * 2
        for ids, pairs in ((torch.tensor([[5], [9]]), 4), (torch.tensor([[5, 9, 3]]), 0)):
            launches.clear()
            with torch.no_grad():
                want = read(ids).logits.float()
                got = kept(ids).logits.float()
            torch.testing.assert_close(got, want, rtol=0, atol=within * want.abs().max().item())
            assert launches == [pairs] * (6 if pairs else 0), (dtype, ids.shape, launches)
    plans = [p for m in kept.modules() if isinstance(m, kept_experts.KeptExperts) for rows in m.kept_rows.values()
             for p in rows.kernel_plans]  # fmt: skip
    made = [list(p.values()) for p in plans]  # each stack's (gate, up; down) plan for the step's four pairs
    other = torch.tensor([[7], [2]])  # a step of other tokens, to other experts: each stack's plan reused
    with torch.no_grad():
        planned = kept(other).logits
        again = [list(p.values()) for p in plans]
        for p in plans:
            p.clear()
        assert torch.equal(planned, kept(other).logits)  # bit for bit its plans worked out afresh
    assert [len(p) for p in made] == [1] * 6 and all(map(operator.is_, sum(again, []), sum(made, [])))
    experts = next(m for m in kept.modules() if isinstance(m, kept_experts.KeptExperts))
    hidden = torch.randn(1, experts.hidden_dim, dtype=dtype, requires_grad=True)
    launches.clear()
    experts(hidden, torch.tensor([[1, 3]]), torch.tensor([[0.5, 0.5]], dtype=dtype)).sum().backward()
    assert launches == [] and hidden.grad is not None
    mxfp4 = hf_parallel.AutoModelForCausalLM.from_pretrained(_paths(tiny_root)["gpt_oss_mxfp4"], keep_quantized=True)
    assert not any(m.kernel_products for m in mxfp4.modules() if isinstance(m, kept_experts.KeptExperts))


@pytest.mark.slow  # loads whole models: outside the pure tier
@pytest.mark.parametrize("name", ["qwen3_moe_w4_group", "qwen3_moe_awq", "qwen3_moe_gptq"])
def test_int4_experts_on_cpu_multiply_through_torchs_int4_kernel(tiny_root, monkeypatch, name):
    """``keep_quantized="int4"`` on CPU: a gated Qwen3-MoE's int4 experts (compressed-tensors' W4A16, AWQ, and
    act-order GPTQ: each expert's inputs spread its own way, stacked slots; a key per expert) are repacked at
    load for torch's int4 kernel, and a step's pairs (two tokens: four) multiply their experts through it: a
    call a stack (gate, up, down) and layer, the logits of the checkpoint dequantized as read (float32 within
    1e-5, bfloat16 within its rounding), traced whole by ``torch.compile`` the same (``fullgraph``, AOT
    autograd's eager backend: inductor would add seconds; one format, float32); a prefill dequantizes;
    ``hf-parallel plan`` gives the packs' bytes."""
    from tiny_models import make_grouped_checkpoint

    import hf_parallel
    from hf_parallel.commands.report import plan_report
    from hf_parallel.quant.kernels import int4_torch
    from hf_parallel.quant.kept import int4_copy_nbytes, kept_products

    path = _paths(tiny_root)[name] if name in MODELS else make_grouped_checkpoint(name, tiny_root)[0]
    calls, product = [], int4_torch.int4_product

    def counted(x, pack, ids=None):
        if ids is not None:  # the experts' products (the attention's linears take none)
            calls.append(len(ids))
        return product(x, pack, ids)

    monkeypatch.setattr(int4_torch, "int4_product", counted)
    for dtype, within in ((torch.float32, 1e-5), (torch.bfloat16, 2**-6)):
        kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, keep_quantized="int4")
        read = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        experts = [m for m in kept.modules() if isinstance(m, kept_experts.KeptExperts)]
        assert [m.kernel_products for m in experts] == [True] * 2, name
        assert kept_products(kept)["experts int4 kernel"] == 2, kept_products(kept)  # the CLI's closing count
        for ids, pairs in ((torch.tensor([[5], [9]]), 4), (torch.tensor([[5, 9, 3]]), 0)):
            calls.clear()
            with torch.no_grad():
                want = read(ids).logits.float()
                got = kept(ids).logits.float()
            torch.testing.assert_close(got, want, rtol=0, atol=within * want.abs().max().item())
            assert calls == [pairs] * (6 if pairs else 0), (name, dtype, ids.shape, calls)
        if name == "qwen3_moe_w4_group" and dtype == torch.float32:  # traced whole once (inductor: the slow part)
            step = torch.tensor([[5], [9]])
            with torch.no_grad():
                compiled = torch.compile(kept.forward, fullgraph=True, backend="aot_eager")(step).logits
                torch.testing.assert_close(compiled, kept(step).logits, rtol=0, atol=1e-5 * compiled.abs().max().item())
        line = next(line for line in plan_report(path, tp=1, dtype=dtype).splitlines() if "int4 kernel" in line)
        assert f"check): [{int4_copy_nbytes(kept)}] bytes per rank on CPU" in line, (name, dtype, line)
