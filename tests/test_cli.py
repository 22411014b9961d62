"""`hf-parallel generate` under torchrun (at TP and at CP) and under `accelerate launch`: rank 0 alone
streams the same greedy text transformers generates in one process; a prompts file goes in batches, and sampling
with a seed draws what one process draws."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PROMPT = "Name three colours."


def reference_text(path: str, new_tokens: int) -> str:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def launch(launcher: list[str], path: str, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = launcher + ["-m", "hf_parallel", "generate", "--model", path, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd="/tmp")


def run(launcher: list[str], path: str, args: list[str]) -> str:
    """rank 0's stdout, after checking it announced the resolved layout once (on stderr)"""
    done = launch(launcher, path, args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.count("hf-parallel generate: ") == 1, done.stderr[-3000:]
    return done.stdout


def test_generate_under_torchrun_and_accelerate(smollm2):
    want = reference_text(smollm2, 12)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2"]
    accelerate += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
    for launcher in (torchrun, accelerate):
        done = launch(launcher, smollm2, ["--prompt", PROMPT, "--max-new-tokens", "12"])
        stdout, stderr = done.stdout, done.stderr
        assert done.returncode == 0 and f"hf-parallel generate: {smollm2} on 2 ranks as tp=2 (cpu" in stderr, stderr
        assert stdout.count("tp=2]") == 1, stdout  # one summary line: only rank 0 prints
        assert stdout.split("[12 tokens in")[0].strip() == want.strip(), stdout
    # the prompt split over a ring of two, the KV cache kept split, each token attending to both shares
    stdout = run(torchrun, smollm2, ["--prompt", PROMPT, "--max-new-tokens", "12", "--cp", "2"])
    assert stdout.count("tp=1 x cp=2]") == 1 and stdout.split("[12 tokens in")[0].strip() == want.strip(), stdout
    # a layout the world cannot hold: one line from rank 0, no traceback from the ranks
    done = launch(torchrun, smollm2, ["--sp", "3"])
    ours = [line for line in done.stderr.splitlines() if line.startswith("hf-parallel generate")]
    assert done.returncode != 0 and ours == ["hf-parallel generate: world size 2 is not a multiple of pp_size x "
                                             "sp_size = 1 x 3"], done.stderr  # fmt: skip
    frames = [line for line in done.stderr.splitlines() if 'File "' in line and "torch/distributed" not in line]
    assert not [f for f in frames if "runpy" not in f], done.stderr  # (torchrun's own traceback aside)


def test_prompts_file_is_generated_in_batches_and_sampling_follows_the_seed(smollm2, tmp_path):
    """Three prompts of different lengths, left-padded into batches of 2 and 1, sampled with a seed:
    rank 0 prints, per prompt, what one process samples from the same batches with the same seed
    (a rank drawing other tokens would feed the others' collectives a different sequence)."""
    import transformers

    prompts = ["Name three colours.", "What is 2 + 2?", "Write one short sentence about the sea and the sky."]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n\n")
    sampling = dict(do_sample=True, temperature=0.9, top_p=0.9)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2, padding_side="left")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)

    def generate(**kwargs) -> list[str]:
        texts = []
        for batch in (prompts[:2], prompts[2:]):
            conversations = [[{"role": "user", "content": p}] for p in batch]
            inputs = tokenizer.apply_chat_template(
                conversations, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
            )
            out = model.generate(**inputs, max_new_tokens=10, pad_token_id=tokenizer.pad_token_id, **kwargs)
            texts += tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        return texts

    torch.manual_seed(5)
    want = generate(**sampling)
    assert want != generate(do_sample=False)  # the seed really samples

    args = ["--prompts-file", str(tmp_path / "prompts.txt"), "--batch-size", "2", "--max-new-tokens", "10"]
    args += ["--temperature", "0.9", "--top-p", "0.9", "--seed", "5"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    stdout = run(torchrun, smollm2, args)
    assert stdout.count("tp=2]") == 2, stdout  # one summary per batch, from rank 0 only
    assert "for 2 prompts in" in stdout and "for 1 prompt in" in stdout, stdout
    for number, (prompt, text) in enumerate(zip(prompts, want), start=1):
        block = stdout.split(f"### prompt {number}: {prompt}\n", 1)[1]
        assert block.split("\n\n")[0].split("\n[")[0].strip() == text.strip(), stdout


@pytest.mark.parametrize("form", ["fp8", "gptq"])
def test_generate_keeps_a_real_quantized_model_quantized(smollm2, tmp_path, form):
    """SmolLM2 as FP8 releases store it (64 x 64 block scales: 576 = 9 blocks, its 3 KV heads 3 blocks) and as
    GPTQ 4-bit releases do (act-order, groups of 64: o_proj's and down_proj's inputs cut inside words' runs of
    groups), generated at TP=2 with ``--keep-quantized`` (each rank holds its slices as stored, dequantized
    module by module; GPTQ with ``--keep-quantized int4``: multiplied by torch's int4 kernel): rank 0 streams
    the greedy text plain transformers generates in one process from the FP8 checkpoint (which it dequantizes)
    or from the GPTQ weights dequantized as floats (it reads GPTQ only through GPU kernels), and its closing
    line counts the linears that multiplied each way."""
    import shutil

    from safetensors.torch import load_file, save_file
    from tiny_models import fp8_config, grouped_config, quantize_fp8, quantize_grouped_checkpoint

    path, plain = tmp_path / f"smollm2-{form}", tmp_path / "smollm2-dequantized"
    for target in (path, plain):
        shutil.copytree(smollm2, target, ignore=shutil.ignore_patterns("*.safetensors*"))
    tensors = {}
    for name in sorted(os.listdir(smollm2)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(smollm2, name)))
    if form == "fp8":
        quantized, _, partial = quantize_fp8({k: t.float() for k, t in tensors.items()}, block=(64, 64))
        assert not partial
        fp8_config(str(path), block=(64, 64))
        reference = path
    else:
        torch.manual_seed(0)
        gptq = ("gptq", 4, "gptq", 64, True, True)
        quantized, dequantized = quantize_grouped_checkpoint(tensors, *gptq)
        save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
        grouped_config(str(path), *gptq)
        reference = plain
    save_file(quantized, path / "model.safetensors", metadata={"format": "pt"})
    want = reference_text(str(reference), 8)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    keep = ["--keep-quantized"] + (["int4"] if form == "gptq" else [])
    stdout = run(torchrun, str(path), ["--prompt", PROMPT, "--max-new-tokens", "8", *keep])
    assert stdout.split("[8 tokens in")[0].strip() == want.strip(), stdout
    way = "int4 kernel" if form == "gptq" else "dequantized"  # the FP8 kernel is for GPUs
    assert f"; rank 0's kept modules: {7 * 30} {way}]" in stdout, stdout  # 30 layers' seven linears


def test_generate_with_expert_parallel_replicas_prints_every_prompt_as_one_process(smollm2, tmp_path):
    """``generate --dp-replicate 2 --ep 2`` on a tiny random Qwen3-MoE with SmolLM2's tokenizer: each replica
    generates its share of three prompts (the second replica's second call steps along with a copy), tokens travel
    to the experts' ranks; rank 0 prints every prompt's greedy text as one process generates it, in prompt order."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=48, intermediate_size=80, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=8,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2, padding_side="left")
    model.save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    prompts = ["Name three colours.", "What is 2 + 2?", "Write one short sentence about the sea."]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    args = ["--prompts-file", str(tmp_path / "prompts.txt"), "--batch-size", "1", "--max-new-tokens", "6"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    wants = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        wants.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    # the same prompts sharded over FSDP replicas (each layer gathered once per call): the same texts
    for layout, summary in ((["--dp-replicate", "2", "--ep", "2"], "(ep=2)]"), (["--fsdp", "2"], "x fsdp=2]")):
        stdout = run(torchrun, str(tmp_path / "moe"), [*args, *layout, "--no-chat-template"])
        for number, (prompt, want) in enumerate(zip(prompts, wants), start=1):
            block = stdout.split(f"### prompt {number}: {prompt}\n", 1)[1]
            assert block.split("\n\n")[0].split("\n[")[0].strip() == want.strip(), (layout, number, want, stdout)
        assert stdout.count(summary) == 2, stdout  # one summary per call, from rank 0 only
