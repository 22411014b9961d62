"""LoRA with peft and transformers' Trainer, both unchanged, on a model split by TP x FSDP.

    torchrun --nproc-per-node 4 examples/train_lora.py                  # TP=2 x FSDP=2 (the default)
    TP=2 FSDP=1 torchrun --nproc-per-node 2 examples/train_lora.py      # TP=2 alone: the adapter merged too
    TP=1 FSDP=1 CUDA_VISIBLE_DEVICES=0 python examples/train_lora.py    # one process: the same losses
    (pip install "hf_parallel[peft]"; MODEL=dir for another checkpoint than the embedded SmolLM2)

What each dimension does: TP splits every layer (each adapter follows its projection's split: q/k/v/gate/up
split B's rows, o/down A's columns); FSDP shards the frozen base between layers. The adapters, added after
the load, are not FSDP-sharded: each data-parallel rank holds its TP slice of them, their gradients averaged over
those ranks.

What the batch size counts: ``per_device_train_batch_size`` is the rows each *data-parallel* rank takes a
step. The TP ranks of one model replica take the same rows, so the global batch is that size times
``world_size // tp`` (here 4 rows whatever the layout, so every layout logs one process's losses).

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
tp, fsdp = int(os.environ.get("TP", "2")), int(os.environ.get("FSDP", "2"))
out = os.environ.get("OUT", "lora_output")
global_batch = 4
model = AutoModelForCausalLM.from_pretrained(
    path, tp_size=tp, fsdp_size=fsdp, tp_plan="auto" if tp > 1 else None, dtype=torch.float32
)
torch.manual_seed(0)  # the same adapter on every rank and in one process
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))

tokenizer = transformers.AutoTokenizer.from_pretrained(path)
texts = ["LoRA trains a low-rank update.", "Each rank holds its slice of the adapter."] * 8
rows = [tokenizer(text, padding="max_length", max_length=16, truncation=True) for text in texts]
dataset = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"], "labels": r["input_ids"]} for r in rows]
data_parallel = int(os.environ.get("WORLD_SIZE", "1")) // tp  # the ranks taking different rows
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
