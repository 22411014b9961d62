"""The cookbook (``examples/``, shown whole in ``docs/cookbook.md``): each script run as written, under torchrun
at tiny size (SmolLM2's tokenizer around a random 2-layer model), its output held to one process's."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cli import PROMPT

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TORCHRUN = ["-m", "torch.distributed.run", "--standalone"]


def run_example(script: str, ranks: int, **env) -> str:
    """``script`` as a user runs it (torchrun with ``ranks`` processes, or plain python for one), its stdout."""
    launcher = [*TORCHRUN, f"--nproc-per-node={ranks}"] if ranks > 1 else []
    done = subprocess.run([sys.executable, *launcher, str(EXAMPLES / script)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, cwd="/tmp")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def greedy_text(path: str, new_tokens: int) -> str:
    """What plain transformers generates greedily in one process from ``path`` (float32), for ``PROMPT``."""
    from test_cli import reference_text

    return reference_text(path, new_tokens).strip()


def test_every_example_is_run_here_and_shown_in_the_cookbook():
    """A script in ``examples/`` that no test runs, or the cookbook does not show, fails here."""
    tests = " ".join(path.read_text() for path in (ROOT / "tests").glob("test_*.py"))
    cookbook = (ROOT / "docs" / "cookbook.md").read_text()
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert len(scripts) >= 8, scripts
    for name in scripts:
        assert re.search(rf"""["']{re.escape(name)}["']""", tests), f"examples/{name}: no test runs it"
        assert f'--8<-- "examples/{name}"' in cookbook, f"examples/{name}: not shown in docs/cookbook.md"


@pytest.mark.distributed
def test_the_generate_example_prints_once_what_one_process_generates(tiny_smollm2):
    """examples/generate.py at TP=8 (one 8-GPU node; SmolLM2's 9 query / 3 KV heads split unevenly): rank 0 alone
    prints the greedy text plain transformers generates in one process."""
    stdout = run_example("generate.py", 8, MODEL=tiny_smollm2, PROMPT=PROMPT, NEW_TOKENS="8")
    want = greedy_text(tiny_smollm2, 8)
    assert len(want) > 10 and stdout.count(want) == 1 and stdout.strip().startswith(want), stdout


def without_pad_token(path: str, root: Path) -> str:
    """A copy of the checkpoint at ``path`` whose tokenizer has no pad token (as Llama 3's has none)."""
    import json
    import shutil

    copy = root / "no_pad_token"
    shutil.copytree(path, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    config.pop("pad_token", None)
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    return str(copy)


@pytest.mark.distributed
def test_the_lora_example_at_tp_and_fsdp_logs_one_processs_losses_and_saves_its_adapter(tiny_smollm2, tmp_path):
    """examples/train_lora.py as written on one 8-GPU node (8 ranks: TP=2 x FSDP=4, its default there) under the
    Trainer, with a tokenizer that has no pad token: rank 0 alone logs the losses the same script logs in one
    process (a global batch of 8 rows either way, padding left out of the loss); the adapter saved unmerged is one
    process's, and plain peft loads it onto plain transformers' model."""
    import peft
    import transformers
    from compare import assert_close
    from safetensors.torch import load_file

    path = without_pad_token(tiny_smollm2, tmp_path)
    assert transformers.AutoTokenizer.from_pretrained(path).pad_token is None
    runs = {}
    for name, ranks in (("one", 1), ("tp2_fsdp4", 8)):
        stdout = run_example("train_lora.py", ranks, MODEL=path, OUT=str(tmp_path / name))
        runs[name] = [[float(x) for x in found.split(",")] for found in re.findall(r"losses \[([-\d., ]+)\]", stdout)]
        assert len(runs[name]) == 1 and len(runs[name][0]) == 3, stdout  # printed once, 3 steps
    assert "rank 0: pp 0/1, tp 0/2, sp 0/1, dp 0/4: losses" in stdout, stdout  # the layout chosen: TP=2 x FSDP=4
    assert_close(runs["tp2_fsdp4"][0], runs["one"][0], atol=1e-4, rtol=0, what="TP=2 x FSDP=4 losses")
    one, parallel = (tmp_path / "one" / "adapter", tmp_path / "tp2_fsdp4" / "adapter")
    assert not (tmp_path / "tp2_fsdp4" / "merged").exists() and (tmp_path / "one" / "merged").is_dir()
    want, got = (load_file(path / "adapter_model.safetensors") for path in (one, parallel))
    assert sorted(got) == sorted(want) and len(want) == 2 * 7 * 2  # 2 layers x 7 targets x (A, B)
    for key in want:
        assert_close(got[key], want[key], atol=1e-4, rtol=0, what=key)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_smollm2, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, str(parallel))
    lora_b = loaded.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert torch.equal(lora_b, got["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])
    assert lora_b.abs().sum() > 0  # trained (peft initialises B to zeros)


def fp8_smollm2(tiny_smollm2: str, root: Path) -> Path:
    """The tiny SmolLM2 stored as FP8 releases store it, in 16 x 16 blocks (whole: plain transformers reads it)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from tiny_models import fp8_config, quantize_fp8

    path = root / "tiny_smollm2_fp8"
    shutil.copytree(tiny_smollm2, path, ignore=shutil.ignore_patterns("*.safetensors"))
    quantized, _, partial = quantize_fp8(load_file(os.path.join(tiny_smollm2, "model.safetensors")), block=(16, 16))
    assert not partial
    save_file(quantized, path / "model.safetensors", metadata={"format": "pt"})
    fp8_config(str(path), block=(16, 16))
    return path


@pytest.mark.distributed
def test_the_quantized_example_prints_one_processs_text_in_both_modes(tiny_smollm2, tmp_path):
    """examples/quantized.py on an FP8 checkpoint at TP=2: dequantized as read and kept as stored, rank 0 prints
    the greedy text plain transformers generates from it in one process; kept holds fewer bytes, and saves the
    checkpoint back bitwise."""
    from safetensors.torch import load_file

    path = fp8_smollm2(tiny_smollm2, tmp_path)
    want = greedy_text(str(path), 8)
    held = {}
    for mode in ("dequantized", "kept"):
        stdout = run_example("quantized.py", 2, MODEL=str(path), MODE=mode, PROMPT=PROMPT, NEW_TOKENS="8",
                             SAVE=str(tmp_path / f"saved_{mode}"))  # fmt: skip
        assert stdout.count(want) == 1 and stdout.strip().startswith(want), (mode, stdout)
        (found,) = re.findall(rf"tp=2, {mode}: ([\d.]+) MB of weights on rank 0", stdout)
        held[mode] = float(found)
    # rank 0's decoder linears, about 0.55 MB in float32, held as FP8 (a quarter, with their blocks' scales);
    # the vocab-parallel embedding (14 MB) the same in both
    assert held["kept"] < held["dequantized"] - 0.35, held
    source, saved = (load_file(p / "model.safetensors") for p in (path, tmp_path / "saved_kept"))
    assert sorted(saved) == sorted(source)
    for key in source:
        assert saved[key].dtype == source[key].dtype and torch.equal(saved[key], source[key]), key


@pytest.mark.distributed
def test_the_long_context_example_splits_the_cache_as_its_formula_says(tiny_smollm2):
    """examples/long_context.py at CP=2 on a prompt of about 600 tokens: rank 0 prints the greedy text the same
    script prints in one process, and its KV cache's bytes equal the formula it prints (half one process's)."""
    outputs = {}
    for name, ranks, cp in (("one", 1, "1"), ("cp2", 2, "2")):
        stdout = run_example("long_context.py", ranks, MODEL=tiny_smollm2, SP="1", CP=cp, LENGTH="600",
                             NEW_TOKENS="8")  # fmt: skip
        (summary,) = re.findall(r"\[(.*) prompt tokens; rank 0's KV cache ([\d,]+) bytes, ([\d,]+) by the formula\]",
                                stdout)  # fmt: skip
        outputs[name] = (stdout.split("[")[0].strip(), summary)
    (text, (_, one_cache, _)), (cp_text, (layout, cp_cache, formula)) = outputs["one"], outputs["cp2"]
    assert len(text) > 10 and cp_text == text, outputs
    assert layout.startswith("tp=1 x cp=2:") and cp_cache == formula, outputs
    one_bytes, cp_bytes = (int(n.replace(",", "")) for n in (one_cache, cp_cache))
    assert abs(cp_bytes - one_bytes / 2) <= one_bytes / 100, outputs  # half, to the zigzag's padding


@pytest.mark.distributed
def test_the_expert_parallel_example_logs_one_processs_losses(tiny_smollm2, tmp_path):
    """examples/expert_parallel.py as written on 8 ranks (FSDP=8 x EP=8: one expert a rank, one row of its 8 each)
    on a tiny random Qwen3-MoE (8 experts, 2 a token) with SmolLM2's tokenizer: rank 0 logs the losses the same
    script logs in one process, and the first layer's tokens per expert count every (token, expert) pair of the
    run once."""
    import transformers
    from compare import assert_close

    config = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=48, intermediate_size=80, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        tie_word_embeddings=True, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path / "moe")
    transformers.AutoTokenizer.from_pretrained(tiny_smollm2).save_pretrained(tmp_path / "moe")
    losses = {}
    for name, ranks in (("one", 1), ("ep8", 8)):
        stdout = run_example("expert_parallel.py", ranks, MODEL=str(tmp_path / "moe"))
        (found,) = re.findall(r"losses \[([-\d., ]+)\]", stdout)
        losses[name] = [float(x) for x in found.split(",")]
    assert_close(losses["ep8"], losses["one"], atol=1e-4, rtol=0, what="FSDP=8 x EP=8 losses")
    (counts,) = re.findall(r"tokens per expert in model.layers.0.mlp.experts: \[([\d, ]+)\]", stdout)
    tokens = transformers.AutoTokenizer.from_pretrained(tiny_smollm2)(
        ["Experts are spread over ranks.", "Each token goes to the ranks holding its experts and comes back."] * 4,
        padding=True,
    )["input_ids"]  # fmt: skip
    pairs = 3 * len(tokens) * len(tokens[0]) * 2  # 3 steps x every token, padding too, routed to 2 experts
    assert sum(int(n) for n in counts.split(",")) == pairs and len(counts.split(",")) == 8, counts


@pytest.mark.distributed
def test_the_long_training_example_at_sp_x_cp_x_fsdp_logs_one_processs_losses(tiny_smollm2):
    """examples/long_training.py on 8 ranks (SP=2 x CP=2 x FSDP=2, checkpointing with offloaded layer inputs,
    tiled loss and MLP): rank 0 logs the losses the same script logs in one process."""
    from compare import assert_close

    losses = {}
    for name, ranks, sp, cp in (("one", 1, "1", "1"), ("sp2cp2fsdp2", 8, "2", "2")):
        stdout = run_example("long_training.py", ranks, MODEL=tiny_smollm2, SP=sp, CP=cp, SEQ="256")
        (found,) = re.findall(r"losses \[([-\d., ]+)\]", stdout)
        losses[name] = [float(x) for x in found.split(",")]
    assert len(losses["one"]) == 3 and losses["one"][0] > losses["one"][-1], losses
    assert_close(losses["sp2cp2fsdp2"], losses["one"], atol=1e-3, rtol=0, what="SP=2 x CP=2 x FSDP=2 losses")
