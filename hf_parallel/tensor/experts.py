"""Styles of mixture-of-experts modules: expert tensor parallelism (every expert split inside) and
expert parallelism (whole experts spread over the ranks), with the parameter rule of stacked experts.

transformers' experts forward takes (hidden states, expert ids, routing weights) on the whole batch
of routed tokens; both styles keep that call and sum the ranks' partial outputs with one all-reduce.
"""

from __future__ import annotations

from dataclasses import replace

from ..compat.torch import parameters_replaced
from ..compat.transformers import mark_expert_parallel
from ..core.expert_args import rewrite_expert_args
from ..distributed import comm
from ..core.layout import chunks, even_sizes
from .styles import Hooks, ParallelStyle
from .token_exchange import EXCHANGE_ATTR, TokenExchange

def _counted_once(module, attrs: list[str], rank: int):
    """Whole parameters added inside a split computation (GPT-OSS's down_proj_bias, inside each
    expert before the sum over ranks) count on rank 0 only: elsewhere the forward sees them times
    zero (their gradient, all of it on rank 0, is summed over the group by the caller)."""
    if rank == 0 or not attrs:
        return None

    def around(forward, *args, **kwargs):
        with parameters_replaced(module, {attr: module.get_parameter(attr) * 0 for attr in attrs}):
            return forward(*args, **kwargs)

    return around


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

    def prepare(self, module, ctx, layouts):
        group, remap = ctx.group, self.localize(module, ctx, layouts)

        def rewrite(role, value):
            if role == 1:
                return value if remap is None else remap(value)
            return comm.copy_to(value, group)

        whole = [
            attr
            for attr, _ in module.named_parameters(recurse=False)
            if attr not in layouts or layouts[attr].is_replicated
        ]
        for attr in whole:
            ctx.gradients.sum_over(module.get_parameter(attr), group)
        return Hooks(
            pre=lambda args, kwargs: rewrite_expert_args(args, kwargs, rewrite),
            around=_counted_once(module, whole, ctx.rank),
            post=lambda out: comm.reduce_from(out, group),
        )


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
        mark_expert_parallel(module, local)

        def remap(index):
            index = index - start
            return index.masked_fill((index < 0) | (index >= local), local)

        return remap


class MoETokenExchange(ParallelStyle):
    """Expert parallelism under ``ep_size``: each EP rank holds its experts whole (``E / ep``, some ranks one
    more where that does not divide), its layouts written over the mesh's ``ep`` dimension; tokens travel
    to them and back (``token_exchange.py``). Each rank routes only its own tokens, so attention and the
    dense layers are data-parallel over the EP group; no gradient sum: each expert saw every token routed
    to it, and the data dimensions (FSDP over ``ep_replicas``) do the rest."""

    def layouts(self, module, ctx, name):
        ep = ctx.mesh.ep
        return {
            attr: replace(chunks(0, even_sizes(param.shape[0], ep.size)), over="ep")
            for attr, param in module.named_parameters(recurse=False)
        }

    def prepare(self, module, ctx, layouts):
        layout = next(iter(layouts.values()))
        first = [pieces[0][0] for pieces in layout.ranges]
        num_experts = layout.ranges[-1][0][1]
        mark_expert_parallel(module, layout.local_size(ctx.mesh.ep.rank))
        exchange = TokenExchange(module, ctx.mesh.ep, ctx.mesh.tp, first, num_experts)
        setattr(module, EXCHANGE_ATTR, exchange)  # (``count_expert_tokens`` finds it there)
        return Hooks(around=lambda forward, *args, **kwargs: exchange(forward, args, kwargs))
