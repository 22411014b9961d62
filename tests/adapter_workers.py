"""Workers of LoRA (peft) on parallel models against one process (test_adapters). The reference runs
in one process with plain transformers + peft; each parallel case loads the reference's initial
adapter sharded and repeats its steps."""

from __future__ import annotations

import os

import torch

LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# AdamW's first step is lr * g / (|g| + eps): a gradient whose last bits differ by d (summed in another order
# over the ranks) moves it by up to lr * d / eps, where g is near 0. At eps 1e-6 that moved the real SmolLM2's
# logits after a step by 5e-3 at TP=3 (0.0032 allowed) while every gradient agreed within 1e-4. The gradients
# themselves are compared slice by slice (test_adapters.py); the step checks each rank updates its own slices
LR, EPS = 1e-3, 1e-4
RANK = 4


def lora_config(targets, **overrides):
    import peft

    return peft.LoraConfig(
        r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_modules=list(targets), init_lora_weights=False,
        **overrides,
    )  # fmt: skip


def batch(vocab: int) -> dict:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (4, 12), generator=generator)
    labels = ids.clone()
    labels[0, :3] = -100
    return {"input_ids": ids, "labels": labels}


def stripped(name: str) -> str:
    """A PeftModel parameter's name in the model it wraps."""
    return name.removeprefix("base_model.model.")


def reference(path: str, targets, out_dir: str) -> dict:
    """One process: the initial adapter (saved), logits, greedy tokens, adapter gradients, one AdamW
    step, the trained adapter; and the base with that initial adapter merged, saved."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(0)
    model = peft.get_peft_model(base, lora_config(targets))
    model.save_pretrained(os.path.join(out_dir, "adapter"))
    data = batch(base.config.vocab_size)
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"]).logits
    tokens = model.generate(input_ids=data["input_ids"][:1], max_new_tokens=4, do_sample=False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    loss = model(**data).loss
    loss.backward()
    grads = {stripped(n): p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer.step()
    with torch.no_grad():
        trained_logits = model(input_ids=data["input_ids"]).logits

    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, os.path.join(out_dir, "adapter")).merge_and_unload()
    merged.save_pretrained(os.path.join(out_dir, "merged"))
    return {"logits": logits, "tokens": tokens, "loss": loss.item(), "grads": grads, "trained_logits": trained_logits}


def parallel(rank: int, world_size: int, cases: dict, root: str) -> dict:
    """Each case (checkpoint, layout, reference adapter): the reference's steps on the parallel
    model with the adapter loaded sharded; then a second adapter switched to, merged and saved."""
    import peft

    import hf_parallel

    results = {}
    for name, (path, sizes, adapter) in cases.items():
        out = os.path.join(root, name)
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
        mesh = hf_parallel.parallel_state(model).mesh
        lora = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
        data = batch(model.config.vocab_size)
        with torch.no_grad():
            logits = lora(input_ids=data["input_ids"]).logits
        tokens = lora.generate(input_ids=data["input_ids"][:1], max_new_tokens=4, do_sample=False)
        optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=LR, eps=EPS)
        loss = hf_parallel.train_step(lora, **data, micro_batches=2)
        state = hf_parallel.parallel_state(lora)
        adapters = {
            n: {"grad": p.grad.tolist(), "layout": state.entry(n).layout.to_json(), "full": state.entry(n).full_shape}
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        outside = [n for n, p in model.named_parameters() if p.grad is not None and n not in state.adapters.entries]
        optimizer.step()
        for n, p in model.named_parameters():
            if n in adapters:
                adapters[n]["trained"] = p.tolist()
        with torch.no_grad():
            trained_logits = lora(input_ids=data["input_ids"]).logits
        lora.save_pretrained(os.path.join(out, "adapter"))
        lora.load_adapter(adapter, adapter_name="other")
        lora.set_adapter("other")
        with torch.no_grad():
            other_logits = lora(input_ids=data["input_ids"]).logits
        merged_logits = merge_error = None
        try:
            merged = lora.merge_and_unload()
            with torch.no_grad():
                merged_logits = merged(input_ids=data["input_ids"]).logits.tolist()
            merged.save_pretrained(os.path.join(out, "merged"))
        except ValueError as error:  # refused under FSDP
            merge_error = str(error)
        results[name] = {  # every rank reports the gradients it holds, each copy of a shard compared
            "tp_rank": mesh.tp.rank, "logits": logits.tolist(), "tokens": tokens.tolist(), "loss": loss.item(),
            "adapters": adapters, "outside": outside, "trained_logits": trained_logits.tolist(),
            "other_logits": other_logits.tolist(), "merged_logits": merged_logits, "merge_error": merge_error,
        }  # fmt: skip
    return results


def refusals(rank: int, world_size: int, paths: dict, root: str) -> dict:
    """At TP=2: peft's own ``get_peft_model`` (its initial adapter saved), and what is refused by name
    instead of trained wrong: DoRA on a split module, a LoRA on fused MoE experts, another peft
    tuner (IA3) on a split module, peft's
    ``modules_to_save`` copy, a parameter and a module added by hand. DoRA is tried first with peft
    imported after loading (its seams go in when it is imported), then with peft imported first."""
    import sys

    import hf_parallel

    def load(name="llama"):
        return hf_parallel.AutoModelForCausalLM.from_pretrained(paths[name], dtype=torch.float32, tp_size=2)

    def error_of(run) -> str | None:
        try:
            run()
        except ValueError as error:
            return str(error)
        return None

    out = {"peft_before_load": "peft" in sys.modules}
    loaded_first = load()
    import peft

    out["dora_after_load"] = error_of(lambda: peft.get_peft_model(loaded_first, lora_config(["q_proj"], use_dora=True)))
    torch.manual_seed(0)
    peft.get_peft_model(load(), lora_config(LLAMA)).save_pretrained(os.path.join(root, "initial"))
    data = batch(101)

    def forward_with_grad(model):
        return lambda: model(**data).loss

    out["dora"] = error_of(lambda: peft.get_peft_model(load(), lora_config(["q_proj"], use_dora=True)))
    out["experts"] = error_of(
        lambda: peft.get_peft_model(load("qwen3_moe"), lora_config([], target_parameters=["mlp.experts.gate_up_proj"]))
    )
    out["ia3"] = error_of(
        lambda: peft.get_peft_model(load(), peft.IA3Config(target_modules=["q_proj"], feedforward_modules=[]))
    )
    copied = peft.get_peft_model(load(), lora_config(["q_proj"], modules_to_save=["lm_head"]))
    out["modules_to_save"] = error_of(lambda: hf_parallel.train_step(copied, **data, micro_batches=1))
    by_hand = load()
    by_hand.model.layers[0].mlp.scale = torch.nn.Parameter(torch.ones(1))
    out["parameter"] = error_of(lambda: hf_parallel.train_step(by_hand, **data, micro_batches=1))
    module = load()
    module.model.norm = torch.nn.Sequential(module.model.norm, torch.nn.Linear(72, 72))
    with torch.no_grad():  # inference records no gradient: nothing to refuse
        module(**data)
    out["module"] = error_of(forward_with_grad(module))
    return out


def one_process_trainer(path: str, adapter: str, global_batch: int, output_dir: str) -> dict:
    """transformers' Trainer in one process with the adapter loaded by plain peft."""
    import peft
    import training_workers
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter, is_trainable=True)
    data = training_workers.trainer_dataset(base.config.vocab_size, global_batch * training_workers.STEPS)
    args = training_workers.trainer_arguments(output_dir, global_batch)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    trainer.save_model(os.path.join(output_dir, "final"))
    return training_workers.trainer_history(trainer)


def trainer(rank: int, world_size: int, path: str, adapter: str, sizes: dict, global_batch: int, root: str,
            resume_sizes: dict) -> dict:  # fmt: skip
    """transformers' Trainer, unchanged, on a PeftModel around a parallel model; ``save_model``
    writes the adapter; then runs resumed from its step-3 checkpoint at the same layout and at
    ``resume_sizes``."""
    import peft
    import training_workers
    import transformers

    import hf_parallel

    runs = {}
    for run in ("uninterrupted", "resumed", "resumed_elsewhere"):
        at = resume_sizes if run == "resumed_elsewhere" else sizes
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **at)
        lora = peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
        dp = hf_parallel.parallel_state(lora).mesh.dp.size
        data = training_workers.trainer_dataset(model.config.vocab_size, global_batch * training_workers.STEPS)
        output_dir = root if run != "resumed_elsewhere" else root + "-elsewhere"
        args = training_workers.trainer_arguments(output_dir, global_batch // dp, save_strategy="steps", save_steps=3)
        trainer = transformers.Trainer(model=lora, args=args, train_dataset=data)
        checkpoint = os.path.join(root, "checkpoint-3") if run != "uninterrupted" else None
        trainer.train(resume_from_checkpoint=checkpoint)
        runs[run] = training_workers.trainer_history(trainer)
        if run == "uninterrupted":
            trainer.save_model(os.path.join(root, "final"))
    return {**runs, "files": sorted(os.listdir(os.path.join(root, "checkpoint-3")))}
