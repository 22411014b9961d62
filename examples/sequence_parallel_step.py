"""One training step with the sequence split over ranks (Ulysses), inside tensor parallelism.

    torchrun --nproc-per-node 4 examples/sequence_parallel_step.py        # tp 2 x sp 2
    SP=4 TP=1 torchrun --nproc-per-node 4 examples/sequence_parallel_step.py
    torchrun --nproc-per-node 8 examples/sequence_parallel_step.py        # tp 2 x sp 4
    python examples/sequence_parallel_step.py                             # one process: the same loss

Every rank passes the whole batch (it is broadcast from each sequence group's first rank anyway);
``out.loss`` is the mean loss one process would compute, ``out.logits`` only this rank's tokens.
"""

import os

import torch
import transformers

from hf_parallel import AutoModelForCausalLM, parallel_state
from hf_parallel.commands.default_model import default_checkpoint

path = os.environ.get("MODEL") or default_checkpoint()  # the embedded SmolLM2-135M-Instruct
world = int(os.environ.get("WORLD_SIZE", "1"))
tp = int(os.environ.get("TP", "2" if world >= 4 and world % 2 == 0 else "1"))  # TP=2 from 4 ranks on
sp = int(os.environ.get("SP", str(world // tp)))  # the sequence split over the rest
model = AutoModelForCausalLM.from_pretrained(
    path, tp_plan="auto" if tp > 1 else None, tp_size=tp, sp_size=sp, dtype=torch.float32
)
tokenizer = transformers.AutoTokenizer.from_pretrained(path)
batch = tokenizer(
    ["Sequence parallelism splits every sequence over ranks.", "Each rank holds a run of tokens."] * 2,
    return_tensors="pt",
    padding=True,
).to(parallel_state(model).mesh.device)  # this rank's device
labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # no loss on padding
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

model.train()
out = model(**batch, labels=labels)
out.loss.backward()  # gradients of every parameter summed over the sequence group
optimizer.step()
mesh = parallel_state(model).mesh
print(f"{mesh}: loss {out.loss.item():.6f}, {out.logits.shape[1]} of {batch['input_ids'].shape[1]} tokens here")
