"""ParallelStyle: the layouts of a module's parameters and the collectives around its forward.

    Y = XW,  W = [W_1 .. W_p]  (colwise):   Y_r = copy_to(X) W_r          -> local Y_r
    Y = XW,  W = [W_1; .. W_p] (rowwise):   Y   = reduce_from(X_r W_r) + b

A style never reads weights: ``layouts`` says which slice of each parameter a rank holds, and
``install`` wraps the module's forward on plain local tensors. Styles are looked up by name in
``STYLES``; users add their own with ``register_style``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import comm
from ..distributed.mesh import Mesh
from .geometry import is_conv1d
from .heads import HeadSplit, in_units
from .layout import Layout, chunks, even_sizes, packed, per_rank, sizes_to_ranges


@dataclass(frozen=True)
class ShardContext:
    """What a style needs to know beyond the module: the tensor-parallel ranks it splits over (the
    mesh's ``tp`` dimension), and head alignment if in attention."""

    mesh: Mesh
    heads: HeadSplit | None = None  # set for modules inside an attention block
    kv_group: object | None = None  # ranks holding the same (replicated) KV head as this rank
    unit: int = 1  # split in multiples of this many elements, where the size allows

    def even_ranges(self, size: int) -> list[tuple[int, int]]:
        """As even as possible, in whole units (when there are enough of them for every rank)."""
        unit = self.unit if size % self.unit == 0 and size // self.unit >= self.size else 1
        return sizes_to_ranges(even_sizes(size // unit, self.size), unit)

    @property
    def rank(self) -> int:
        """This rank's index in the tensor-parallel group, which every layout is written in."""
        return self.mesh.tp.rank

    @property
    def size(self) -> int:
        return self.mesh.tp.size

    @property
    def group(self):
        return self.mesh.tp.group


# torch's grouped_mm (transformers' default experts kernel) needs row strides of a multiple of 16
# bytes: stacked expert weights are split in multiples of 8 elements (Mixtral's 14336 over 3 ranks
# would otherwise leave 4778-element rows)
GROUPED_MM_UNIT = 8


def out_dim(module: nn.Module) -> int:
    return 1 if is_conv1d(module) else 0


def in_dim(module: nn.Module) -> int:
    return 0 if is_conv1d(module) else 1


def split_ranges(size: int, ctx: ShardContext, name: str) -> list[tuple[int, int]]:
    """Per-rank ranges of a dim of ``size`` elements.

    Inside attention the split follows whole heads (q, kv, or per-head fused qkv); elsewhere it
    is as even as possible."""
    heads = ctx.heads
    if heads is None:
        return ctx.even_ranges(size)
    hd = heads.head_dim
    if size == heads.num_heads * hd:
        return in_units(heads.q_ranges, hd)
    if size == heads.num_heads:  # one value per query head (GPT-OSS attention sinks)
        return list(heads.q_ranges)
    if size == heads.num_kv_heads * hd:
        return in_units(heads.kv_ranges, hd)
    if size == 3 * heads.num_heads * hd and heads.num_heads == heads.num_kv_heads:
        return in_units(heads.q_ranges, 3 * hd)  # per-head fused [q_h k_h v_h] (GPT-NeoX)
    raise ValueError(
        f"{name}: cannot align a dim of {size} to attention heads "
        f"(heads={heads.num_heads}, kv_heads={heads.num_kv_heads}, head_dim={hd})"
    )


def packed_layout(dim: int, size: int, ctx: ShardContext, name: str, num_blocks: int = 2) -> Layout:
    """q|k|v blocks (sizes from the heads) inside attention, else ``num_blocks`` equal blocks."""
    heads = ctx.heads
    if heads is not None and size == (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim:
        hd = heads.head_dim
        q, kv = in_units(heads.q_ranges, hd), in_units(heads.kv_ranges, hd)
        return packed(dim, [heads.num_heads * hd, heads.num_kv_heads * hd, heads.num_kv_heads * hd], [q, kv, kv])
    if size % num_blocks:
        raise ValueError(f"{name}: packed dim of {size} does not split into {num_blocks} equal blocks")
    block = size // num_blocks
    return packed(dim, [block] * num_blocks, [ctx.even_ranges(block)] * num_blocks)


def interleaved_layout(dim: int, size: int, ctx: ShardContext, name: str) -> Layout:
    """[g0 u0 g1 u1 ...] (GPT-OSS's experts take gate = x[..., ::2], up = x[..., 1::2]): each rank
    holds a contiguous run of whole (gate, up) pairs, so the local tensor interleaves the same way."""
    if size % 2:
        raise ValueError(f"{name}: an interleaved gate/up dim of {size} is odd")
    pairs = ctx.even_ranges(size // 2)  # as the down projection splits the intermediate dim
    return per_rank(dim, [(2 * start, 2 * stop) for start, stop in pairs])


def stacked_dims(experts: nn.Module) -> tuple[int, int]:
    """(out, in) dims of a stacked expert weight: [E, out, in], or [E, in, out] for transformers'
    transposed experts (GPT-OSS)."""
    return (2, 1) if getattr(experts, "is_transposed", False) else (1, 2)


def grouped_qkv_layout(dim: int, size: int, ctx: ShardContext, name: str) -> Layout:
    """A fused projection laid out per KV group as [q heads of the group, k, v] (Falcon, and with
    one head per group BLOOM / GPT-NeoX's per-head [q_h k_h v_h]). Each rank takes its query heads
    of each of its groups plus that group's k and v; the local tensor keeps the same grouped form."""
    heads = ctx.heads
    if heads is None or size != (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim:
        raise ValueError(f"{name}: a dim of {size} is not a grouped q/k/v projection of the attention heads")
    group, hd = heads.num_heads // heads.num_kv_heads, heads.head_dim
    ranges = []
    for (q_start, q_stop), (kv_start, kv_stop) in zip(heads.q_ranges, heads.kv_ranges):
        if (q_start, q_stop) == (kv_start * group, kv_stop * group):  # whole groups: one contiguous run
            pieces = [(kv_start * (group + 2), kv_stop * (group + 2))]
        else:  # one KV group shared with other ranks: some of its query heads, then its k and v
            base = kv_start * (group + 2) - kv_start * group
            pieces = [
                (base + q_start, base + q_stop),
                (base + (kv_start + 1) * group, base + (kv_start + 1) * group + 2),
            ]
        ranges.append(tuple((start * hd, stop * hd) for start, stop in pieces))
    return Layout(dim, tuple(ranges), "grouped")


def _dim_layout(dim: int, size: int, ctx: ShardContext, name: str, fused_layout) -> Layout:
    """The split of a linear's sharded dim: by the style's fused layout, else head-aligned / even."""
    if fused_layout is not None:
        return fused_layout(dim, size, ctx, name)
    return per_rank(dim, split_ranges(size, ctx, name))


def _sum_replicated_grads(param: nn.Parameter, layout: Layout, rank: int, group) -> None:
    """Sum, over the ranks sharing them, the gradient rows of pieces held by several ranks
    (a replicated KV head: each replica saw only its share of the query heads)."""
    counts = layout.replica_counts(rank)
    if group is None or layout.dim is None or max(counts, default=1) == 1:
        return
    offsets = [sum(stop - start for start, stop in layout.ranges[rank][:i]) for i in range(len(counts))]
    shared = [
        (offset, stop - start)
        for offset, (start, stop), count in zip(offsets, layout.ranges[rank], counts)
        if count > 1
    ]

    def hook(grad):
        grad = grad.clone()
        summed = comm.all_reduce(torch.cat([grad.narrow(layout.dim, o, n) for o, n in shared], layout.dim), group)
        done = 0
        for offset, length in shared:
            grad.narrow(layout.dim, offset, length).copy_(summed.narrow(layout.dim, done, length))
            done += length
        return grad

    param.register_hook(hook)


def _matmul(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight if is_conv1d(module) else F.linear(x, module.weight)


class ParallelStyle:
    """Base: replicated parameters, forward unchanged."""

    shards_heads = False  # True: the attention module around it must run on local heads

    def layouts(self, module: nn.Module, ctx: ShardContext, name: str) -> dict[str, Layout]:
        return {}

    def install(self, module: nn.Module, ctx: ShardContext, name: str, layouts: dict[str, Layout]) -> None:
        """Wrap ``module`` (already holding its local shards, as ``layouts`` describe)."""

    def param_layout(self, owner: nn.Module, attr: str, ctx: ShardContext, name: str) -> Layout:
        """The layout of ``owner.attr``, a parameter named by a rule of its own (stacked expert
        weights and biases, attention sinks)."""
        raise ValueError(f"plan rule for {name}: style {self} applies to modules, not to a single parameter")

    def __repr__(self) -> str:
        return type(self).__name__


class Replicated(ParallelStyle):
    pass


class ReplicatedWithGradAllReduce(ParallelStyle):
    """Weights replicated, but each rank sees only its heads or tokens: sum the gradients."""

    def install(self, module, ctx, name, layouts):
        for param in module.parameters(recurse=False):
            comm.sum_gradient_over(param, ctx.group)


class Colwise(ParallelStyle):
    """Y_r = copy_to(X) W_r^T + b_r; the output stays sharded on its last dim."""

    gather_output = False
    fused_layout = None  # packed_layout / grouped_qkv_layout for a dim made of blocks; None: plain split

    @property
    def shards_heads(self) -> bool:
        """Whether the module after this one sees only local heads (no gather of the output)."""
        return not self.gather_output

    def _layout(self, module, ctx, name) -> Layout:
        dim = out_dim(module)
        size = module.weight.shape[dim]
        if not self.shards_heads:
            ctx = ShardContext(ctx.mesh)  # the output is gathered: any even split will do
        return _dim_layout(dim, size, ctx, name, self.fused_layout)

    def layouts(self, module, ctx, name):
        weight = self._layout(module, ctx, name)
        out = {"weight": weight}
        if getattr(module, "bias", None) is not None:
            out["bias"] = Layout(0, weight.ranges, weight.kind)
        return out

    def param_layout(self, owner, attr, ctx, name):
        """Split the output dim: of a per-head vector (sinks, head-aligned), of stacked expert
        biases [E, out] and of stacked expert weights (``stacked_dims``)."""
        param = owner.get_parameter(attr)
        if param.dim() == 1:
            return _dim_layout(0, param.shape[0], ctx, name, self.fused_layout)
        dim = 1 if param.dim() == 2 else stacked_dims(owner)[0]
        fused = self.fused_layout
        if fused is packed_layout and not getattr(owner, "is_concatenated", True):
            fused = interleaved_layout
        return _dim_layout(dim, param.shape[dim], ShardContext(ctx.mesh, unit=GROUPED_MM_UNIT), name, fused)

    def install(self, module, ctx, name, layouts):
        group = ctx.group
        layout = layouts["weight"]
        sizes = [layout.local_size(r) for r in range(layout.world_size)]
        for attr, param_layout in layouts.items():
            _sum_replicated_grads(getattr(module, attr), param_layout, ctx.rank, ctx.kv_group)
        if is_conv1d(module):
            module.nf = sizes[ctx.rank]  # Conv1D reshapes its output to nf features
        module.register_forward_pre_hook(lambda m, args: (comm.copy_to(args[0], group), *args[1:]))
        if self.gather_output:
            module.register_forward_hook(lambda m, args, out: comm.gather_from(out, -1, sizes, group))


class ColwiseGatherOutput(Colwise):
    gather_output = True


class PackedColwise(Colwise):
    fused_layout = staticmethod(packed_layout)


class GroupedQKVColwise(Colwise):
    fused_layout = staticmethod(grouped_qkv_layout)


class Rowwise(ParallelStyle):
    """Y = reduce_from(X_r W_r^T) + b; the bias is added once, after the sum."""

    split_input = False
    fused_layout = None

    def _layout(self, module, ctx, name) -> Layout:
        dim = in_dim(module)
        size = module.weight.shape[dim]
        if self.split_input:
            ctx = ShardContext(ctx.mesh)  # splits a replicated input itself: any even split will do
        return _dim_layout(dim, size, ctx, name, self.fused_layout)

    def layouts(self, module, ctx, name):
        return {"weight": self._layout(module, ctx, name)}

    def param_layout(self, owner, attr, ctx, name):
        """Split the input dim of stacked expert weights (``stacked_dims``); their output bias stays
        whole, and the experts style adds it once."""
        param = owner.get_parameter(attr)
        if param.dim() != 3:
            raise ValueError(
                f"{name}: rowwise splits the input dim of stacked [E, out, in] weights, not {tuple(param.shape)}"
            )
        dim = stacked_dims(owner)[1]
        return _dim_layout(dim, param.shape[dim], ShardContext(ctx.mesh, unit=GROUPED_MM_UNIT), name, self.fused_layout)

    def install(self, module, ctx, name, layouts):
        group = ctx.group
        layout = layouts["weight"]
        sizes = [layout.local_size(r) for r in range(layout.world_size)]
        split_input = self.split_input

        def forward(x, *args, **kwargs):
            if split_input:
                x = comm.scatter_to(x, -1, sizes, group)
            y = comm.reduce_from(_matmul(module, x), group)
            return y if module.bias is None else y + module.bias

        module.forward = forward


class RowwiseSplitInput(Rowwise):
    split_input = True


class PackedRowwise(Rowwise):
    fused_layout = staticmethod(packed_layout)


# transformers' experts forward takes (hidden states, expert ids, routing weights); GPT-OSS names them
# (hidden_states, router_indices, routing_weights)
EXPERT_ARG_ROLES = {"hidden_states": 0, "top_k_index": 1, "router_indices": 1, "top_k_weights": 2, "routing_weights": 2}


def _rewrite_expert_args(args: tuple, kwargs: dict, rewrite) -> tuple[tuple, dict]:
    """Apply ``rewrite(role, value)`` to each experts-forward argument, passed by position or name."""
    args = tuple(rewrite(role, value) if role < 3 else value for role, value in enumerate(args))
    kwargs = {key: rewrite(EXPERT_ARG_ROLES[key], v) if key in EXPERT_ARG_ROLES else v for key, v in kwargs.items()}
    return args, kwargs


def _add_once(module: nn.Module, attrs: list[str], rank: int, group) -> None:
    """Whole parameters added inside a split computation (GPT-OSS's down_proj_bias, inside each
    expert before the sum over ranks) count on rank 0 only: elsewhere the forward sees them times
    zero. Their gradient (all of it on rank 0) is summed, so every replica gets the same one."""
    for attr in attrs:
        comm.sum_gradient_over(module.get_parameter(attr), group)
    if rank == 0 or not attrs:
        return
    forward = module.forward

    def forward_with_zeros(*args, **kwargs):
        params = {attr: module._parameters[attr] for attr in attrs}
        module._parameters.update({attr: param * 0 for attr, param in params.items()})
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(params)

    module.forward = forward_with_zeros


class MoETPExperts(ParallelStyle):
    """Every expert split inside (its gate_up by columns, its down by rows, per parameter rules):
    each rank computes every routed token's partial expert output; one all-reduce sums them.

    The hidden states and routing weights enter through copy_to, whose backward sums their
    gradients: each rank's share of the output depends on them through its own slice only."""

    def localize(self, module, ctx, layouts):
        """Set the module's sizes to the local ones; returns a remapping of expert ids, or None."""
        if "gate_up_proj" in layouts and hasattr(module, "intermediate_dim"):
            module.intermediate_dim = layouts["gate_up_proj"].local_size(ctx.rank) // 2
        return None

    def install(self, module, ctx, name, layouts):
        group, remap = ctx.group, self.localize(module, ctx, layouts)

        def rewrite(role, value):
            if role == 1:
                return value if remap is None else remap(value)
            return comm.copy_to(value, group)

        module.register_forward_pre_hook(
            lambda m, args, kwargs: _rewrite_expert_args(args, kwargs, rewrite), with_kwargs=True
        )
        module.register_forward_hook(lambda m, args, out: comm.reduce_from(out, group))
        whole = [
            attr
            for attr, _ in module.named_parameters(recurse=False)
            if attr not in layouts or layouts[attr].is_replicated
        ]
        _add_once(module, whole, ctx.rank, group)


class GroupedGemm(ParallelStyle):
    """A stacked expert parameter [E, ...] under expert parallelism: each rank holds whole experts."""

    def param_layout(self, owner, attr, ctx, name):
        return chunks(0, even_sizes(owner.get_parameter(attr).shape[0], ctx.size))


class MoEEPExperts(MoETPExperts):
    """Expert parallelism: each rank holds E/ws whole experts (``grouped_gemm`` parameter rules).
    The router stays replicated; its expert ids are remapped here to local ones, and ids of other
    ranks' experts become transformers' EP sentinel (``num_experts``), which both its eager loop and
    its grouped_mm kernel skip, so those tokens add zero. Collectives as for ``moe_tp_experts``."""

    def layouts(self, module, ctx, name):
        """Every stacked parameter (biases too, whether or not a rule names them) by whole experts."""
        return {
            attr: GroupedGemm().param_layout(module, attr, ctx, f"{name}.{attr}")
            for attr, _ in module.named_parameters(recurse=False)
        }

    def localize(self, module, ctx, layouts):
        layout = next(layout for layout in layouts.values() if layout.dim == 0)
        ((start, stop),) = layout.ranges[ctx.rank]
        local = stop - start
        module.num_experts, module._is_expert_parallel = local, True

        def remap(index):
            index = index - start
            return index.masked_fill((index < 0) | (index >= local), local)

        return remap


class EmbeddingRowwise(ParallelStyle):
    """Vocab-parallel lookup: each rank embeds the ids in its vocab range, zeros the rest, all-reduce."""

    def layouts(self, module, ctx, name):
        return {"weight": chunks(0, even_sizes(module.weight.shape[0], ctx.size))}

    def install(self, module, ctx, name, layouts):
        group = ctx.group
        start, stop = layouts["weight"].ranges[ctx.rank][0]
        if getattr(module, "padding_idx", None) is not None:  # its row gets no gradient: keep it global
            module.padding_idx = module.padding_idx - start if start <= module.padding_idx < stop else None

        def mask_ids(m, args):
            ids = args[0]
            outside = (ids < start) | (ids >= stop)
            m._hfp_outside = outside
            return ((ids - start).masked_fill(outside, 0), *args[1:])

        def reduce(m, args, out):
            out = out.masked_fill(m._hfp_outside.unsqueeze(-1), 0)
            del m._hfp_outside
            return comm.reduce_from(out, group)

        module.register_forward_pre_hook(mask_ids)
        module.register_forward_hook(reduce)
        for param_name, param in module.named_parameters():  # e.g. a norm inside the embedding module:
            if param_name != "weight":  # it saw only this rank's tokens (the others are zeroed after it)
                comm.sum_gradient_over(param, group)


class EmbeddingColwise(ParallelStyle):
    """Hidden-dim-parallel lookup: each rank embeds its slice of the hidden dim, then all-gather."""

    def layouts(self, module, ctx, name):
        return {"weight": chunks(1, even_sizes(module.weight.shape[1], ctx.size))}

    def install(self, module, ctx, name, layouts):
        layout = layouts["weight"]
        sizes = [layout.local_size(r) for r in range(layout.world_size)]
        module.register_forward_hook(lambda m, args, out: comm.gather_from(out, -1, sizes, ctx.group))


class SequenceParallel(ParallelStyle):
    """Run the module on this rank's slice of the sequence (dim 1), gather it back after.

    Parameters are replicated and their gradients summed, since each rank saw only its tokens."""

    def install(self, module, ctx, name, layouts):
        group, ws = ctx.group, ctx.size
        state = {}

        def scatter(m, args):
            x = args[0]
            state["sizes"] = even_sizes(x.shape[1], ws)
            return (comm.scatter_to(x, 1, state["sizes"], group), *args[1:])

        module.register_forward_pre_hook(scatter)
        module.register_forward_hook(lambda m, args, out: comm.gather_from(out, 1, state["sizes"], group))
        for param in module.parameters(recurse=False):
            comm.sum_gradient_over(param, group)


class ShardedRMSNorm(ParallelStyle):
    """RMSNorm over a dim that is sharded like its input (OLMo-2's q_norm over all heads):
    the mean of squares is summed across ranks, so no all-gather of the activations is needed."""

    def layouts(self, module, ctx, name):
        return {"weight": per_rank(0, split_ranges(module.weight.shape[0], ctx, name))}

    def install(self, module, ctx, name, layouts):
        layout = layouts["weight"]
        full = max(stop for rank in layout.ranges for _, stop in rank)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        group = ctx.group
        # a replicated (KV) piece must count once in the sum of squares, not once per replica
        weights = torch.cat(
            [
                torch.full((stop - start,), 1.0 / count)
                for (start, stop), count in zip(layout.ranges[ctx.rank], layout.replica_counts(ctx.rank))
            ]
        )
        _sum_replicated_grads(module.weight, layout, ctx.rank, ctx.kv_group)

        def forward(hidden_states):
            dtype = hidden_states.dtype
            x = hidden_states.to(torch.float32)
            variance = comm.all_reduce_sum((x.pow(2) * weights.to(x.device)).sum(-1, keepdim=True), group) / full
            x = x * torch.rsqrt(variance + eps)
            return (module.weight * x).to(dtype)

        module.forward = forward


STYLES: dict[str, ParallelStyle] = {
    "replicated": Replicated(),
    "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce(),
    "colwise": Colwise(),
    "colwise_gather_output": ColwiseGatherOutput(),
    "packed_colwise": PackedColwise(),
    "grouped_qkv_colwise": GroupedQKVColwise(),
    "rowwise": Rowwise(),
    "rowwise_split_input": RowwiseSplitInput(),
    "packed_rowwise": PackedRowwise(),
    "moe_tp_experts": MoETPExperts(),
    "moe_ep_experts": MoEEPExperts(),
    "grouped_gemm": GroupedGemm(),
    "embedding_rowwise": EmbeddingRowwise(),
    "embedding_colwise": EmbeddingColwise(),
    "sequence_parallel": SequenceParallel(),
    "sharded_rmsnorm": ShardedRMSNorm(),
}


def register_style(name: str, style: ParallelStyle, *, overwrite: bool = False) -> None:
    """Make ``style`` usable by name in plans."""
    if not isinstance(style, ParallelStyle):
        raise TypeError(f"register_style({name!r}): expected a ParallelStyle instance, got {type(style).__name__}")
    if name in STYLES and not overwrite:
        raise ValueError(f"style {name!r} is already registered; pass overwrite=True to replace it")
    STYLES[name] = style


def get_style(name: str, rule: str = "") -> ParallelStyle:
    try:
        return STYLES[name]
    except KeyError:
        where = f" (rule {rule!r})" if rule else ""
        raise ValueError(
            f"unknown parallel style {name!r}{where}; registered styles: {', '.join(sorted(STYLES))}"
        ) from None
