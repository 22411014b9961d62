"""Rank workers for test_compile.py: parallel forwards under ``torch.compile`` against one process's (and
against their own eager runs)."""

from __future__ import annotations

import torch
from compare import gap

INPUT_IDS = [[5, 7, 9, 11, 13, 17, 19, 23, 29, 31, 37]]
HOST_SYNCS = {"item", "tolist", "numpy", "_local_scalar_dense"}  # what stops a CUDA graph (and waits for the device)


def _load(path: str, sizes: dict):
    import hf_parallel

    return hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)


def recording(graphs: list, inductor: bool):
    """A torch.compile backend that keeps each graph dynamo hands it, then compiles it with inductor
    (or runs it through AOT autograd with the ops' fake implementations, faster to build)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    def backend(gm, example_inputs):
        graphs.append(gm)
        if inductor:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    return backend


def graph_facts(graphs: list, device: str = "cpu") -> dict:
    """The collectives each traced graph holds, and any host synchronisation in it (a copy to the
    host too, where the model is on another device: on the CPU, transformers' ``.to(x.device)`` is one)."""
    collectives, syncs = 0, []
    for gm in graphs:
        for node in gm.graph.nodes:
            target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
            if "hf_parallel" in str(node.target):
                collectives += 1
            if node.op in ("call_method", "call_function") and target in HOST_SYNCS:
                syncs.append(f"{node.op} {target}")
            copies = target == "cpu" or (target == "to" and "cpu" in str((node.args[1:], node.kwargs)))
            if device != "cpu" and node.op == "call_method" and copies:
                syncs.append(f"{target}(cpu)")
    return {"graphs": len(graphs), "collectives": collectives, "host_syncs": syncs}


def explained(model, *args, **kwargs) -> dict:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(*args, **kwargs)
    torch._dynamo.reset()
    return {"explain_graphs": explanation.graph_count, "breaks": [b.reason[:300] for b in explanation.break_reasons]}


def _single(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def forward_case(path: str, sizes: dict, inductor: bool, fullgraph: bool = True, per_rank: bool = False,
                 padded: bool = False) -> dict:  # fmt: skip
    """Logits of the compiled forward against one process's and against the eager forward's. ``per_rank``:
    each rank passes other ids of the same shape (a sequence-parallel group computes its first rank's batch,
    eager and compiled); ``padded``: the first three tokens are left padding (an attention mask)."""
    from hf_parallel.distributed import comm

    model = _load(path, sizes)
    ids = torch.tensor(INPUT_IDS) + (torch.distributed.get_rank() if per_rank else 0)
    mask = torch.ones_like(ids).index_fill_(1, torch.arange(3), 0) if padded else None
    with torch.no_grad():
        want = _single(path)(torch.tensor(INPUT_IDS), attention_mask=mask).logits
        comm.COUNTS.clear()
        eager = model(ids, attention_mask=mask).logits
        eager_moved = dict(comm.COUNTS)
        facts = explained(model, ids, attention_mask=mask)
        graphs = []
        compiled_model = torch.compile(model, fullgraph=fullgraph, backend=recording(graphs, inductor))
        compiled_model(ids, attention_mask=mask)  # traced and compiled
        comm.COUNTS.clear()
        compiled = compiled_model(ids, attention_mask=mask).logits
        compiled_moved = dict(comm.COUNTS)
    return {**facts, **graph_facts(graphs), "logits": gap(compiled, want), "eager_logits": gap(compiled, eager),
            "last_logits": compiled[0, -1, :5].tolist(), "eager_moved": eager_moved,
            "compiled_moved": compiled_moved}  # fmt: skip


def mismatch_case(path: str, sizes: dict) -> dict:
    """A sequence-parallel group's ranks calling the compiled forward with different shapes: every
    rank's error, raised before any byte is read into the wrong shape."""
    model = _load(path, sizes)
    ids = torch.tensor(INPUT_IDS)[:, : 8 + torch.distributed.get_rank()]
    try:
        with torch.no_grad():
            torch.compile(model, fullgraph=True, backend=recording([], inductor=False))(ids)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def _step(stepped, forward, ids):
    """One training forward and backward with labels: the loss and every trainable parameter's gradient."""
    stepped.train()
    stepped.zero_grad(set_to_none=True)
    loss = forward(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss, {n: p.grad.clone() for n, p in stepped.named_parameters() if p.requires_grad}


def compared_steps(single, model) -> tuple:
    """One process's step, the parallel model's eager step and its step compiled whole (aot_eager), on the same
    batch; with dynamo's account of the model and the compiled graphs' facts."""
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    want, eager = _step(single, single, ids), _step(model, model, ids)
    facts = explained(model, input_ids=ids, labels=ids)
    graphs = []
    compiled = _step(model, torch.compile(model, fullgraph=True, backend=recording(graphs, inductor=False)), ids)
    return want, eager, compiled, {**facts, **graph_facts(graphs)}


def lora_case(path: str, sizes: dict) -> dict:
    """LoRA at TP: loss and every adapter gradient (this rank's slice), compiled, against one process's with the
    same adapter (peft's own initialisation, same seed), and against eager."""
    import peft
    from compare import piece_gap

    import hf_parallel

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                             init_lora_weights=False)  # fmt: skip
    torch.manual_seed(0)
    single = peft.get_peft_model(_single(path), config)
    torch.manual_seed(0)
    model = peft.get_peft_model(_load(path, sizes), config)
    state = hf_parallel.parallel_state(model)
    (want_loss, want_grads), (eager_loss, eager_grads), (loss, grads), facts = compared_steps(single, model)
    rank = state.mesh.tp.rank
    slices = {n: piece_gap(grads.get(n), want_grads[n], state.entry(n.removeprefix("base_model.model.")).layout, rank)
              for n in want_grads}  # fmt: skip
    eager = {n: piece_gap(grads.get(n), eager_grads[n]) for n in eager_grads}
    return {**facts, "loss": gap(loss, want_loss), "eager_loss": gap(loss, eager_loss),
            "grads": slices, "eager_grads": eager, "adapters": len(grads)}  # fmt: skip


def static_generate_case(path: str, sizes: dict, mode: str | None = None) -> dict:
    """Greedy generate with a static cache and a compiled forward (gpt-fast's recipe) against eager
    generate; scalar outputs are captured into the graph, so a ``.item()`` would show as a node.
    ``mode``: torch.compile's (``"reduce-overhead"``: CUDA graphs, inductor's own backend)."""
    model = _load(path, sizes)
    ids = torch.tensor(INPUT_IDS, device=model.device)
    options = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    eager = model.generate(ids, **options)
    graphs = []
    torch._dynamo.reset()
    how = dict(mode=mode) if mode else dict(backend=recording(graphs, inductor=True))
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        model.forward = torch.compile(model.forward, fullgraph=True, **how)
        compiled = model.generate(ids, **options)
    return {**graph_facts(graphs), "tokens": compiled.tolist(), "eager_tokens": eager.tolist(),
            "device": str(model.device)}  # fmt: skip


def train_case(path: str, sizes: dict) -> dict:
    """A training forward and backward with labels, compiled whole (the ring's autograd function traced, its
    backward's exchanges in the backward graph): the loss and every gradient against one process's and eager's."""
    (want_loss, want_grads), (eager_loss, eager_grads), (loss, grads), facts = compared_steps(
        _single(path), _load(path, sizes)
    )
    return {**facts, "loss": gap(loss, want_loss), "eager_loss": gap(loss, eager_loss),
            "grads": {n: gap(grads[n], want_grads[n]) for n in grads},
            "eager_grads": {n: gap(grads[n], eager_grads[n]) for n in grads}}  # fmt: skip


def compiled_cases(rank: int, world_size: int, cases: dict) -> dict:
    results = {}
    for name, (kind, path, sizes, options) in cases.items():
        torch._dynamo.reset()
        kinds = {"forward": forward_case, "lora": lora_case, "generate": static_generate_case,
                 "mismatch": mismatch_case, "train": train_case}  # fmt: skip
        run = kinds[kind]
        results[name] = run(path, sizes, **options)
    return results
