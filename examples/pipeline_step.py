"""Pipeline stages with a TP size each (VTP): one training step over micro-batches, then generate.

    torchrun --nproc-per-node 3 examples/pipeline_step.py                # stage 0 at TP=2, stage 1 at TP=1
    torchrun --nproc-per-node 8 examples/pipeline_step.py                # two stages at TP=4 each
    python examples/pipeline_step.py                                     # one process: the same loss and tokens
    STAGE_TP=1,1 torchrun --nproc-per-node 2 examples/pipeline_step.py   # plain PP=2

Every rank passes the same batch; ``train_step`` runs the 1F1B schedule and returns one process's
mean loss on every rank; each rank's optimizer steps its own stage's parameters (a tied embedding's
two copies get the same summed gradient, so they stay equal).
"""

import os

import torch
import transformers

import hf_parallel
from hf_parallel.commands.default_model import default_checkpoint

path = os.environ.get("MODEL") or default_checkpoint()  # the embedded SmolLM2-135M-Instruct
world = int(os.environ.get("WORLD_SIZE", "1"))
halves = f"{world - world // 2},{world // 2}" if world > 1 else "1"  # two stages (3 ranks: TP=2, then TP=1)
stage_tp = [int(n) for n in os.environ.get("STAGE_TP", halves).split(",")]
model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, stage_tp_sizes=stage_tp, dtype=torch.float32)
tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
batch = tokenizer(
    ["Pipeline stages hold runs of layers.", "Each stage may have its own tensor-parallel size."] * 2,
    return_tensors="pt",
    padding=True,
).to(hf_parallel.parallel_state(model).mesh.device)  # this rank's device (a later stage's embedding is not here)
labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # no loss on padding
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

model.train()
loss = hf_parallel.train_step(model, batch["input_ids"], labels, batch["attention_mask"], micro_batches=4)
optimizer.step()
model.eval()
out = model.generate(**batch, max_new_tokens=8, do_sample=False)
state = hf_parallel.parallel_state(model)  # the mesh, the plan, this rank's pipeline stage
mesh = state.mesh
layers = state.stage.layers() if state.stage else range(model.config.num_hidden_layers)  # one process: all of them
print(f"{mesh}: layers {layers.start}-{layers.stop - 1}, loss {loss.item():.6f}, tokens {out[0, -8:].tolist()}")
