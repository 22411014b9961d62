"""Ring attention: context parallelism's attention, exact, after the Ulysses all-to-all.

Each Ulysses rank holds, for a slice of the heads, its group's tokens: two zigzag chunks of the
sequence (``tokens.py``). The ranks at the same Ulysses index of every group form a ring (the
mesh's ``cp``); their key/value blocks travel around it, one step at a time, so after ``cp`` steps
every query has met every key. Each step gives, per (query chunk, key chunk) pair, a partial output
and its log-sum-exp; partials merge exactly (``o = sum_i exp(lse_i - lse) o_i``, ``lse = logaddexp``
over the i), in float32, as flash attention's online softmax does.

The mask is the model's own, built per chunk pair at the pair's size from the description its mask
creation handed over (``masks.py``: transformers' mask function, with padding, packed documents and
sliding windows; chunks are contiguous runs of positions), or, where there is none (sdpa's causal fast
path), causality from the chunks' positions. A pair whose keys all come after its queries is skipped
(the model is causal: checked at load, and its mask once per call), and so is one wholly outside a
sliding window; with eager's additive mask over padding every pair is computed (``RingPlan.additive``).
Attention sinks (gpt-oss: one logit per head added to every softmax's denominator) enter once, after
the merge. Each pair goes through a fused kernel that returns its log-sum-exp (``pair_kernels.py``: torch's
flash kernel on the CPU, the memory-efficient one in the model's dtype on CUDA); soft-capped pairs and eager's
additive masks over padding are written out in float32.

The whole ring is one autograd function (as ring-flash-attention's): its backward sends the blocks
round again and recomputes each pair's probabilities from the saved log-sum-exp, so no scores are
kept between forward and backward, and every rank runs the same exchanges in the same order whatever
pairs it skips. Memory: no ``[S, S]`` tensor of the model's (a 4D mask a caller hands the model is read
per pair); a pair's mask is ``[batch, 1, c, c]``, and a written-out pair's scores ``[batch, heads,
SCORE_TILE, c]``.
Each step's key/value block is on its way to the next rank while the step's pairs compute (an
asynchronous all-to-all); the gradients travelling with it in the backward leave once the step's
pairs have added to them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..distributed import comm
from .masks import OPENS_AFTER, MaskDescription, skipped_pairs_opened, what_opens
from .pair_kernels import compute_dtype, pair_backward, pair_forward, pair_kernel


@dataclass(frozen=True)
class RingPlan:
    """What one layer's ring attention needs beyond its tensors (the same on every rank of the ring)."""

    layout: object  # the call's TokenLayout
    ring: object  # the mesh's cp Dim
    mask: MaskDescription | torch.Tensor | None  # the model's mask (masks.py; a 4D tensor if the caller gave one;
    # None: causal from positions)
    scale: float
    softcap: float | None
    window: int | None
    groups: int  # query heads per key/value head
    device: torch.device = torch.device("cpu")  # where the tensors are
    eager: bool = False  # the model computes attention with eager's additive masks

    @property
    def additive(self) -> bool:
        """Eager's additive mask over padding: a query masked from every key (left padding) attends to all
        of them alike, with gradients to every score, so every pair is computed; sdpa's boolean mask gives
        such a query zeros, and pairs are skipped where causality or the window rules every key out."""
        if isinstance(self.mask, MaskDescription):
            return self.eager and self.mask.padding is not None
        return self.mask is not None and self.mask.dtype != torch.bool

    def pairs(self, step: int):
        """``(a, qi, b, ki, keys)`` for each (query chunk, key chunk) pair computed at ``step``: the
        chunks' places in the held tensors, their ids, and the key chunk's keys before the padding."""
        layout, c = self.layout, self.layout.chunk
        source = (self.ring.rank - step) % self.ring.size
        for a, qi in enumerate(layout.chunks_of(self.ring.rank)):
            for b, ki in enumerate(layout.chunks_of(source)):
                keys = min(max(layout.tokens - ki * c, 0), c)
                outside = ki > qi or (self.window and (qi - ki - 1) * c + 1 > self.window)
                if keys and (self.additive or not outside):
                    yield a, qi, b, ki, keys

    def kernel(self, q: torch.Tensor, v: torch.Tensor) -> str | None:
        """The fused kernel each pair goes through (``pair_kernels.py``: torch's flash kernel for the CPU, the
        memory-efficient one on CUDA), the pair's mask as its bias; None: written out in float32, for
        soft-capping and for eager's additive mask over padding (whose fully masked queries weigh every key of
        the sequence alike, which a pair's kernel cannot know)."""
        return pair_kernel(self.device, self.softcap, self.additive, q.shape[-1], v.shape[-1], q.dtype)

    def pair_mask(self, qi: int, ki: int, keys: int) -> torch.Tensor | None:
        """The model's mask of one pair (None: causal from positions, the kernel's own)."""
        return None if self.mask is None else _pair_mask(self.mask, qi, ki, self.layout.chunk, keys, self.device)

    def scores(self, q, k, mask):
        """Scaled (soft-capped) scores of some of a pair's queries ``q`` against its keys (``k``: repeated for
        the query heads, ``_repeat``), ``mask`` those queries' rows of the pair's; and, when capped, the tanh for
        the backward."""
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        capped = None
        if self.softcap:
            capped = torch.tanh(scores / self.softcap)
            scores = capped * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, MASKED) if mask.dtype == torch.bool else scores + mask.float()
        return scores, capped


MASKED = torch.finfo(torch.float32).min
SCORE_TILE = 512  # queries a written-out pair scores at once: its float32 scores are [b, h, SCORE_TILE, c]


def _tiles(rows: int):
    """The query rows of a pair a written-out tile covers, ``SCORE_TILE`` at a time."""
    return [slice(start, start + SCORE_TILE) for start in range(0, rows, SCORE_TILE)]


def _rows(mask, rows: slice):
    return None if mask is None else mask[..., rows, :]


def _written_out(plan: RingPlan, q, k, v, mask):
    """A pair written out in float32, one tile of queries at a time: its output and log-sum-exp."""
    outs, lses = [], []
    for rows in _tiles(q.shape[2]):
        scores, _ = plan.scores(q[:, :, rows], k, _rows(mask, rows))
        lses.append(torch.logsumexp(scores, dim=-1))
        outs.append(torch.matmul(torch.exp(scores - lses[-1].unsqueeze(-1)), v))
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


class _RingAttention(torch.autograd.Function):
    """Forward: every pair's partial output merged by log-sum-exp while the key/value blocks go round.
    Backward: the blocks go round again, each pair's gradients recomputed from the merged output and
    log-sum-exp (flash attention's backward), the key/value gradients travelling with their block and
    one last step home. Scores are never kept: memory is the inputs, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: RingPlan):
        c, ring, kind = plan.layout.chunk, plan.ring, plan.kernel(q, v)
        dtype = compute_dtype(kind, q.dtype)
        queries = q.to(dtype).split(c, dim=2)
        outs, lses, seen, sums = [None, None], [None, None], [None, None], [0.0, 0.0]
        ctx.rng = None  # (the CUDA kernel's random-number state, for its backward)
        block = torch.stack([k, v])  # what travels: this group's keys and values, then each other group's
        for step in range(ring.size):
            following = comm.shift_async(block, ring.group, 1) if step < ring.size - 1 else None  # during the pairs
            for a, qi, b, ki, keys in plan.pairs(step):
                pair_k, pair_v = (_repeat(part[:, :, b * c : b * c + keys], plan, dtype) for part in block)
                if kind is not None:
                    mask = plan.pair_mask(qi, ki, keys)
                    o, lse, rng = pair_forward(kind, queries[a], pair_k, pair_v, mask, qi == ki and mask is None,
                                               plan.scale)  # fmt: skip
                    ctx.rng = ctx.rng or rng
                else:
                    mask = _pair_mask(plan.mask, qi, ki, c, keys, q.device)
                    o, lse = _written_out(plan, queries[a], pair_k, pair_v, mask)
                outs[a], lses[a] = merge(outs[a], lses[a], o, lse)
                if plan.mask is not None:  # which queries attend to some key (and, for eager's, every value's sum)
                    sees = _allowed(mask).any(-1)
                    seen[a] = sees if seen[a] is None else seen[a] | sees
                    sums[a] = sums[a] + pair_v.sum(2) if plan.additive else 0.0
            block = following.wait() if following is not None else None
        for a, part in enumerate(queries):  # padding queries with no key in reach (past the end and the window)
            if outs[a] is None:
                outs[a] = part.new_zeros(part.shape, dtype=torch.float32)
                lses[a] = part.new_full(part.shape[:-1], MASKED, dtype=torch.float32)
                if plan.mask is not None:  # (the mask's batch: 1 where a caller's mask broadcasts)
                    rows = plan.mask.batch if isinstance(plan.mask, MaskDescription) else plan.mask.shape[0]
                    seen[a] = torch.zeros(rows, 1, c, dtype=torch.bool, device=part.device)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        if sinks is not None:
            out, lse = with_sinks(out, lse, sinks)
        # which queries attend to some key; with sinks, one masked from every key gives the sink all its weight:
        # zeros already
        attended = torch.cat(seen, dim=-1).unsqueeze(-1) if seen[0] is not None and sinks is None else None
        if attended is not None:  # queries masked from every key (left padding): what one process gives them
            unattended = _unattended(sums, plan, c) if plan.additive else 0.0
            out = torch.where(attended, out, unattended)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, sinks, out, lse, attended)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, sinks, out, lse, attended = ctx.saved_tensors
        plan = ctx.plan
        c, ring, kind = plan.layout.chunk, plan.ring, plan.kernel(q, v)
        dtype = compute_dtype(kind, q.dtype)
        grad = grad.float()
        if attended is not None and not plan.additive:  # sdpa's zeros for queries masked from every key
            grad = torch.where(attended, grad, 0.0)
        delta = (grad * out).sum(-1)  # [b, h, T]: rowsum(dO * O)
        queries, grads, lses = q.to(dtype).split(c, dim=2), grad.split(c, dim=2), lse.split(c, dim=2)
        deltas, outs = delta.split(c, dim=2), out.split(c, dim=2)
        uniform = attended.split(c, dim=2) if attended is not None and plan.additive else None
        dq = [torch.zeros_like(part, dtype=torch.float32) for part in queries]
        block = torch.stack([k, v])
        travelling = torch.zeros_like(block, dtype=torch.float32)  # the held block's key/value gradients so far
        for step in range(ring.size):
            following = comm.shift_async(block, ring.group, 1) if step < ring.size - 1 else None  # during the pairs
            for a, qi, b, ki, keys in plan.pairs(step):
                keys_at = slice(b * c, b * c + keys)
                pair_k, pair_v = (_repeat(part[:, :, keys_at], plan, dtype) for part in block)
                if kind is not None:  # the kernel's backward from the merged output and log-sum-exp (as flash's)
                    mask = plan.pair_mask(qi, ki, keys)
                    d_q, d_k, d_v = pair_backward(kind, grads[a], queries[a], pair_k, pair_v, outs[a], lses[a], mask,
                                                  qi == ki and mask is None, plan.scale, ctx.rng)  # fmt: skip
                    dq[a] += d_q
                    travelling[0, :, :, keys_at] += _fold(d_k, plan)
                    travelling[1, :, :, keys_at] += _fold(d_v, plan)
                    continue
                mask = _pair_mask(plan.mask, qi, ki, c, keys, q.device)
                for rows in _tiles(c):  # written out, a tile of queries at a time
                    scores, capped = plan.scores(queries[a][:, :, rows], pair_k, _rows(mask, rows))
                    p = torch.exp(scores - lses[a][:, :, rows].unsqueeze(-1))
                    if uniform is not None:  # eager: a query masked from every key weighs them all alike
                        p = torch.where(uniform[a][:, :, rows], p, 1.0 / plan.layout.tokens)
                    d_p = torch.matmul(grads[a][:, :, rows], pair_v.transpose(-1, -2))
                    d_scores = p * (d_p - deltas[a][:, :, rows].unsqueeze(-1))
                    if capped is not None:
                        d_scores = d_scores * (1 - capped * capped)
                    d_scores = d_scores * plan.scale
                    dq[a][:, :, rows] += torch.matmul(d_scores, pair_k)
                    d_k = torch.matmul(d_scores.transpose(-1, -2), queries[a][:, :, rows])
                    travelling[0, :, :, keys_at] += _fold(d_k, plan)
                    travelling[1, :, :, keys_at] += _fold(torch.matmul(p.transpose(-1, -2), grads[a][:, :, rows]), plan)
            travelling = comm.shift(travelling, ring.group, 1)  # with its block; the last step takes it home
            block = following.wait() if following is not None else None
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:  # d sink = -sum over rows of p_sink * rowsum(dO * O)
            d_sinks = -(torch.exp(sinks.float().view(1, -1, 1) - lse) * delta).sum((0, 2)).to(sinks.dtype)
        return torch.cat(dq, dim=2).to(q.dtype), travelling[0].to(k.dtype), travelling[1].to(v.dtype), d_sinks, None


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Where a bool or additive mask lets a query attend."""
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def _unattended(sums: list, plan: RingPlan, c: int) -> torch.Tensor:
    """Eager's output for a query masked from every key: the same minimum added to every score, so the
    mean of every key's value (every pair was computed: ``sums`` holds each query chunk's sum over all)."""
    return torch.cat([total.unsqueeze(2).expand(-1, -1, c, -1) for total in sums], dim=2) / plan.layout.tokens


def _repeat(x, plan: RingPlan, dtype: torch.dtype):
    """Key/value heads repeated for their query heads, in ``dtype``."""
    return (x.repeat_interleave(plan.groups, 1) if plan.groups > 1 else x).to(dtype)


def _fold(x, plan: RingPlan):
    """Gradients of repeated key/value heads summed back onto each head."""
    if plan.groups == 1:
        return x
    return x.unflatten(1, (-1, plan.groups)).sum(2)


def ring_attention(module, query, key, value, attention_mask, sequence, heads: tuple[int, int], **kwargs):
    """``query [b, hq, T, d]``, ``key``/``value [b, hk, T, d]``: this rank's heads (``heads``: their
    range among the module's local heads) for its group's ``T`` tokens. Returns ``[b, T, hq, d]``,
    as transformers' attention functions do."""
    ring = sequence.split.cp
    if kwargs.get("dropout") and module.training:
        raise ValueError(
            f"cp_size={ring.size}: attention dropout ({kwargs['dropout']}) is not applied by ring attention; "
            "set the config's attention_dropout to 0 to train with context parallelism"
        )
    scale = kwargs.get("scaling")
    plan = RingPlan(
        sequence.layout, ring, _checked_mask(attention_mask, sequence, kwargs.get("sliding_window")),
        query.shape[-1] ** -0.5 if scale is None else scale, kwargs.get("softcap"), kwargs.get("sliding_window"),
        query.shape[1] // key.shape[1], query.device, sequence.split.inner == "eager",
    )  # fmt: skip
    sinks = kwargs.get("s_aux")
    sinks = sinks[heads[0] : heads[1]] if sinks is not None else None
    out = _RingAttention.apply(query, key, value, sinks, plan)
    return out.transpose(1, 2).to(query.dtype)


def with_sinks(out, lse, sinks):
    """Attention sinks (gpt-oss): one more logit per head in every softmax's denominator, contributing no
    value, entered once into a merged output ``[b, h, n, d]`` and its log-sum-exp ``[b, h, n]``."""
    total = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
    return out * torch.exp(lse - total).unsqueeze(-1), total


def merge(o, lse, o_new, lse_new):
    """Two partial softmax outputs over disjoint keys, as one (exact)."""
    if o is None:
        return o_new, lse_new
    total = torch.logaddexp(lse, lse_new)
    return o * torch.exp(lse - total).unsqueeze(-1) + o_new * torch.exp(lse_new - total).unsqueeze(-1), total


def _checked_mask(mask, sequence, window):
    """The model's mask, checked once per call and mask to allow nothing in the pairs ring attention skips:
    keys after their query (the model is causal, yet a mask could open bidirectional blocks) and keys
    further back than the sliding window. A description (``masks.py``) is checked pair by pair, and only
    where its construction does not already say; a 4D tensor a caller handed the model, whole (an O(S^2)
    pass). None stays None."""
    ring = sequence.split.cp
    if mask is None:
        return None
    if id(mask) in sequence.checked_masks:
        return mask
    if isinstance(mask, MaskDescription):
        layout = sequence.layout
        opened = skipped_pairs_opened(mask, layout.chunk, 2 * layout.cp, window, sequence.split.device)
    else:
        opened = _tensor_opened(mask, ring, window)
    if opened:
        advice = "use sp_size alone" if opened == OPENS_AFTER else "it cannot serve this mask"
        raise ValueError(
            f"cp_size={ring.size}: the model's attention mask {opened}; ring attention skips those keys, so {advice}"
        )
    sequence.checked_masks[id(mask)] = mask  # held for the call: the id is not reused while it runs
    return mask


def _tensor_opened(mask: torch.Tensor, ring, window) -> str | None:
    """What a whole 4D mask opens among the pairs ring attention skips (None: nothing)."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(
            f"cp_size={ring.size}: ring attention reads a [batch, 1, queries, keys] mask; the model was given one of "
            f"shape {tuple(mask.shape)}"
        )
    allowed = _allowed(mask)
    return what_opens(allowed.triu(1).any(), allowed.tril(-window - 1).any() if window else None, window)


def _pair_mask(mask, qi: int, ki: int, c: int, keys: int, device):
    """The mask of query chunk ``qi`` against the first ``keys`` keys of chunk ``ki`` (chunks are
    contiguous positions; keys never reach the padding). Query rows past the model's mask (padding)
    attend to every key: their outputs are dropped."""
    if isinstance(mask, MaskDescription):
        return mask.pair((qi * c, (qi + 1) * c), (ki * c, ki * c + keys), device)
    if mask is not None:
        rows = mask[..., qi * c : (qi + 1) * c, ki * c : ki * c + keys]
        if rows.shape[-2] < c:
            allow = True if mask.dtype == torch.bool else 0.0
            rows = torch.nn.functional.pad(rows, (0, 0, 0, c - rows.shape[-2]), value=allow)
        return rows
    if qi == ki:  # the diagonal: causal inside the chunk
        return torch.ones(c, c, dtype=torch.bool, device=device).tril()[:, :keys]
    return None  # keys wholly before the queries
