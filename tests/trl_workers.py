"""TRL's SFTTrainer, unchanged, on the tiny llama: in one process (plain transformers) and on hf_parallel's
ranks. Each run logs every step: loss, grad norm and TRL's own metrics (entropy, token accuracy, tokens)."""

from __future__ import annotations

import os

import torch

STEPS = 3
GLOBAL_BATCH = 2  # rows per step, over all data-parallel ranks
WORDS = "the a cat dog sat on mat ran far fast slow red blue green big small one two three".split()
TEXTS = [
    "the cat sat on the mat", "a dog ran far", "the red dog sat", "a big cat ran fast", "one two three",
    "the small green cat sat on a big red mat", "two dogs ran", "the blue mat",
]  # fmt: skip
LOGGED = ("loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens")


def tokenizer():
    """A word-level tokenizer whose ids fit the tiny models' vocabulary (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{word: i + 4 for i, word in enumerate(WORDS)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                           init_lora_weights=False)  # fmt: skip


MODES = ("full", "lora", "packed")  # full fine-tuning, LoRA, full with packing=True (padding-free rows)


def sft(model, output_dir: str, mode: str, replicas: int = 1) -> dict:
    """SFTTrainer with its defaults (gradient checkpointing on) for STEPS steps of GLOBAL_BATCH rows over
    ``replicas`` data-parallel ranks, in one of MODES; every step's logged values."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    args = SFTConfig(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=GLOBAL_BATCH // replicas,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", bf16=False, use_cpu=True,
        max_length=16 if mode == "packed" else 32, seed=0, disable_tqdm=True, lr_scheduler_type="constant",
        packing=mode == "packed",
    )  # fmt: skip
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tokenizer(),
        peft_config=lora_config() if mode == "lora" else None,
    )  # fmt: skip
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {key: [entry[key] for entry in logged] for key in LOGGED}


def one_process(path: str, root: str) -> dict:
    import transformers

    return {
        mode: sft(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                  os.path.join(root, mode), mode)  # fmt: skip
        for mode in MODES
    }


def parallel(rank: int, world_size: int, path: str, root: str, sizes: dict) -> dict:
    import sys

    import hf_parallel
    from hf_parallel.tensor import vocab_loss

    vocab_loss.TOKENS_PER_CHUNK = 8  # several chunks, each recomputed in backward
    out = {}
    for mode in MODES:
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
        try:
            replicas = sizes.get("fsdp_size", 1) * sizes.get("dp_replicate_size", 1)
            out[mode] = sft(model, os.path.join(root, mode), mode, replicas)
        except ValueError as error:  # a layout refused by name
            out[mode] = str(error)
    kernel = sys.modules["trl.trainer.utils"]._ChunkedLogProbFunction
    out["kernel"] = kernel.__qualname__
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if sizes.get("tp_size", 1) == 1 or weight is None:  # no vocabulary split (or a stage's stand-in)
        out["unseen"] = None
        return out
    try:  # TRL's kernel reached outside a fused call hf_parallel saw, on this rank's rows of the vocabulary
        kernel.apply(torch.zeros(1, weight.shape[1]), weight, None, torch.zeros(1, dtype=torch.long), 1.0, 64)
        out["unseen"] = None
    except ValueError as error:
        out["unseen"] = str(error)
    return out


PREFERENCES = {
    "prompt": ["the cat", "a dog", "the red mat", "one two", "the big dog", "a small cat", "two dogs", "the blue"],
    "chosen": ["sat on the mat", "ran far", "is big", "three", "ran fast", "sat", "ran", "mat"],
    "rejected": ["ran far", "sat on the mat", "ran", "one", "sat", "ran far fast", "sat on a mat", "dog"],
}
DPO_LOGGED = ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "num_tokens")


def dpo(model, output_dir: str) -> dict:
    """TRL's DPOTrainer with LoRA (its reference: the base with the adapter disabled), STEPS steps."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    args = DPOConfig(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
        report_to="none", save_strategy="no", bf16=False, use_cpu=True, max_length=32, seed=0, disable_tqdm=True,
        lr_scheduler_type="constant",
    )  # fmt: skip
    trainer = DPOTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict(PREFERENCES), processing_class=tokenizer(),
        peft_config=lora_config(),
    )  # fmt: skip
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {key: [entry[key] for entry in logged] for key in DPO_LOGGED}


def dpo_one_process(path: str, root: str) -> dict:
    import transformers

    return dpo(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), root)


def dpo_parallel(rank: int, world_size: int, path: str, root: str, sizes: dict) -> dict:
    import hf_parallel

    return dpo(hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes), root)


def different_batches(rank: int, world_size: int, path: str, sizes: dict) -> dict:
    """TRL's fused call on each rank of one replica with its own batch (as GRPO's per-rank sampling gives):
    the error, or None; then the same batch on every rank goes through."""
    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
    from trl.trainer import utils  # after the load: its add_fused_lm_head is the one TRL's trainers call

    utils.add_fused_lm_head(model)
    ids = torch.randint(3, 20, (2, 9), generator=torch.Generator().manual_seed(rank))
    try:
        model(input_ids=ids, labels=ids, fused_lm_head=True)
        error = None
    except ValueError as raised:
        error = str(raised)
    same = torch.randint(3, 20, (2, 9), generator=torch.Generator().manual_seed(0))
    return {"error": error, "same": float(model(input_ids=same, labels=same, fused_lm_head=True).loss)}
