"""Workers of sequence parallelism against one process (test_sequence_parallel). Each runs inside a rank of a spawned gloo group (``distributed.run_ranks``)."""

from __future__ import annotations

import os

import torch
from compare import gap, gaps, of_model


def sequence_batches(vocab: int) -> dict:
    """Batches for sequence parallelism: lengths that do not divide (37) and do (64), padding on
    the left and on the right, two samples packed in one row (positions restarting at 0), and a
    sequence shorter than the group (3 tokens)."""
    gen = torch.Generator().manual_seed(7)

    def ids(length, rows=2):
        return torch.randint(3, vocab, (rows, length), generator=gen)

    padded_ids, mask = ids(37), torch.ones(2, 37, dtype=torch.long)
    mask[0, :6] = 0  # left padding
    mask[1, 30:] = 0  # right padding
    packed_ids = ids(37, rows=1)
    # use_cache=False everywhere: with a cache, transformers' single-process mask ignores packed samples
    # (their position_ids restart at 0) and lets the second attend to the first
    return {
        "len37": dict(input_ids=(x := ids(37)), labels=x, use_cache=False),
        "len64": dict(input_ids=(y := ids(64)), labels=y, use_cache=False),
        "padded": dict(
            input_ids=padded_ids, attention_mask=mask, labels=padded_ids.masked_fill(mask == 0, -100), use_cache=False
        ),
        "packed": dict(
            input_ids=packed_ids,
            position_ids=torch.cat([torch.arange(20), torch.arange(17)]).unsqueeze(0),
            labels=packed_ids,
            use_cache=False,
        ),
        "len3": dict(input_ids=(z := ids(3)), labels=z, use_cache=False),
    }


def held_positions(seq: int, sp: int, cp: int, index: int) -> list[int]:
    """The positions of a ``seq``-token sequence that rank ``index`` of a cp x sp sequence group holds,
    worked out here from the rule (not from hf_parallel's layout): Ulysses alone, runs of seq // sp with
    the first seq % sp ranks one more (padded to one per rank); under CP, 2 cp equal chunks of the
    sequence padded to hold at least one token per rank, group g holding chunks g and 2 cp - 1 - g,
    split over its sp ranks the same way. Positions past the sequence are padding."""
    length, group, u = max(seq, sp), 0, index
    positions = list(range(length))
    if cp > 1:
        chunk = -(-max(seq, cp * sp) // (2 * cp))
        group, u = divmod(index, sp)
        positions = [p for i in (group, 2 * cp - 1 - group) for p in range(i * chunk, (i + 1) * chunk)]
    sizes = [len(positions) // sp + (r < len(positions) % sp) for r in range(sp)]
    start = sum(sizes[:u])
    return positions[start : start + sizes[u]]


def one_process_sp(path: str, batches) -> dict:
    """What ``compare_sp`` compares with, from one process: each batch's loss, logits and gradients, greedy
    tokens, and the weights after one SGD step on the last batch's gradients."""
    import transformers

    single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = {}
    for batch_name, batch in sequence_batches(single.config.vocab_size).items():
        if batches is not None and batch_name not in batches:
            continue
        single.zero_grad()
        want = single(**batch)
        want.loss.backward()
        out.update({f"{batch_name}/loss": want.loss.detach(), f"{batch_name}/logits": want.logits.detach()})
        out.update({f"{batch_name}/grad/{k}": v for k, v in of_model(single).items()})
    out["generate"] = single.generate(prompt_of(single.config.vocab_size), max_new_tokens=6, do_sample=False)
    torch.optim.SGD(single.parameters(), lr=0.5).step()
    out.update({f"step/{k}": v for k, v in of_model(single, "data").items()})
    return out


def prompt_of(vocab: int) -> torch.Tensor:
    return sequence_batches(vocab)["len37"]["input_ids"][:, :9]


def compare_sp(
    rank: int, world_size: int, cases: dict, tp_size: int, sp_size: int, save_root: str, cp_size: int = 1,
    batches=None, load_kwargs=None,
) -> dict:  # fmt: skip
    """For each checkpoint: every batch's loss, this rank's logits and every parameter's gradient
    under tp x sp (x cp) against one process (``one_process_sp``, computed once a session: references.py), the
    whole logits of an inference forward (no labels), greedy generate, a save, and the weights after one SGD
    step. ``batches``: the names of the batches to run; ``load_kwargs``: more of from_pretrained's keywords."""
    import references
    import transformers

    import hf_parallel
    from hf_parallel.distributed.mesh import get_mesh

    results = {}
    sp_rank = get_mesh(tp_size, sp_size=sp_size, cp_size=cp_size).sp.rank
    for name, path in cases.items():
        key = f"compare_sp {path} {sorted(batches) if batches is not None else 'every batch'}"
        single = references.one_process(key, lambda: one_process_sp(path, batches))
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto" if tp_size > 1 else None, tp_size=tp_size, sp_size=sp_size, cp_size=cp_size,
            dtype=torch.float32, **(load_kwargs or {}),
        )  # fmt: skip
        state = hf_parallel.parallel_state(model)
        masks = []  # what the decoder layers were handed as their attention mask
        model.model.layers[0].register_forward_pre_hook(
            lambda module, args, kwargs: masks.append(kwargs.get("attention_mask")), with_kwargs=True
        )
        vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
        for batch_name, batch in sequence_batches(vocab).items():
            if batches is not None and batch_name not in batches:
                continue
            masks.clear()
            model.zero_grad()
            want_loss, want_logits = single[f"{batch_name}/loss"], single[f"{batch_name}/logits"]
            got = model(**batch)
            got.loss.backward()
            seq = batch["input_ids"].shape[1]
            held = torch.tensor(held_positions(seq, sp_size, cp_size, sp_rank))
            real = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool().unsqueeze(-1)
            extra = (0, 0, 0, max(0, int(held.max()) + 1 - seq))  # padding tokens are compared nowhere
            local_logits = torch.nn.functional.pad(want_logits, extra)[:, held]
            local_real = torch.nn.functional.pad(real, extra)[:, held]
            with torch.no_grad():
                whole = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            results[f"{name}/{batch_name}"] = {
                "loss": gap(got.loss, want_loss),
                "logits": gap(got.logits.masked_fill(~local_real, 0), local_logits.masked_fill(~local_real, 0)),
                "local_tokens": got.logits.shape[1],
                "whole_logits": gap(whole.masked_fill(~real, 0), want_logits.masked_fill(~real, 0)),
                "grads": gaps(model, state, single.under(f"{batch_name}/grad/"), state.mesh.tp.rank),
                "mask_elements": max((m.numel() for m in masks if isinstance(m, torch.Tensor)), default=0),
                "masks_described": sum(type(m).__name__ == "MaskDescription" for m in masks),
            }
        generated = model.generate(prompt_of(vocab), max_new_tokens=6, do_sample=False)
        results[f"{name}/generate"] = generated.equal(single["generate"])
        model.save_pretrained(os.path.join(save_root, name))
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        results[f"{name}/step"] = gaps(model, state, single.under("step/"), state.mesh.tp.rank, "data")
    return results


def checkpointed(rank: int, world_size: int, path: str, tp_size: int, sp_size: int, cp_size: int = 1) -> dict:
    """Activation checkpointing (``gradient_checkpointing_enable``, reentrant and not) under tp x sp: the
    loss and every gradient against one process's, checkpointed the same way; the recompute runs in
    backward, where it needs the forward's call (its token split) back."""
    import transformers

    import hf_parallel

    results = {}
    for reentrant in (False, True):
        kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
        single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto" if tp_size > 1 else None, tp_size=tp_size, sp_size=sp_size, cp_size=cp_size,
            dtype=torch.float32,
        )  # fmt: skip
        for each in (single, model):
            each.train()
            each.gradient_checkpointing_enable(**kwargs)
        batch = sequence_batches(single.config.vocab_size)["padded"]
        want, got = single(**batch), model(**batch)
        want.loss.backward()
        got.loss.backward()
        state = hf_parallel.parallel_state(model)
        results["reentrant" if reentrant else "non-reentrant"] = {
            "loss": gap(got.loss, want.loss), "grads": gaps(model, state, of_model(single), state.mesh.tp.rank),
            "checkpointed": model.is_gradient_checkpointing,
        }  # fmt: skip
    return results


def decode_with_cache(rank: int, world_size: int, path: str, tp_size: int, sp_size: int, cp_size: int) -> dict:
    """Greedy generation under tp x sp (x cp) with the KV cache split over the sequence group, against one
    process: a left-padded batch of two prompts; the tokens each decode step ran through the first layer
    (one each: the prompt is not re-run); and the keys this rank's cache holds (its share, not the whole)."""
    import transformers

    import hf_parallel

    single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(
        path, tp_plan="auto" if tp_size > 1 else None, tp_size=tp_size, sp_size=sp_size, cp_size=cp_size,
        dtype=torch.float32,
    )  # fmt: skip
    prompts = torch.randint(3, single.config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(prompts)
    mask[1, :5] = 0  # left padding
    steps = []
    model.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: steps.append((args[0] if args else kwargs["hidden_states"]).shape[1]),
        with_kwargs=True,
    )
    new = 7
    want = single.generate(prompts, attention_mask=mask, max_new_tokens=new, do_sample=False, min_new_tokens=new)
    out = model.generate(
        prompts, attention_mask=mask, max_new_tokens=new, do_sample=False, min_new_tokens=new,
        return_dict_in_generate=True,
    )  # fmt: skip
    cache = out.past_key_values
    return {
        "same_tokens": out.sequences.equal(want),
        "tokens_per_step": steps,
        "cache_type": type(cache).__name__,
        "keys_held": cache.layers[0].keys.shape[-2],
        "length": cache.get_seq_length(),
    }


def tiled_loss(rank: int, world_size: int, cases: dict) -> dict:
    """``from_pretrained(tiled_loss=5, offload_checkpoints=True)`` under gradient checkpointing, for each case
    ``{name: (path, sizes)}``: the loss and every gradient of a padded batch against one process's, untiled
    and kept on the device; which way the loss was scored (vocab-parallel or through the head's module), the
    logits returned (None) and whether the offloading context ran."""
    import transformers
    from torch.distributed.tensor import DTensor

    import hf_parallel

    results = {}
    for name, (path, sizes) in cases.items():
        single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, tiled_loss=5, offload_checkpoints=True, **sizes
        )
        for each in (single, model):
            each.train()
            each.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        packed = []  # the tensors the offloading context took (under checkpointing: each layer's input)
        offload = torch.autograd.graph.save_on_cpu

        def counting(pin_memory=False):
            context = offload(pin_memory)
            pack = context.pack_hook
            context.pack_hook = lambda tensor: (packed.append(tuple(tensor.shape)), pack(tensor))[1]
            return context

        torch.autograd.graph.save_on_cpu = counting
        try:
            batch = sequence_batches(single.config.vocab_size)["padded"]
            want, got = single(**batch), model(**batch)
            want.loss.backward()
            got.loss.backward()
        finally:
            torch.autograd.graph.save_on_cpu = offload
        state = hf_parallel.parallel_state(model)
        if state.mesh.shape.dp > 1:  # FSDP: each gradient whole, against one process's
            whole = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                     for n, p in model.named_parameters()}  # fmt: skip
            grads = {n: gap(grad, single.get_parameter(n).grad) for n, grad in whole.items()}
        else:
            grads = gaps(model, state, of_model(single), state.mesh.tp.rank)
        with torch.no_grad():  # shift_labels (each token's next label) instead of labels: the same loss (FSDP's
            # gradients read first: they are None after another forward)
            shift_labels = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            shifted = model(**inputs, shift_labels=shift_labels).loss
        tiled = state.runtime.tiled_loss
        results[name] = {
            "loss": gap(got.loss, want.loss), "grads": grads, "vocab_parallel": tiled.vocab_split is not None,
            "shift_labels": gap(shifted, want.loss),
            "logits": got.logits, "transform": list(tiled.transform), "packed": len(packed),
            "hidden_packed": sum(shape[-1:] == (single.config.hidden_size,) for shape in packed),
        }  # fmt: skip
    return results
