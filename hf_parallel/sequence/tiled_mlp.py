"""Tiled MLP (ALST's, from Arctic Long Sequence Training): each decoder layer's MLP run over tiles of the
sequence, each tile under activation checkpointing in training.

For long sequences the MLP's intermediate activations (``[batch, tokens, intermediate]``: 3.5x the hidden
size for Llama, kept for the backward) are a layer's largest; tiled, they exist for one tile at a time, in
the forward and again in the backward's recompute. Exact: an MLP acts on each token alone, so the tiles'
outputs concatenated are the whole sequence's (the same kernels on fewer rows). Under sequence and
context parallelism the tiles are of the rank's own tokens. Without gradients (inference, prefill) the
tiles run one after the other with nothing to keep. A mixture of experts is refused by name (its router's
statistics are the whole batch's), and so is, at its first call, a module that returns more than its hidden
states.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


def tile_mlps(layers: list, tile: int) -> None:
    """Each of ``layers``' ``mlp`` runs over tiles of ``tile`` tokens (the sequence is dim 1 of its input)."""
    if tile < 1:
        raise ValueError(f"tiled_mlp={tile}: a tile holds at least one token")
    for index, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        if mlp is None and next(layer.parameters(), None) is None:  # another pipeline stage's layer: a stand-in
            continue
        if not isinstance(mlp, torch.nn.Module):
            raise ValueError(
                f"tiled_mlp: decoder layer {index} ({type(layer).__name__}) has no `mlp` module to tile"
            )
        if any(name.rsplit(".", 1)[-1] == "experts" for name, _ in mlp.named_modules()):
            raise ValueError(
                f"tiled_mlp: decoder layer {index}'s mlp ({type(mlp).__name__}) routes tokens to experts, whose "
                "router statistics (the auxiliary loss) are taken over the whole batch; tiling serves dense MLPs"
            )
        mlp.forward = functools.partial(_tiled_forward, mlp.forward, tile, f"layer {index}'s mlp")


def _tiled_forward(forward, tile: int, where: str, hidden_states: torch.Tensor, *args, **kwargs):
    if hidden_states.dim() < 3 or hidden_states.shape[1] <= tile:
        return _checked(forward(hidden_states, *args, **kwargs), where)
    run = functools.partial(_checked_call, forward, where, args, kwargs)
    tiles = [part.contiguous() for part in hidden_states.split(tile, dim=1)]  # (rows of a batch: a copy each)
    if torch.is_grad_enabled():  # keep only each tile's input; its intermediates are recomputed in backward
        outs = [checkpoint(run, part, use_reentrant=False) for part in tiles]
    else:
        outs = [run(part) for part in tiles]
    return torch.cat(outs, dim=1)


def _checked_call(forward, where: str, args, kwargs, part: torch.Tensor) -> torch.Tensor:
    return _checked(forward(part, *args, **kwargs), where)


def _checked(out, where: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"tiled_mlp: {where} returns {type(out).__name__}, not its hidden states alone (a mixture of experts' "
            "router logits?); tiling serves dense MLPs: load without tiled_mlp"
        )
    return out
