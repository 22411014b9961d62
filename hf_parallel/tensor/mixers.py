"""Styles of recurrent token mixers (state-space and linear-attention layers), split by their heads.

A mixer's parameters only make sense together: Mamba-2's ``in_proj`` packs z | x | B | C | dt, its
depthwise ``conv1d`` runs over x | B | C, ``A_log`` / ``D`` / ``dt_bias`` are per head, and its gated
norm per group of heads. So one rule names the whole mixer (``layers.*.mamba = "mamba2_mixer"``) and
its style places every parameter below it (``ParallelStyle.places_descendants``). Each rank runs
the model's own forward on its heads (the module's head counts set to the local ones):

    y = out_proj(mix(x)) = reduce_from( mix_r(copy_to(x)) W_out,r^T ) + b

Heads map onto groups (Mamba-2's B/C groups, Gated DeltaNet's key heads) as query heads map onto
KV heads in attention, so ``split_heads`` splits them: whole groups per rank, or, with more ranks
than groups, one group held by several ranks (its rows replicated, their gradients summed) and its
heads shared among them. Caches follow: transformers sizes conv and recurrent states from the
tensors it is given, which are the local ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import comm
from .heads import HeadSplit, split_heads
from ..core.layout import Layout, Range, replicated
from .styles import Hooks, ParallelStyle, Rowwise, apply_hooks, matmul


def _pieces(dim: int, per_rank: list[list[Range]]) -> Layout:
    """A layout from each rank's pieces in order. Adjacent pieces stay apart: a piece several ranks
    hold (a shared group's rows) must be the same piece on each, for its gradient sum."""
    return Layout(dim, tuple(tuple(pieces) for pieces in per_rank), "heads")


def _blocks(split: HeadSplit, rank: int, blocks: list[tuple[int, str, int]]) -> list[Range]:
    """Pieces of a dim made of consecutive blocks, ``(offset, "heads" | "groups", width per item)``:
    this rank's heads (or groups) of each block."""
    ranges = {"heads": split.q_ranges[rank], "groups": split.kv_ranges[rank]}
    return [(offset + ranges[by][0] * width, offset + ranges[by][1] * width) for offset, by, width in blocks]


def _by_heads(split: HeadSplit, dim: int, blocks: list[tuple[int, str, int]]) -> Layout:
    """The layout of a dim made of ``blocks`` (``_blocks``), every rank's pieces."""
    return _pieces(dim, [_blocks(split, rank, blocks) for rank in range(split.world_size)])


def _with_biases(module: nn.Module, out: dict[str, Layout], like_weights) -> dict[str, Layout]:
    """``out`` and the biases: of ``like_weights`` (children split on their output) as their weights,
    ``out_proj``'s whole (added once, after the sum)."""
    for child in like_weights:
        if module.get_submodule(child).bias is not None:
            out[f"{child}.bias"] = out[f"{child}.weight"]
    if module.out_proj.bias is not None:
        out["out_proj.bias"] = replicated(out["out_proj.weight"].world_size)
    return out


class _MixerStyle(ParallelStyle):
    """What the mixers share: the input enters through ``copy_to``, ``out_proj`` is rowwise (its
    partial products summed, its bias added once), and a check that the model's forward did call
    ``out_proj`` (a fused kernel that applies it inside would return a rank's partial sum)."""

    places_descendants = True

    def split(self, module: nn.Module, size: int) -> HeadSplit:
        raise NotImplementedError

    def replica_group(self, module, ctx):
        """The ranks sharing this rank's group (its rows held by several ranks), or None."""
        shared = self.split(module, ctx.size).kv_replica_groups()
        if not shared:
            return None
        if shared == [list(range(ctx.size))]:
            return ctx.group
        if ctx.mesh.num_stages > 1:
            raise ValueError(
                f"{type(module).__name__}: {ctx.size} tensor-parallel ranks share its groups unevenly, which needs "
                "subgroups that pipeline stages cannot create together; use a TP size dividing or divided by its groups"
            )
        return ctx.mesh.subgroup("tp", lambda size: self.split(module, size).kv_replica_groups())

    def install_around(self, module, ctx, layouts, localize) -> Hooks:
        """Sum the gradients of replicated pieces, set the local sizes (``localize``), make
        ``out_proj`` rowwise; the hooks of the mixer itself."""
        group = self.replica_group(module, ctx)
        for name, layout in layouts.items():
            ctx.gradients.sum_pieces(module.get_parameter(name), layout, ctx.rank, group)
        localize(group)
        out_proj = module.out_proj
        apply_hooks(out_proj, Rowwise().prepare(out_proj, ctx, {"weight": layouts["out_proj.weight"]}))
        calls = []
        out_proj.register_forward_pre_hook(lambda m, args: calls.append(1))
        tp = ctx.group

        def pre(args, kwargs):
            if args:
                return (comm.copy_to(args[0], tp), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": comm.copy_to(kwargs["hidden_states"], tp)}

        def around(forward, *args, **kwargs):
            calls.clear()
            out = forward(*args, **kwargs)
            if not calls:
                raise RuntimeError(
                    f"{type(module).__name__}: its forward did not call out_proj (a fused kernel applied it inside), "
                    "so this rank holds only its partial sum; run without the fused mixer kernels under tensor "
                    "parallelism"
                )
            return out

        return Hooks(pre=pre, around=around)


class Mamba2Mixer(_MixerStyle):
    """Mamba-2 (Falcon-H1, Bamba, Nemotron-H, Granite-4 hybrid): heads of ``head_dim`` channels in
    ``n_groups`` B/C groups. ``in_proj`` rows z | x | B | C | dt, ``conv1d`` channels x | B | C,
    ``dt_bias`` / ``A_log`` / ``D`` per head, ``norm`` (RMS over each group, gated) per channel,
    ``out_proj`` columns per channel. A group split over ranks normalises with its sum of squares
    summed over them."""

    def split(self, module, size):
        return split_heads(module.num_heads, module.n_groups, module.head_dim, size)

    def layouts(self, module, ctx, name):
        if not all(hasattr(module, a) for a in ("A_log", "in_proj", "conv1d", "out_proj", "n_groups", "head_dim")):
            return {}  # not a Mamba-2 mixer (a hybrid's pattern also matching its attention or MLP): whole
        heads, groups, hd, state = module.num_heads, module.n_groups, module.head_dim, module.ssm_state_size
        inner = heads * hd
        if module.intermediate_size != inner:
            raise ValueError(f"{name}: intermediate_size {module.intermediate_size} is not {heads} heads x {hd}")
        split, gs = self.split(module, ctx.size), groups * state
        conv = [(0, "heads", hd), (inner, "groups", state), (inner + gs, "groups", state)]
        proj = [(0, "heads", hd)] + [(inner + o, by, w) for o, by, w in conv] + [(2 * inner + 2 * gs, "heads", 1)]
        per_head, channels = _by_heads(split, 0, [(0, "heads", 1)]), [(0, "heads", hd)]
        out = {"in_proj.weight": _by_heads(split, 0, proj), "conv1d.weight": _by_heads(split, 0, conv)}
        out |= {attr: per_head for attr in ("dt_bias", "A_log", "D")}
        out["out_proj.weight"] = _by_heads(split, 1, channels)
        if isinstance(getattr(module.norm, "weight", None), nn.Parameter):
            out["norm.weight"] = _by_heads(split, 0, channels)
        return _with_biases(module, out, ("in_proj", "conv1d"))

    def prepare(self, module, ctx, layouts):
        if not layouts:
            return Hooks()
        split, rank = self.split(module, ctx.size), ctx.rank
        heads, groups = split.local_q(rank), split.local_kv(rank)
        full_groups, group_channels = module.n_groups, module.intermediate_size // module.n_groups

        def localize(group):
            proj = layouts["in_proj.weight"]
            if isinstance(getattr(module, "mup_vector", None), torch.Tensor):  # Falcon-H1's per-row multipliers
                module.mup_vector = torch.cat([module.mup_vector[..., a:b] for a, b in proj.ranges[rank]], -1)
            module.num_heads, module.n_groups = heads, groups
            module.intermediate_size = heads * module.head_dim
            module.conv_dim = module.intermediate_size + 2 * groups * module.ssm_state_size
            if hasattr(module, "groups_time_state_size"):
                module.groups_time_state_size = groups * module.ssm_state_size
            if "norm.weight" in layouts:
                _localize_gated_norm(module.norm, group_channels, groups, split.world_size > full_groups, group)

        return self.install_around(module, ctx, layouts, localize)


def _localize_gated_norm(norm: nn.Module, group_channels: int, local_groups: int, shared: bool, group) -> None:
    """The mixer's gated RMS norm on this rank's channels. Whole groups: the model's own code, told
    its local group count (Falcon-H1 reads ``n_groups``; the others derive it from ``group_size``).
    Part of one group (more ranks than groups): its sum of squares summed over the ranks sharing it."""
    if not shared:
        if hasattr(norm, "n_groups"):
            norm.n_groups = local_groups
        return
    eps = norm.variance_epsilon
    falcon = hasattr(norm, "n_groups")  # Falcon-H1: optionally gates after, scales in float32
    gate_after = falcon and norm.norm_before_gate

    def around(forward, hidden_states, gate=None):
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        if gate is not None and not gate_after:
            x = x * F.silu(gate.to(torch.float32))
        variance = comm.all_reduce_sum(x.pow(2).sum(-1, keepdim=True), group) / group_channels
        x = x * torch.rsqrt(variance + eps)
        if not falcon:
            return norm.weight * x.to(dtype)
        x = norm.weight * x
        if gate is not None and gate_after:
            x = x * F.silu(gate.to(torch.float32))
        return x.to(dtype)

    apply_hooks(norm, Hooks(around=around))


class GatedDeltaNet(_MixerStyle):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5): ``num_v_heads`` value heads over ``num_k_heads`` key heads.
    Qwen3-Next's ``in_proj_qkvz`` rows per key head [q, k, its value heads' v, their z], ``in_proj_ba``
    per key head [b, a] of its value heads (Qwen3.5: ``in_proj_qkv`` as the conv, z / b / a per value
    head); ``conv1d`` channels q | k | v; ``dt_bias`` / ``A_log`` per value
    head; the gated norm is per head (whole, its gradient summed); ``out_proj`` columns per value head."""

    def split(self, module, size):
        return split_heads(module.num_v_heads, module.num_k_heads, 1, size)

    def layouts(self, module, ctx, name):
        if not all(hasattr(module, a) for a in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv1d")):
            raise ValueError(f"{name}: gated_deltanet splits a Gated DeltaNet (key / value heads, conv1d); "
                             f"{type(module).__name__} is not one")  # fmt: skip
        nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
        split, ws, per = self.split(module, ctx.size), ctx.size, nv // nk
        key_dim = nk * dk
        conv = [(0, "groups", dk), (key_dim, "groups", dk), (2 * key_dim, "heads", dv)]
        per_head = _by_heads(split, 0, [(0, "heads", 1)])
        out = {"conv1d.weight": _by_heads(split, 0, conv), "dt_bias": per_head, "A_log": per_head}
        out["out_proj.weight"] = _by_heads(split, 1, [(0, "heads", dv)])
        if hasattr(module, "in_proj_qkv"):  # Qwen3.5: q | k | v as the conv, z / b / a per value head
            out["in_proj_qkv.weight"] = out["conv1d.weight"]
            out["in_proj_z.weight"] = _by_heads(split, 0, [(0, "heads", dv)])
            out["in_proj_b.weight"] = out["in_proj_a.weight"] = per_head
            return out
        if not hasattr(module, "in_proj_qkvz"):
            raise ValueError(f"{name}: gated_deltanet knows Qwen3-Next's in_proj_qkvz / in_proj_ba and Qwen3.5's "
                             f"in_proj_qkv / z / b / a; {type(module).__name__} has neither")  # fmt: skip
        qkvz, ba = [], []
        for rank in range(ws):
            (k0, k1), (v0, v1) = split.kv_ranges[rank], split.q_ranges[rank]
            rows, gates = [], []
            for kh in range(k0, k1):
                a, b = max(v0, kh * per) - kh * per, min(v1, (kh + 1) * per) - kh * per
                base = kh * (2 * dk + 2 * per * dv)
                value, z = base + 2 * dk, base + 2 * dk + per * dv
                rows += [(base, base + 2 * dk), (value + a * dv, value + b * dv), (z + a * dv, z + b * dv)]
                gates += [(kh * 2 * per + a, kh * 2 * per + b), (kh * 2 * per + per + a, kh * 2 * per + per + b)]
            qkvz.append(rows)
            ba.append(gates)
        return out | {"in_proj_qkvz.weight": _pieces(0, qkvz), "in_proj_ba.weight": _pieces(0, ba)}

    def prepare(self, module, ctx, layouts):
        split, rank = self.split(module, ctx.size), ctx.rank

        def localize(group):
            module.num_v_heads, module.num_k_heads = split.local_q(rank), split.local_kv(rank)
            module.key_dim = module.num_k_heads * module.head_k_dim
            module.value_dim = module.num_v_heads * module.head_v_dim
            module.conv_dim = 2 * module.key_dim + module.value_dim
            ctx.gradients.sum_over(module.norm.weight, ctx.group)  # per head, each rank saw its heads

        return self.install_around(module, ctx, layouts, localize)


class ShortConv(_MixerStyle):
    """LFM2's gated short convolution: ``in_proj`` rows B | C | x, a depthwise ``conv`` and
    ``out_proj`` columns, all per channel (no heads: an even split of the channels)."""

    def split(self, module, size):
        channels = module.conv.weight.shape[0]
        return split_heads(channels, channels, 1, size)

    def layouts(self, module, ctx, name):
        conv, in_proj = getattr(module, "conv", None), getattr(module, "in_proj", None)
        channels = conv.weight.shape[0] if isinstance(conv, nn.Conv1d) else None
        if channels is None or conv.groups != channels or in_proj.weight.shape[0] != 3 * channels:
            raise ValueError(f"{name}: short_conv splits LFM2's in_proj (B | C | x) and depthwise conv; "
                             f"{type(module).__name__} is laid out otherwise")  # fmt: skip
        split = self.split(module, ctx.size)
        out = {"in_proj.weight": _by_heads(split, 0, [(i * channels, "heads", 1) for i in range(3)])}
        out |= {
            "conv.weight": _by_heads(split, 0, [(0, "heads", 1)]),
            "out_proj.weight": _by_heads(split, 1, [(0, "heads", 1)]),
        }
        return _with_biases(module, out, ("in_proj", "conv"))

    def prepare(self, module, ctx, layouts):
        return self.install_around(module, ctx, layouts, lambda group: None)


class Mamba1Mixer(_MixerStyle):
    """Mamba-1 (Jamba, Mamba, Falcon-Mamba): every channel its own recurrence, so the channels split
    evenly. ``in_proj`` rows x | z, ``conv1d`` / ``dt_proj`` rows / ``A_log`` / ``D`` per channel,
    ``out_proj`` rowwise. ``x_proj`` reads all channels for the shared dt | B | C: each rank's
    partial product is summed (``all_reduce_sum``: every rank's channels use the sum, so its
    gradient is summed back too), and the norms on it (whole) get their gradients summed."""

    def split(self, module, size):
        channels = module.intermediate_size
        return split_heads(channels, channels, 1, size)

    def layouts(self, module, ctx, name):
        if not hasattr(module, "x_proj"):
            return {}
        channels, split = module.intermediate_size, self.split(module, ctx.size)
        if module.x_proj.bias is not None:  # the partial products' sum would count it once per rank
            raise ValueError(f"{name}: mamba1_mixer splits x_proj's input, and x_proj here has a bias")
        rows, columns = _by_heads(split, 0, [(0, "heads", 1)]), _by_heads(split, 1, [(0, "heads", 1)])
        out = {"in_proj.weight": _by_heads(split, 0, [(0, "heads", 1), (channels, "heads", 1)])}
        out |= {"conv1d.weight": rows, "dt_proj.weight": rows, "A_log": rows, "D": rows}
        out |= {"x_proj.weight": columns, "out_proj.weight": columns}
        return _with_biases(module, out, ("in_proj", "conv1d", "dt_proj"))

    def prepare(self, module, ctx, layouts):
        if not layouts:
            return Hooks()
        tp = ctx.group

        def localize(group):
            module.intermediate_size = layouts["D"].local_size(ctx.rank)
            x_proj = module.x_proj
            apply_hooks(x_proj, Hooks(around=lambda forward, x: matmul(x_proj, x),
                                      post=lambda y: comm.all_reduce_sum(y, tp)))  # fmt: skip
            for child, norm in module.named_children():  # Jamba's dt / B / C norms (Falcon-Mamba's weightless)
                if child.endswith("layernorm"):
                    for param in norm.parameters():
                        ctx.gradients.sum_over(param, tp)

        return self.install_around(module, ctx, layouts, localize)


# transformers' mixer classes whose parameters are laid out as each style expects, for discovery (a class
# not named here, though it look alike, stays replicated: its packing is not known)
KNOWN_MIXERS = {
    **dict.fromkeys(("FalconH1Mixer", "BambaMixer", "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer",
                     "Mamba2Mixer"), "mamba2_mixer"),
    **dict.fromkeys(("JambaMambaMixer", "MambaMixer", "FalconMambaMixer"), "mamba1_mixer"),
    **dict.fromkeys(("Qwen3NextGatedDeltaNet", "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"), "gated_deltanet"),
    "Lfm2ShortConv": "short_conv",
}  # fmt: skip


def recurrent_mixers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that carry a state along the sequence (Mamba, Gated DeltaNet, short convolutions):
    each holds a depthwise causal convolution over the tokens. Token splits (Ulysses) cannot serve
    them: every token needs the state of the ones before it. A recurrence with no such convolution
    (RWKV, xLSTM) is not found here; it meets Ulysses' own checks (attention through the registry)."""
    return [
        (path, module)
        for path, module in model.named_modules()
        if any(isinstance(c, nn.Conv1d) and c.groups == c.in_channels > 1 for c in module.children())
    ]
