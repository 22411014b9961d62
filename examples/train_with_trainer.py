"""Fine-tune with transformers' own Trainer, unchanged, on a parallel model.

    torchrun --nproc-per-node 2 examples/train_with_trainer.py                 # FSDP=2 (FSDP=N on N ranks)
    CUDA_VISIBLE_DEVICES=0 python examples/train_with_trainer.py               # one process, the same losses
    FSDP=1 TP=2 torchrun --nproc-per-node 2 examples/train_with_trainer.py     # TP=2
    FSDP=2 TP=2 torchrun --nproc-per-node 4 examples/train_with_trainer.py     # FSDP=2 x TP=2
    FSDP=4 TP=2 torchrun --nproc-per-node 8 examples/train_with_trainer.py     # one 8-GPU node

Resume at another layout: save every N steps, then pick a checkpoint up at any other TP / FSDP sizes (each
rank reads its own slices of the model and of every rank's optimizer state):

    FSDP=1 TP=4 STEPS=4 SAVE_EVERY=2 torchrun --nproc-per-node 4 examples/train_with_trainer.py
    FSDP=2 TP=2 STEPS=4 RESUME=trainer_output/checkpoint-2 torchrun --nproc-per-node 4 examples/train_with_trainer.py

The Trainer hands every data-parallel rank its own rows and the ranks of one model replica the
same ones, clips with the global gradient norm and saves a standard checkpoint (and, with
``save_strategy="steps"``, every rank's own optimizer state for ``resume_from_checkpoint``).
"""

import os

import torch
import transformers

from hf_parallel import AutoModelForCausalLM, parallel_state
from hf_parallel.commands.default_model import default_checkpoint

path = os.environ.get("MODEL") or default_checkpoint()  # the embedded SmolLM2-135M-Instruct
world = int(os.environ.get("WORLD_SIZE", "1"))
tp = int(os.environ.get("TP", "1"))
fsdp = int(os.environ.get("FSDP", str(world // tp)))  # FSDP over the ranks TP leaves
global_batch = 8  # rows a step over all data-parallel ranks: 1, 2, 4 or 8 of them divide it
if global_batch % fsdp:
    raise SystemExit(f"train_with_trainer.py: FSDP={fsdp} must divide the {global_batch} rows a step")
model = AutoModelForCausalLM.from_pretrained(
    path, fsdp_size=fsdp, tp_size=tp, tp_plan="auto" if tp > 1 else None, dtype=torch.float32
)
tokenizer = transformers.AutoTokenizer.from_pretrained(path)
texts = ["Tensor parallelism splits every layer.", "FSDP shards what each rank keeps between layers."] * 16
if tokenizer.pad_token is None:  # (Llama 3's has none) rows are padded to one length
    tokenizer.pad_token = tokenizer.eos_token
rows = [tokenizer(text, padding="max_length", max_length=16, truncation=True) for text in texts]
dataset = [
    {"input_ids": row["input_ids"], "attention_mask": row["attention_mask"],
     "labels": [t if keep else -100 for t, keep in zip(row["input_ids"], row["attention_mask"])]}  # no loss on padding
    for row in rows
]  # fmt: skip
args = transformers.TrainingArguments(
    output_dir=os.environ.get("OUT", "trainer_output"),
    per_device_train_batch_size=global_batch // fsdp,  # the same global batch whatever the layout
    max_steps=int(os.environ.get("STEPS", "3")),
    learning_rate=1e-5,
    max_grad_norm=1.0,
    logging_steps=1,
    save_strategy="steps" if os.environ.get("SAVE_EVERY") else "no",
    save_steps=int(os.environ.get("SAVE_EVERY", "0")) or 500,
    report_to=[],
    use_cpu=not torch.cuda.is_available(),
)
trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
trainer.train(resume_from_checkpoint=os.environ.get("RESUME") or None)  # steps after the checkpoint's
trainer.save_model(os.path.join(args.output_dir, "final"))  # every rank calls; a standard checkpoint
losses = [round(entry["loss"], 4) for entry in trainer.state.log_history if "loss" in entry]
print(f"{parallel_state(model).mesh}: losses {losses}")
