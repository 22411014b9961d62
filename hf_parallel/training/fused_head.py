"""A fused LM head over a vocabulary split on the TP group (TRL's trainers compute their losses so).

The fused head scores each token from the final hidden states and the LM head's weight, never building
the logits of the whole vocabulary at once. With the vocabulary split, TRL's kernel is replaced by
``tensor/vocab_loss.py``'s (Megatron's cross-entropy, every field TRL asks for as one process computes it,
gradients included). Around TRL's fused call, ``fused_runner`` adds what sequence parallelism and an
FSDP-sharded untied head need.
"""

from __future__ import annotations

import contextlib
import functools
import types
import weakref

import torch

from ..core.context import Call, batch_inputs, calling
from ..distributed import comm
from ..sequence.shard import shifted_labels, whole_tokens
from ..state import is_parallel, parallel_model, parallel_state
from ..tensor.vocab_loss import vocab_parallel


def fused_split(model) -> dict | None:
    """How a parallel model's LM head splits the vocabulary, as ``vocab_parallel`` takes it (None: whole
    on every rank, TRL's own kernel is right); layouts TRL's fused forward cannot be right on are refused by name."""
    state = parallel_state(model)
    if state.stage is not None:
        raise ValueError(
            f"TRL's fused LM head ({state.mesh.shape}) runs the backbone in one call, and pipeline stages need a "
            "schedule; train on pipeline stages with hf_parallel.train_step, or load without pp_size / stage_tp_sizes"
        )
    if state.sequence is not None and getattr(model.config.get_text_config(), "output_router_logits", False):
        raise ValueError(
            f"TRL's fused LM head ({state.mesh.shape}) adds the router's load-balancing loss from the router logits of "
            "this rank's tokens only; load with sp_size=1, or with output_router_logits=False"
        )
    return vocab_rows(parallel_model(model), state.entry, state.mesh.tp, "TRL's fused LM head")


def vocab_rows(model, entry, tp, who: str) -> dict | None:
    """The vocabulary rows of the LM head's weight this rank holds, as ``vocab_parallel`` takes them (None:
    whole on every rank); a split other than by whole rows refused by name (``who``: the caller, in the
    message). ``entry``: a parameter's ``ShardedParam`` by name; ``tp``: the mesh's TP dimension."""
    head, path = _head(model)
    found = entry(f"{path}.weight")
    if found is None or found.layout.is_replicated:
        return None
    layout = found.layout
    if layout.dim != 0 or len(layout.ranges[tp.rank]) != 1:
        raise ValueError(
            f"{who}: {path}.weight is split as {layout}, not by whole vocabulary rows; hf_parallel "
            "scores a fused head over a vocabulary split by rows only"
        )
    ((start, _),) = layout.ranges[tp.rank]
    return dict(group=tp.group, start=start, vocab=found.full_shape[0])


LABEL_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def fused_runner(model):
    """``run(fused, args, kwargs)``: how a fused call of TRL's forward runs on this layout (None: as TRL
    makes it). Two things TRL's forward does itself need hf_parallel's help:
    - at SP it runs the backbone, bypassing hf_parallel's forward: it runs under the call's token split
      (the hidden states stay split); each rank scores its tokens against their next-token labels,
      taken on the whole sequence (TRL's ``shift_labels``), and the per-token fields are gathered whole,
      each rank's gradient its own tokens' (what follows, the trainer's loss, is the same on every
      rank). The fields and their shapes are one process's; the loss is summed over the group;
    - under FSDP an untied LM head is a group of its own, whole only while its forward runs: TRL reads
      its weight outside it (and would gather it without reducing its gradient over the replicas), so
      the head's weight is taken through its module's call (``_head_through_its_module``)."""
    state = parallel_state(model)
    head = model.get_output_embeddings()
    through_module = state.mesh.shape.dp > 1 and _sharded_on_its_own(head)
    replica = state.mesh.model  # the ranks that compute one model replica together: one batch
    if state.sequence is None and not through_module and replica.size == 1:
        return None

    def run(fused, args, kwargs):
        _check_one_batch(state, state.runtime.bound(args, kwargs), replica)
        with _head_through_its_module(model, head) if through_module else contextlib.nullcontext():
            if state.sequence is None:
                return fused(*args, **kwargs)
            return _fused_over_sequence(state.runtime, state.sequence, fused, args, kwargs)

    return run


def _check_one_batch(state, inputs: dict, replica) -> None:
    """The ranks of one replica compute one batch together; a trainer that samples on each rank (GRPO and
    RLOO seed every rank apart, so each generates its own completions) would hand them different ones,
    mixed in the collectives into a gradient of no loss: refused by name (a fingerprint of the token ids
    and labels, compared over the replica)."""
    if replica.size == 1:
        return
    ids = batch_inputs(inputs).double()
    labels = inputs.get("labels", inputs.get("shift_labels"))
    sums = [ids.new_tensor(ids.numel()), ids.sum(), (ids**2).sum()]  # on the device: no host copy but the verdict
    fingerprint = torch.stack(sums + ([] if labels is None else [labels.double().sum()]))
    everyone = comm.all_gather(fingerprint.unsqueeze(0), 0, [1] * replica.size, replica.group)
    if not bool((everyone == everyone[0]).all()):
        raise ValueError(
            f"TRL's fused LM head ({state.mesh.shape}): the ranks of one model replica were given different "
            "batches, which they would mix in their collectives. A trainer that samples on each rank (GRPO, RLOO: "
            "their seeds differ per rank) cannot run where a replica spans several ranks; load with fsdp_size "
            "only (one rank per replica), or give the replica's ranks the same samples"
        )


@contextlib.contextmanager
def _head_through_its_module(model, head):
    """While TRL's forward runs, ``model.get_output_embeddings()`` hands it the head's weight (and bias) as
    the head's FSDP module returns them from a call: FSDP gathers them for it, keeps them whole (the head
    is last: not resharded after its forward), and, the call's outputs being in the graph, reduce-scatters
    their gradient after backward (FSDP's root runs the post-backward of a module whose inputs needed none)."""
    own = head.__dict__.get("forward")  # a TP style's forward (the vocab gather), kept
    head.forward = lambda *_: tuple(None if p is None else p.view_as(p) for p in (head.weight, head.bias))
    try:
        weight, bias = head(torch.empty(0))
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    model.get_output_embeddings = lambda: types.SimpleNamespace(weight=weight, bias=bias)
    try:
        yield
    finally:
        del model.get_output_embeddings


def _fused_over_sequence(runtime, split, fused, args, kwargs):
    dropped = ("fused_lm_head", "past_key_values")  # a training forward: no KV cache
    inputs = runtime.inputs(args, {**{k: v for k, v in kwargs.items() if k not in dropped}, "use_cache": False})
    labels, shift = inputs.pop("labels", None), inputs.pop("shift_labels", None)
    count = inputs.pop("num_items_in_batch", None)
    rows, tokens = batch_inputs(inputs).shape[:2]
    sequence = split.call(tokens, keep_split=True)
    whole, local = shifted_labels(labels if shift is None else shift, sequence, shift=shift is None)
    count = (whole != -100).sum().clamp(min=1) if count is None else count
    with calling(Call(rows, tokens, 0, sequence)), split.masks(sequence):  # (under CP, masks described)
        out = fused(**inputs, fused_lm_head=True, shift_labels=local, num_items_in_batch=count)
    out.loss = comm.reduce_from(out.loss, split.group)
    kept = tokens - 1 if shift is None else tokens  # TRL's fields cover the tokens that have a next one
    for name in LABEL_FIELDS:
        value = getattr(out, name, None)
        if value is not None:
            moved = value if value.is_floating_point() else value.to(torch.int32)
            moved = whole_tokens(moved, 1, sequence, gather=comm.gather_from)[:, :kept]
            setattr(out, name, moved if value.is_floating_point() else moved.to(value.dtype))
    return out


def _head(model) -> tuple:
    """The LM head module and its path."""
    head = model.get_output_embeddings()
    return head, next(name for name, module in model.named_modules() if module is head)


_SPLIT_HEADS: dict[int, weakref.ref] = {}  # LM head weights holding this rank's vocabulary rows only (by id:
# a WeakSet would compare tensors with ==)


def is_split_head(weight) -> bool:
    found = _SPLIT_HEADS.get(id(weight))
    return found is not None and found() is weight


def note_split_head(model, state) -> None:
    """Remember the LM head weight of a model whose vocabulary is split (at load): TRL's own kernel, reached
    by a forward hf_parallel's wrapper never saw, must not score it as the whole vocabulary."""
    if model.get_output_embeddings() is None:
        return
    head, path = _head(model)
    entry = state.entry(f"{path}.weight")
    if entry is not None and not entry.layout.is_replicated:
        _SPLIT_HEADS[id(head.weight)] = weakref.ref(head.weight)


def _sharded_on_its_own(module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@functools.cache
def install_trl_fused_head() -> None:
    """TRL's fused LM head on hf_parallel's models, once TRL's trainer utilities are imported (``compat/trl.py``)."""
    from ..compat import trl

    trl.install_fused_head(
        fused_split=fused_split, fused_runner=fused_runner, vocab_parallel=vocab_parallel,
        is_parallel=is_parallel, is_split=is_split_head,
    )  # fmt: skip


@functools.cache
def install_trl_token_count(module: str) -> None:
    """The token count of the TRL trainer in ``module`` on hf_parallel's models, once it is imported."""
    from ..compat import trl

    trl.install_token_count(module, replicas=lambda model: parallel_state(model).mesh.shape.replica_size,
                            is_parallel=is_parallel)  # fmt: skip
