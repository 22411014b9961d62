"""The package's weight-only FP8 kernel (``quant/kernels/fp8_weight_only.py``) run by Triton's interpreter on CPU
(``TRITON_INTERPRET=1``, which ``triton.jit`` reads when it decorates: the module is reloaded under it): the
product of every kind of kept FP8 box (whole blocks, a box starting inside its blocks, blocks of other sizes,
a scale per row or one for all, e5m2) against the dequantized weight's; the load-time check refusing a
kernel that computes otherwise; which linears take it. TP=4, whose shards start inside blocks, is in
``test_quantized.py``; the card's compiled kernel runs in the cuda tier (``test_cuda.py``)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_parallel.quant.scaled_fp8 import KeptFP8
from hf_parallel.quant.kernels import fp8_weight_only

CPU = torch.device("cpu")


def kept_box(outputs, inputs, offset, block, fp8=torch.float8_e4m3fn, seed=0) -> KeptFP8:
    """A box of ``outputs`` x ``inputs`` starting at ``offset`` inside its first block, with the scales of the
    blocks it touches (a block as large as the box: one scale, stored as [1])."""
    generator = torch.Generator().manual_seed(seed)
    grid = [-(-(size + start) // length) for size, start, length in zip((outputs, inputs), offset, block)]
    scales = torch.rand(*grid, generator=generator) / 64 + 1e-3
    weight = (torch.randn(outputs, inputs, generator=generator) * 64).to(fp8)
    return KeptFP8({}, weight, scales.reshape(1) if grid == [1, 1] else scales, block, offset)


BOXES = {  # name -> (outputs, inputs, offset, block, fp8, rows)
    "whole 128 blocks, one row": (256, 256, (0, 0), (128, 128), torch.float8_e4m3fn, (1,)),
    "inside its blocks": (200, 300, (64, 32), (128, 128), torch.float8_e4m3fn, (3,)),
    "64 x 48 blocks, 3-D input": (70, 96, (3, 40), (64, 48), torch.float8_e4m3fn, (2, 5)),
    "a scale per row": (33, 50, (0, 9), (1, 1000), torch.float8_e4m3fn, (40,)),
    "one scale": (33, 50, (7, 9), (1000, 1000), torch.float8_e5m2, (4,)),
}


@pytest.mark.parametrize("box", BOXES, ids=list(BOXES))
def test_the_kernel_computes_the_dequantized_weights_product(interpreted, box):
    """float32: the dequantized product within float32's sums; bfloat16: within the weights' and output's
    rounding (the interpreter truncates where the card rounds to nearest)."""
    outputs, inputs, offset, block, fp8, rows = BOXES[box]
    kept = kept_box(outputs, inputs, offset, block, fp8)
    assert interpreted.takes(kept, (outputs, inputs), torch.float32)
    x = torch.randn(*rows, inputs, generator=torch.Generator().manual_seed(1))
    want = F.linear(x, kept.dequantize(torch.float32))
    got = interpreted.weight_only_product(x, kept)
    assert got.shape == (*rows, outputs) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    x = x.bfloat16()
    want = F.linear(x.float(), kept.dequantize(torch.bfloat16).float())
    got = interpreted.weight_only_product(x, kept)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2**-6 * want.abs().max().item())


@pytest.mark.parametrize("box", BOXES, ids=list(BOXES))
def test_the_gathered_kernel_multiplies_each_pair_by_its_experts_weight(interpreted, box):
    """The gathered product (``kept_experts``' decode steps): three experts' boxes stacked, five (token,
    expert) pairs, one expert twice and one not at all: each pair's row times its expert's dequantized weight
    (float32 within its sums, bfloat16 within the weights' and output's rounding)."""
    outputs, inputs, offset, block, fp8, _ = BOXES[box]
    experts = [kept_box(outputs, inputs, offset, block, fp8, seed=e) for e in range(3)]
    stacked = dataclasses.replace(experts[0], weight=torch.stack([e.weight for e in experts]),
                                  scales=torch.stack([e.scales for e in experts]))  # fmt: skip
    assert interpreted.takes(stacked, None, torch.float32, experts=True)
    ids = torch.tensor([2, 0, 2, 0, 2])
    x = torch.randn(5, inputs, generator=torch.Generator().manual_seed(1))
    for dtype, within in ((torch.float32, 1e-5), (torch.bfloat16, 2**-6)):
        want = torch.stack([x[p].to(dtype).float() @ experts[e].dequantize(dtype).float().T
                            for p, e in enumerate(ids.tolist())])  # fmt: skip
        got = interpreted.weight_only_product(x.to(dtype), stacked, ids=ids)
        assert got.shape == (5, outputs) and got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=0, atol=within * want.abs().max().item())


def test_an_empty_box_is_left_to_the_dequantized_product(interpreted):
    """A shard with no rows or no inputs: nothing for a kernel to read (and no program to write a zero result),
    so neither kernel takes it; the dequantized product gives the empty or zero result."""
    for shape in ((0, 64), (64, 0)):
        kept = KeptFP8({}, torch.zeros(shape, dtype=torch.float8_e4m3fn), torch.ones(1), (128, 128), (0, 0))
        assert not interpreted.takes(kept, shape, torch.float32), shape
        stacked = dataclasses.replace(kept, weight=kept.weight.expand(2, *shape), scales=torch.ones(2, 1, 1))
        assert not interpreted.takes(stacked, None, torch.float32, experts=True), shape


def nan_beyond(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` as a view whose rows are each followed by a NaN in memory (the last row too)."""
    padded = torch.full((*scales.shape[:-1], scales.shape[-1] + 1), float("nan"), dtype=scales.dtype)
    padded[..., :-1] = scales
    return padded[..., :-1]


@pytest.mark.parametrize("box", ["inside its blocks", "a scale per row"])
def test_the_other_launches_compute_the_same_product(interpreted, box):
    """``Launch.swap`` (the weight's tile the tiles' left operand, the sums held transposed), ``unroll``
    (tiles of columns loaded together, the last past the inputs' end), ``split`` (runs of columns summed
    apart: here 3 tiles or 1 in 2 or 4 runs, some empty, some ending inside an unrolled step) and ``dot=False``
    (GEMV: the rows' products summed in registers, one to ``GEMV_ROWS`` rows a program) and ``tile_k``
    (columns a step under the weight's tile), plain and gathered: each the dequantized weights' product, as the
    default launches compute it, with NaN just past each row of scales (an unrolled step past the end must read
    none of it); a GEMV launch that asks to swap, or a tile_k not a power of two, is refused."""
    outputs, inputs, offset, block, fp8, rows = BOXES[box]
    experts = [kept_box(outputs, inputs, offset, block, fp8, seed=e) for e in range(3)]
    experts = [dataclasses.replace(e, scales=nan_beyond(e.scales)) for e in experts]
    stacked = dataclasses.replace(experts[0], weight=torch.stack([e.weight for e in experts]),
                                  scales=nan_beyond(torch.stack([e.scales for e in experts])))  # fmt: skip
    x, ids = torch.randn(*rows, inputs, generator=torch.Generator().manual_seed(1)), torch.tensor([2, 0, 2])
    pairs = x[torch.arange(3) % len(x)]
    wants = {"plain": F.linear(x, experts[0].dequantize(torch.float32)),
             "gathered": torch.stack([pairs[p] @ experts[e].dequantize(torch.float32).T
                                      for p, e in enumerate(ids.tolist())])}  # fmt: skip
    # wide tiles: the interpreter's cost is per program
    launches = [interpreted.Launch(32, 4, 2, swap=True, unroll=2), interpreted.Launch(64, 4, 3, unroll=3, split=2),
                interpreted.Launch(64, 4, 3, swap=True, split=4, tile_k=32), interpreted.Launch(64, 4, 3, dot=False),
                interpreted.Launch(32, 2, 2, unroll=2, split=4, dot=False, tile_k=16)]
    for launch in launches:
        gots = {"plain": interpreted.weight_only_product(x, experts[0], launch),
                "gathered": interpreted.weight_only_product(pairs, stacked, launch, ids=ids)}  # fmt: skip
        for name, want in wants.items():
            assert gots[name].shape == want.shape and gots[name].dtype == torch.float32, (name, launch)
            torch.testing.assert_close(gots[name], want, rtol=0, atol=1e-5 * want.abs().max().item(),
                                       msg=f"{name}, {launch}")  # fmt: skip
    gemv = launches[-1]  # a program's one or two rows
    for rows in (1, 2):
        got = interpreted.weight_only_product(x[:rows], experts[0], gemv)
        want = wants["plain"][:rows]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item(), msg=f"{rows} rows")
    with pytest.raises(ValueError, match="this launch takes no tl.dot"):
        interpreted.weight_only_product(x, experts[0], interpreted.Launch(64, 4, 3, swap=True, dot=False))
    with pytest.raises(ValueError, match="a power of two of at least 16"):
        interpreted.weight_only_product(x, experts[0], interpreted.Launch(64, 4, 3, tile_k=24))
    split = launches[1]  # float32 runs summed, then rounded once
    got = interpreted.weight_only_product(x.bfloat16(), experts[0], split)
    want = F.linear(x.bfloat16().float(), experts[0].dequantize(torch.bfloat16).float())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2**-7 * want.abs().max().item())


def test_a_compiled_step_splits_the_columns_of_a_product_with_few_programs(interpreted, monkeypatch):
    """``split=0`` (the defaults): one run of columns in eager; inside a compiled step (here its flag raised
    by hand, the product run by the interpreter) ``split_for``'s, the least power of two giving ``PROGRAMS``
    programs with runs of at least two tiles, and the product is still the dequantized weight's."""
    programs, split_for = interpreted.PROGRAMS, interpreted.split_for
    assert split_for(programs // 3, 4096, 128) == 4  # 3x too few: 4 runs of 8 tiles
    assert split_for(4, 1024, 128) == 4 and split_for(4, 1023, 128) == 2  # runs of two tiles or more
    assert split_for(4, 9 * 128, 128) == 3  # 9 tiles cut for 4 runs: runs of 3, so three runs, none empty
    assert split_for(programs, 4096, 128) == 1 == split_for(1, 511, 128)
    kept = kept_box(64, 1024, (0, 0), (128, 128))
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(1))
    want = F.linear(x, kept.dequantize(torch.float32))
    splits, split = [], interpreted._split
    monkeypatch.setattr(interpreted, "_split", lambda *given: splits.append(split(*given)) or splits[-1])
    for compiling in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
        got = interpreted.weight_only_product(x, kept)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())
    assert splits == [1, 4]


def test_a_kernel_that_computes_otherwise_is_refused_at_load(interpreted, monkeypatch):
    """The load-time check against the dequantized product: a kernel reading a box's scales from the start of
    its first block (its offset dropped) is refused with a warning naming the device; without Triton's
    interpreter a CPU never takes the kernel."""
    assert interpreted.runs_on(CPU)
    interpreted.runs_on.cache_clear()
    right = interpreted.weight_only_product
    def offset_dropped(x, kept, *launch, **ids):
        return right(x, dataclasses.replace(kept, offset=(0, 0)), *launch, **ids)

    monkeypatch.setattr(interpreted, "weight_only_product", offset_dropped)
    with pytest.warns(UserWarning, match=r"does not compute right on cpu.*\[\(20, \(64, 64\)"):  # the case named
        assert not interpreted.runs_on(CPU)
    monkeypatch.setattr(interpreted, "weight_only_product",  # one expert's weight for every pair: refused
                        lambda x, kept, *launch, ids: right(x, kept, *launch, ids=ids * 0))  # fmt: skip
    with pytest.warns(UserWarning, match=r"gathered weight-only FP8 kernel does not compute right on cpu.*\[\(1, "):
        assert not interpreted.runs_on(CPU, experts=True)
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled = importlib.reload(fp8_weight_only)
    assert not compiled.runs_on(CPU) and not compiled.takes(kept_box(32, 32, (0, 0), (32, 32)), (32, 32), torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the file's shared module as it was: interpreted, nothing refused
    importlib.reload(fp8_weight_only)


def _a_second_step_reuses_each_linears_plan(interpreted, kept, linears: list, monkeypatch):
    """Each kept linear worked out its launch for a shape once (``LaunchPlans``): a step of other tokens in that
    shape makes no plan and gives, bit for bit, the logits its plans worked out afresh give; a copy of the
    plans is empty (a plan holds its tensors' addresses); another weight's product drops them."""
    from tp_workers import INPUT_IDS

    shapes = [[(torch.Size([*INPUT_IDS.shape, m.in_features]), torch.float32, interpreted.PLAIN)] for m in linears]
    assert [[list(plans) for plans in m.kernel.plans] for m in linears] == [[shape] for shape in shapes]
    made, plan = [], interpreted._launch_plan
    monkeypatch.setattr(interpreted, "_launch_plan", lambda *arguments: made.append(1) or plan(*arguments))
    with torch.no_grad():
        kept(INPUT_IDS[:, :3])
        planned = kept(INPUT_IDS[:, 3:6]).logits
        assert len(made) == len(linears) and [len(m.kernel.plans[0]) for m in linears] == [2] * len(linears)
        plans = copy.deepcopy(linears[0].kernel.plans[0]), pickle.loads(pickle.dumps(linears[0].kernel.plans[0]))
        for linear in linears:
            linear.kernel.plans[0].clear()
        afresh = kept(INPUT_IDS[:, 3:6]).logits
    assert len(made) == 2 * len(linears) and torch.equal(planned, afresh) and plans == ({}, {})
    plans, other = linears[0].kernel.plans[0], dataclasses.replace(linears[0].kernel.boxes[0])  # another weight
    x = torch.randn(2, linears[0].in_features)
    interpreted.weight_only_product(x, other, plans=plans)  # the first weight's plans dropped
    assert plans.owner[0] is other and list(plans) == [(x.shape, torch.float32, interpreted.PLAIN)]


def test_kept_fp8_linears_take_the_kernel_up_to_its_rows(interpreted, tiny_root, monkeypatch):
    """One process, ``llama_fp8_partial`` (32 x 32 blocks, dims ending in a partial block) kept: every decoder
    linear takes the kernel (``FP8WeightOnlyKernel``) and gives the logits of the checkpoint dequantized as
    read; a batch of more than ``KERNEL_ROWS`` rows takes the dequantized product, and so do an input
    that needs a gradient and one of another dtype; ue8m0 scales (``llama_fp8_ue8m0``) stay dequantized
    (``DequantizedKernel``). Phi-3's packed q|k|v and gate|up (a box a part) take it a part each, joined."""
    from tiny_models import make_fp8_checkpoint
    from tp_workers import INPUT_IDS

    import hf_parallel

    path = make_fp8_checkpoint("llama_fp8_partial", tiny_root)
    kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_quantized=True)
    read = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    linears = [m for m in kept.model.layers.modules() if isinstance(m, nn.Linear)]
    assert {type(m.kernel).__name__ for m in linears} == {"FP8WeightOnlyKernel"}
    calls = []
    right = interpreted.weight_only_product
    def counted(x, kept, *launch, **plans):
        calls.append(x.numel() // x.shape[-1])
        return right(x, kept, *launch, **plans)

    monkeypatch.setattr(interpreted, "weight_only_product", counted)
    long = INPUT_IDS.repeat(1, 5)  # 70 rows
    with torch.no_grad():
        for ids in (INPUT_IDS, long):
            torch.testing.assert_close(kept(ids).logits, read(ids).logits, rtol=1e-5, atol=1e-5)
    assert len(calls) == len(linears) and set(calls) == {INPUT_IDS.numel()}  # 14 rows: the kernel; 70: not
    x = torch.randn(3, linears[0].in_features, requires_grad=True)
    linears[0](x).sum().backward()
    with pytest.raises(RuntimeError, match="dtype"), torch.no_grad():  # another dtype: refused as nn.Linear does
        linears[0](x.double())
    assert len(calls) == len(linears) and x.grad is not None
    _a_second_step_reuses_each_linears_plan(interpreted, kept, linears, monkeypatch)
    ue8m0 = hf_parallel.AutoModelForCausalLM.from_pretrained(make_fp8_checkpoint("llama_fp8_ue8m0", tiny_root),
                                                             dtype=torch.bfloat16, keep_quantized=True)  # fmt: skip
    assert {type(m.kernel).__name__ for m in ue8m0.model.layers.modules() if isinstance(m, nn.Linear)} == {
        "DequantizedKernel"}
    phi3 = make_fp8_checkpoint("phi3_fp8", tiny_root)
    kept = hf_parallel.AutoModelForCausalLM.from_pretrained(phi3, dtype=torch.float32, keep_quantized=True)
    read = hf_parallel.AutoModelForCausalLM.from_pretrained(phi3, dtype=torch.float32)
    boxes = {name: len(m.kernel.boxes) for name, m in kept.model.layers[0].named_modules() if isinstance(m, nn.Linear)}
    assert boxes == {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
    calls.clear()
    with torch.no_grad():
        torch.testing.assert_close(kept(INPUT_IDS).logits, read(INPUT_IDS).logits, rtol=1e-5, atol=1e-5)
    assert len(calls) == 7 * kept.config.num_hidden_layers  # a product a box
