"""Train a mixture-of-experts model with its experts spread over ranks and tokens sent to them (expert parallelism).

    MODEL=allenai/OLMoE-1B-7B-0924 torchrun --nproc-per-node 8 examples/expert_parallel.py   # FSDP=8, EP=8
    MODEL=allenai/OLMoE-1B-7B-0924 torchrun --nproc-per-node 4 examples/expert_parallel.py   # FSDP=4, EP=4
    EP=2 MODEL=... torchrun --nproc-per-node 4 examples/expert_parallel.py        # EP=2: each expert on 2 ranks
    EP=1 FSDP=1 CUDA_VISIBLE_DEVICES=0 MODEL=... python examples/expert_parallel.py   # one process (if it fits)

(float32 weights and AdamW: 16 bytes a parameter, so a 7B MoE takes about 28 GB a rank at FSDP=4, before
activations.)

Each rank holds 1/EP of the experts (FSDP-sharded over the ranks holding the same ones) and its FSDP share of
everything else; attention and the router run on each rank's own rows; each (token, expert) pair travels by
all-to-all to the rank holding its expert and back. ``train_step`` takes the same global batch on every rank
(each data-parallel rank computes its rows) and leaves one process's gradients. Rank 0 prints the losses and
how many tokens each expert of the first layer received over the run (``count_expert_tokens``, under EP).
"""

import os

import torch
import transformers

from hf_parallel import AutoModelForCausalLM, clip_grad_norm_, parallel_state, train_step

path = os.environ["MODEL"]
world = int(os.environ.get("WORLD_SIZE", "1"))
fsdp, ep = int(os.environ.get("FSDP", str(world))), int(os.environ.get("EP", str(world)))
model = AutoModelForCausalLM.from_pretrained(
    path, tp_plan=None, fsdp_size=fsdp, ep_size=ep, count_expert_tokens=ep > 1, dtype=torch.float32
)
tokenizer = transformers.AutoTokenizer.from_pretrained(path)
if tokenizer.pad_token is None:  # (Llama 3's has none) the batch is padded to its longest row
    tokenizer.pad_token = tokenizer.eos_token
# 8 rows, the same global batch on every rank and at every world size that divides it (1, 2, 4, 8 ranks): each
# data-parallel rank computes its rows
texts = ["Experts are spread over ranks.", "Each token goes to the ranks holding its experts and comes back."] * 4
batch = tokenizer(texts, return_tensors="pt", padding=True).to(parallel_state(model).mesh.device)
labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # no loss on padding
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

losses = []
for step in range(int(os.environ.get("STEPS", "3"))):
    loss = train_step(model, batch["input_ids"], labels, batch["attention_mask"], micro_batches=1)
    clip_grad_norm_(model, 1.0)  # the whole model's norm, over every shard
    optimizer.step()
    optimizer.zero_grad()
    losses.append(round(loss.item(), 4))

state = parallel_state(model)
counts = state.tokens_per_expert() if ep > 1 else {}  # every rank's counts summed: one collective
if state.mesh.is_main:
    print(f"{state.mesh.shape}: losses {losses}", flush=True)
    for module in sorted(counts)[:1]:
        print(f"tokens per expert in {module}: {counts[module]}", flush=True)
