"""A long prompt split over the sequence dimension: each rank holds its share of the tokens and of the KV cache.

    SP=2 CP=1 torchrun --nproc-per-node 2 examples/long_context.py        # Ulysses: heads exchanged, up to heads
    CP=2 torchrun --nproc-per-node 2 examples/long_context.py             # a ring: past the head count
    SP=2 CP=2 torchrun --nproc-per-node 4 examples/long_context.py        # a ring of Ulysses pairs
    SP=1 CP=1 python examples/long_context.py                              # one process, the same tokens

Which layout for which length (per device: the weights, then the KV cache and the attention's activations):

- the whole sequence fits beside the weights: TP alone (it splits the cache's heads too);
- longer: add SP (Ulysses) up to the KV heads TP leaves (SmolLM2's 3 KV heads: SP=3), one all-to-all a layer;
- past that: CP (a ring): attention's keys and values pass round the ring in blocks, so no rank ever holds the
  whole sequence's scores, and CP grows past the heads.

The memory arithmetic this script prints: a rank's KV cache holds 2 (keys, values) x layers x the KV heads it
computes x head_dim x its share of the tokens x the dtype's bytes. Its share: the prompt's tokens split over
the sp x cp ranks (the first ranks one more; under CP the prompt padded to 2 x cp equal chunks, each ring group
holding two), and the keys of every (sp x cp)-th decode step, the ranks taking turns. One
process holds every token, so each rank holds about 1 / (sp x cp) of that.
"""

import math
import os

import torch
from transformers import AutoTokenizer

from hf_parallel import AutoModelForCausalLM, parallel_state
from hf_parallel.commands.default_model import default_checkpoint

path = os.environ.get("MODEL") or default_checkpoint()  # the embedded SmolLM2-135M-Instruct
sp, cp = int(os.environ.get("SP", "1")), int(os.environ.get("CP", "2"))
length, new_tokens = int(os.environ.get("LENGTH", "4096")), int(os.environ.get("NEW_TOKENS", "16"))
dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
model = AutoModelForCausalLM.from_pretrained(path, tp_plan=None, sp_size=sp, cp_size=cp, dtype=dtype)
tokenizer = AutoTokenizer.from_pretrained(path)

line = "The ring passes each rank's keys and values to the next, block by block. "
words = tokenizer(line, add_special_tokens=False)["input_ids"]
document = tokenizer.decode((words * (length // len(words) + 1))[: length - 32])  # about length tokens in all
messages = [{"role": "user", "content": document + "\nWhat does the ring pass? One sentence."}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)

cache = out.past_key_values  # this rank's share of every layer's keys and values
held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
config, prompt = model.config, inputs["input_ids"].shape[1]
head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
padded = prompt if cp == 1 else 2 * cp * math.ceil(prompt / (2 * cp))  # the ring's zigzag: 2 x cp equal chunks
generated = out.sequences.shape[1] - prompt  # (fewer than new_tokens where the model ended its answer)
share = math.ceil(padded / (sp * cp)) + math.ceil((generated - 1) / (sp * cp))  # rank 0's (the last token: none)
predicted = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * share * dtype.itemsize
mesh = parallel_state(model).mesh
if mesh.is_main:
    print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True), flush=True)
    print(f"[{mesh.shape}: {prompt} prompt tokens; rank 0's KV cache {held:,} bytes, {predicted:,} by the formula]",
          flush=True)  # fmt: skip
