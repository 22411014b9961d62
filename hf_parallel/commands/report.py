"""The plan dry run: what every parameter becomes on every rank, with no process and no weight read."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import transformers

from ..build import build_empty, build_rank_model, check_mixers_under_fsdp, resolve_dtype
from ..distributed.mesh import Mesh
from ..distributed.shape import MeshShape
from ..memory import Savings, footprint, step_memory
from ..pipeline.stage import tied_across_stages
from ..sequence.tokens import token_layout
from ..sequence.ulysses import head_spread
from ..tensor.attention import outermost
from ..tensor.geometry import attention_geometry
from .quantized_plan import quantized_lines


def default_auto_class(config):
    """The class the dry run builds: an encoder-decoder's generating class (text, else speech), else the causal LM."""
    if getattr(config, "is_encoder_decoder", False):
        for auto in (transformers.AutoModelForSeq2SeqLM, transformers.AutoModelForSpeechSeq2Seq):
            if type(config) in auto._model_mapping:
                return auto
    return transformers.AutoModelForCausalLM


@dataclass
class ParamRow:
    """One parameter of the dry run, as every rank holds it."""

    name: str  # with the names it is tied to
    rule: str  # "pattern [source]", or "-"
    style: str
    layout: str
    full_shape: tuple[int, ...]
    shapes: list[tuple[int, ...]]  # per rank
    nbytes: list[int]  # per rank

    @property
    def replicated(self) -> bool:
        return all(shape == self.full_shape for shape in self.shapes)

    def line(self) -> str:
        shown = " ".join("x".join(map(str, s)) for s in self.shapes)
        return f"{self.name:<48} {self.rule:<34} {self.style:<24} {self.layout:<36} {shown} / {self.nbytes}"


@dataclass
class PlanFacts:
    """What the dry run found, once: the text report and the HTML page (``plan_html.py``) both render it."""

    path: str
    model_type: str
    tp: int
    source: str  # where the rules came from
    shape: MeshShape
    mesh: list[str]  # the mesh's lines (data-parallel sizes, groups spanning nodes)
    heads: str | None
    rows: list[ParamRow]
    details: list[str]  # discovery's notes, quantized bytes, adapters, the sequence split
    totals: list[int]  # bytes per rank
    full_bytes: int
    at_rest: list[int] | None  # bytes per rank at rest under FSDP2
    fsdp: int  # ranks each TP shard is split over at rest
    memory: list[str] = field(default_factory=list)  # the formulas of memory.py for the rank holding the most

    def lines(self) -> list[str]:
        out = [*self.mesh, f"plan for {self.path} ({self.model_type}) at tp={self.tp}: rules from {self.source}"]
        if self.heads:
            out.append(self.heads)
        out.append(f"{'parameter':<48} {'rule':<34} {'style':<24} {'layout':<36} local shape per rank / bytes per rank")
        out += [row.line() for row in self.rows]
        out += self.details
        out.append(f"bytes per rank: {self.totals} (full model {self.full_bytes})")
        if self.at_rest is not None:
            every = " (rank 0's EP group: each EP rank holds its own experts)" if len(self.at_rest) > self.tp else ""
            out.append(
                f"at rest under FSDP2 (each TP shard split over fsdp x cp x sp = {self.fsdp} ranks): about "
                f"{self.at_rest} bytes per rank{every}, the same again for gradients, twice for AdamW"
            )
        return out + self.memory


def plan_report(
    path: str,
    tp: int,
    tp_plan="auto",
    dtype=None,
    auto_class=None,
    sp: int = 1,
    seq=None,
    cp: int = 1,
    pp_size: int = 1,
    stage_tp_sizes=None,
    stage_layers=None,
    fsdp_size: int = 1,
    dp_replicate_size: int = 1,
    nproc_per_node: int | None = None,
    lora: dict | None = None,
    batch: int = 1,
    ep_size: int = 1,
    ep_plan=None,
    savings: Savings = Savings(),
) -> str:
    """The dry run's text: every parameter's rule, layout, local shape and bytes per rank, then the
    heads, the sequence split, the data-parallel sizes and the adapters asked for, and the memory per
    rank by ``memory.py``'s formulas, a training step's at ``batch`` rows x ``seq`` tokens (2048 unless
    given) (``plan_facts``); under pipeline stages, each stage's ranks, layers and bytes."""
    if stage_tp_sizes is None and pp_size == 1:
        facts = plan_facts(path, tp, tp_plan=tp_plan, dtype=dtype, auto_class=auto_class, sp=sp, seq=seq, cp=cp,
                           fsdp_size=fsdp_size, dp_replicate_size=dp_replicate_size, nproc_per_node=nproc_per_node,
                           lora=lora, batch=batch, ep_size=ep_size, ep_plan=ep_plan, savings=savings)  # fmt: skip
        return "\n".join(facts.lines())
    if ep_plan is not None:
        raise ValueError("hf-parallel plan: --ep-plan with pipeline stages is not drawn (each stage's report "
                         "shows its layers under --tp-plan); drop --pp/--stage-tp or --ep-plan")
    config = transformers.AutoConfig.from_pretrained(path)
    shape = MeshShape.requested(
        tp_size=None if stage_tp_sizes else tp, sp_size=sp, pp_size=pp_size, stage_tp_sizes=stage_tp_sizes,
        fsdp_size=fsdp_size, dp_replicate_size=dp_replicate_size, cp_size=cp, ep_size=ep_size,
    )  # fmt: skip
    report = pipeline_report(path, config, resolve_dtype(dtype, config), auto_class or default_auto_class(config),
                             tp_plan, shape, stage_layers)  # fmt: skip
    return "\n".join([*mesh_lines(shape, nproc_per_node), report])


def plan_facts(
    path: str,
    tp: int,
    tp_plan="auto",
    dtype=None,
    auto_class=None,
    sp: int = 1,
    seq=None,
    cp: int = 1,
    fsdp_size: int = 1,
    dp_replicate_size: int = 1,
    nproc_per_node: int | None = None,
    lora: dict | None = None,
    batch: int = 1,
    ep_size: int = 1,
    ep_plan=None,
    savings: Savings = Savings(),
) -> PlanFacts:
    """The dry run of one model replica without pipeline stages, as facts. ``ep_size``: the rows show every rank
    of rank 0's EP group (each holds its own experts; every other EP group the same), and a line says how the
    experts spread."""
    config = transformers.AutoConfig.from_pretrained(path)
    auto_class = auto_class or default_auto_class(config)
    dtype = resolve_dtype(dtype, config)
    data = dict(fsdp_size=fsdp_size, dp_replicate_size=dp_replicate_size, ep_size=ep_size) if ep_size > 1 else {}
    shape = MeshShape.requested(tp_size=tp, sp_size=sp, fsdp_size=fsdp_size, dp_replicate_size=dp_replicate_size,
                                cp_size=cp, ep_size=ep_size)  # fmt: skip
    mesh = Mesh.dry_run(tp_size=tp, sp_size=sp, cp_size=cp, **data)
    built = build_rank_model(auto_class, config, dtype, mesh, tp_plan=tp_plan, ep_plan=ep_plan)
    model, shard = built.model, built.layout
    check_mixers_under_fsdp(model, tp, shape.dp_shard)  # the dry run's mesh has no data-parallel sizes
    itemsize = torch.empty((), dtype=dtype).element_size()
    heads = None
    if shard.heads is not None:
        h = shard.heads
        heads = (f"heads: q per rank {[h.local_q(r) for r in range(tp)]}, kv per rank "
                 f"{[h.local_kv(r) for r in range(tp)]}, head_dim {h.head_dim}")  # fmt: skip
    sizes = dict(tp_size=tp, sp_size=sp, cp_size=cp, fsdp_size=fsdp_size, dp_replicate_size=dp_replicate_size,
                 ep_size=ep_size)  # fmt: skip
    # the TP ranks of one replica (every other replica holds the same), or under ep_size the ranks of rank 0's EP
    # group: each holds its own experts, and every other EP group holds the same ones
    ranks = Mesh.dry_run(0, **sizes).ep.ranks if ep_size > 1 else range(tp)
    views = [Mesh.dry_run(rank, **sizes) for rank in ranks]
    rows = []
    for entry in shard.unique_params():
        rule = entry.rule
        shapes = [tuple(entry.layout.local_shape(entry.full_shape, view[entry.layout.over].rank if ep_size > 1
                                                 else view.rank)) for view in views]  # fmt: skip
        rows.append(ParamRow(
            entry.name + (f" (= {', '.join(entry.aliases[1:])})" if len(entry.aliases) > 1 else ""),
            f"{rule.pattern} [{rule.source}]" if rule else "-", rule.style_name if rule else "replicated",
            entry.layout.describe(), tuple(entry.full_shape), shapes, [math.prod(s) * itemsize for s in shapes],
        ))  # fmt: skip
    details = [f"left replicated by discovery: {note}" for note in shard.plan.notes]
    if built.quantization is not None:
        details += quantized_lines(path, model, shard, tp, built.quantization, dtype)
    adapters = None
    if lora is not None:
        lines, adapters = lora_lines(model, shard, tp, lora, dtype)
        details += lines
    if sp * cp > 1:
        details += sequence_lines(model, shard, tp, sp, seq, cp)
    if ep_size > 1:
        details += expert_lines(shard, shape, itemsize)
    totals = [sum(row.nbytes[r] for row in rows) for r in range(len(views))]
    full_bytes = sum(math.prod(e.full_shape) for e in shard.unique_params()) * itemsize
    fsdp = shape.dp_shard * shape.sp
    at_rest = [math.ceil(t / fsdp) for t in totals] if shape.dp > 1 else None
    if ep_size > 1:  # the experts are split over the ranks holding the same ones, not over FSDP's group
        at_rest = [footprint(shard, dtype, view).share for view in views]
    memory = memory_lines(model, shard, dtype, views, batch, seq or TRAINING_SEQ, savings, adapters)
    return PlanFacts(path, config.model_type, tp, shard.plan.source, shape, mesh_lines(shape, nproc_per_node),
                     heads, rows, details, totals, full_bytes, at_rest, fsdp, memory)  # fmt: skip


TRAINING_SEQ = 2048  # tokens per row of the training step the plan's memory line assumes, unless --seq is given


def memory_lines(model, shard, dtype, meshes: list, batch: int, seq: int, savings: Savings = Savings(),
                 adapters: list[int] | None = None) -> list[str]:
    """``memory.py``'s formulas for the rank of ``meshes`` (their views) that needs the most (FSDP's first rank
    holds the most rows): its weights, the load's peak, and a training step's at ``batch`` x ``seq`` tokens with
    ``savings``; ``adapters`` (LoRA's bytes per TP rank): only they train, sharded as the rest under FSDP.
    The layout was built on a mesh without the data-parallel sizes; each rank's view here has them."""

    def trainable(mesh) -> int | None:
        return None if adapters is None else -(-adapters[mesh.tp.rank] // (mesh.shape.dp_shard * mesh.shape.sp))

    try:
        figures = [(footprint(shard, dtype, m), step_memory(model, shard, dtype, batch, seq, m, savings, trainable(m)))
                   for m in meshes]  # fmt: skip
    except ValueError as error:  # no list of layers for FSDP to gather one by one (the load refuses it too)
        return [f"memory per rank (formula): not estimated under FSDP: {error}"]
    rank, (load, step) = max(enumerate(figures), key=lambda item: item[1][1].total)
    gathered = f" + one gathered unit {_mib(step.gathered)} ({step.gathered_unit})" if step.gathered_unit else ""
    pairs = ""
    if step.expert_pairs:  # under ep_size
        pairs = f", up to {step.expert_pairs:,} (token, expert) pairs arriving per experts layer"
    return [
        f"memory per rank (formula{f', rank {rank}, the largest' if len(meshes) > 1 else ''}): weights "
        f"{_mib(load.share)} MiB, load peak {_mib(load.load_peak)} MiB (share + largest TP slice "
        f"{_mib(load.largest_slice)} MiB), training step ~ {_mib(step.total)} MiB (params {_mib(step.params)} + "
        f"grads {_mib(step.grads)} + AdamW {_mib(step.optimizer)}{gathered} + activations {_mib(step.activations)} "
        f"at batch {step.batch} x seq {step.seq}{savings.describe()}{pairs}"
        f"{'; LoRA: only the adapters have gradients and AdamW states' if adapters else ''}; hf_parallel/memory.py)"
    ]


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.2f}"


def parse_lora(text: str) -> dict:
    """``r=8,target=q_proj,v_proj`` (``hf-parallel plan --lora``): the rank and the target module names."""
    spec: dict[str, list[str]] = {}
    key = None
    for token in filter(None, text.split(",")):
        if "=" in token:
            key, token = token.split("=", 1)
            spec[key] = []
        if key is None:
            raise ValueError(f"--lora {text!r}: expected r=N,target=name[,name...]")
        spec[key].append(token)
    if set(spec) != {"r", "target"} or len(spec["r"]) != 1 or not spec["r"][0].isdigit():
        raise ValueError(f"--lora {text!r}: expected r=N,target=name[,name...] (e.g. r=8,target=q_proj,v_proj)")
    return {"r": int(spec["r"][0]), "target": spec["target"]}


def lora_lines(model, shard, tp: int, lora: dict, dtype) -> tuple[list[str], list[int]]:
    """Each targeted module's adapter pair (peft's name matching: the module's name or its last
    parts): how A and B split, following the module, and their bytes per rank; and those bytes per TP rank."""
    from ..adapters.placement import adapter_layout, site_for
    from ..tensor.splits import in_dim, out_dim

    r, targets = lora["r"], lora["target"]
    # peft keeps 16-bit models' adapters in fp32 (autocast_adapter_dtype)
    itemsize = 4 if dtype in (torch.float16, torch.bfloat16) else torch.empty((), dtype=dtype).element_size()
    lines = [f"LoRA r={r} on {', '.join(targets)} ({itemsize}-byte adapter weights; each pair follows its module):"]
    totals, count = [0] * tp, 0
    for path, module in model.named_modules():
        if not any(path == t or path.endswith(f".{t}") for t in targets) or f"{path}.weight" not in shard.params:
            continue
        site = site_for(shard, path, module)
        full = shard.params[f"{path}.weight"].full_shape
        if isinstance(module, torch.nn.Embedding):  # [vocab, dim]: an adapter maps ids to the hidden dim
            in_features, out_features = full
        else:
            in_features, out_features = full[in_dim(module)], full[out_dim(module)]
        pairs = {
            "A": ((r, in_features), adapter_layout(site, "in", 2, tp)),
            "B": ((out_features, r), adapter_layout(site, "out", 2, tp)),
        }
        nbytes = [
            sum(math.prod(layout.local_shape(shape, rank)) for shape, layout in pairs.values()) * itemsize
            for rank in range(tp)
        ]
        totals, count = [t + n for t, n in zip(totals, nbytes)], count + 1
        described = "  ".join(
            f"{name} {'x'.join(map(str, shape))} {layout.describe()}"
            + (" (gradient summed over TP)" if layout.is_replicated and site.split.sum_whole and tp > 1 else "")
            for name, (shape, layout) in pairs.items()
        )
        style = site.rule.style_name if site.rule is not None else "replicated"
        lines.append(f"  {path:<46} {style:<24} {described} / {nbytes}")
    if not count:
        raise ValueError(f"--lora: no module of the model is named {', '.join(targets)} (peft would refuse it too)")
    lines.append(f"  {count} adapter pairs, bytes per rank {totals}; AdamW adds twice that, gradients once")
    return lines, totals


def expert_lines(shard, shape: MeshShape, itemsize: int) -> list[str]:
    """Under ``ep_size``: the EP groups, how many experts each EP rank holds and their bytes there (before FSDP
    shards them over the ranks holding the same ones), and how tokens reach them."""
    paths = shard.exchanging_experts()
    if not paths:
        return []
    held = shard.layouts[paths[0]]
    layout = next(iter(held.values()))
    per_rank = [layout.local_size(r) for r in range(layout.world_size)]
    nbytes = [sum(math.prod(lay.local_shape(shard.params[f"{paths[0]}.{attr}"].full_shape, r)) * itemsize
                  for attr, lay in held.items()) for r in range(layout.world_size)]  # fmt: skip
    groups = shape.groups("ep")
    return [
        f"experts (ep_size={shape.ep} = tp {shape.stage_tp_sizes[0]} x {shape.ep_data} data-parallel ranks; EP "
        f"groups {[list(g) for g in groups[:4]]}{' ...' if len(groups) > 4 else ''}): {len(paths)} experts "
        f"modules, each {layout.ranges[-1][0][1]} experts held {per_rank} per EP rank ({nbytes} bytes per EP rank "
        f"and module), FSDP-sharded over the {shape.world_size // shape.ep} rank(s) holding the same ones; each "
        "rank routes its own tokens, sent to their experts' ranks and back by all-to-all"
    ]


def mesh_lines(shape: MeshShape, nproc_per_node: int | None) -> list[str]:
    """The mesh in one line and, given the ranks per node, every TP or SP group that would span
    nodes (their collectives run in every layer: they belong on a node's fast links). Nothing for a
    mesh without data-parallel replicas when no node size is given (the report's own lines say it)."""
    if shape.dp == 1 and not nproc_per_node:
        return []
    lines = [
        f"mesh: {shape} = {shape.world_size} ranks; one model replica = {shape.replica_size} ranks, "
        f"{shape.dp} data-parallel replica(s), each with its own batch"
    ]
    if nproc_per_node:
        for dim in ("tp", "sp"):
            for ranks in shape.groups(dim):
                nodes = sorted({rank // nproc_per_node for rank in ranks})
                if len(nodes) > 1:
                    lines.append(
                        f"warning: {dim} group {list(ranks)} spans nodes {nodes} ({nproc_per_node} ranks per node): "
                        f"its collectives run in every layer; shrink {dim} to fit a node and give the rest to "
                        "fsdp_size / dp_replicate_size"
                    )
                    break
        if len(lines) == 1:
            lines.append(f"every tp and sp group stays inside a node of {nproc_per_node} ranks")
    return lines


def pipeline_report(path: str, config, dtype, auto_class, tp_plan, shape: MeshShape, stage_layers) -> str:
    """Per stage: its ranks, layers and modules, each rank's bytes; and what one token costs to
    send between stages (its hidden state, forward, and its gradient back in training)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    stage_tp_sizes = list(shape.stage_tp_sizes)
    stages = len(stage_tp_sizes)
    lines = [f"pipeline plan for {path} ({config.model_type}): {stages} stages, TP per stage {stage_tp_sizes}"]
    full = sum(p.numel() for p in build_empty(auto_class, config, dtype).parameters()) * itemsize
    for stage, tp in enumerate(stage_tp_sizes):
        ranks = shape.stage_ranks(stage)
        mesh = Mesh.dry_run(ranks[0], stage_tp_sizes=stage_tp_sizes)
        built = build_rank_model(auto_class, config, dtype, mesh, tp_plan=tp_plan, stage_layers=stage_layers)
        model, shard, split = built.model, built.layout, built.split
        totals = [
            sum(math.prod(e.layout.local_shape(e.full_shape, r)) for e in shard.unique_params()) * itemsize
            for r in range(tp)
        ]
        layers = split.layers_of(stage)
        extra = [p for p in split.owned(stage) if not p.startswith(split.layer_list + ".")]
        tied = tied_across_stages(model, shard, built.cut)
        lines.append(
            f"stage {stage}: ranks {list(ranks)} (tp={tp}), "
            f"layers {layers.start}-{layers.stop - 1} ({len(layers)})"
            + (f" + {', '.join(extra)}" if extra else "")
            + (f" + tied {', '.join(tied)}" if tied else "")
            + f"; bytes per rank {totals}"
        )
    hidden = getattr(config.get_text_config(), "hidden_size", None)
    if hidden is not None:
        lines.append(
            f"sent between stages per token: {hidden * itemsize} bytes of hidden state (hidden {hidden} x {itemsize}), "
            "from a stage's first rank to the next's, broadcast over its TP group; the same back as gradient in "
            "training. Positions, masks and rotary tables are computed by every stage from the batch it is given"
        )
    lines.append(f"full model {full} bytes")
    return "\n".join(lines)


def sequence_lines(model, shard, tp: int, sp: int, seq, cp: int = 1) -> list[str]:
    """Per rank of tp x sp (x cp): the query / key-value heads it computes before the all-to-all (what
    TP left it) and after (its share of those over SP), its place in the ring, and the tokens it holds
    of ``seq``."""
    path, module = outermost(model)[0]
    geometry, _ = attention_geometry(module, model.config, path)
    lines = [f"sequence parallel over sp={sp} (ranks of one TP group adjacent, TP groups inside SP groups):"]
    if cp > 1:
        lines[0] = (
            f"context parallel over cp={cp} x sp={sp}: Ulysses inside groups of {sp} adjacent SP rank(s), a ring of "
            f"{cp} such groups passing key/value blocks; the sequence cut into {2 * cp} chunks, group g holding "
            f"chunks g and {2 * cp - 1} - g (zigzag):"
        )
    layout = token_layout(seq, sp, cp) if seq is not None else None
    for rank in range(tp * sp * cp):
        index, t = divmod(rank, tp)
        g, s = divmod(index, sp)
        heads = shard.heads
        q, kv = (heads.local_q(t), heads.local_kv(t)) if heads else (geometry.num_heads, geometry.num_kv_heads)
        spread = head_spread(q, kv, sp)
        kv_note = "whole groups" if spread.kv_repeat is None else "one per query head"
        where = f"tp {t}, sp {s}" + (f", cp {g}" if cp > 1 else "")
        after = f"{spread.q_sizes[s]} q / {spread.kv_sizes[s]} kv ({kv_note})"
        line = f"  rank {rank} ({where}): heads {q} q / {kv} kv -> all-to-all -> {after}"
        if layout is not None:
            line += f"; tokens {layout.sizes[index]} of {seq}"
            if cp > 1:
                line += f" (of chunks {' and '.join(map(str, layout.chunks_of(g)))}, {layout.chunk} tokens each)"
            if layout.length > seq:
                line += " (padded to one per rank)" if cp == 1 else f" (the sequence padded to {layout.length})"
        lines.append(line)
    return lines
