"""Expert parallelism that moves tokens, not weights: each rank routes its own tokens, sends each
(token, expert) pair to the rank holding that expert, runs its own experts on what arrives, and
sends the outputs back to be weighted and summed (torchtitan's ``_token_dispatch`` / ``_token_combine``
around ``all_to_all_single`` with variable splits; dropless).

The EP group is ``tp`` ranks times ranks borrowed from the data dimensions (``shape.py``). The TP ranks
of one group hold the same tokens, so each takes its share of them first and the outputs are gathered
back over TP at the end (split forward / gather backward and the reverse: each token is computed once).

Per layer the ranks first gather every rank's tokens per expert (``[ep, num_experts]`` integers, one host
read, as torchtitan's): every rank then knows every pair's piece, so the exchange needs no padding. The
routing weights stay with the sender: the experts compute with weight one and the sender multiplies the
outputs as transformers' experts forward would, so the router's gradient never travels. The combine puts
each pair back in its (token, k) place and sums over k: no atomic adds, so the same bits on every run.
"""

from __future__ import annotations

import torch

from ..compat.torch import current_backward
from ..core.expert_args import expert_args, rewrite_expert_args
from ..core.layout import even_sizes
from ..distributed import comm

EXCHANGE_ATTR = "_hf_parallel_token_exchange"  # an experts module's ``TokenExchange``, set by its style


class TokenExchange:
    """The dispatch, local experts and combine of one experts module under ``ep_size``.

    ``first_experts[r]``: the first expert id EP rank ``r`` holds (its experts are contiguous, some
    ranks one more where they do not divide evenly). ``counts``: when asked for (``count_expert_tokens``), a
    device tensor of tokens per expert this rank routed, added to without a host read."""

    def __init__(self, module, ep, tp, first_experts: list[int], num_experts: int):
        self.module, self.ep, self.tp, self.num_experts = module, ep, tp, num_experts
        self.counts: torch.Tensor | None = None
        # the split sizes are read on the host: in a compiled model the exchange runs eagerly (made here, not
        # at import: the compiler's modules are heavy, and a consolidation never builds a model)
        self._exchange = torch.compiler.disable(self._exchange)
        self.first = list(first_experts) + [num_experts]
        self.local = self.first[ep.rank + 1] - self.first[ep.rank]

    def __call__(self, forward, args: tuple, kwargs: dict) -> torch.Tensor:
        return self._exchange(forward, args, kwargs)

    def _exchange(self, forward, args: tuple, kwargs: dict) -> torch.Tensor:
        hidden, expert_ids, weights = expert_args(args, kwargs)
        rows = even_sizes(hidden.shape[0], self.tp.size)  # each TP rank's share of the tokens
        mine = comm.scatter_to(hidden, 0, rows, self.tp.group)
        expert_ids = comm.split(expert_ids, 0, rows, self.tp.group)
        weights = comm.scatter_to(weights, 0, rows, self.tp.group)
        top_k = expert_ids.shape[-1]
        flat = expert_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # grouped by expert, so by destination rank
        token = torch.div(order, top_k, rounding_mode="floor")
        per_expert = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        per_expert.index_add_(0, flat, torch.ones_like(flat))  # (bincount would read its range on the host)
        if self.counts is not None and current_backward() == -1:  # (not again in a checkpoint's recompute)
            self.counts += per_expert
        sends, receives, peak, arriving = self._sizes(per_expert)
        received = comm.all_to_all(mine[token], 0, 0, sends, receives, self.ep.group, peak)
        local_ids = torch.arange(self.local, device=hidden.device).repeat(self.ep.size)
        local_ids = local_ids.repeat_interleave(arriving, output_size=received.shape[0])
        ones = received.new_ones(received.shape[0], 1, dtype=weights.dtype)
        values = (received, local_ids[:, None], ones)
        args, kwargs = rewrite_expert_args(args, kwargs, lambda role, _: values[role])
        outputs = forward(*args, **kwargs)
        if received.shape[0] == 0 and torch.is_grad_enabled():
            # no token came: the backward must still run both exchanges here (the other ranks wait in them), and
            # every expert parameter gets its (zero) gradient
            outputs = outputs + received.sum() * 0 + sum(p.sum() * 0 for p in self.module.parameters())
        back = comm.all_to_all(outputs, 0, 0, receives, sends, self.ep.group, peak)
        weighted = back * weights.reshape(-1)[order, None]  # (in the weights' dtype, as transformers')
        # each pair back in its (token, k) place, then summed over k: no atomics, the same sum on every run
        pairs = torch.empty_like(weighted).index_copy(0, order, weighted)
        combined = pairs.view(-1, top_k, pairs.shape[-1]).sum(1).to(mine.dtype)
        return comm.gather_from(combined, 0, rows, self.tp.group)

    def _sizes(self, per_expert: torch.Tensor) -> tuple[list[int], list[int], int, torch.Tensor]:
        """(rows this rank sends each EP rank, rows it receives from each, the most rows between any two ranks,
        tokens arriving per (source rank, local expert)), from every rank's tokens per expert: one host read."""
        size = self.ep.size
        everyone = comm.all_gather(per_expert[None], 0, [1] * size, self.ep.group)  # [ep, num_experts]
        by_rank = torch.stack(
            [everyone[:, self.first[r] : self.first[r + 1]].sum(1) for r in range(size)], 1
        )  # [source, destination]
        arriving = everyone[:, self.first[self.ep.rank] : self.first[self.ep.rank + 1]].reshape(-1)
        table = by_rank.cpu()  # the host read
        sends, receives = table[self.ep.rank].tolist(), table[:, self.ep.rank].tolist()
        return sends, receives, int(table.max()), arriving


def count_expert_tokens(model, paths: list[str], device: torch.device) -> dict[str, torch.Tensor]:
    """``from_pretrained(count_expert_tokens=True)``: per experts module (by path), a device tensor of the
    tokens this rank routed to each expert, added to by every forward without a host read."""
    counts = {}
    for path in paths:
        exchange = getattr(model.get_submodule(path), EXCHANGE_ATTR)
        exchange.counts = counts[path] = torch.zeros(exchange.num_experts, dtype=torch.int64, device=device)
    return counts


def refuse_local_router_loss(model) -> None:
    """Under ``ep_size`` a forward asked for ``output_router_logits=True`` is refused: the router's auxiliary loss
    would count this rank's tokens per expert, not the global batch's (the load refuses it in the config)."""

    def check(_, args, kwargs):
        if kwargs.get("output_router_logits"):
            raise ValueError(
                "output_router_logits=True under ep_size: the router's auxiliary loss would count only this rank's "
                "tokens per expert, not the global batch's; call the model without it"
            )

    model.register_forward_pre_hook(check, with_kwargs=True)
