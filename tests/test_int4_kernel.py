"""Kept GPTQ / AWQ int4 weights multiplied by torch's own int4 kernel (``quant/kernels/int4_torch.py``), on CPU
(``_weight_int4pack_mm_for_cpu``): the repacked form's products against the format's definition (groups in
place, act-order inputs spread to their groups' slots, a last group half full, outputs padded to 16), the
load-time check refusing a kernel that computes otherwise, and which linears take it in a model, whose
logits are the checkpoint's dequantized as read. GPTQ and AWQ run through it with
``keep_quantized="int4"`` at TP=4 in ``test_quantized.py``; CUDA's kernel runs in the cuda tier."""

from __future__ import annotations

import pytest
import torch

from hf_parallel.quant.kernels import int4_torch

CPU = torch.device("cpu")


SHAPES = {  # name -> (groups, inputs in each, spread)
    "groups in place": (3, None, False),
    "act-order, a group half full": (3, None, True),
    "an act-order shard, 10 inputs in each of 8 groups": (8, 10, True),
}


def int4_weight(outputs: int, group: int, shape: str, seed: int = 0):
    """Unsigned values [outputs, inputs], zero points and scales [groups, outputs], each input's group (``SHAPES``;
    spread: shuffled, as act-order stores them); and the weight they stand for."""
    generator = torch.Generator().manual_seed(seed)
    groups, each, spread = SHAPES[shape]
    index = torch.arange(groups * group) // group
    if each is not None:
        index = torch.arange(groups).repeat_interleave(each)
    elif spread:
        index = index[: len(index) - group // 2]  # the last group half full
    if spread:
        index = index[torch.randperm(len(index), generator=generator)]
    inputs = len(index)
    values = torch.randint(0, 16, (outputs, inputs), generator=generator, dtype=torch.uint8)
    zero = torch.randint(0, 16, (groups, outputs), generator=generator).float()
    scales = torch.rand(groups, outputs, generator=generator) / 16 + 1e-3
    weight = (values.float() - zero.T[:, index]) * scales.T[:, index]
    return (values, zero, scales, index), weight


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("group", [32, 128])
def test_the_repacked_weight_multiplies_as_the_format_defines(group, shape):
    """float32: within float32's sums; bfloat16: within the scales', zeros' and output's rounding. Outputs of
    40 (padded to 48), 1, 7 and 64 rows. Groups not whole in the box fill chunks of 32 slots: an act-order
    shard's contraction is about its own width, not the whole weight's."""
    (values, zero, scales, index), weight = int4_weight(40, group, shape)
    spread, inputs = SHAPES[shape][2], values.shape[1]
    for dtype, within in ((torch.float32, 1e-5), (torch.bfloat16, 2**-6)):
        pack = int4_torch._packed(values, zero, scales, index, group, dtype)
        assert (pack.slots is not None) == spread and pack.packed.dtype == torch.uint8
        assert pack.width == (inputs if not spread else sum(-(-int(n) // 32) * 32 for n in index.bincount()))
        for rows in (1, 7, 64):
            x = torch.randn(rows, values.shape[1]).to(dtype)
            want = x.float() @ weight.T
            got = int4_torch.int4_product(x, pack)
            assert got.shape == (rows, 40) and got.dtype == dtype
            torch.testing.assert_close(got.float(), want, rtol=0, atol=within * want.abs().max().item())


def test_experts_packs_stack_only_in_one_form_and_each_row_takes_its_experts():
    """Three experts' packs of one form (act-order: each expert's inputs spread its own way, their slots
    stacked) multiply each row by its own expert's weight (ids 2, 0, 2, 1: an expert twice), as each expert's
    pack alone does, bit for bit; packs of another form (groups in place: no slots; another width) or a
    missing one do not stack."""
    experts = [int4_weight(24, 32, "an act-order shard, 10 inputs in each of 8 groups", seed) for seed in range(3)]
    packs = [int4_torch._packed(*parts, 32, torch.float32) for parts, _ in experts]
    stack = int4_torch.stacked(packs)
    assert stack.packed.shape[0] == 3 and stack.slots.shape == (3, 80)
    ids, x = torch.tensor([2, 0, 2, 1]), torch.randn(4, 80)
    got = int4_torch.int4_product(x, stack, ids)
    want = torch.cat([int4_torch.int4_product(x[p : p + 1], packs[e]) for p, e in enumerate(ids.tolist())])
    assert torch.equal(got, want)
    torch.testing.assert_close(got, torch.stack([x[p] @ experts[e][1].T for p, e in enumerate(ids.tolist())]),
                               rtol=0, atol=1e-5 * got.abs().max().item())  # fmt: skip
    in_place = int4_torch._packed(*int4_weight(24, 32, "groups in place")[0], 32, torch.float32)
    assert int4_torch.stacked([*packs[:2], in_place]) is None and int4_torch.stacked([*packs[:2], None]) is None


@pytest.mark.parametrize("inputs", [576, 288, 160])
def test_a_scale_per_row_is_cut_into_the_largest_kernel_groups_that_fit(inputs):
    """A format's group larger than the kernel's (compressed-tensors' scale per output row: a group of all 576
    inputs) and a row-parallel shard of it (288, from input 288) stay in place, in the largest kernel group that
    divides the box's inputs (64 and 32); a cut that none divides (160 inputs, with a group of 100 cut at 60:
    counts 40, 100 and 20) fills chunks of 32 slots."""
    generator = torch.Generator().manual_seed(inputs)
    group = 576 if inputs != 160 else 100
    index = (torch.arange(inputs) + (288 if inputs == 288 else 60 if inputs == 160 else 0)) // group
    index -= int(index[0])
    count = int(index.max()) + 1
    values = torch.randint(0, 16, (24, inputs), generator=generator, dtype=torch.uint8)
    zero = torch.randint(0, 16, (count, 24), generator=generator).float()
    scales = torch.rand(count, 24, generator=generator) / 16 + 1e-3
    weight = (values.float() - zero.T[:, index]) * scales.T[:, index]
    pack = int4_torch._packed(values, zero, scales, index, group, torch.float32)
    assert (pack.group, pack.width, pack.slots is None) == {576: (64, 576, True), 288: (32, 288, True),
                                                            160: (32, 64 + 128 + 32, False)}[inputs]  # fmt: skip
    x = torch.randn(3, inputs)
    want = x @ weight.T
    torch.testing.assert_close(int4_torch.int4_product(x, pack), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_a_kernel_that_computes_otherwise_is_refused_at_load(monkeypatch):
    """The load-time check against the format's weights: a layout whose values' nibbles are swapped is refused
    with a warning naming the device and dtype, and the weights stay dequantized."""
    assert int4_torch.runs_on(CPU, torch.float32)
    layout = int4_torch._kernel_layout
    monkeypatch.setattr(int4_torch, "_kernel_layout", lambda codes: layout(15 - codes))
    int4_torch.runs_on.cache_clear()
    try:
        with pytest.warns(UserWarning, match="int4 kernel does not compute right on cpu in torch.float32"):
            assert not int4_torch.runs_on(CPU, torch.float32)
    finally:
        int4_torch.runs_on.cache_clear()


def test_kept_int4_linears_take_the_int4_kernel(tiny_root, monkeypatch):
    """One process, ``keep_quantized="int4"``: act-order GPTQ (``llama_gptq``), GPTQ with one group of all the
    inputs (``phi3_gptq``: groups of 96 and 160 inputs; its packed q|k|v and gate|up are a box per part, each
    through the kernel, the products joined), AWQ with partial groups and 80 outputs (``llama_awq``), and
    compressed-tensors' W4A16 (groups of 32; zero points packed along the rows with partial groups; a scale and
    zero point per output row) kept: every kept decoder linear takes the kernel and gives the logits of the
    checkpoint dequantized as read (float32 within 1e-5, bfloat16 within its rounding), its copies' bytes as
    ``hf-parallel plan`` gives them; a batch over ``KERNEL_ROWS`` rows takes the dequantized product;
    ``keep_quantized=True`` holds the stored bytes alone (dequantized per module), and so does 8-bit GPTQ, with
    a warning."""
    from tiny_models import make_grouped_checkpoint, make_packed_checkpoint
    from tp_workers import INPUT_IDS

    import hf_parallel
    from hf_parallel.commands.report import plan_report

    calls = []
    product = int4_torch.int4_product
    monkeypatch.setattr(int4_torch, "int4_product",
                        lambda x, pack: calls.append(x.shape[:-1].numel()) or product(x, pack))  # fmt: skip
    grouped, packed = ("llama_gptq", "phi3_gptq", "llama_awq"), ("llama_w4_group", "llama_w4_zero_point",
                                                                 "llama_w4_channel_zero_point")  # fmt: skip
    for name in grouped + packed:
        path = (make_grouped_checkpoint if name in grouped else make_packed_checkpoint)(name, tiny_root)[0]
        for dtype, within in ((torch.float32, 1e-5), (torch.bfloat16, 2**-6)):
            kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, keep_quantized="int4")
            read = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            linears = {n: m for n, m in kept.model.layers.named_modules() if hasattr(m, "kept_weight")}
            for module_name, module in linears.items():  # Phi-3's packed parts: a box each, a product each
                parts = {"qkv_proj": 3, "gate_up_proj": 2}.get(module_name.rpartition(".")[2], 1)
                parts = parts if name == "phi3_gptq" else 1
                assert type(module.kernel).__name__ == "Int4TorchKernel", (name, module_name)
                assert len(module.kernel.packs) == parts, (name, module_name)
            held = sum(t.nbytes for m in linears.values() for pack in m.kernel.packs for t in pack
                       if isinstance(t, torch.Tensor))
            line = next(line for line in plan_report(path, tp=1, dtype=dtype).splitlines() if "int4 kernel" in line)
            cuda = held if dtype == torch.bfloat16 else 0  # CUDA's kernel takes bfloat16 only
            assert f"check): [{held}] bytes per rank on CPU ([{cuda}] on CUDA" in line, (name, dtype, line)
            packs = sum(len(m.kernel.packs) for m in linears.values())
            calls.clear()
            with torch.no_grad():
                for ids in (INPUT_IDS, INPUT_IDS.repeat(1, 5)):  # 14 rows: the kernel; 70: dequantized
                    want = read(ids).logits.float()
                    got = kept(ids).logits.float()
                    torch.testing.assert_close(got, want, rtol=0, atol=within * want.abs().max().item())
            assert calls == [INPUT_IDS.numel()] * packs, (name, calls)
    path = make_grouped_checkpoint("llama_gptq", tiny_root)[0]  # keep_quantized=True: the stored bytes alone
    kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_quantized=True)
    assert {type(m.kernel).__name__ for m in kept.model.layers.modules() if hasattr(m, "kept_weight")} == {
        "DequantizedKernel"}
    for name in ("llama_gptq_v2_w8",):
        path = make_grouped_checkpoint(name, tiny_root)[0]
        with pytest.warns(UserWarning, match="keep_quantized='int4': no kept weight is multiplied"):
            kept = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_quantized="int4")
        assert {type(m.kernel).__name__ for m in kept.model.layers.modules() if hasattr(m, "kept_weight")} == {
            "DequantizedKernel"}
