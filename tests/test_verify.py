"""hf-parallel verify: every layer of a parallel load against one process, on the user's checkpoint."""

import os
import subprocess
import sys

import pytest
import torch
import tp_workers
from distributed import run_ranks

pytestmark = pytest.mark.distributed


def _verify(*args):
    env = {**os.environ, "HF_PARALLEL_TIMEOUT": "120"}
    return subprocess.run(
        [sys.executable, "-m", "hf_parallel", "verify", *args], capture_output=True, text=True, env=env, timeout=600
    )


def test_verify_passes_a_correct_model_and_prints_every_layer(tiny_paths):
    done = _verify(tiny_paths["llama"], "--tp", "2")  # starts its own two ranks
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.endswith(" ok")}
    assert list(rows) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "logits"], done.stdout
    assert all(float(row[3]) < 1e-5 for row in rows.values()), done.stdout  # relative difference, fp32
    assert "PASS" in done.stdout and "tp=2" in done.stdout


def test_verify_refuses_a_plan_that_cannot_split_the_heads(tiny_paths, tmp_path):
    plan = tmp_path / "broken.toml"
    plan.write_text('[rules]\n"layers.*.self_attn.q_proj" = "colwise"\n"layers.*.self_attn.k_proj" = "colwise"\n'
                    '"layers.*.self_attn.v_proj" = "colwise"\n"layers.*.self_attn.o_proj" = "colwise"\n')  # fmt: skip
    done = _verify(tiny_paths["llama"], "--tp", "2", "--tp-plan", str(plan))
    assert done.returncode != 0
    assert "model.layers.0.self_attn.o_proj (72, 72): rule 'layers.*.self_attn.o_proj' (colwise)" in done.stderr
    assert done.stderr.count("hf-parallel verify:") == 1  # said once, by the first rank


def test_verify_names_the_first_layer_that_diverges(tiny_paths, tmp_path):
    rank0, rank1 = run_ranks(2, tp_workers.verify_with_a_broken_layer, tiny_paths["llama"], out_dir=str(tmp_path))
    assert rank1 is None
    assert rank0["first"] == "model.layers.1", rank0["text"]
    assert rank0["rows"]["model.layers.0"] < 1e-5 and rank0["rows"]["model.layers.1"] > 1e-2
    assert "FAIL: first diverging: model.layers.1" in rank0["text"]


def test_verify_streams_the_reference_from_disk_under_a_memory_budget(tiny_paths):
    done = _verify(tiny_paths["llama"], "--tp", "2", "--reference-memory-gb", "0.00001")  # ~10 KB: every layer on disk
    assert done.returncode == 0, done.stderr[-3000:]
    assert "one process streamed from disk within 0 MiB" in done.stdout and "PASS" in done.stdout


@pytest.mark.parametrize("flag, layout", [("--sp", "tp=1 x sp=2"), ("--cp", "tp=1 x cp=2")])
def test_verify_under_sequence_parallelism(tiny_paths, flag, layout):
    """Ulysses (each rank a run of tokens) and the ring (each rank two zigzag chunks): every layer's
    output gathered and put back in the sequence's order before it is compared."""
    done = _verify(tiny_paths["llama"], "--tp", "1", flag, "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert layout in done.stdout and "PASS" in done.stdout
    assert [line.split()[0] for line in done.stdout.splitlines() if line.endswith(" ok")][-1] == "logits"


@pytest.mark.parametrize("name", ["llama_fp8", "llama_gptq"])
def test_verify_passes_a_quantized_checkpoint(tiny_root, tmp_path, name):
    """An FP8 block-scaled checkpoint (32-row blocks split inside at TP=2) and a GPTQ act-order one: every layer
    of the parallel load, each rank dequantizing its slices, against one process: plain transformers
    dequantizing the FP8 whole; for GPTQ (which transformers reads only through GPU kernels) transformers on
    the weights dequantized whole, which are, bit for bit, the format's definition (the test's own twin)."""
    from safetensors.torch import load_file
    from tiny_models import make_fp8_checkpoint, make_grouped_checkpoint

    from hf_parallel.commands.verify import dequantized_copy

    if name == "llama_gptq":
        path, twin = make_grouped_checkpoint(name, tiny_root)
        written = dequantized_copy(path, str(tmp_path / "copy"))
        copy = {k: t for f in sorted(os.listdir(written)) if f.endswith(".safetensors")
                for k, t in load_file(os.path.join(written, f)).items()}  # fmt: skip
        want = load_file(os.path.join(twin, "model.safetensors"))
        assert sorted(copy) == sorted(want) and all(torch.equal(copy[k], want[k]) for k in want)
    else:
        path = make_fp8_checkpoint(name, tiny_root)
    done = _verify(path, "--tp", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PASS" in done.stdout, done.stdout
