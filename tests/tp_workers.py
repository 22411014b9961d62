"""Workers of the tensor- and expert-parallel comparisons against one process (test_tp_models, test_moe, test_encoders, test_smollm2, test_bad_input, test_verify). Each runs inside a rank of a spawned gloo group (``distributed.run_ranks``)."""

from __future__ import annotations

import math
import os

import torch
from compare import gap, gaps

PROMPT = [{"role": "user", "content": "Explain in detail how a bicycle works."}]


# holds the first vocab row of every rank at TP=2, 3, 4 (vocab 101: 51; 34, 68; 26, 51, 76), where a
# padding_idx left unshifted would silently drop the gradient
INPUT_IDS = torch.tensor([[1, 51, 42, 34, 99, 68, 8], [3, 64, 26, 76, 31, 9, 50]])


def _output_and_loss(model, encoder: bool):
    """Causal LMs: logits and the LM loss. Encoders: the last hidden state and a loss on it."""
    if encoder:
        out = model(INPUT_IDS)
        pooled = getattr(out, "pooler_output", None)
        loss = out.last_hidden_state.square().mean() + (0 if pooled is None else pooled.square().mean())
        return out.last_hidden_state, loss
    out = model(INPUT_IDS, labels=INPUT_IDS)
    return out.logits, out.loss


def reference(path: str, encoder: bool = False):
    """Single-process transformers: output and gradients of one step."""
    import transformers

    auto = transformers.AutoModel if encoder else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, dtype=torch.float32)
    output, loss = _output_and_loss(model, encoder)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return output.detach(), grads


def compare_tp(
    rank: int,
    world_size: int,
    cases: dict,
    save_root: str | None,
    encoder: bool = False,
    distributed: bool = False,
    generate: int = 0,
) -> dict:
    """For each case (checkpoint path, tp_plan[, reference path]): TP output/grads vs single process
    (of the reference path, when the checkpoint is one transformers cannot read), collectives per
    forward, the fraction of the parameters this rank holds, and a save (``distributed``: per-rank
    files). ``encoder``: AutoModel and its last hidden state instead of logits. ``generate``: that many
    greedy tokens (caches of split layers), the parallel model's and one process's."""
    import hf_parallel
    from hf_parallel.distributed import comm
    from hf_parallel.distributed.shm import channel_for

    auto = hf_parallel.AutoModel if encoder else hf_parallel.AutoModelForCausalLM
    results = {}
    for name, (path, tp_plan, *reference_path) in cases.items():
        ref_output, ref_grads = reference(reference_path[0] if reference_path else path, encoder)
        model = auto.from_pretrained(path, tp_plan=tp_plan, dtype=torch.float32)
        comm.COUNTS.clear()
        with torch.no_grad():
            model(INPUT_IDS)
        counts = {op: comm.COUNTS[op] for op in ("all_reduce", "all_gather")}
        moved = {op: comm.COUNTS[op + ":bytes"] for op in ("all_reduce", "all_gather")}
        output, loss = _output_and_loss(model, encoder)
        loss.backward()
        state = hf_parallel.parallel_state(model)
        full = sum(math.prod(entry.full_shape) for entry in state.layout.unique_params())
        held = sum(p.numel() for p in model.parameters()) / full
        if generate:
            import transformers

            single = transformers.AutoModelForCausalLM.from_pretrained(reference_path[0] if reference_path else path)
            tokens = {
                "parallel": model.generate(INPUT_IDS[:1], max_new_tokens=generate, do_sample=False)[0].tolist(),
                "single": single.generate(INPUT_IDS[:1], max_new_tokens=generate, do_sample=False)[0].tolist(),
            }
        results[name] = {
            "held": held,
            **({"tokens": tokens} if generate else {}),
            "logits": gap(output, ref_output),
            "grads": gaps(model, state, ref_grads, rank),
            "shm": channel_for(state.mesh.tp.group) is not None,  # which transport carried TP's collectives
            "counts": counts,
            "moved": moved,  # bytes each rank sent into each kind of collective
            "hidden": model.config.hidden_size,
            "vocab": model.config.vocab_size,
            "layers": model.config.num_hidden_layers,
            "plan_source": state.layout.source,
        }
        if save_root is not None:
            model.save_pretrained(os.path.join(save_root, name), distributed=distributed)
    return results


def compare_ep(rank: int, world_size: int, cases: dict, save_root: str, sizes: dict | None = None) -> dict:
    """compare_tp for expert parallelism (``ep_plan="auto"``, with or without tensor parallelism; ``sizes``
    with ``ep_size``: tokens exchanged, every data-parallel rank on the same batch): outputs and gradients vs
    one process, experts held per rank, and a save."""
    import hf_parallel

    results = {}
    for name, (path, tp_plan) in cases.items():
        ref_output, ref_grads = reference(path)
        how = dict(sizes) if sizes else dict(ep_plan="auto")
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan=tp_plan, dtype=torch.float32, **how)
        output, loss = _output_and_loss(model, False)
        loss.backward()
        state = hf_parallel.parallel_state(model)
        rank = state.mesh.tp.rank
        counted = state.tokens_per_expert() if how.get("count_expert_tokens") else None
        experts = {
            entry.name: model.get_parameter(entry.name).shape[0]
            for entry in state.layout.unique_params()
            if entry.name.endswith("experts.gate_up_proj")
        }
        results[name] = {"logits": gap(output, ref_output), "grads": gaps(model, state, ref_grads, rank),
                         "experts": experts, "tokens_per_expert": counted}  # fmt: skip
        model.save_pretrained(os.path.join(save_root, name))
    return results


def routed_per_expert(path: str) -> dict[str, list[int]]:
    """One process's tokens per expert in one forward of ``INPUT_IDS``, by experts module, as its router
    hands them to the experts."""
    import transformers

    from hf_parallel.core.expert_args import expert_args

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    counts = {}

    def count(path, module):
        def hook(_, args, kwargs):
            ids = expert_args(args, kwargs)[1]
            counts[path] = torch.bincount(ids.reshape(-1), minlength=module.num_experts).tolist()

        return hook

    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts"):
            module.register_forward_pre_hook(count(name, module), with_kwargs=True)
    with torch.no_grad():
        model(INPUT_IDS)
    return counts


def own_prompts_generated(rank: int, world_size: int, path: str, sizes: dict, prompts: list, new_tokens: list) -> dict:
    """Each data-parallel rank generates its own prompt (``prompts[dp rank]``, ``new_tokens[dp rank]`` greedy
    tokens): the ranks of different lengths stepping together, their tokens exchanged with the experts' ranks."""
    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **sizes)
    mine = hf_parallel.parallel_state(model).mesh.dp.rank
    ids = torch.tensor([prompts[mine]])
    out = model.generate(ids, max_new_tokens=new_tokens[mine], do_sample=False, eos_token_id=None)
    return {"prompt": mine, "tokens": out[0].tolist()}


def generate_tokens(rank: int, world_size: int, path: str, max_new_tokens: int, save_dir: str | None) -> dict:
    import transformers

    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    if save_dir is not None:
        model.save_pretrained(save_dir)
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"tokens": out[0, ids.shape[1] :].tolist(), "local_bytes": local_bytes}


def load_expecting_error(rank: int, world_size: int, paths: list, kwargs: dict) -> dict:
    """Rank r loads ``paths[r]``; returns the error it got (or None)."""
    import hf_parallel

    try:
        hf_parallel.AutoModelForCausalLM.from_pretrained(paths[rank], tp_plan="auto", **kwargs)
    except Exception as error:  # noqa: BLE001 - the test asserts the type by name
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None, "message": None}


def expert_parallel_memory(rank: int, world_size: int, path: str, warm_path: str, ep: bool) -> dict:
    """Peak and resident RSS above the pre-load baseline, over loading and one forward, with
    experts spread over the ranks (``ep``) or every rank holding all of them. A tiny model of the
    same family is loaded and run first, so code imported and initialised on first use (and the
    process group) is in the baseline."""
    import gc

    from checkpoint_workers import benchmark_rss_readings

    import hf_parallel

    rss_bytes, peak_rss_bytes, reset_peak_rss = benchmark_rss_readings()

    kwargs = dict(tp_plan=None, ep_plan="auto") if ep else dict(tp_plan=None)
    warm = hf_parallel.AutoModelForCausalLM.from_pretrained(warm_path, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        warm(INPUT_IDS)
    del warm
    gc.collect()
    baseline = rss_bytes()
    reset_peak_rss()
    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    with torch.no_grad():
        model(INPUT_IDS)
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)
    return {
        "peak": peak_rss_bytes() - baseline,
        "resident": rss_bytes() - baseline,
        "local_expert_bytes": experts,
        "rest_bytes": rest,
    }


def verify_with_a_broken_layer(rank: int, world_size: int, path: str) -> dict | None:
    """hf-parallel verify on a plan whose layer 1 output projection keeps each rank's partial sum
    (a registered style that forgot its all-reduce): wrong numbers and no error, from layer 1 on."""
    import torch.nn.functional as F

    from hf_parallel import register_style
    from hf_parallel.commands.verify import verify
    from hf_parallel.tensor.plan import curated_plan_for
    from hf_parallel.tensor.styles import Hooks, Rowwise

    class RowwiseWithoutSum(Rowwise):
        def prepare(self, module, ctx, layouts):
            return Hooks(around=lambda forward, x, *args, **kwargs: F.linear(x, module.weight))

    register_style("rowwise_without_sum", RowwiseWithoutSum(), overwrite=True)
    rules = {**curated_plan_for("llama")[0], "layers.1.self_attn.o_proj": "rowwise_without_sum"}
    report = verify(path, tp_plan=rules)
    if report is None:
        return None
    first = report.first_divergence
    return {"first": first.name, "rows": {row.name: row.relative for row in report.rows}, "text": str(report)}


def quantized_logits(rank: int, world_size: int, paths: dict, save_root: str, sizes: dict, keep=False) -> dict:
    """Each checkpoint of ``paths`` (quantized) loaded at ``sizes`` (``keep``: its weights kept quantized):
    its logits on INPUT_IDS, and a gathered save under ``save_root/<name>``; kept, "held:<name>" the bytes
    this rank holds (kept parts, and the parameters that are not placeholders), "kinds:<name>" the kernels of
    its kept linears, "int4:<name>" the bytes of their packs for torch's int4 kernel, a per-rank save under
    ``save_root/<name>_per_rank``, "step:<name>" the logits of INPUT_IDS' first token alone (a decode step's
    size: fused experts dequantize only the experts it goes to) and "experts:<name>" each kept expert weight
    gathered by expert id in that step ("dequantized", or "as stored": multiplied by the gathered FP8 kernel)."""
    import hf_parallel
    from hf_parallel.quant.kept import int4_copy_nbytes
    from hf_parallel.quant.kept_experts import ExpertRows

    out = {}
    for name, path in paths.items():
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_quantized=keep,
                                                                 **sizes)  # fmt: skip
        with torch.no_grad():
            out[name] = model(INPUT_IDS).logits.tolist()
        if keep:
            params = {id(p): p for p in model.parameters() if p.device.type != "meta"}.values()
            kept = hf_parallel.parallel_state(model).kept.values()
            out["held:" + name] = sum(p.numel() * p.element_size() for p in params) + sum(w.nbytes for w in kept)
            linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and hasattr(m, "kept_weight")]
            out["kinds:" + name] = sorted({type(m.kernel).__name__ for m in linears})
            out["int4:" + name] = int4_copy_nbytes(model)
            gathered, rows, product = [], ExpertRows.rows, ExpertRows.product
            ExpertRows.rows = lambda self, ids: gathered.append("dequantized") or rows(self, ids)
            ExpertRows.product = lambda self, x, ids: gathered.append("as stored") or product(self, x, ids)
            try:
                with torch.no_grad():
                    out["step:" + name] = model(INPUT_IDS[:1, :1]).logits.tolist()
            finally:
                ExpertRows.rows, ExpertRows.product = rows, product
            out["experts:" + name] = gathered
            model.save_pretrained(os.path.join(save_root, name + "_per_rank"), distributed=True)
        model.save_pretrained(os.path.join(save_root, name))
    return out


class TinyExperts(torch.nn.Module):
    """transformers' experts forward in miniature: ``weight[e]`` per expert, weighted outputs summed per token."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)  # as transformers': only the experts hit compute (none: no graph)
        for expert in top_k_index.unique().tolist():
            token, k = torch.where(top_k_index == expert)
            product = hidden_states[token] @ self.weight[expert] * top_k_weights[token, k, None]
            out = out.index_add(0, token, product)
        return out


def exchange_with_an_idle_rank(rank: int, world_size: int) -> dict:
    """Two ranks, one expert each; every token of both routed to expert 0, so rank 1's expert receives nothing: the
    forward and backward still finish on both ranks, each rank's outputs and input gradients are one process's on
    its tokens, expert 0's gradient the sum over both ranks' tokens and expert 1's zero."""
    from hf_parallel.distributed.mesh import get_mesh
    from hf_parallel.tensor.token_exchange import TokenExchange

    torch.manual_seed(0)
    weight = torch.randn(2, 4, 4)
    hidden = [torch.randn(3, 4) for _ in range(world_size)]
    ids = torch.zeros(3, 1, dtype=torch.int64)
    routing = [torch.rand(3, 1) for _ in range(world_size)]
    mesh = get_mesh(dp_replicate_size=2, ep_size=2)
    local = TinyExperts(weight[mesh.ep.rank : mesh.ep.rank + 1])
    exchange = TokenExchange(local, mesh.ep, mesh.tp, [0, 1], 2)
    x, w = hidden[rank].clone().requires_grad_(), routing[rank].clone().requires_grad_()
    out = exchange(local.forward, (x, ids, w), {})
    out.square().sum().backward()
    whole = TinyExperts(weight)
    xs = [h.clone().requires_grad_() for h in hidden]
    ws = [r.clone().requires_grad_() for r in routing]
    want = [whole(a, ids, b) for a, b in zip(xs, ws)]
    sum(o.square().sum() for o in want).backward()
    return {"out": gap(out, want[rank]), "x_grad": gap(x.grad, xs[rank].grad), "w_grad": gap(w.grad, ws[rank].grad),
            "expert_grad": gap(local.weight.grad, whole.weight.grad[mesh.ep.rank : mesh.ep.rank + 1])}
