"""LoRA with peft and transformers' Trainer, both unchanged, on a model split by TP x FSDP.

    torchrun --nproc-per-node 8 examples/train_lora.py                  # TP=2 x FSDP=4: one 8-GPU node
    torchrun --nproc-per-node 4 examples/train_lora.py                  # TP=2 x FSDP=2
    torchrun --nproc-per-node 2 examples/train_lora.py                  # TP=2 alone: the adapter merged too
    TP=1 torchrun --nproc-per-node 8 examples/train_lora.py             # FSDP=8
    CUDA_VISIBLE_DEVICES=0 python examples/train_lora.py                # one process: the same losses (on GPUs
                                                                        # within bf16's rounding)
    (pip install "hf_parallel[peft]"; MODEL=dir for another checkpoint than the embedded SmolLM2)

What each dimension does: TP splits every layer (each adapter follows its projection's split: q/k/v/gate/up
split B's rows, o/down A's columns); FSDP shards the frozen base between layers. The adapters, added after
the load, are not FSDP-sharded: each data-parallel rank holds its TP slice of them, their gradients averaged over
those ranks.

What the batch size counts: ``per_device_train_batch_size`` is the rows each *data-parallel* rank takes a
step. The TP ranks of one model replica take the same rows, so the global batch is that size times
``world_size // tp`` (here 8 rows whatever the layout, so every layout logs one process's losses).

Saving: ``save_pretrained`` on every rank writes peft's standard adapter once (rank 0, whole), which plain
peft loads in one process. Merging is refused under FSDP (its shards are DTensors), so merge where the base
is loaded without ``fsdp_size``, in one process or at TP alone (``path``: the checkpoint trained on)::

    base = transformers.AutoModelForCausalLM.from_pretrained(path)
    peft.PeftModel.from_pretrained(base, "lora_output/adapter").merge_and_unload().save_pretrained("merged")
"""

import os

import peft
import torch
import transformers

from hf_parallel import AutoModelForCausalLM, parallel_state
from hf_parallel.commands.default_model import default_checkpoint

path = os.environ.get("MODEL") or default_checkpoint()  # the embedded SmolLM2-135M-Instruct
world = int(os.environ.get("WORLD_SIZE", "1"))
tp = int(os.environ.get("TP", str(min(2, world))))  # TP=2 where there are ranks for it, FSDP over the rest
fsdp = int(os.environ.get("FSDP", str(world // tp)))
out = os.environ.get("OUT", "lora_output")
global_batch = 8  # rows a step over all data-parallel ranks: 1, 2, 4 or 8 of them divide it
if tp * fsdp != world or global_batch % fsdp:
    raise SystemExit(f"train_lora.py: TP={tp} x FSDP={fsdp} on {world} ranks: TP x FSDP must be the ranks, and FSDP "
                     f"divide the {global_batch} rows a step")
mixed = "bf16" if torch.cuda.is_available() else None  # on GPUs: bf16 compute, float32 masters and optimizer state
model = AutoModelForCausalLM.from_pretrained(
    path, tp_size=tp, fsdp_size=fsdp, tp_plan="auto" if tp > 1 else None, dtype=torch.float32, mixed_precision=mixed
)
torch.manual_seed(0)  # the same adapter on every rank and in one process
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))

tokenizer = transformers.AutoTokenizer.from_pretrained(path)
if tokenizer.pad_token is None:  # (Llama 3's has none) rows are padded to one length
    tokenizer.pad_token = tokenizer.eos_token
texts = ["LoRA trains a low-rank update.", "Each rank holds its slice of the adapter."] * 8
rows = [tokenizer(text, padding="max_length", max_length=16, truncation=True) for text in texts]
dataset = [
    {"input_ids": r["input_ids"], "attention_mask": r["attention_mask"],
     "labels": [t if keep else -100 for t, keep in zip(r["input_ids"], r["attention_mask"])]}  # no loss on padding
    for r in rows
]  # fmt: skip
data_parallel = world // tp  # the ranks taking different rows
args = transformers.TrainingArguments(
    output_dir=out, per_device_train_batch_size=global_batch // data_parallel,
    max_steps=int(os.environ.get("STEPS", "3")), learning_rate=1e-3, max_grad_norm=1.0, logging_steps=1,
    save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
)  # fmt: skip
trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
trainer.train()
model.save_pretrained(os.path.join(out, "adapter"))  # every rank calls; rank 0 writes the whole adapter
if fsdp == 1:  # at TP alone each rank merges its slice of B A into its shard
    model.merge_and_unload().save_pretrained(os.path.join(out, "merged"))  # a standard checkpoint, gathered

mesh = parallel_state(model).mesh
if mesh.is_main:
    losses = [round(entry["loss"], 4) for entry in trainer.state.log_history if "loss" in entry]
    print(f"{mesh}: losses {losses}", flush=True)
