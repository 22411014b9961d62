"""Generate at TP=N: every rank holds its shard and runs the same generate; rank 0 prints.

    torchrun --nproc-per-node 2 examples/generate.py                       # the embedded SmolLM2-135M-Instruct
    MODEL=Qwen/Qwen3-8B torchrun --nproc-per-node 4 examples/generate.py   # a hub id or a directory, TP=4
    PROMPT="Why is the sky blue?" NEW_TOKENS=64 torchrun --nproc-per-node 2 examples/generate.py

On GPUs each rank takes the device at its LOCAL_RANK and the weights load in bfloat16; on CPU, in the
checkpoint's dtype. The inputs go to ``model.device`` (this rank's device), and only rank 0 prints.
"""

import os

import torch
from transformers import AutoTokenizer

from hf_parallel import AutoModelForCausalLM, parallel_state
from hf_parallel.commands.default_model import default_checkpoint

path = os.environ.get("MODEL") or default_checkpoint()
dtype = torch.bfloat16 if torch.cuda.is_available() else "auto"
model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype)
tokenizer = AutoTokenizer.from_pretrained(path)

messages = [{"role": "user", "content": os.environ.get("PROMPT", "What is tensor parallelism? One sentence.")}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
out = model.generate(**inputs, max_new_tokens=int(os.environ.get("NEW_TOKENS", "32")), do_sample=False)

state = parallel_state(model)
if state.mesh.is_main:  # every rank holds the same tokens; one prints them
    print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True), flush=True)
    print(f"[{state.mesh.shape}]", flush=True)
