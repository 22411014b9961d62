"""Kept experts dequantized only where tokens go (``keep_quantized=True`` on a fused-experts module).

A kept weight of any other module is dequantized whole for each call. An experts module holds every local
expert ([E, ...]: Qwen3-MoE, DeepSeek-V3, GPT-OSS, Mixtral), and a decode step routes each token to only
``top_k`` of them, so dequantizing all E per step (what transformers' grouped_mm forward would need: it
takes the whole [E, ...] weight) costs E / top_k times the work of the experts used: 16x for 128 experts
and top-8.

So where a call routes no more (token, expert) pairs than the module holds experts (decode steps, small
batches), the module computes as if it held one expert per pair: each pair's expert is dequantized (its
kept parts gathered by expert id on the device, no host sync, every pair at once through ``torch.vmap`` of
the format's own dequantization), every other per-expert parameter (biases) gathered likewise, and the
pairs' ids become 0..pairs-1 (an expert parallel sentinel stays the sentinel, now ``pairs``). transformers'
experts forward (eager, grouped_mm or batched_mm: whichever the config names) runs unchanged on that
module of ``pairs`` experts; the numbers are the whole weight's, each pair multiplied by the same rows.
Larger calls (prefill) dequantize every expert into the slots, as other modules do.

Where the module is transformers' gated kind without biases (Qwen3-MoE, DeepSeek-V3, Mixtral), a step can
skip the dequantization: each pair's row is multiplied by its own expert's weight as stored, and the gate,
down product, routing weights and sum follow transformers' grouped_mm forward. FP8 weights take the package's
FP8 kernel with expert ids where it runs (``fp8_weight_only.weight_only_product``, one launch for all pairs). With
``keep_quantized="int4"`` on CPU, GPTQ / AWQ / compressed-tensors int4 experts are repacked at load for
torch's int4 kernel, an expert's pack beside its stored words (``int4_torch.stacked``), and a step makes a
kernel call a pair (``int4_torch.int4_product`` with expert ids): on CPU dequantizing a decode step's experts costs
far more than those calls. Not on CUDA: there the calls would be launches a pair, and dequantizing the
step's experts is a few launches of memory-bound work.

The module's class is swapped for a subclass with this forward (``KeptExperts.hold``, as FSDP2's
``fully_shard`` swaps a module's class) before the TP / EP hooks wrap it, so it sees the expert ids EP has
made local. A kept weight's per-expert pieces (one per expert key, or per expert and part) are stacked once at
load into one tensor per part, the pieces keeping views of it (what a save reads), so the gather is one index
per part. Pieces that cannot stack (an act-order GPTQ expert's groups start elsewhere than its neighbour's)
leave that module on the whole-weight path.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import fields, replace

import torch
from torch import nn

from .base import Kept
from ..compat.torch import MODULE_PARAMETERS, parameters_replaced
from .kernels import fp8_weight_only, int4_torch
from ..core.expert_args import EXPERT_ARG_ROLES, expert_args, rewrite_expert_args
from .kept_linear import rows_in_order


class ExpertRows:
    """A kept weight's experts gathered by id: ``rows(ids)`` is ``weight.dequantize()[ids]`` without
    dequantizing the others. ``stacks``: per part of each expert's slice (its place there), the experts'
    ``Kept`` boxes of that part stacked along a new leading dim (or one box holding every expert)."""

    def __init__(self, weight, stacks: list[tuple[tuple, Kept, bool]]):
        self.weight, self.stacks = weight, stacks  # (place in an expert's slice, stacked box, box holds E)
        self.kernel_plans = [fp8_weight_only.LaunchPlans() for _ in stacks]  # each stack's launches, once a shape
        self.int4_stacks = None  # each stack's experts' packs for torch's int4 kernel (``int4_packed``), or None

    @classmethod
    def of(cls, weight) -> ExpertRows | None:
        """Stack ``weight``'s (a ``KeptWeight`` [E, ...]) pieces, each piece then holding views of the stack;
        None where they do not stack."""
        experts, one_each, stacks = weight.shape[0], [], []
        for piece in weight.pieces:
            first, place = piece.at[0], piece.at[1:]
            if piece.kept.holds_experts:  # one box of all the experts (MXFP4: [E, out, groups, 16])
                if (first.start, first.stop) != (0, experts):
                    return None
                stacks.append((place, piece.kept, True))
            else:  # one expert's box: stacked with the others' of its place
                one_each.append((piece.kept, piece.at, piece))
        places = _experts_by_place(one_each, experts)
        if places is None:
            return None
        for place, ordered in places:  # one place at a time: its pieces' bytes are held twice only meanwhile
            stacked = _stacked([p.kept for p in ordered])
            for e, piece in enumerate(ordered):  # views of the stack: the bytes once
                piece.kept = replace(piece.kept, **{name: t[e] for name, t in stacked.tensors().items()})
            stacks.append((place, stacked, False))
        return cls(weight, stacks)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Experts ``ids`` (int64, on the device) dequantized: [len(ids), *an expert's shape]."""
        weight = self.weight
        out = torch.empty((ids.numel(), *weight.shape[1:]), dtype=weight.dtype, device=ids.device)
        for place, stacked, holds_all in self.stacks:
            taken = {name: t.index_select(0, ids) for name, t in stacked.tensors().items()}
            if holds_all:  # the format dequantizes its experts' dim itself
                values = replace(stacked, **taken).dequantize(weight.dtype)
            else:  # every expert at once, by the format's own dequantization
                one = functools.partial(_dequantized, stacked, weight.dtype, list(taken))
                values = torch.vmap(one)(*taken.values())
            target = out[(slice(None), *place)]
            target.copy_(values.reshape(target.shape))
        return out

    def _whole_rows(self) -> bool:
        """Whether every part is a stack of per-expert boxes of whole rows of an expert's slice, tiling them."""
        if len(self.weight.shape) != 3 or not self.stacks or any(holds_all for _, _, holds_all in self.stacks):
            return False
        return rows_in_order([place for place, _, _ in self.stacks], self.weight.shape[1:]) is not None

    def multiplies_as_stored(self) -> bool:
        """Whether a step's pairs multiply by their experts as stored: every part's stack repacked for torch's
        int4 kernel (``int4_stacks``), or taken by the weight-only FP8 kernel with expert ids on its device
        (``fp8_weight_only.takes``)."""
        if self.int4_stacks is not None:
            return True
        takes = functools.partial(fp8_weight_only.takes, shape=None, dtype=self.weight.dtype, experts=True)
        return self._whole_rows() and all(takes(stacked) for _, stacked, _ in self.stacks)

    def int4_packed(self) -> list | None:
        """Each stack's experts repacked for torch's int4 kernel (``int4_torch.int4_pack`` an expert, then
        ``stacked``), for ``int4_stacks``; None where a part is not taken (not int4, another dtype, act-order
        experts spread each their own way)."""
        if not self._whole_rows():
            return None
        stacks = []
        for (rows, columns), stacked, _ in self.stacks:
            shape, experts = (rows.stop - rows.start, columns.stop - columns.start), self.weight.shape[0]
            packs = [int4_torch.int4_pack(replace(stacked, **{name: t[e] for name, t in stacked.tensors().items()}),
                                           shape, self.weight.dtype) for e in range(experts)]  # fmt: skip
            stacks.append(int4_torch.stacked(packs))
            if stacks[-1] is None:
                return None
        return stacks

    def product(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each row ``p`` of ``x`` times expert ``ids[p]``'s weight as stored (``multiplies_as_stored``)."""
        out = torch.empty(x.shape[0], self.weight.shape[1], dtype=x.dtype, device=x.device)
        if self.int4_stacks is not None:
            for ((rows, _), _, _), stack in zip(self.stacks, self.int4_stacks):
                out[:, rows] = int4_torch.int4_product(x, stack, ids)
            return out
        # none while compiling, as ``FP8WeightOnlyKernel``'s (dynamo would guard on their lengths)
        plans = [None] * len(self.stacks) if torch.compiler.is_compiling() else self.kernel_plans
        for ((rows, _), stacked, _), stack_plans in zip(self.stacks, plans):
            out[:, rows] = fp8_weight_only.weight_only_product(x, stacked, plans=stack_plans, ids=ids)
        return out


def _experts_by_place(one_each: list[tuple], experts: int) -> list[tuple] | None:
    """Boxes of one expert each (``one_each``: (box, its place in the [E, ...] shard, what to return for it)),
    grouped by their place in an expert's slice: [(the place, a tuple of slices; its items in expert order)];
    None where a box spans experts, a place lacks an expert or its boxes do not stack (``_stack_together``)."""
    by_place: dict = {}
    for kept, at, item in one_each:
        if at[0].stop - at[0].start != 1 or kept.holds_experts:
            return None
        by_place.setdefault(_key(at[1:]), {})[at[0].start] = (kept, item)
    places = [(tuple(slice(a, b) for a, b in key), [boxes.get(e) for e in range(experts)])
              for key, boxes in by_place.items()]  # fmt: skip
    if any(None in ordered or not _stack_together([kept for kept, _ in ordered]) for _, ordered in places):
        return None
    return [(place, [item for _, item in ordered]) for place, ordered in places]


def int4_stack_nbytes(placed: list[tuple[Kept, tuple]], shape: tuple, dtype) -> int | None:
    """What ``ExpertRows.int4_packed`` holds for one weight of a rank's experts [E, out, in] of ``shape``, from
    its boxes and where each goes (``placed``; boxes kept with ``meta``: a plan's figure); None where it would
    hold none (the stacks ``ExpertRows.of`` makes, of whole rows, every expert's pack in one form)."""
    places = _experts_by_place([(kept, at, kept) for kept, at in placed], shape[0])
    if not places or rows_in_order([place for place, _ in places], shape[1:]) is None:
        return None
    total = 0
    for (rows, columns), ordered in places:
        forms = {int4_torch.pack_form(box, (rows.stop - rows.start, columns.stop - columns.start), dtype)
                 for box in ordered}  # fmt: skip
        if len(forms) != 1 or None in forms:
            return None
        total += forms.pop().nbytes * shape[0]
    return total


def _dequantized(template: Kept, dtype, names: list, *tensors) -> torch.Tensor:
    return replace(template, **dict(zip(names, tensors))).dequantize(dtype)


def _key(place: tuple) -> tuple:
    return tuple((s.start, s.stop) for s in place)


def _stack_together(boxes: list[Kept]) -> bool:
    """Whether ``boxes`` differ in nothing but their tensors' values and where they were read from."""
    first = boxes[0]
    same = [f.name for f in fields(first) if f.name != "at" and not isinstance(getattr(first, f.name), torch.Tensor)]
    shapes = {name: t.shape for name, t in first.tensors().items()}
    return all(all(getattr(box, name) == getattr(first, name) for name in same)
               and {name: t.shape for name, t in box.tensors().items()} == shapes for box in boxes[1:])  # fmt: skip


def _stacked(boxes: list[Kept]) -> Kept:
    """One box whose tensors are ``boxes``' stacked along a new leading dim (the first's other fields)."""
    return replace(boxes[0], **{name: torch.stack([getattr(b, name) for b in boxes]) for name in boxes[0].tensors()})


class KeptExperts(nn.Module):
    """The forward of a fused-experts module whose weights are kept (mixed in before its own class)."""

    kept_rows: dict  # attr -> ExpertRows, or None: that weight dequantizes whole
    kept_weights: dict  # attr -> KeptWeight
    per_expert: tuple  # its other parameters (biases), gathered by id alike (the placeholders never touched)
    kernel_products: bool  # a step's pairs multiply their experts as stored (``_products_as_stored``)

    @staticmethod
    def hold(module: nn.Module, weights: dict, int4_kernels: bool = False) -> KeptExperts:
        """Make ``module`` compute with its kept ``weights``: its class becomes its own with this forward mixed
        in (the module stays the same object, as FSDP2's ``fully_shard`` swaps a module's class), then it
        stacks its weights' experts and chooses how a step multiplies them (``_take``)."""
        module.__class__ = _kept_class(type(module))
        module._take(weights, int4_kernels)
        return module

    def _take(self, weights: dict, int4_kernels: bool) -> None:
        """Its kept weights, their experts stacked (``ExpertRows``), repacked for torch's int4 kernel where asked
        for on CPU (both weights, or neither), and whether a step multiplies them as stored."""
        self.kept_weights = weights
        self.per_expert = tuple(attr for attr, _ in self.named_parameters(recurse=False) if attr not in weights)
        self.kept_rows = {attr: ExpertRows.of(weight) for attr, weight in weights.items()}
        whole_rows = _takes_kernel_products(self, lambda rows: rows._whole_rows())
        if int4_kernels and whole_rows and next(iter(weights.values())).device.type == "cpu":
            packed = {attr: rows.int4_packed() for attr, rows in self.kept_rows.items()}
            if None not in packed.values():  # both weights through the kernel, or neither
                for attr, stacks in packed.items():
                    self.kept_rows[attr].int4_stacks = stacks
        self.kernel_products = _takes_kernel_products(self)

    def forward(self, *args, **kwargs):
        hidden, ids, routing = expert_args(args, kwargs)
        experts, pairs = self.num_experts, ids.numel()
        if pairs == 0 or pairs > experts or any(rows is None for rows in self.kept_rows.values()):
            whole = {attr: weight.dequantize() for attr, weight in self.kept_weights.items()}
            return self._forward_with(whole, experts, args, kwargs)
        grad = torch.is_grad_enabled() and hidden.requires_grad
        if self.kernel_products and not grad and hidden.dtype == self.kept_weights["down_proj"].dtype:
            return self._products_as_stored(hidden, ids, routing)
        index = ids.reshape(-1).clamp(max=experts - 1)  # EP's sentinel (``experts``) gathers any; it is skipped
        own = torch.arange(pairs, device=ids.device).view_as(ids)
        per_pair = torch.where(ids < experts, own, pairs)
        slots = {attr: self._parameters[attr].index_select(0, index) for attr in self.per_expert}  # biases
        slots.update({attr: rows.rows(index) for attr, rows in self.kept_rows.items()})
        args, kwargs = rewrite_expert_args(args, kwargs, lambda role, value: per_pair if role == 1 else value)
        return self._forward_with(slots, pairs, args, kwargs)

    def _products_as_stored(self, hidden, ids, routing) -> torch.Tensor:
        """transformers' experts forward for a gated, bias-free, untransposed module (grouped_mm's steps: the
        gate|up product, ``_apply_gate``, the down product, weighted by the routing and summed over each
        token's experts), each pair's products from the stored bytes (``ExpertRows.product``)."""
        experts, (tokens, top_k) = self.num_experts, ids.shape
        index = ids.reshape(-1).clamp(max=experts - 1)
        pairs = hidden.repeat_interleave(top_k, 0)  # pair p is token p // top_k's
        gated = self._apply_gate(self.kept_rows["gate_up_proj"].product(pairs, index))
        out = self.kept_rows["down_proj"].product(gated, index) * routing.reshape(-1, 1)
        out = torch.where((ids < experts).reshape(-1, 1), out, 0)  # EP's sentinel: another rank's expert
        return out.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)

    def _forward_with(self, slots: dict, experts: int, args, kwargs):
        """The class's forward with ``slots`` in those parameters' places, as a module of ``experts`` experts;
        put back after, whatever happens."""
        held = self.num_experts
        with parameters_replaced(self, slots):
            self.num_experts = experts
            try:
                return super().forward(*args, **kwargs)
            finally:
                self.num_experts = held


def gated_experts(module) -> bool:
    """transformers' gated experts (``use_experts_implementation``'s flags: a gate|up weight, no biases, not
    transposed, no norm after each expert): their forward ``_products_as_stored`` follows."""
    flags = [getattr(module, name, None) for name in ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")]
    return flags == [True, False, False, False]


def _takes_kernel_products(module, takes=ExpertRows.multiplies_as_stored) -> bool:
    """Gated experts whose two weights a kernel multiplies as stored."""
    rows = module.kept_rows
    return gated_experts(module) and set(rows) == {"gate_up_proj", "down_proj"} and all(
        r is not None and takes(r) for r in rows.values()
    )


@functools.cache
def _kept_class(cls: type) -> type:
    return type(f"Kept{cls.__name__}", (KeptExperts, cls), {})


def hold_experts(module: nn.Module, weights: dict, int4_kernels: bool = False) -> bool:
    """Make a fused-experts module (transformers' experts forward taking expert ids, an int ``num_experts``,
    every parameter stacked [E, ...]) compute with its kept ``weights`` (attr -> ``KeptWeight``) as this
    module's docstring says (``int4_kernels``: int4 experts on CPU through torch's int4 kernel); False for
    any other."""
    params = dict(module.named_parameters(recurse=False))
    leading = {tuple(p.shape[:1]) for p in params.values()}
    named = inspect.signature(type(module).forward).parameters  # transformers' experts forward: (hidden, ids, ..)
    routed = any(EXPERT_ARG_ROLES.get(name) == 1 for name in named)
    if not routed or not isinstance(getattr(module, "num_experts", None), int) or len(leading) != 1:
        return False
    if any(p.dim() < 2 for p in params.values()):  # stacked weights [E, out, in] and biases [E, out] only
        return False
    if not set(weights) <= set(params) or any(w.shape[:1] != next(iter(leading)) for w in weights.values()):
        return False
    MODULE_PARAMETERS.get()  # the forward swaps entries of the module's parameters for its call
    KeptExperts.hold(module, weights, int4_kernels)
    return True
