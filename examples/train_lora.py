"""LoRA with peft, unchanged, on a tensor-parallel model (pip install "hf_parallel[peft]").

    torchrun --nproc-per-node 2 examples/train_lora.py          # TP=2
    TP=1 python examples/train_lora.py                          # one process, the same losses
    TP=3 torchrun --nproc-per-node 3 examples/train_lora.py     # TP=3 (SmolLM2's 9/3 heads: 3/1 per rank)

Each adapter follows its projection's split (q/k/v/gate/up: B's rows; o/down: A's columns), trains
with transformers' Trainer, and is saved whole by ``save_pretrained`` (peft's standard adapter, which
plain peft loads in one process); ``merge_and_unload`` then merges it into each rank's shards.
"""

import os

import peft
import torch
import transformers

from hf_parallel import AutoModelForCausalLM, parallel_state
from hf_parallel.commands.default_model import default_checkpoint

path = os.environ.get("MODEL") or default_checkpoint()  # the embedded SmolLM2-135M-Instruct
tp = int(os.environ.get("TP", "2"))
out = os.environ.get("OUT", "lora_output")
model = AutoModelForCausalLM.from_pretrained(path, tp_size=tp, tp_plan="auto" if tp > 1 else None, dtype=torch.float32)
torch.manual_seed(0)  # the same adapter on every rank and in one process
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets))

tokenizer = transformers.AutoTokenizer.from_pretrained(path)
texts = ["LoRA trains a low-rank update.", "Each rank holds its slice of the adapter."] * 8
rows = [tokenizer(text, padding="max_length", max_length=16, truncation=True) for text in texts]
dataset = [{"input_ids": r["input_ids"], "attention_mask": r["attention_mask"], "labels": r["input_ids"]} for r in rows]
args = transformers.TrainingArguments(
    output_dir=out, per_device_train_batch_size=4, max_steps=int(os.environ.get("STEPS", "3")), learning_rate=1e-3,
    max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=not torch.cuda.is_available(),
)  # fmt: skip
trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
trainer.train()
model.save_pretrained(os.path.join(out, "adapter"))  # every rank calls; rank 0 writes the whole adapter
merged = model.merge_and_unload()  # each rank merges its slice of B A into its shard
merged.save_pretrained(os.path.join(out, "merged"))  # a standard checkpoint, gathered
losses = [round(entry["loss"], 4) for entry in trainer.state.log_history if "loss" in entry]
print(f"{parallel_state(merged).mesh}: losses {losses}")
