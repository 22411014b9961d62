"""The ``cuda`` tier: the distributed cases that matter, with every rank on a GPU. Two ranks share one card
(the mesh's groups become gloo groups, point-to-point messages go through pinned host memory), so a
one-GPU machine runs every layout; skipped where torch sees no GPU. ``pytest -m cuda tests``.

Each case checks the one device truth (nothing left on the host after loading), one process's numbers on
the CPU (fp32: outputs, loss, every gradient's slice), greedy tokens, and saves bitwise equal to the
source (gathered and per rank + consolidate), under NCCL's point-to-point rules like every test here."""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from checks import assert_same_checkpoint
from compare import assert_within
from distributed import run_ranks

import hf_parallel

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: the cuda tier runs where torch sees one"),
]

# name -> (checkpoint, from_pretrained keywords, what runs); every family whose buffers the load must move
CASES = {
    "llama_tp2": ("llama", dict(tp_plan="auto"), {"generate", "save", "compile"}),  # 9/3 heads: uneven KV groups
    "gemma2_tp2": ("gemma2", dict(tp_plan="auto"), {"generate"}),  # embedding scale, sliding-window tables
    "gptj_tp2": ("gptj", dict(tp_plan="auto"), {"generate", "save"}),  # embed_positions
    "falcon_alibi_tp2": ("falcon_alibi", dict(tp_plan="auto"), {"generate"}),
    "bert_tp2": ("bert", dict(tp_plan="auto"), {"encoder", "save"}),  # position_ids, token_type_ids
    "falcon_h1_tp2": ("falcon_h1", dict(tp_plan="auto"), {"generate", "save"}),  # mup_vector, conv and SSM caches
    "qwen3_moe_ep2": ("qwen3_moe", dict(tp_plan="auto", ep_plan="auto"), {"generate", "save"}),
    "llama_sp2": ("llama", dict(tp_plan=None, sp_size=2), set()),
    "llama_cp2": ("llama", dict(tp_plan=None, cp_size=2), {"generate"}),  # ring attention, zigzag order
    # the ring's pairs through the memory-efficient kernel in bf16, against one process in fp32
    "llama_cp2_bf16": ("llama", dict(tp_plan=None, cp_size=2, dtype=torch.bfloat16), {"bf16"}),
    "pp_tied_pp2": ("pp_tied", dict(tp_plan=None, pp_size=2), {"train_step", "save"}),  # tied gradient, 1F1B
    "llama_fsdp2": ("llama", dict(tp_plan=None, fsdp_size=2), {"save"}),  # FSDP2 over gloo groups, one layer whole
    "llama_fsdp2_offload": ("llama", dict(tp_plan=None, fsdp_size=2, fsdp_cpu_offload=True), {"save"}),  # on the host
}
FOUR_RANKS = {  # world 4 on the same card
    "llama_tp2sp2": ("llama", dict(tp_size=2, sp_size=2), set()),  # Ulysses inside TP groups
    "llama_sp2cp2": ("llama", dict(tp_plan=None, sp_size=2, cp_size=2), set()),  # Ulysses inside the ring
}
CHECKPOINTS = {name for name, _, _ in [*CASES.values(), *FOUR_RANKS.values()]}


@pytest.fixture(scope="module")
def gpu_results(tmp_path_factory):
    import cuda_workers
    from tiny_models import make_checkpoint

    root = str(tmp_path_factory.mktemp("cuda"))
    paths = {name: make_checkpoint(name, root) for name in CHECKPOINTS}
    save_root = os.path.join(root, "saved")
    before = os.environ.get("HF_PARALLEL_DEVICE")
    os.environ["HF_PARALLEL_DEVICE"] = "cuda:0"  # inherited by the ranks: all on the first GPU
    try:
        results = {}
        for world, cases in ((2, CASES), (4, FOUR_RANKS)):
            asked = {case: (paths[name], kwargs, sorted(runs)) for case, (name, kwargs, runs) in cases.items()}
            ranks = run_ranks(world, cuda_workers.on_gpu, asked, save_root, out_dir=os.path.join(root, f"out{world}"))
            for case in cases:
                results[case] = [rank[case] for rank in ranks]
    finally:
        os.environ.pop("HF_PARALLEL_DEVICE")
        if before is not None:
            os.environ["HF_PARALLEL_DEVICE"] = before
    return paths, results, save_root


@pytest.mark.parametrize("case", [*CASES, *FOUR_RANKS])
def test_on_a_gpu_like_one_process(gpu_results, case):
    paths, results, save_root = gpu_results
    name, kwargs, runs = {**CASES, **FOUR_RANKS}[case]
    for rank, got in enumerate(results[case]):
        where = f"{case} rank {rank}: {got}"
        assert got["device"].startswith("cuda") and got["wire"] == "cpu", where  # two ranks on one card: gloo
        assert not got["left_behind"], where
        # fp32: the kernels' rounding; bf16 (its weights rounded too): a few of its 8 bits, relative to each tensor
        loss, close = (dict(atol=3e-2, rtol=0), dict(atol=0, rtol=5e-2)) if "bf16" in runs else (
            dict(atol=1e-5, rtol=0), dict(atol=1e-4, rtol=0))
        assert_within({"loss": got["loss"]}, **loss, where=where)
        outputs = {k: got[k] for k in ("output", "compiled") if k in got}  # (none under SP and stages)
        if outputs:
            assert_within(outputs, **close, where=where)
        assert_within(got["grads"], **close, where=f"{case} rank {rank} gradients")  # NaN, missing: fail
        if "generate" in runs:
            assert got["greedy"], where
    if "save" in runs:
        assert_same_checkpoint(paths[name], os.path.join(save_root, case, "gathered"))
        consolidated = os.path.join(save_root, case, "consolidated")
        hf_parallel.consolidate(os.path.join(save_root, case, "distributed"), consolidated, progress=False)
        assert_same_checkpoint(paths[name], consolidated)


def test_fp8_kept_quantized_on_a_gpu(tmp_path, monkeypatch):
    """``llama_fp8`` (32 x 32 blocks) kept at TP=2, whose shards start inside blocks: on a card that runs the
    package's weight-only kernel every kept linear takes it; logits as the checkpoint dequantized as read
    (float32 and bfloat16), a second eager forward bit for bit the first (its launches through the kernels kept
    from the first's: ``triton_launch``), compiled whole as eager; saved back (the float32 load bitwise,
    gathered and per rank; the bfloat16 one's plain weights as it holds them)."""
    import cuda_workers
    from tiny_models import make_fp8_checkpoint

    path = make_fp8_checkpoint("llama_fp8", str(tmp_path))
    monkeypatch.setenv("HF_PARALLEL_DEVICE", "cuda:0")
    results = run_ranks(2, cuda_workers.kept_fp8, path, str(tmp_path / "saved"), dict(tp_size=2),
                        out_dir=str(tmp_path / "out"))  # fmt: skip
    for rank, got in enumerate(results):
        where = f"rank {rank}: {got}"
        assert got["kernel"] or got["capability"] < [8, 9], where  # FP8 conversions: Ada, Hopper and later
        assert got["kept kernels"] or not got["kernel"], where  # the eager launches after a key's first: kept
        for dtype, within in (("torch.float32", dict(atol=1e-4, rtol=0)), ("torch.bfloat16", dict(atol=0, rtol=0.05))):
            assert got[f"kinds {dtype}"] == ["FP8WeightOnlyKernel" if got["kernel"] else "DequantizedKernel"], where
            assert got[f"again {dtype}"], where  # bit for bit through the kept kernels
            assert_within(got[dtype], **within, where=f"FP8 kept and compiled, {dtype}, {where}")
    assert_same_checkpoint(path, str(tmp_path / "saved" / "float32" / "gathered"))
    assert_same_checkpoint(path, str(tmp_path / "saved" / "bfloat16" / "gathered"), held=torch.bfloat16)
    hf_parallel.consolidate(str(tmp_path / "saved" / "float32" / "per_rank"), str(tmp_path / "consolidated"),
                            progress=False)  # fmt: skip
    assert_same_checkpoint(path, str(tmp_path / "consolidated"))


def test_int4_kept_through_torch_kernel_on_a_gpu(tmp_path, monkeypatch):
    """``keep_quantized="int4"``, act-order GPTQ (``llama_gptq``) at TP=2 in bfloat16: on a card with torch's
    int4 kernel (Ampere and later) every kept linear takes it; logits as the checkpoint dequantized as read
    within bfloat16's rounding, compiled whole as eager; its quantized parts saved back bitwise."""
    import cuda_workers
    from tiny_models import make_grouped_checkpoint

    path = make_grouped_checkpoint("llama_gptq", str(tmp_path))[0]
    monkeypatch.setenv("HF_PARALLEL_DEVICE", "cuda:0")
    results = run_ranks(2, cuda_workers.kept_int4, path, str(tmp_path / "saved"), out_dir=str(tmp_path / "out"))
    for rank, got in enumerate(results):
        where = f"rank {rank}: {got}"
        assert got["kernel"] or got["capability"] < [8, 0], where
        assert got["kinds"] == ["Int4TorchKernel" if got["kernel"] else "DequantizedKernel"], where
        assert_within({"kept": got["kept"], "compiled": got["compiled"]}, atol=0, rtol=0.05, where=where)
    assert_same_checkpoint(path, str(tmp_path / "saved" / "gathered"), held=torch.bfloat16)


def test_kept_experts_gather_a_steps_experts_on_a_gpu(tmp_path, monkeypatch):
    """``keep_quantized=True``, Qwen3-MoE FP8 (per-expert keys) with its experts spread (EP=2) in float32: a
    one-token step gathers each pair's expert on the card (other ranks' experts as EP's sentinel), multiplied
    as stored by the gathered FP8 kernel on cards with FP8 conversions (Ada, Hopper and later), a prefill
    dequantizes every expert, both as the checkpoint dequantized as read; the step compiles whole; saved
    back bitwise."""
    import cuda_workers
    from tiny_models import make_fp8_checkpoint

    path = make_fp8_checkpoint("qwen3_moe_fp8", str(tmp_path))
    monkeypatch.setenv("HF_PARALLEL_DEVICE", "cuda:0")
    results = run_ranks(2, cuda_workers.kept_experts, path, str(tmp_path / "saved"), dict(tp_size=2, ep_plan="auto"),
                        out_dir=str(tmp_path / "out"))  # fmt: skip
    for rank, got in enumerate(results):
        assert got["experts"] == 2, got
        if got["capability"] >= [8, 9]:  # FP8 conversions: a step's experts multiplied as stored (3 a layer)
            assert got["as_stored"] == [True, True] and got["launches"] == 6, got
        assert_within({k: got[k] for k in ("step", "prefill", "compiled")}, atol=1e-4, rtol=0, where=f"rank {rank}")
    assert_same_checkpoint(path, str(tmp_path / "saved" / "gathered"))


WHOLE_BLOCKS = ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # K of 4 blocks


def test_fp8_kept_in_whole_blocks_is_multiplied_in_fp8_on_hopper(tmp_path, monkeypatch):
    """``keep_quantized="fp8"``, TP=2, bfloat16, 128 x 128 blocks: on a Hopper card with CUDA 12.9+ the query
    and MLP shards (whole blocks, a contraction of 4) multiply in FP8, the output projection too where the
    card's recipe takes 2 blocks, and the key/value shards (half a block) dequantize; each product is the
    W8A8 product computed in float32 up to bfloat16's rounding of the output; the model's logits are the
    dequantized path's up to the activations' FP8 rounding; compiled (fullgraph) gives eager's; saved bitwise."""
    import cuda_workers
    from tiny_models import make_fp8_checkpoint

    path = make_fp8_checkpoint("llama_fp8_128", str(tmp_path))
    monkeypatch.setenv("HF_PARALLEL_DEVICE", "cuda:0")
    results = run_ranks(2, cuda_workers.fp8_products, path, str(tmp_path / "saved"), out_dir=str(tmp_path / "out"))
    for rank, got in enumerate(results):
        where = f"rank {rank}: {got}"
        hopper = got["capability"][0] == 9 and tuple(map(int, got["cuda"].split(".")[:2])) >= (12, 9)
        if not hopper:
            assert got["fp8"] == [] and not got["supported"], where
            continue
        assert got["supported"], where
        whole_blocks = WHOLE_BLOCKS + ("self_attn.o_proj",) * got["supported"]["any_k"]  # K of 2 blocks
        assert got["fp8"] == sorted(f"model.layers.{i}.{name}" for i in range(2) for name in whole_blocks), where
        assert_within(got["products"], atol=0, rtol=2**-7, where=f"FP8 products, {where}")
        assert_within({"logits": got["logits"]}, atol=0, rtol=0.1, where=f"FP8 logits, {where}")
        assert_within({"compiled": got["compiled"]}, atol=0, rtol=0.1, where=f"FP8 compiled, {where}")
    assert_same_checkpoint(path, str(tmp_path / "saved" / "gathered"), held=torch.bfloat16)


def test_verify_on_a_gpu(tmp_path, monkeypatch):
    import cuda_workers
    from tiny_models import make_checkpoint

    path = make_checkpoint("llama", str(tmp_path))
    monkeypatch.setenv("HF_PARALLEL_DEVICE", "cuda:0")
    results = run_ranks(2, cuda_workers.verified, path, dict(tp_size=2), out_dir=str(tmp_path / "out"))
    assert results[0]["ok"], results[0]["report"]


DECODE_STEPS = {"llama_tp2": dict(tp_plan="auto"), "llama_sp2": dict(tp_plan=None, sp_size=2)}


@pytest.mark.parametrize("case", DECODE_STEPS)
def test_a_decode_step_waits_on_the_host_only_inside_the_transport(tmp_path, monkeypatch, case):
    """CUDA's sync debug mode around one decode step: no host synchronisation but those torch.distributed
    makes itself, staging device tensors through the host for gloo (two ranks on one card; under NCCL,
    one rank a GPU, there are none), and those plain transformers makes at the same line in one process
    taking the same step, as many times as there (SP's step has no cache: transformers' packed-sequence check
    synchronises). The control ``.item()`` must be seen, each time."""
    import cuda_workers
    from tiny_models import make_checkpoint

    path = make_checkpoint("llama", str(tmp_path))
    monkeypatch.setenv("HF_PARALLEL_DEVICE", "cuda:0")
    ranks = run_ranks(2, cuda_workers.decode_syncs, path, DECODE_STEPS[case], out_dir=str(tmp_path / "out"))
    for rank, got in enumerate(ranks):
        assert sum("cuda_workers.py" in where for where in got["control"]) == 2, got
        transport = f"torch{os.sep}distributed{os.sep}" if got["wire"] == "cpu" else None
        ours = Counter(where for where in got["syncs"] if transport is None or transport not in where)
        assert ours - Counter(got["one_process"]) == Counter(), (case, rank, got)  # none beyond one process's


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="CUDA graphs capture NCCL's collectives, one rank a GPU; "
                    "two ranks sharing a card talk over gloo, which no graph can capture")  # fmt: skip
def test_a_reduce_overhead_tp_decode_gives_eager_tokens(tmp_path):
    """``torch.compile(mode="reduce-overhead")`` of the TP=2 decode step with a static cache: captured as CUDA
    graphs, greedy tokens equal to eager's."""
    import compile_workers
    from tiny_models import make_checkpoint

    path = make_checkpoint("llama", str(tmp_path))
    cases = {"tp2": ("generate", path, dict(tp_size=2), dict(mode="reduce-overhead"))}
    for rank, got in enumerate(run_ranks(2, compile_workers.compiled_cases, cases, out_dir=str(tmp_path / "out"))):
        assert got["tp2"]["tokens"] == got["tp2"]["eager_tokens"], (rank, got["tp2"])
        assert got["tp2"]["device"].startswith("cuda"), got["tp2"]


def test_a_reduce_overhead_decode_of_kept_fp8_gives_eager_tokens(tmp_path, monkeypatch):
    """One process on the card, ``llama_fp8`` kept (float32): ``torch.compile(mode="reduce-overhead")`` of the
    decode step with a static cache, the package's FP8 kernel inside the CUDA graphs (the MLP's down projection
    split in two runs, as ``split_for`` gives 160 inputs in tiles of 32: what a compiled step captures is traced
    on CPU in ``test_triton_launch.py``), gives eager's greedy tokens (eager splits none)."""
    import compile_workers
    from tiny_models import make_fp8_checkpoint

    path = make_fp8_checkpoint("llama_fp8", str(tmp_path))
    monkeypatch.setenv("HF_PARALLEL_DEVICE", "cuda:0")
    cases = {"kept": ("generate", path, dict(keep_quantized=True), dict(mode="reduce-overhead"))}
    (got,) = run_ranks(1, compile_workers.compiled_cases, cases, out_dir=str(tmp_path / "out"))
    assert got["kept"]["tokens"] == got["kept"]["eager_tokens"] and got["kept"]["device"].startswith("cuda"), got
