"""Tiled loss (ALST's tiled logits and loss): the LM head and the next-token cross-entropy over chunks of tokens,
each chunk recomputed in the backward, so a rank never holds more than one chunk's logits.

At long lengths the logits are a training step's largest tensors: ``[tokens, vocab]`` in float32 for the
loss (a 128k vocabulary at 32k tokens: 16 GiB) and their gradient as large again. With ``tiled_loss`` the
model's forward runs with its LM head handed each row's first token only (a forward pre-hook, which keeps the
head's input: the final hidden states), and the loss is computed from those hidden states a chunk at a time:

- where the head's weight is split by vocabulary rows over the TP group (and no data dimension shards it),
  by Megatron's vocab-parallel cross-entropy (``tensor/vocab_loss.py``): no logits are gathered;
- otherwise through the head module itself (its TP gather, FSDP's all-gather, a kept quantized weight:
  whatever its call does), one chunk's logits at a time.

Under sequence and context parallelism each rank scores its own tokens against their labels shifted on the
whole sequence, and the sum over the group divided by the batch's labelled tokens is one process's loss.

What a model does to its head's output (Gemma's final soft-capping, Cohere's logit scale, Granite's logits
scaling, Falcon-H1's multiplier) is read from its config, and checked at the first call against the model's
own logits of the token its head was handed, every rank agreeing on the verdict: a model whose logits differ
otherwise is refused by name. The output's ``logits`` are None (what reads them would read one token's). The
head is looked up at each call: one a LoRA adapter wraps is scored through its module.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..distributed import comm
from ..tensor.vocab_loss import transformed, vocab_parallel
from .shard import shifted_labels

IGNORED = -100  # transformers' ignore_index
LOSS_CHUNK = 1024  # tokens a chunk scores at once under tiled_loss=True


class TiledLoss:
    """The loss of a forward given labels, from the final hidden states, ``tokens`` at a time."""

    def __init__(self, model: nn.Module, tokens: int, vocab_split: dict | None):
        """``vocab_split``: the head's vocabulary rows on this rank, as ``vocab_parallel`` takes them
        (``group``, ``start``, ``vocab``); None: the head is scored through its module."""
        if tokens < 1:
            raise ValueError(f"tiled_loss={tokens}: a chunk holds at least one token")
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Module):
            raise ValueError(f"tiled_loss: {type(model).__name__} has no LM head module to tile the loss of")
        self.loaded_head, self.tokens, self.vocab_split = head, tokens, vocab_split
        self._model, self.model_name = weakref.ref(model), type(model).__name__
        self.candidates = _transforms(model.config.get_text_config())
        self.transform: tuple[float, float | None] | None = None  # (logit scale, soft-cap), once checked

    @property
    def head(self) -> nn.Module:
        """The model's LM head now (peft may have wrapped the one it was loaded with)."""
        return self._model().get_output_embeddings()

    @contextlib.contextmanager
    def first_tokens_only(self):
        """While the model's forward runs: the head's input kept (yielded, a list), the head handed each row's
        first token."""
        kept = []

        def first_token(module, args):
            hidden = args[0]
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
                raise ValueError(
                    f"tiled_loss: {self.model_name}'s LM head was called with {type(hidden).__name__} "
                    f"{tuple(getattr(hidden, 'shape', ()))}, not the [batch, tokens, hidden] states it tiles"
                )
            kept.append(hidden)
            return (hidden[:, :1], *args[1:])

        handle = self.head.register_forward_pre_hook(first_token, prepend=True)
        try:
            yield kept
        finally:
            handle.remove()
        if len(kept) != 1:
            raise ValueError(f"tiled_loss: {self.model_name}'s LM head ran {len(kept)} times in one forward, not once")

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, sequence, count, first_logits,
             shifted: bool = False) -> torch.Tensor:  # fmt: skip
        """The mean next-token cross-entropy of the batch (``count``: labelled tokens of a larger batch this is
        part of), from this rank's final hidden states ``[batch, tokens, hidden]``; summed over the sequence
        group (each rank's backward its own tokens'). ``shifted``: ``labels`` are each token's next one already
        (transformers' ``shift_labels``)."""
        if self.transform is None:
            self.transform = self._checked(hidden, first_logits)
        if sequence is None:
            shifted = local = labels if shifted else F.pad(labels, (0, 1), value=IGNORED)[:, 1:]
        else:
            shifted, local = shifted_labels(labels, sequence, IGNORED, shift=not shifted)
        count = (shifted != IGNORED).sum() if count is None else count
        local = local.to(hidden.device).reshape(-1)
        total = self._summed(hidden.reshape(-1, hidden.shape[-1]), local)
        loss = total / count
        return loss if sequence is None else comm.reduce_from(loss, sequence.split.group)

    def _summed(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        scale, softcap = self.transform
        head = self.head
        if self.vocab_split is not None and head is self.loaded_head:
            log_probs = vocab_parallel(hidden, head.weight, getattr(head, "bias", None), targets, 1.0, None, softcap,
                                       scale, tokens_per_chunk=self.tokens, **self.vocab_split)[0]  # fmt: skip
            return -torch.where(targets != IGNORED, log_probs, 0.0).sum()
        parts = []
        for first in range(0, len(hidden), self.tokens):
            chunk = hidden[first : first + self.tokens], targets[first : first + self.tokens]
            parts.append(checkpoint(self._chunk, *chunk, use_reentrant=False) if torch.is_grad_enabled() else
                         self._chunk(*chunk))  # fmt: skip
        return torch.stack(parts).sum()

    def _chunk(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = transformed(self.head(hidden.unsqueeze(0))[0].float(), *self.transform)
        return F.cross_entropy(logits, targets, ignore_index=IGNORED, reduction="sum")

    def _checked(self, hidden: torch.Tensor, first_logits) -> tuple[float, float | None]:
        """The transform of the head's logits that gives the model's own for the tokens its head was handed
        (its config's, else none); refused by name when neither does (one host read, at the first call)."""
        if not isinstance(first_logits, torch.Tensor) or first_logits.shape[:2] != hidden[:, :1].shape[:2]:
            raise ValueError(
                f"tiled_loss: {self.model_name}'s forward returned logits of shape "
                f"{tuple(getattr(first_logits, 'shape', ()))}, not its LM head's for the tokens it was handed"
            )
        want = first_logits.detach().float()
        with torch.no_grad():
            raw = self.head(hidden[:, :1].detach()).float()
        exact = want.dtype == first_logits.dtype  # a float32 model's logits: no rounding of the transform
        tolerance = (1e-4 if exact else 2e-2) * want.abs().max().clamp(min=1e-6)
        gaps = torch.stack([(transformed(raw, *candidate) - want).abs().max() for candidate in self.candidates])
        wrong = (gaps > tolerance).float()
        if torch.distributed.is_initialized():  # every rank the same verdict (one raising alone would hang the rest)
            wrong = comm.all_reduce(wrong, torch.distributed.group.WORLD)
        for candidate, off in zip(self.candidates, wrong.tolist()):
            if off == 0:
                return candidate
        gaps = [f"scale {c[0]}, soft-cap {c[1]}: {gap:.3g}" for c, gap in zip(self.candidates, gaps.tolist())]
        raise ValueError(
            f"tiled_loss: {self.model_name}'s forward changes its LM head's logits in a way hf_parallel does not "
            f"know (largest gap to the model's own logits on this rank, {'; '.join(gaps)}); load without tiled_loss"
        )


def _transforms(config) -> list[tuple[float, float | None]]:
    """The (logit scale, soft-cap) pairs to try on the head's logits: the config's, then none."""
    scale = 1.0
    for name, of in (("logit_scale", lambda x: x), ("logits_scaling", lambda x: 1.0 / x),
                     ("lm_head_multiplier", lambda x: x)):  # fmt: skip
        value = getattr(config, name, None)
        if isinstance(value, int | float) and value != 1:
            scale *= of(float(value))
    softcap = getattr(config, "final_logit_softcapping", None)
    declared = (scale, float(softcap) if softcap else None)
    return [declared] if declared == (1.0, None) else [declared, (1.0, None)]
