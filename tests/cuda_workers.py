"""Workers of the ``cuda`` tier (``test_cuda.py``): every rank computes on the GPU (``HF_PARALLEL_DEVICE``),
one process's reference on the CPU in fp32, and every comparison is ``compare``'s, on the host. Several ranks share
one GPU (the mesh's groups are then gloo groups, and point-to-point messages are staged through pinned
host memory), so one card runs every layout."""

from __future__ import annotations

import os

import torch
from compare import gap, gaps, of_model

torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as one process's on the CPU computes it (TF32 keeps 10 bits)
torch.backends.cudnn.allow_tf32 = False

INPUT_IDS = torch.tensor([[1, 51, 42, 34, 99, 68, 8], [3, 64, 26, 76, 31, 9, 50]])


def _forward(model, encoder: bool, device):
    ids = INPUT_IDS.to(device)
    if encoder:
        out = model(ids)
        return out.last_hidden_state, out.last_hidden_state.square().mean()
    out = model(ids, labels=ids)
    return out.logits, out.loss


def on_gpu(rank: int, world_size: int, cases: dict, save_root: str) -> dict:
    """Each case (checkpoint, from_pretrained keywords, what to run): where every tensor lives, output and
    every gradient's slice against one process, greedy tokens, a compiled forward, saves to compare."""
    import transformers

    import hf_parallel
    from hf_parallel.on_device import left_behind

    results = {}
    for name, (path, kwargs, runs) in cases.items():
        encoder = "encoder" in runs
        auto = transformers.AutoModel if encoder else transformers.AutoModelForCausalLM
        single = auto.from_pretrained(path, dtype=torch.float32)
        ref_output, ref_loss = _forward(single, encoder, "cpu")
        ref_loss.backward()
        parallel = hf_parallel.AutoModel if encoder else hf_parallel.AutoModelForCausalLM
        model = parallel.from_pretrained(path, **{"dtype": torch.float32, **kwargs})  # (a case may ask for bf16)
        state = hf_parallel.parallel_state(model)
        device = state.mesh.device
        offloaded = kwargs.get("fsdp_cpu_offload", False)  # FSDP's shards on the host between uses
        out = {"device": str(device), "wire": str(state.mesh.wire),
               "left_behind": left_behind(model, device, parameters=not offloaded)}  # fmt: skip
        if "train_step" in runs:  # pipeline stages: the schedule's loss and every gradient
            model.train()
            loss = hf_parallel.train_step(model, input_ids=INPUT_IDS.to(device), labels=INPUT_IDS.to(device),
                                          micro_batches=4, schedule="1f1b")  # fmt: skip
            out["loss"] = gap(loss, ref_loss)
        else:  # eval mode, as one process's: no dropout (BERT's would differ)
            output, loss = _forward(model, encoder, device)
            loss.backward()
            if state.sequence is None:  # under SP a rank holds its own tokens' outputs: loss and gradients say it
                out["output"] = gap(output, ref_output)
            out["loss"] = gap(loss, ref_loss)
        out["grads"] = gaps(model, state, of_model(single), state.mesh.tp.rank)  # FSDP's: this rank's rows
        model.eval()
        model.zero_grad()
        if "generate" in runs:
            prompt = INPUT_IDS[:1, :5]
            want = single.generate(prompt, max_new_tokens=6, do_sample=False)
            out["greedy"] = model.generate(prompt.to(device), max_new_tokens=6, do_sample=False).cpu().equal(want)
        if "compile" in runs:
            compiled = torch.compile(model.forward, fullgraph=True)
            with torch.no_grad():
                out["compiled"] = gap(compiled(INPUT_IDS.to(device)).logits, ref_output)
        if "save" in runs:
            model.save_pretrained(os.path.join(save_root, name, "gathered"))
            model.save_pretrained(os.path.join(save_root, name, "distributed"), distributed=True)
        results[name] = out
    return results


def kept_fp8(rank: int, world_size: int, path: str, save_root: str, sizes: dict) -> dict:
    """An FP8 checkpoint kept quantized on the GPU against the same checkpoint dequantized as read, in float32
    and bfloat16: logits (eager, eager again: through the kernels kept from the first launches, and compiled
    whole), the kernels of the kept linears (the package's kernel where the card runs it), the kernels kept for
    launching again, and each load saved back (gathered; the float32 one per rank too)."""
    from hf_parallel.quant.kernels import fp8_weight_only

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits, model, device = _kept_logits(path, (False, True), dtype, **sizes)
        with torch.no_grad():
            again = model(INPUT_IDS.to(device)).logits.float()
            compiled = torch.compile(model.forward, fullgraph=True)(INPUT_IDS.to(device)).logits.float()
        out[str(dtype)] = {"kept": gap(logits[True], logits[False]), "compiled": gap(compiled, logits[True])}
        out[f"again {dtype}"] = torch.equal(again, logits[True])
        out[f"kinds {dtype}"] = sorted({type(m.kernel).__name__ for m in model.modules() if hasattr(m, "kept_weight")})
        model.save_pretrained(os.path.join(save_root, str(dtype).removeprefix("torch."), "gathered"))
        if dtype == torch.float32:  # the checkpoint's floats: every tensor saved bit for bit, per rank too
            model.save_pretrained(os.path.join(save_root, "float32", "per_rank"), distributed=True)
    out["kernel"], out["capability"] = fp8_weight_only.runs_on(device), list(torch.cuda.get_device_capability(device))
    out["kept kernels"] = len(fp8_weight_only._source.launch_weight_only_fp8.kernels) if out["kernel"] else 0
    return out


def _kept_logits(path: str, keeps: tuple, dtype, **sizes):
    """``path`` loaded with each ``keep_quantized`` of ``keeps`` in turn: their logits on INPUT_IDS (float32),
    and the last model and its device."""
    import hf_parallel

    logits = {}
    for keep in keeps:
        model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, keep_quantized=keep, **sizes)
        device = hf_parallel.parallel_state(model).mesh.device
        with torch.no_grad():
            logits[keep] = model(INPUT_IDS.to(device)).logits.float()
    return logits, model, device


def kept_experts(rank: int, world_size: int, path: str, save_root: str, sizes: dict) -> dict:
    """A Qwen3-MoE FP8 checkpoint at ``sizes`` in float32, kept against dequantized as read: a one-token step
    (each pair's expert gathered by id on the card) and a prefill (every expert dequantized), the step
    compiled whole against eager, how many experts modules compute with their kept weights, and the kept
    weights saved back."""
    import hf_parallel
    from hf_parallel.quant.kept_experts import KeptExperts

    models = {keep: hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, keep_quantized=keep,
                                                                     **sizes) for keep in (False, True)}  # fmt: skip
    from hf_parallel.quant.kernels import fp8_weight_only

    device, out = hf_parallel.parallel_state(models[True]).mesh.device, {}
    step = INPUT_IDS[:1, :1].to(device)
    launches, product = [], fp8_weight_only.weight_only_product

    def counted(x, kept, *launch, ids=None, **plans):
        if ids is not None:  # the experts' products (the attention's linears take none)
            launches.append(len(ids))
        return product(x, kept, *launch, ids=ids, **plans)

    fp8_weight_only.weight_only_product = counted
    with torch.no_grad():
        for what, ids in (("step", step), ("prefill", INPUT_IDS.to(device))):
            out[what] = gap(models[True](ids).logits.float(), models[False](ids).logits.float())
        out["launches"] = len(launches)  # the step's, where the card runs the gathered FP8 kernel
        compiled = torch.compile(models[True].forward, fullgraph=True)(step).logits.float()
        out["compiled"] = gap(compiled, models[True](step).logits.float())
    experts = [m for m in models[True].modules() if isinstance(m, KeptExperts)]
    out["experts"], out["as_stored"] = len(experts), [m.kernel_products for m in experts]
    out["capability"] = list(torch.cuda.get_device_capability(device))
    models[True].save_pretrained(os.path.join(save_root, "gathered"))
    return out


def kept_int4(rank: int, world_size: int, path: str, save_root: str) -> dict:
    """An act-order GPTQ checkpoint at TP=2 in bfloat16, ``keep_quantized="int4"`` against dequantized as read:
    logits (eager, and compiled whole), the kept linears' kernels (torch's int4 kernel where the card runs it),
    and the kept weights saved back."""
    from hf_parallel.quant.kernels import int4_torch

    logits, model, device = _kept_logits(path, (False, "int4"), torch.bfloat16, tp_size=2)
    with torch.no_grad():
        compiled = torch.compile(model.forward, fullgraph=True)(INPUT_IDS.to(device)).logits.float()
    model.save_pretrained(os.path.join(save_root, "gathered"))
    return {"kept": gap(logits["int4"], logits[False]), "compiled": gap(compiled, logits["int4"]),
            "kinds": sorted({type(m.kernel).__name__ for m in model.modules() if hasattr(m, "kept_weight")}),
            "kernel": int4_torch.runs_on(device, torch.bfloat16),
            "capability": list(torch.cuda.get_device_capability(device))}  # fmt: skip


def fp8_products(rank: int, world_size: int, path: str, save_root: str) -> dict:
    """FP8 kept in 128 x 128 blocks at TP=2 in bfloat16: which modules multiply in FP8 on this card, each
    one's product against the same W8A8 product in float32 (its activations quantized as it quantizes them,
    its weight dequantized), the logits against ``keep_quantized=True``'s (dequantized), compiled (fullgraph)
    against eager, and the kept weights saved back."""
    from hf_parallel.quant import kept_linear
    from hf_parallel.quant.kernels import fp8_scaled_mm

    out = {}
    logits, model, device = _kept_logits(path, (True, "fp8"), torch.bfloat16, tp_size=2)
    recipe = fp8_scaled_mm.supports_block_fp8(device)
    out["supported"] = None if recipe is None else recipe._asdict()
    out["cuda"], out["capability"] = torch.version.cuda, list(torch.cuda.get_device_capability(device))
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, kept_linear.KeptLinear) and isinstance(m.kernel, fp8_scaled_mm.FP8ScaledMMKernel)}
    out["fp8"] = sorted(linears)
    out["products"] = {}
    generator = torch.Generator(device=device).manual_seed(rank)
    for name, module in linears.items():
        x = torch.randn(5, module.kernel.fp8.shape[1], device=device, generator=generator, dtype=torch.bfloat16)
        activations = fp8_scaled_mm.act_dequant(*fp8_scaled_mm.act_quant(x))
        with torch.no_grad():
            weight = module.kept_weight.whole.dequantize(torch.float32)  # exact: FP8 codes times float32 scales
            out["products"][name] = gap(module.product(x).float(), activations @ weight.T)
    out["logits"] = gap(logits["fp8"], logits[True])
    compiled = torch.compile(model.forward, fullgraph=True)
    with torch.no_grad():
        out["compiled"] = gap(compiled(INPUT_IDS.to(device)).logits.float(), logits["fp8"])
    model.save_pretrained(os.path.join(save_root, "gathered"))
    return out


def verified(rank: int, world_size: int, path: str, sizes: dict) -> dict:
    """``hf-parallel verify`` on the GPU ranks: rank 0's report."""
    from hf_parallel.commands.verify import verify

    report = verify(path, **sizes)
    return {"ok": report is None or report.first_divergence is None, "report": str(report)}


def decode_syncs(rank: int, world_size: int, path: str, kwargs: dict) -> dict:
    """Where each host synchronisation of one decode step comes from, by CUDA's sync debug mode (warning,
    recorded with the Python line that asked), for hf_parallel's model and for plain transformers' in one
    process on the same card taking the same step. TP: a token on a warm cache; SP keeps no cache, so its step
    is the whole sequence again. The step runs once unwatched (first-call allocations); the control, an
    ``.item()`` under the same recorder, shows the recorder sees a synchronisation when there is one."""
    import transformers

    import hf_parallel

    model = hf_parallel.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
    state = hf_parallel.parallel_state(model)
    device, cached = state.mesh.device, state.sequence is None
    single = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    out = {"wire": str(state.mesh.wire)}
    for name, which in (("syncs", model), ("one_process", single)):
        control, out[name] = _syncs_of(_decode_step(which, INPUT_IDS[:1].to(device), cached), device)
        out["control"] = out.get("control", []) + control
    return out


def _decode_step(model, ids, cached: bool):
    """One decode step of ``model`` after ``ids``' prefill (with the cache, or the whole sequence again)."""
    with torch.no_grad():
        first = model(ids, use_cache=cached)
    token = first.logits[:, -1:].argmax(-1)
    if cached:
        return lambda: model(token, past_key_values=first.past_key_values, use_cache=True)
    return lambda: model(torch.cat([ids, token], 1), use_cache=False)


def _syncs_of(step, device) -> tuple[list[str], list[str]]:
    """(where the control ``.item()`` synchronised, where ``step`` did), each as ``file:line``."""
    import warnings

    with torch.no_grad():
        step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                torch.ones(1, device=device).item()
                control = len(caught)
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
    located = [f"{w.filename}:{w.lineno}" for w in caught]
    return located[:control], located[control:]
