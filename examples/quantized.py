"""Load a quantized checkpoint (FP8 block scales, compressed-tensors, MXFP4, GPTQ, AWQ) at TP=N and generate.

    MODEL=Qwen/Qwen3-8B-FP8 torchrun --nproc-per-node 2 examples/quantized.py                 # dequantized as read
    MODE=kept MODEL=Qwen/Qwen3-8B-FP8 torchrun --nproc-per-node 2 examples/quantized.py       # the stored bytes held
    MODE=int4 MODEL=Qwen/Qwen3-8B-AWQ torchrun --nproc-per-node 2 examples/quantized.py       # torch's int4 kernel
    MODE=fp8 MODEL=Qwen/Qwen3-8B-FP8 torchrun --nproc-per-node 2 examples/quantized.py        # W8A8 on Hopper, bf16

Each rank reads only its slice of every quantized weight and the scales of the blocks it touches. The mode
(``keep_quantized``) decides what it then holds:

- ``dequantized`` (the default, ``keep_quantized=False``): plain floats in the dtype asked for. The fastest
  on a GPU today; the most memory (a bf16 model's bytes).
- ``kept`` (``True``): the stored bytes (FP8: about half of bf16), each module's weight dequantized in its
  forward, or multiplied as stored by the package's FP8 kernel on a GPU for small batches. Slower on a CPU.
- ``int4`` (``"int4"``): 4-bit GPTQ / AWQ / W4A16 repacked once for torch's int4 kernel (a copy beside the
  stored words): the fastest decode on a CPU.
- ``fp8`` (``"fp8"``): FP8 weights in whole 128 x 128 blocks multiplied by ``torch._scaled_mm`` with the
  activations quantized too (Hopper, bfloat16); logits differ by the activations' rounding.

Rank 0 prints the answer and the bytes of weights each rank holds; ``save_pretrained`` in any mode writes
the checkpoint back (kept: in its own format, bitwise; dequantized: as floats).
"""

import os

import torch
from transformers import AutoTokenizer

from hf_parallel import AutoModelForCausalLM, parallel_state
from hf_parallel.memory import weights_held

MODES = {"dequantized": False, "kept": True, "int4": "int4", "fp8": "fp8"}
path, mode = os.environ["MODEL"], os.environ.get("MODE", "dequantized")
dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype, keep_quantized=MODES[mode])
tokenizer = AutoTokenizer.from_pretrained(path)

messages = [{"role": "user", "content": os.environ.get("PROMPT", "What does a block scale do? One sentence.")}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
out = model.generate(**inputs, max_new_tokens=int(os.environ.get("NEW_TOKENS", "16")), do_sample=False)

held = weights_held(model)
mesh = parallel_state(model).mesh
if mesh.is_main:
    print(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True), flush=True)
    print(f"[{mesh.shape}, {mode}: {held / 1e6:.2f} MB of weights on rank 0]", flush=True)
if "SAVE" in os.environ:
    model.save_pretrained(os.environ["SAVE"])  # every rank calls; rank 0 writes
