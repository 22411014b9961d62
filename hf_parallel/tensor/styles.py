"""ParallelStyle: the layouts of a module's parameters and the collectives around its forward.

    Y = XW,  W = [W_1 .. W_p]  (colwise):   Y_r = copy_to(X) W_r          -> local Y_r
    Y = XW,  W = [W_1; .. W_p] (rowwise):   Y   = reduce_from(X_r W_r) + b

Every style has one lifecycle (transformers 5's shard -> prepare -> pre / around / post):

1. ``layouts`` (and ``param_layout`` for a parameter named by a rule of its own): which slice of
   each parameter a rank holds. Bookkeeping on the meta device, before any weight is read: the
   loader reads by it and ``hf-parallel plan`` prints it.
2. ``prepare``, once the local shards are in place: the module's local sizes and the gradient sums
   its split needs; it returns the ``Hooks`` that run around the module's forward.
3. ``install`` wraps the module's forward with those hooks, in one way for every style: ``pre`` on
   the inputs, ``around`` in place of the forward (which it may call), ``post`` on the output.

The styles of mixture-of-experts modules are in ``experts.py``; the registry by name is ``registry.py``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import comm
from .geometry import is_conv1d
from ..quant.kept_linear import KeptLinear
from ..core.layout import Layout, chunks, even_sizes, per_rank
from .splits import (
    GROUPED_MM_UNIT,
    ShardContext,
    dim_layout,
    grouped_qkv_layout,
    in_dim,
    interleaved_layout,
    out_dim,
    packed_layout,
    split_ranges,
    stacked_dims,
)


class Hooks(NamedTuple):
    """What runs around a module's forward, in this order; None: nothing at that point.

    ``pre`` and ``post`` are the collectives at the module's edges, ``around`` its local compute:
    when an adapter wraps the module (peft's LoRA), the edges move to the wrapper, so the adapter's
    own product joins the same collectives, and ``around`` stays on the module (``adapters/``)."""

    pre: Callable | None = None  # (args, kwargs) -> (args, kwargs)
    around: Callable | None = None  # (forward, *args, **kwargs) -> output, in place of forward(*args, **kwargs)
    post: Callable | None = None  # (output) -> output

    @property
    def edges(self) -> Hooks:
        return Hooks(self.pre, None, self.post)

    @property
    def compute(self) -> Hooks:
        return Hooks(None, self.around, None)


class AdapterSplit(NamedTuple):
    """How a low-rank adapter pair (y += B A x) on a module of a style splits over TP, following
    the module: ``side="out"``: B's rows split as the module's output (A whole); ``"in"``: A's
    columns as its input (B whole); None: both whole. ``sum_whole``: the whole matrices' gradients
    are summed over TP (each rank saw part of the product: its rows of the output, its inputs)."""

    side: str | None
    sum_whole: bool


def apply_hooks(module: nn.Module, hooks: Hooks) -> None:
    """``module.forward``: its class's forward wrapped with ``hooks`` (replacing an earlier wrapping)."""
    module.__dict__.pop("forward", None)
    pre, around, post = hooks
    if pre is None and around is None and post is None:
        return
    forward = module.forward

    def parallel_forward(*args, **kwargs):
        if pre is not None:
            args, kwargs = pre(args, kwargs)
        out = forward(*args, **kwargs) if around is None else around(forward, *args, **kwargs)
        return out if post is None else post(out)

    module.forward = parallel_forward


class ParallelStyle:
    """Base: replicated parameters, forward unchanged."""

    shards_heads = False  # True: the attention module around it must run on local heads
    places_descendants = False  # True: ``layouts`` also names parameters of submodules ("in_proj.weight")
    adapters: AdapterSplit | None = None  # None: a LoRA adapter on such a module is refused

    def layouts(self, module: nn.Module, ctx: ShardContext, name: str) -> dict[str, Layout]:
        return {}

    def param_layout(self, owner: nn.Module, attr: str, ctx: ShardContext, name: str) -> Layout:
        """The layout of ``owner.attr``, a parameter named by a rule of its own (stacked expert
        weights and biases, attention sinks)."""
        raise ValueError(f"plan rule for {name}: style {self} applies to modules, not to a single parameter")

    def prepare(self, module: nn.Module, ctx: ShardContext, layouts: dict[str, Layout]) -> Hooks:
        """``module`` holds its local shards (as ``layouts`` describe): set what its forward needs to
        run on them, and return the hooks around that forward."""
        return Hooks()

    def install(self, module: nn.Module, ctx: ShardContext, layouts: dict[str, Layout]) -> Hooks:
        """``prepare``, then the module's forward wrapped with its hooks (the same for every style)."""
        hooks = self.prepare(module, ctx, layouts)
        apply_hooks(module, hooks)
        return hooks

    def __repr__(self) -> str:
        return type(self).__name__


def local_sizes(layout: Layout) -> list[int]:
    """Every rank's extent of the split dim."""
    return [layout.local_size(rank) for rank in range(layout.world_size)]


def matmul(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` times ``module``'s weight, without its bias."""
    if isinstance(module, KeptLinear):  # its weight kept quantized: the module's own product
        return module.product(x)
    return x @ module.weight if is_conv1d(module) else F.linear(x, module.weight)


class Replicated(ParallelStyle):
    adapters = AdapterSplit(None, sum_whole=False)


class ReplicatedWithGradAllReduce(ParallelStyle):
    """Weights replicated, but each rank sees only its heads or tokens: sum the gradients."""

    adapters = AdapterSplit(None, sum_whole=True)

    def prepare(self, module, ctx, layouts):
        for param in module.parameters(recurse=False):
            ctx.gradients.sum_over(param, ctx.group)
        return Hooks()


class Colwise(ParallelStyle):
    """Y_r = copy_to(X) W_r^T + b_r; the output stays sharded on its last dim."""

    gather_output = False
    adapters = AdapterSplit("out", sum_whole=True)
    fused_layout = None  # packed_layout / grouped_qkv_layout for a dim made of blocks; None: plain split

    @property
    def shards_heads(self) -> bool:
        """Whether the module after this one sees only local heads (no gather of the output)."""
        return not self.gather_output

    def _layout(self, module, ctx, name) -> Layout:
        dim = out_dim(module)
        size = module.weight.shape[dim]
        if not self.shards_heads:
            ctx = ctx.unaligned()  # the output is gathered: any even split will do
        return dim_layout(dim, size, ctx, name, self.fused_layout)

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
            return dim_layout(0, param.shape[0], ctx, name, self.fused_layout)
        dim = 1 if param.dim() == 2 else stacked_dims(owner)[0]
        fused = self.fused_layout
        if fused is packed_layout and not getattr(owner, "is_concatenated", True):
            fused = interleaved_layout
        return dim_layout(dim, param.shape[dim], ctx.unaligned(GROUPED_MM_UNIT), name, fused)

    def prepare(self, module, ctx, layouts):
        group, sizes = ctx.group, local_sizes(layouts["weight"])
        for attr, param_layout in layouts.items():
            ctx.gradients.sum_pieces(getattr(module, attr), param_layout, ctx.rank, ctx.kv_group)
        if is_conv1d(module):
            module.nf = sizes[ctx.rank]  # Conv1D reshapes its output to nf features
        return Hooks(
            pre=lambda args, kwargs: ((comm.copy_to(args[0], group), *args[1:]), kwargs),
            post=(lambda out: comm.gather_from(out, -1, sizes, group)) if self.gather_output else None,
        )


class ColwiseGatherOutput(Colwise):
    gather_output = True


class PackedColwise(Colwise):
    fused_layout = staticmethod(packed_layout)


class GroupedQKVColwise(Colwise):
    fused_layout = staticmethod(grouped_qkv_layout)


class Rowwise(ParallelStyle):
    """Y = reduce_from(X_r W_r^T) + b; the bias is added once, after the sum."""

    split_input = False
    adapters = AdapterSplit("in", sum_whole=True)
    fused_layout = None

    def _layout(self, module, ctx, name) -> Layout:
        dim = in_dim(module)
        size = module.weight.shape[dim]
        if self.split_input:
            ctx = ctx.unaligned()  # splits a replicated input itself: any even split will do
        return dim_layout(dim, size, ctx, name, self.fused_layout)

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
        return dim_layout(dim, param.shape[dim], ctx.unaligned(GROUPED_MM_UNIT), name, self.fused_layout)

    def prepare(self, module, ctx, layouts):
        group, sizes = ctx.group, local_sizes(layouts["weight"])

        def split(args, kwargs):
            return (comm.scatter_to(args[0], -1, sizes, group), *args[1:]), kwargs

        def partial_product(forward, x, *args, **kwargs):
            return matmul(module, x)

        def reduce(y):
            y = comm.reduce_from(y, group)
            return y if module.bias is None else y + module.bias

        return Hooks(pre=split if self.split_input else None, around=partial_product, post=reduce)


class RowwiseSplitInput(Rowwise):
    split_input = True


class PackedRowwise(Rowwise):
    fused_layout = staticmethod(packed_layout)


class EmbeddingRowwise(ParallelStyle):
    """Vocab-parallel lookup: each rank embeds the ids in its vocab range, zeros the rest, all-reduce."""

    adapters = AdapterSplit(None, sum_whole=False)  # an adapter's lookup is whole: it takes every id

    def layouts(self, module, ctx, name):
        return {"weight": chunks(0, even_sizes(module.weight.shape[0], ctx.size))}

    def prepare(self, module, ctx, layouts):
        group = ctx.group
        start, stop = layouts["weight"].ranges[ctx.rank][0]
        if getattr(module, "padding_idx", None) is not None:  # its row gets no gradient: keep it global
            module.padding_idx = module.padding_idx - start if start <= module.padding_idx < stop else None
        for param_name, param in module.named_parameters():  # e.g. a norm inside the embedding module:
            if param_name != "weight":  # it saw only this rank's tokens (the others are zeroed after it)
                ctx.gradients.sum_over(param, group)

        def around(forward, ids, *args, **kwargs):
            outside = (ids < start) | (ids >= stop)
            out = forward((ids - start).masked_fill(outside, 0), *args, **kwargs)
            return comm.reduce_from(out.masked_fill(outside.unsqueeze(-1), 0), group)

        return Hooks(around=around)


class EmbeddingColwise(ParallelStyle):
    """Hidden-dim-parallel lookup: each rank embeds its slice of the hidden dim, then all-gather."""

    adapters = AdapterSplit("out", sum_whole=True)

    def layouts(self, module, ctx, name):
        return {"weight": chunks(1, even_sizes(module.weight.shape[1], ctx.size))}

    def prepare(self, module, ctx, layouts):
        sizes, group = local_sizes(layouts["weight"]), ctx.group
        return Hooks(post=lambda out: comm.gather_from(out, -1, sizes, group))


class EmbeddingHeads(ParallelStyle):
    """A lookup table of one value per attention head (T5's relative position bias, [buckets, heads]):
    each rank keeps its heads' columns, so the bias it builds has exactly its local heads. No
    collective; each rank's gradient is its own columns' (no other rank computes them)."""

    shards_heads = True

    def layouts(self, module, ctx, name):
        if ctx.heads is None:
            raise ValueError(
                f"{name}: embedding_heads splits a per-head table, so it must sit inside a split attention"
            )
        size = module.weight.shape[1]
        if size != ctx.heads.num_heads:
            raise ValueError(
                f"{name}: embedding_heads expects one column per query head ({ctx.heads.num_heads}), got {size}"
            )
        return {"weight": per_rank(1, split_ranges(size, ctx, name))}


class TokensOverTP(ParallelStyle):
    """Megatron's sequence parallelism *inside the tensor-parallel group* (transformers' style name
    ``sequence_parallel``): the module (a norm) runs on this TP rank's slice of the tokens (dim 1),
    gathered back after. Not Ulysses: splitting every sequence over the mesh's own ``sp`` dimension
    (``sp_size``) is ``hf_parallel/sequence/``.

    Parameters are replicated and their gradients summed over TP, since each rank saw only its tokens."""

    def prepare(self, module, ctx, layouts):
        group, ws = ctx.group, ctx.size
        for param in module.parameters(recurse=False):
            ctx.gradients.sum_over(param, group)

        def around(forward, x, *args, **kwargs):
            sizes = even_sizes(x.shape[1], ws)
            out = forward(comm.scatter_to(x, 1, sizes, group), *args, **kwargs)
            return comm.gather_from(out, 1, sizes, group)

        return Hooks(around=around)


class ShardedRMSNorm(ParallelStyle):
    """RMSNorm over a dim that is sharded like its input (OLMo-2's q_norm over all heads):
    the mean of squares is summed across ranks, so no all-gather of the activations is needed."""

    def layouts(self, module, ctx, name):
        return {"weight": per_rank(0, split_ranges(module.weight.shape[0], ctx, name))}

    def prepare(self, module, ctx, layouts):
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
        ).to(module.weight.device)  # made once; the call's .to is a no-op unless the module moved
        ctx.gradients.sum_pieces(module.weight, layout, ctx.rank, ctx.kv_group)

        def around(forward, hidden_states):
            dtype = hidden_states.dtype
            x = hidden_states.to(torch.float32)
            variance = comm.all_reduce_sum((x.pow(2) * weights.to(x.device)).sum(-1, keepdim=True), group) / full
            x = x * torch.rsqrt(variance + eps)
            return (module.weight * x).to(dtype)

        return Hooks(around=around)
