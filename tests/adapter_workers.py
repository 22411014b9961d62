"""Workers of LoRA (peft) on parallel models against one process (test_adapters). The reference runs
in one process with plain transformers + peft; each parallel case loads the reference's initial
adapter sharded and repeats its steps."""

from __future__ import annotations

import os

import torch

LR, EPS = 1e-3, 1e-6  # AdamW's first step is lr * g / (|g| + eps): eps bounds how much a gradient's last bits move it
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
        holds = mesh.sp.rank == 0 and mesh.dp.rank == 0  # one copy of each shard reports its gradients
        results[name] = {
            "tp_rank": mesh.tp.rank, "logits": logits.tolist(), "tokens": tokens.tolist(), "loss": loss.item(),
            "adapters": adapters if holds else {}, "outside": outside, "trained_logits": trained_logits.tolist(),
            "other_logits": other_logits.tolist(), "merged_logits": merged_logits, "merge_error": merge_error,
        }  # fmt: skip
    return results
