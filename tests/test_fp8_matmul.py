"""Kept FP8 weights multiplied in FP8 (``quant/kernels/fp8_scaled_mm.py``), what a CPU can check: the activations'
quantization, the scales laid out as torch's block-scaled product reads them, and which modules take the
product. CPU torch has no block-scaled ``_scaled_mm``: here it is ``block_scaled_mm``, torch's layout checks
(``ScaledBlas.cpp``: ``is_blockwise_1x128_scaling``, ``is_blockwise_128x128_scaling``, both of its stride rules)
restated with the product in float32. The card's own product runs in the cuda tier (``test_cuda.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_parallel.quant.kernels import fp8_scaled_mm
from hf_parallel.quant.kernels.fp8_scaled_mm import BLOCK, act_quant, block_scales, fp8_product

E4M3_STEP = 2.0**-4  # float8_e4m3fn's relative rounding (3 mantissa bits, half a step)
E4M3_SUBNORMAL = 2.0**-9  # its smallest step, below which the rounding is absolute (times the group's scale)


def block_scaled_mm(padded: bool):
    def scaled_mm(a, b, scale_a, scale_b, out_dtype):
        (m, k), n = a.shape, b.shape[1]
        assert a.dtype == b.dtype == torch.float8_e4m3fn and a.is_contiguous() and b.t().is_contiguous()
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert scale_a.shape == (m, k // BLOCK) and (m <= 1 or scale_a.stride(0) == 1), scale_a.stride()
        assert k // BLOCK <= 1 or scale_a.stride(1) == m, scale_a.stride()  # outer-dim-major
        weight_scales, row = scale_b.t(), (-(-k // BLOCK // 4) * 4 if padded else k // BLOCK)
        assert weight_scales.shape == (n // BLOCK, k // BLOCK) and weight_scales.stride(1) == 1
        assert n // BLOCK <= 1 or weight_scales.stride(0) == row, (weight_scales.stride(), row)
        x = a.float().unflatten(1, (-1, BLOCK)) * scale_a[..., None]
        w = b.t().float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK) * weight_scales[:, None, :, None]
        return (x.flatten(1) @ w.reshape(n, k).T).to(out_dtype)

    return scaled_mm


def test_activations_quantize_per_token_and_128_columns():
    x = torch.randn(2, 3, 4 * BLOCK, dtype=torch.bfloat16) * torch.logspace(-3, 3, 4 * BLOCK)
    x[0, 1, :BLOCK] = 0  # a group of zeros: zeros, not 0 / 0
    quantized, scales = act_quant(x)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == (6, 4 * BLOCK)
    assert scales.shape == (6, 4) and scales.stride() == (1, 6)  # outer-dim-major, as _scaled_mm reads 1x128
    back = quantized.float().unflatten(1, (-1, BLOCK)) * scales[..., None]
    want = x.reshape(6, -1).float().unflatten(1, (-1, BLOCK))
    bound = E4M3_STEP * want.abs() + E4M3_SUBNORMAL * scales[..., None]
    assert ((back - want).abs() <= bound).all() and back[1, 0].eq(0).all()
    assert torch.equal(scales, want.abs().amax(-1).div(448).clamp(min=torch.finfo(torch.float32).tiny))


@pytest.mark.parametrize("padded,rows", [(True, 1), (False, 16)])
def test_an_fp8_product_is_the_float_product_within_the_activations_rounding(monkeypatch, padded, rows):
    """K of 5 blocks (the two scale layouts differ), rows as given or padded to 16: the W8A8 product against
    x @ W.T in float32, W the dequantized weight; the only difference allowed is the activations' FP8 rounding."""
    monkeypatch.setattr(torch, "_scaled_mm", block_scaled_mm(padded))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5 * BLOCK, generator=generator)
    weight = (torch.randn(2 * BLOCK, 5 * BLOCK, generator=generator) * 64).to(torch.float8_e4m3fn)
    scales = torch.rand(2, 5, generator=generator) / 64 + 1e-3
    dequantized = (weight.float().view(2, BLOCK, 5, BLOCK) * scales[:, None, :, None]).view(2 * BLOCK, 5 * BLOCK)
    got = fp8_product(x, weight, block_scales(scales, padded), torch.float32, rows)
    groups = x.unflatten(1, (-1, BLOCK))
    group_scale = (groups.abs().amax(-1, keepdim=True) / 448).expand_as(groups).flatten(1)
    bound = (E4M3_STEP * x.abs() + E4M3_SUBNORMAL * group_scale) @ dequantized.abs().T
    assert ((got - x @ dequantized.T).abs() <= bound).all()
    with pytest.raises(AssertionError):  # the other layout is not what this torch reads
        fp8_product(x, weight, block_scales(scales, not padded), torch.float32)


# compiled against eager, relative to the logits' largest: bfloat16 computed in float32 inside inductor's kernels
# (1%), and FP8 products besides, where those differences move activations across FP8 roundings (2**-4 each)
COMPILED_WITHIN = {"fp8": 0.1, True: 0.02}


@pytest.mark.slow
def test_kept_linears_multiply_in_fp8_where_whole_blocks_and_compile_whole(tiny_root, monkeypatch):
    """One process, ``llama_fp8_128`` (128 x 128 blocks) kept, on a card with the product (its rows padded to
    16): in bfloat16 every decoder linear multiplies in FP8 and gives the dequantized path's logits within the
    activations' rounding; ``keep_quantized=True`` and float32 dequantize (``DequantizedKernel``). Both kinds
    compile whole in bfloat16 (``fullgraph``: no parameter built in the forward), giving their eager logits."""
    from tiny_models import make_fp8_checkpoint
    from tp_workers import INPUT_IDS

    import hf_parallel

    path = make_fp8_checkpoint("llama_fp8_128", tiny_root)
    monkeypatch.setattr(fp8_scaled_mm, "supports_block_fp8", lambda device: fp8_scaled_mm.Recipe(True, 16, any_k=True))
    monkeypatch.setattr(torch, "_scaled_mm", block_scaled_mm(padded=True))
    logits, kinds = {}, {}
    for keep, dtype in (("fp8", torch.bfloat16), (True, torch.bfloat16), ("fp8", torch.float32)):
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, keep_quantized=keep)
        kinds[keep, dtype] = {type(m.kernel).__name__ for m in model.model.layers.modules() if isinstance(m, nn.Linear)}
        with torch.no_grad():
            logits[keep, dtype] = eager = model(INPUT_IDS).logits.float()
        if dtype == torch.bfloat16:  # float32's DequantizedKernel: compiled as bfloat16's (a compile is seconds)
            with torch.no_grad():
                compiled = torch.compile(model.forward, fullgraph=True)(INPUT_IDS).logits.float()
            within = COMPILED_WITHIN[keep] * eager.abs().max().item()
            torch.testing.assert_close(compiled, eager, atol=within, rtol=0)
    assert kinds == {("fp8", torch.bfloat16): {"FP8ScaledMMKernel"}, (True, torch.bfloat16): {"DequantizedKernel"},
                     ("fp8", torch.float32): {"DequantizedKernel"}}  # fmt: skip
    fp8, dequantized = logits["fp8", torch.bfloat16], logits[True, torch.bfloat16]
    assert not torch.equal(fp8, dequantized)  # the activations were rounded to FP8
    within = 0.1 * dequantized.abs().max().item()  # the activations rounded to FP8 (2**-4) through two layers
    torch.testing.assert_close(fp8, dequantized, atol=within, rtol=0)


def test_a_recipe_without_any_contraction_takes_multiples_of_four_blocks():
    """torch 2.11 accepts a weight's scales unpadded where the contraction is not a multiple of 4 blocks, and
    cuBLASLt reads them otherwise (seen on an H100): such a weight stays dequantized."""
    assert [fp8_scaled_mm.Recipe(False, 16, any_k=False).takes(k * BLOCK) for k in (2, 4, 6, 12)] == [0, 1, 0, 1]
    assert fp8_scaled_mm.Recipe(True, 1, any_k=True).takes(6 * BLOCK)


def test_keep_quantized_takes_true_false_or_fp8(tiny_root):
    import hf_parallel

    with pytest.raises(ValueError, match="keep_quantized='int8': one of False, True, 'fp8' and 'int4'"):
        hf_parallel.AutoModelForCausalLM.from_pretrained(tiny_root, keep_quantized="int8")
