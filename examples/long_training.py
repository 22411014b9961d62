"""Train on long sequences: each sequence split over SP x CP ranks, the model sharded by FSDP over the rest,
and what a step keeps cut down (ALST's recipe: checkpointing, offloaded layer inputs, tiled loss and MLP).

    MODEL=meta-llama/Llama-3.1-8B-Instruct SEQ=131072 SP=4 torchrun --nproc-per-node 8 examples/long_training.py
    SP=2 CP=2 torchrun --nproc-per-node 8 examples/long_training.py        # a ring of Ulysses pairs, FSDP=2
    SP=1 CP=1 python examples/long_training.py                              # one process, the same losses

Check the memory before anything runs (the same sizes and savings as flags):

    hf-parallel plan MODEL --sp 4 --fsdp 2 --seq 131072 --dtype float32 --checkpointing --offload-checkpoints \\
        --tiled-loss --tiled-mlp

- ``sp_size`` (Ulysses) splits each sequence over ranks that exchange heads around attention, up to the KV
  heads; ``cp_size`` (a ring) goes past them. FSDP shards the parameters, gradients and AdamW's states over
  every rank (the sequence ranks included): each data-parallel replica takes its own rows.
- ``model.gradient_checkpointing_enable()``: each layer keeps its input alone, recomputed in the backward;
  ``offload_checkpoints=True`` holds those inputs in host memory until then (pinned on a GPU).
- ``tiled_loss=True``: the loss 1024 tokens at a time, so the [tokens, vocab] logits never exist;
  ``tiled_mlp=True``: each MLP over tiles of ``hidden_size`` tokens.
- On GPUs: bf16 compute over float32 masters (``mixed_precision="bf16"``).

Every rank passes the same global batch (``train_step``: each replica its rows, each sequence rank its
tokens); rank 0 prints one process's losses.
"""

import os

import torch
import transformers

from hf_parallel import AutoModelForCausalLM, parallel_state, train_step
from hf_parallel.commands.default_model import default_checkpoint

path = os.environ.get("MODEL") or default_checkpoint()  # the embedded SmolLM2-135M-Instruct
world = int(os.environ.get("WORLD_SIZE", "1"))
sp, cp = int(os.environ.get("SP", str(min(world, 4)))), int(os.environ.get("CP", "1"))
seq, rows = int(os.environ.get("SEQ", "512")), 2  # rows: the global batch, one per data-parallel replica here
fsdp = world // (sp * cp)
if sp * cp * fsdp != world or rows % fsdp:
    raise SystemExit(f"long_training.py: SP={sp} x CP={cp} on {world} ranks: SP x CP must divide the ranks, and "
                     f"the rest (FSDP={fsdp}) divide the {rows} rows a step")  # fmt: skip
model = AutoModelForCausalLM.from_pretrained(
    path, tp_plan=None, sp_size=sp, cp_size=cp, fsdp_size=fsdp, dtype=torch.float32,
    mixed_precision="bf16" if torch.cuda.is_available() else None,
    tiled_loss=True, tiled_mlp=True, offload_checkpoints=True,
)  # fmt: skip
model.gradient_checkpointing_enable()
model.train()

tokenizer = transformers.AutoTokenizer.from_pretrained(path)
text = " ".join(f"Paragraph {n}: long documents are split over the ranks of the sequence group." for n in range(4096))
ids = tokenizer([text, text[len(text) // 3 :]], return_tensors="pt", max_length=seq, truncation=True)["input_ids"]
ids = ids.to(parallel_state(model).mesh.device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
losses = []
for _ in range(3):
    losses.append(round(train_step(model, ids, ids, micro_batches=1).item(), 4))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
mesh = parallel_state(model).mesh
if mesh.is_main:
    print(f"{mesh.shape}: {ids.shape[1]} tokens a row, losses {losses}")
