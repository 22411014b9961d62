"""Plan discovery: a tensor-parallel plan derived from the module tree, for models nobody wrote one for.

Each repeated block (an ``nn.ModuleList`` of identical layers) is split into its attention
module(s) and the rest. A projection is given a role only when its name *and* its shape agree:

- attention: separate q/k/v (``hidden -> heads x head_dim``) colwise, or one fused q/k/v whose
  packing is known for the family (``FUSED_QKV_STYLE``); the output projection
  (``heads x head_dim -> hidden``) rowwise; per-head norms replicated with summed gradients;
- the rest: up/gate projections (``hidden -> I``) colwise, the down projection (``I -> hidden``)
  rowwise, norms of the residual stream replicated;
- the input embedding vocab-parallel, the output embedding vocab-parallel with gathered logits;
- a recurrent mixer of a class known to lay its parameters out as a mixer style expects
  (``mixers.KNOWN_MIXERS``: Mamba-1/2, Gated DeltaNet, LFM2's short convolution) gets that style.

A module whose role cannot be settled that way (an unknown projection, a fused q/k/v of unknown
packing, a norm acting on sharded activations, a mixture of experts) is left replicated, and the
reason is kept as a note that ``hf-parallel plan`` prints. A wrong split is never guessed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from ..core.layers import repeated_layers
from . import attention
from .geometry import FUSED_QKV_NAMES, OUT_NAMES, QKV_NAMES, attention_geometry, is_conv1d, named, text_config
from .mixers import KNOWN_MIXERS
from .rules import compile_pattern

UP_NAMES = {"up_proj", "gate_proj", "fc1", "fc_in", "c_fc", "dense_h_to_4h", "w1", "w3", "intermediate.dense"}
DOWN_NAMES = {"down_proj", "fc2", "fc_out", "c_proj", "dense_4h_to_h", "w2", "output.dense"}

# How each family packs its fused q/k/v output dim. A family missing here keeps it replicated.
FUSED_QKV_STYLE = {
    "gpt2": "packed_colwise",  # [q | k | v]
    "gpt_bigcode": "packed_colwise",  # [q | k | v], k and v one head each under multi-query
    "bloom": "grouped_qkv_colwise",  # per head [q_h k_h v_h]
    "gpt_neox": "grouped_qkv_colwise",
    "falcon": "grouped_qkv_colwise",  # per KV group [q heads, k, v]; multi-query is one group
}


@dataclass
class Discovery:
    rules: dict[str, str]  # module path pattern -> style name
    notes: list[str]  # what was left replicated, and why


@dataclass(frozen=True)
class Projection:
    path: str  # relative to its block
    fan_in: int
    fan_out: int


class Unclassified(Exception):
    """A region whose roles cannot all be settled: it stays replicated, with this reason."""


def _projections(root: nn.Module, skip=()) -> tuple[list[Projection], list[tuple[str, nn.Module]]]:
    """Linear / Conv1D projections under ``root`` and the other modules that own parameters."""
    linears, others = [], []
    for path, module in root.named_modules():
        if not path or any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if isinstance(module, nn.Linear) or is_conv1d(module):
            fan_in, fan_out = module.weight.shape if is_conv1d(module) else module.weight.shape[::-1]
            linears.append(Projection(path, fan_in, fan_out))
        elif any(True for _ in module.parameters(recurse=False)):
            others.append((path, module))
    return linears, others


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _param_sizes(module: nn.Module) -> set[tuple[int, ...]]:
    return {tuple(p.shape) for p in module.parameters(recurse=False)}


def _holds_matrices(module: nn.Module) -> bool:
    return any(p.dim() >= 2 for p in module.parameters(recurse=False))


def classify_attention(region: nn.Module, hidden: int, heads, qkv_style: str | None) -> dict[str, str]:
    """Styles for the projections and norms of one attention module (paths relative to it)."""
    q_width, kv_width = heads.num_heads * heads.head_dim, heads.num_kv_heads * heads.head_dim
    linears, others = _projections(region)
    rules, outputs, inputs = {}, [], []
    for p in linears:
        if named(p.path, QKV_NAMES) and p.fan_in == hidden and p.fan_out in (q_width, kv_width):
            rules[p.path] = "colwise"
            inputs.append(p)
        elif named(p.path, FUSED_QKV_NAMES) and p.fan_in == hidden and p.fan_out == q_width + 2 * kv_width:
            if qkv_style is None:
                raise Unclassified(f"{p.path} is a fused q/k/v projection whose packing is not known for this family")
            rules[p.path] = qkv_style
            inputs += [p, p, p]
        elif named(p.path, OUT_NAMES) and p.fan_in == q_width and p.fan_out == hidden:
            rules[p.path] = "rowwise"
            outputs.append(p)
        else:
            raise Unclassified(f"{p.path} ({p.fan_in} -> {p.fan_out}) is not a recognised q/k/v or output projection")
    if len(inputs) != 3 or len(outputs) != 1:
        raise Unclassified(f"expected q, k, v and one output projection, found {sorted(rules)}")
    for name, param in region.named_parameters(recurse=False):
        if tuple(param.shape) != (heads.num_heads,):
            raise Unclassified(
                f"{name} {tuple(param.shape)} is a parameter of the attention that may act on the split heads"
            )
        rules[name] = "colwise"  # one value per query head (attention sinks): split with the heads
    out_parent, in_parents = _parent(outputs[0].path), {_parent(p.path) for p in inputs}
    for path, module in others:
        if any(part.isdigit() for part in path.split(".")):
            raise Unclassified(f"{path} is one of a list of per-head modules, which local heads would misindex")
        if _param_sizes(module) <= {(heads.head_dim,)} and heads.head_dim > 1:
            rules[path] = "replicated_with_grad_allreduce"  # per-head norm: each rank sees its heads only
        elif _parent(path) != out_parent or out_parent in in_parents:
            raise Unclassified(f"{path} ({type(module).__name__}) may act on the split heads")
    return rules


def classify_mlp(linears: list[Projection], others, hidden: int) -> dict[str, str]:
    """Up/gate colwise and down rowwise, for what of a block is not attention."""
    if not linears:
        # stacked experts and their router: a curated or transformers plan splits those
        if any(_holds_matrices(module) for _, module in others):
            raise Unclassified("matrices that are not linear layers (stacked experts: a curated or transformers plan)")
        return {}
    downs = [p for p in linears if named(p.path, DOWN_NAMES) and p.fan_out == hidden]
    if len(downs) != 1:
        raise Unclassified(f"expected one down projection to {hidden}, found {[p.path for p in downs]}")
    inner = downs[0].fan_in
    rules = {downs[0].path: "rowwise"}
    for p in linears:
        if p is downs[0]:
            continue
        if not (named(p.path, UP_NAMES) and p.fan_in == hidden and p.fan_out == inner):
            raise Unclassified(f"{p.path} ({p.fan_in} -> {p.fan_out}) is not a recognised up/gate/down projection")
        rules[p.path] = "colwise"
    for path, module in others:
        scalars = all(p.numel() == 1 for p in module.parameters(recurse=False))
        if scalars and _parent(path) == _parent(downs[0].path):
            rules[path] = "replicated_with_grad_allreduce"  # a learned activation (xIELU): each rank sees part
        elif not scalars and _param_sizes(module) != {(hidden,)}:
            raise Unclassified(f"{path} ({type(module).__name__}) may act on the split intermediate activations")
    return rules


def classify_block(block: nn.Module, hidden: int, config, qkv_style) -> tuple[dict[str, str], list[str]]:
    rules, notes = {}, []
    mixers = {
        path: KNOWN_MIXERS[type(m).__name__] for path, m in block.named_modules() if type(m).__name__ in KNOWN_MIXERS
    }
    rules.update(mixers)  # a known recurrent mixer: its block style places all of it
    regions = [path for path, _ in attention.outermost(block)]
    for path in regions:
        try:
            try:
                heads, _ = attention_geometry(block.get_submodule(path), config, path)
            except ValueError as why:
                raise Unclassified(str(why)) from None
            found = classify_attention(block.get_submodule(path), hidden, heads, qkv_style)
            rules.update({f"{path}.{p}": style for p, style in found.items()})
        except Unclassified as why:
            notes.append(f"{path}: replicated, {why}")
    linears, others = _projections(block, skip=regions + list(mixers))
    try:
        rules.update(classify_mlp(linears, others, hidden))
    except Unclassified as why:
        label = ", ".join(p.path for p in linears) or ", ".join(path for path, m in others if _holds_matrices(m))
        notes.append(f"{label}: replicated, {why}")
    return rules, notes


def _generalise(model: nn.Module, exact: dict[str, str]) -> dict[str, str]:
    """Layer indices become ``*`` where the wildcard rule matches exactly the same modules."""
    paths = [path for path, _ in model.named_modules()]
    rules = {}
    for path, style in exact.items():
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path)
        regex = compile_pattern(pattern)
        matched = [p for p in paths if regex.fullmatch(p)]
        uniform = all(exact.get(p) == style for p in matched)
        rules[pattern if uniform else path] = style
    return rules


def discover_plan(model: nn.Module) -> Discovery:
    config = text_config(model.config)
    hidden = next(getattr(config, a) for a in ("hidden_size", "n_embd", "d_model") if getattr(config, a, None))
    qkv_style = FUSED_QKV_STYLE.get(getattr(config, "model_type", None))
    exact, notes = {}, []
    names = {module: path for path, module in model.named_modules()}
    embedding, output = model.get_input_embeddings(), model.get_output_embeddings()
    if isinstance(embedding, nn.Embedding):
        exact[names[embedding]] = "embedding_rowwise"
    if isinstance(output, nn.Linear):
        exact[names[output]] = "colwise_gather_output"
    blocks = repeated_layers(model)
    for block_path in blocks:
        rules, block_notes = classify_block(model.get_submodule(block_path), hidden, config, qkv_style)
        exact.update({f"{block_path}.{p}": style for p, style in rules.items()})
        notes += [f"{block_path}.{note}" for note in block_notes]
    for p in _projections(model, skip=blocks)[0]:
        if p.path not in exact:
            notes.append(f"{p.path} ({p.fan_in} -> {p.fan_out}): replicated, outside the repeated layers")
    notes = sorted({re.sub(r"\.\d+\.", ".*.", note) for note in notes})
    return Discovery(_generalise(model, exact), notes)
