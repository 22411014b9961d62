"""``hf-parallel verify``: is this checkpoint served right in parallel? Proved on the user's own model.

Rank 0 runs one probe batch (two rows of different lengths, left-padded) through transformers in
one process and keeps every layer's output; then every rank loads the checkpoint in parallel and
runs the same batch. Per layer (the embeddings, each repeated layer, the logits) the largest
difference at real tokens is compared with a tolerance picked from the dtype, relative to that
output's largest value; the first layer beyond it is named. A parallel forward that fails is
reported at the layer it failed in.

transformers reads GPTQ and AWQ only through GPU kernels (gptqmodel); for them the one-process model is
transformers' own, on the weights dequantized whole by hf_parallel's reader (each matrix in one box, the
format's definition, checked against the tests' packer, GPTQModel's packing, in tests/test_quantized.py), so
what verify proves is the split, as for any other checkpoint.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass

import torch
import transformers

from ..build import resolve_dtype

# relative to each output's largest value: reduction order alone moves fp32 by ~1e-6 and bf16 by
# a few of its 2**-8 steps over a model's depth
TOLERANCES = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
PROBE_LENGTHS = (11, 6)


@dataclass
class Row:
    name: str
    diff: float  # max |parallel - single| at real tokens
    scale: float  # max |single|
    error: str | None = None  # the parallel forward failed here

    @property
    def relative(self) -> float:
        return math.inf if self.error else self.diff / max(self.scale, 1e-12)


@dataclass
class Report:
    rows: list[Row]
    tolerance: float
    header: str

    @property
    def first_divergence(self) -> Row | None:
        return next((row for row in self.rows if not row.relative <= self.tolerance), None)

    def __str__(self) -> str:
        lines = [self.header, f"{'output':<40} {'max |diff|':>12} {'max |ref|':>12} {'relative':>10}"]
        for row in self.rows:
            if row.error:
                lines.append(f"{row.name:<40} the parallel forward failed here: {row.error}")
                continue
            mark = "ok" if row.relative <= self.tolerance else "DIVERGES"
            lines.append(f"{row.name:<40} {row.diff:>12.3e} {row.scale:>12.3e} {row.relative:>10.2e}  {mark}")
        bad = self.first_divergence
        lines.append(
            f"PASS: every output within {self.tolerance:g} of one process"
            if bad is None
            else f"FAIL: first diverging: {bad.name} ({'failed' if bad.error else f'relative {bad.relative:.2e} > {self.tolerance:g}'})"
        )
        return "\n".join(lines)


def probe_batch(config) -> dict[str, torch.Tensor]:
    """Two seeded rows of token ids, left-padded to one length (ids past the special tokens)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 64
    lengths = [min(n, limit) for n in PROBE_LENGTHS]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(min(3, text.vocab_size - 1), text.vocab_size, (len(lengths), max(lengths)), generator=generator)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        mask[row, max(lengths) - length :] = 1
    pad = getattr(text, "pad_token_id", None)
    ids = ids.masked_fill(mask == 0, pad if isinstance(pad, int) and 0 <= pad < text.vocab_size else 0)
    return {"input_ids": ids, "attention_mask": mask}


def _first_tensor(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else next(o for o in output if isinstance(o, torch.Tensor))


def outputs_by_layer(model, batch, state=None) -> tuple[dict[str, torch.Tensor], str | None]:
    """The embeddings', every repeated layer's and the logits' outputs (fp32 copies), in forward
    order, and the error if the forward failed. ``state``: the model's parallel state (under
    pipeline stages, a stage's own layers are watched, and its embeddings on the first)."""
    from ..core.layers import repeated_layers

    names = {module: path for path, module in model.named_modules()}
    embedding = names[model.get_input_embeddings()]
    if state is not None and state.stage is not None:
        stage = state.stage
        watched = [f"{stage.split.layer_list}.{i}" for i in stage.layers()]
        if embedding not in stage.cut.held_elsewhere | stage.cut.kept_for_tied_weights:
            watched.insert(0, embedding)
    else:
        watched = [embedding, *repeated_layers(model)]
    outputs, handles = {}, []
    for path in watched:
        handles.append(
            model.get_submodule(path).register_forward_hook(
                lambda m, args, out, path=path: outputs.__setitem__(path, _first_tensor(out).detach().float().clone())
            )
        )
    try:
        with torch.no_grad():
            outputs["logits"] = model(**batch).logits.detach().float()
        return outputs, None
    except Exception as error:  # any failure of the parallel forward is the finding
        return outputs, f"{type(error).__name__}: {error}"
    finally:
        for handle in handles:
            handle.remove()


def compare(reference: dict, parallel: dict, mask: torch.Tensor, error: str | None = None) -> list[Row]:
    """Rows in forward order, up to the first output the parallel run did not produce: the layer
    its forward failed in (hooks record an output only once a layer completes)."""
    rows = []
    for name, want in reference.items():
        got = parallel.get(name)
        if got is None or got.shape != want.shape:
            shape = None if got is None else f"shape {tuple(got.shape)}, one process gives {tuple(want.shape)}"
            rows.append(Row(name, math.inf, 0.0, shape or error or "no output"))
            break
        real = mask.bool().reshape(*mask.shape, *([1] * (want.dim() - mask.dim())))
        diff = (got - want).abs().masked_fill(~real, 0).max().item()
        rows.append(Row(name, diff, want.abs().masked_fill(~real, 0).max().item()))
    return rows


def whole_sequences(outputs: dict, tokens: int, split) -> dict:
    """Under sequence (and context) parallelism each layer's output holds this rank's tokens: gathered
    over the group (every rank, same order) and put back in the sequence's order, so every token of
    every layer is compared."""
    from ..sequence.shard import whole_tokens

    sequence = split.call(tokens, keep_split=False)
    whole = {}
    for name, out in outputs.items():
        if out.dim() >= 2 and out.shape[1] == sequence.sizes[split.rank] != tokens:
            out = whole_tokens(out.contiguous(), 1, sequence)
        whole[name] = out
    return whole


def every_stage(outputs: dict, mesh) -> dict:
    """Under pipeline parallelism each stage recorded its own layers: all of them on rank 0, in
    forward order (each stage's first rank speaks for it)."""
    merged = {}
    for theirs in mesh.per_stage(outputs, "collecting every stage's layer outputs"):
        merged.update({name: out for name, out in theirs.items() if name != "logits"})
    merged["logits"] = outputs["logits"] if "logits" in outputs else None
    return {name: out for name, out in merged.items() if out is not None}


def single_process_model(path: str, dtype: torch.dtype, memory: int | None, offload_dir: str):
    """transformers' model in one process; with a ``memory`` budget (bytes) what does not fit is
    offloaded to ``offload_dir`` and streamed in layer by layer during the forward (accelerate)."""
    if memory is None:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, device_map="auto", max_memory={"cpu": memory}, offload_folder=offload_dir
    )


DEQUANTIZED_REFERENCE = ("gptq", "awq")  # quant_methods transformers reads only through GPU kernels


SHARD_BYTES = 1 << 30  # the dequantized copy is written a shard at a time: memory holds one shard's floats


def dequantized_copy(path: str, out_dir: str) -> str:
    """``path`` with its quantized weights dequantized whole (float32) into ``out_dir``, its config without
    ``quantization_config``, written in shards of ``SHARD_BYTES`` (an index beside them): the one-process
    reference for a format transformers cannot read here."""
    import json
    from contextlib import ExitStack

    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..checkpoint.loading import checkpoint_files
    from ..quant.formats import read_quantization, readable, stored_in_parts, with_stored_keys

    config = transformers.AutoConfig.from_pretrained(path)
    quantization = read_quantization(config)
    files = with_stored_keys(checkpoint_files(path), quantization)
    os.makedirs(out_dir, exist_ok=True)
    shard, weight_map, parts, shards = {}, {}, set(), []

    def flush():
        shards.append(f"model-{len(shards) + 1:05d}.safetensors")
        save_file(shard, os.path.join(out_dir, shards[-1]), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, shards[-1]))
        shard.clear()

    with ExitStack() as stack:
        handles = {}

        def handle(file):
            return handles.get(file) or handles.setdefault(file, stack.enter_context(safe_open(file, "pt")))

        held = 0  # bytes in the shard being filled
        for key in files:
            if stored_in_parts(key, files, quantization):
                weight = readable(handle, files, key, quantization)
                shard[key], parts = weight[:].contiguous(), parts | set(weight.parts)
                held += shard[key].nbytes
            if held >= SHARD_BYTES:
                flush()
                held = 0
        for key in sorted(set(files) - parts - set(weight_map) - set(shard)):
            shard[key] = handle(files[key]).get_tensor(key)
        flush()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config.save_pretrained(out_dir)
    return out_dir


def default_reference_memory(path: str) -> int | None:
    """Stream the reference from disk when its weights would take more than half the memory free now."""
    from ..distributed.devices import free_bytes

    weights = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    available = free_bytes(torch.device("cpu"))
    if available is None:
        return None
    return available // 2 if weights > available // 2 else None


def _reference_outputs(path: str, dtype, batch: dict, reference_memory: int | None, dequantized: bool):
    """The one-process model's outputs by layer (rank 0's), the model freed before the parallel one
    loads; and the memory it was bounded by (None: held whole)."""
    with tempfile.TemporaryDirectory(prefix="hf_parallel-verify-") as offload_dir:
        source = path
        if dequantized:
            source = dequantized_copy(path, os.path.join(offload_dir, "dequantized"))
        if reference_memory is None:  # sized by the weights the reference holds (a dequantized copy's floats)
            reference_memory = default_reference_memory(source)
        single = single_process_model(source, dtype, reference_memory, offload_dir)
        reference, _ = outputs_by_layer(single, batch)
        del single
    return reference, reference_memory


def _parallel_outputs(model, state, batch: dict, mesh):
    """The parallel model's outputs by layer as the reference's are: whole sequences, on the host,
    every stage's on rank 0; and the error a layer raised (None: none)."""
    on_device = {name: tensor.to(mesh.device) for name, tensor in batch.items()}  # the reference ran on the host
    parallel, error = outputs_by_layer(model, on_device, state)
    if mesh.sp.size > 1 and error is None:
        parallel = whole_sequences(parallel, batch["input_ids"].shape[1], state.runtime.sequence)
    parallel = {name: out.cpu() for name, out in parallel.items()}  # compared (and gathered as objects) on the host
    if mesh.num_stages > 1:
        parallel = every_stage(parallel, mesh)
    return parallel, error


def verify(
    path: str,
    tp_plan="auto",
    dtype=torch.float32,
    tolerance: float | None = None,
    tp_size=None,
    sp_size: int = 1,
    reference_memory: int | None = None,
    cp_size: int = 1,
    **stages,
) -> Report | None:
    """Run under torchrun (every rank); rank 0 returns the report, the others None. Under sequence
    parallelism each layer's split output is gathered first, so every token is compared.
    ``reference_memory`` (bytes; default: half the free memory, if the weights need more) bounds the
    one-process reference, which then streams its layers from disk. ``stages``: ``pp_size``,
    ``stage_tp_sizes``, ``stage_layers`` as ``from_pretrained`` takes them: each stage's layers
    are collected on rank 0."""
    from ..api import AutoModelForCausalLM
    from ..quant.formats import quant_method
    from ..distributed.mesh import get_mesh
    from ..state import parallel_state

    config = transformers.AutoConfig.from_pretrained(path)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"{path}: {type(config).__name__} is an encoder-decoder, and verify compares a causal LM's layers with one "
            "process's (tests/test_encoder_decoders.py compares T5, BART and Whisper)"
        )
    dtype = resolve_dtype(dtype, config)
    tolerance = TOLERANCES.get(dtype, 1e-2) if tolerance is None else tolerance
    vtp = stages.get("stage_tp_sizes") is not None
    mesh = get_mesh(
        None if vtp else tp_size, sp_size=sp_size, pp_size=stages.get("pp_size", 1),
        stage_tp_sizes=stages.get("stage_tp_sizes"), cp_size=cp_size,
    )  # fmt: skip
    batch = probe_batch(config)
    method = quant_method(config)
    dequantized = method in DEQUANTIZED_REFERENCE  # one process reads its weights dequantized whole
    reference = None
    if mesh.is_main:  # the single-process model is freed before the parallel one loads
        reference, reference_memory = _reference_outputs(path, dtype, batch, reference_memory, dequantized)
    mesh.barrier()
    if mesh.num_stages > 1:  # the layer hooks record one forward of the whole probe batch
        stages.setdefault("micro_batches", 1)
    model = AutoModelForCausalLM.from_pretrained(
        path, tp_plan=tp_plan, dtype=dtype, tp_size=None if vtp else mesh.tp.size, sp_size=sp_size,
        cp_size=cp_size, **stages,
    )  # fmt: skip
    state = parallel_state(model)
    parallel, error = _parallel_outputs(model, state, batch, mesh)
    mesh.barrier()
    if not mesh.is_main:
        return None
    header = _header(path, mesh, dtype, state, batch, tolerance, reference_memory, method if dequantized else None)
    return Report(compare(reference, parallel, batch["attention_mask"], error), tolerance, header)


def _header(path, mesh, dtype, state, batch, tolerance, reference_memory, dequantized_method) -> str:
    """The report's first line: what was compared, on which probe, within what tolerance, and how the
    one-process reference held its weights."""
    return (
        f"verify {path} at {mesh.shape} ({str(dtype).removeprefix('torch.')}, plan: {state.layout.source}); "
        f"probe: {len(PROBE_LENGTHS)} rows of {' and '.join(map(str, batch['attention_mask'].sum(1).tolist()))} "
        f"tokens, left-padded; tolerance {tolerance:g} of each output's largest value"
        + (f"; one process streamed from disk within {reference_memory / 2**20:.0f} MiB" if reference_memory else "")
        + (f"; one process on the {dequantized_method} weights dequantized whole (transformers reads them only "
           "through GPU kernels)" if dequantized_method else "")
    )  # fmt: skip
