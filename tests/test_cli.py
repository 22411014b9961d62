"""`hf-parallel generate` under torchrun and under `accelerate launch`: rank 0 alone streams the
same greedy text transformers generates in one process."""

import os
import subprocess
import sys

import torch
import transformers

PROMPT = "Name three colours."


def reference_text(path: str, new_tokens: int) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def run(launcher: list[str], path: str, new_tokens: int) -> str:
    args = ["-m", "hf_parallel", "generate", "--model", path, "--prompt", PROMPT, "--max-new-tokens", str(new_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(launcher + args, capture_output=True, text=True, timeout=600, env=env, cwd="/tmp")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_generate_under_torchrun_and_accelerate(smollm2):
    want = reference_text(smollm2, 12)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes=2"]
    accelerate += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
    for launcher in (torchrun, accelerate):
        stdout = run(launcher, smollm2, 12)
        assert stdout.count("tp=2]") == 1, stdout  # one summary line: only rank 0 prints
        assert stdout.split("[12 tokens in")[0].strip() == want.strip(), stdout
