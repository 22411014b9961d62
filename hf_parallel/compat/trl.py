"""Every internal of TRL hf_parallel uses, and why.

TRL's ``SFTTrainer`` patches the model's forward with a fused LM head (``add_fused_lm_head``): called with
``fused_lm_head=True``, it runs the backbone, then reads ``get_output_embeddings().weight`` itself and
scores every token with ``ChunkedLogProbFunction`` (log-probabilities, entropy, top-1). Under tensor
parallelism that weight holds this rank's rows of the vocabulary: scored as it is, the softmax would run
over part of the vocabulary (a loss of ln(V/tp) at the start). There is no public seam, so:
- ``add_fused_lm_head`` (every TRL trainer calls it: SFT, DPO, KTO, RLOO, GRPO) is wrapped where TRL's
  modules hold it: on hf_parallel's models ``fused_split`` refuses, by name, the layouts TRL's forward cannot
  be right on, and says how the vocabulary is split; the forward TRL installs then marks each fused call,
  and runs it where TRL's forward needs help: over the sequence split at SP (TRL calls the backbone itself,
  bypassing hf_parallel's forward), with an untied LM head's weight taken through its FSDP module's call;
- the kernel TRL's forward calls (``trl.trainer.utils._ChunkedLogProbFunction``) dispatches, during such a
  call, to ``vocab_parallel`` (the same fields over the split vocabulary), and to TRL's own otherwise;
- ``_tp_size`` of the trainers that count tokens (SFT, DPO, KTO, reward: their ``num_tokens`` metric divides by
  it) is set to the ranks that share a batch.
Not served: ``DistillationTrainer`` reads both models' head weights itself (not through this kernel).
"""

from __future__ import annotations

import functools

from . import Seam

FUSED_HEAD = Seam("trl", "trl.trainer.utils:add_fused_lm_head", "(its forward reads the LM head's weight)",
                  parameters=("model", "outputs"),
                  reads=("_ChunkedLogProbFunction", "get_output_embeddings"))  # fmt: skip
KERNEL = Seam("trl", "trl.kernels.chunked_logprob:ChunkedLogProbFunction.forward", "(TRL's per-token scores)",
              parameters=("hidden", "weight", "bias", "targets", "temperature", "chunk_size",
                          "final_logit_softcapping", "logit_scale", "outputs"))  # fmt: skip
KERNEL_NAME = Seam("trl", "trl.trainer.utils:_ChunkedLogProbFunction", "(the name the fused forward calls)")
TOKEN_COUNTING = {  # module -> its trainer, whose num_tokens metric divides by _tp_size
    module: Seam("trl", f"{module}:{trainer}", "(num_tokens is divided by _tp_size)", reads=("_tp_size",))
    for module, trainer in {
        "trl.trainer.sft_trainer": "SFTTrainer", "trl.trainer.dpo_trainer": "DPOTrainer",
        "trl.trainer.kto_trainer": "KTOTrainer", "trl.trainer.reward_trainer": "RewardTrainer",
    }.items()
}  # fmt: skip


def install_fused_head(*, fused_split, fused_runner, vocab_parallel, is_parallel, is_split) -> None:
    """Once ``trl.trainer.utils`` is imported (before any trainer module binds its names, or, when TRL was
    imported first, in every TRL module that did): ``fused_split(model)`` -> the keyword arguments
    ``vocab_parallel`` needs for a parallel model (None: its LM head is whole on every rank, TRL's kernel
    is right); ``fused_runner(model)`` -> ``run(fused, args, kwargs)``, which makes a fused call on the
    model's layout (None: TRL's call is right as it is); ``is_split(weight)``: a head weight holding part of the
    vocabulary (never scored as whole)."""
    import contextvars
    import sys

    utils = sys.modules["trl.trainer.utils"]
    add_fused_lm_head, kernel = FUSED_HEAD.get(), KERNEL_NAME.get()
    KERNEL.get()
    split = contextvars.ContextVar("hf_parallel_fused_head", default=None)

    class Kernel:
        """TRL's kernel, or, inside a fused call of a model whose vocabulary is split, ``vocab_parallel``."""

        @staticmethod
        def apply(*args):
            where = split.get()
            if where is not None:
                return vocab_parallel(*args, **where)
            if is_split(args[1]):  # a forward patched by an add_fused_lm_head hf_parallel never saw
                raise ValueError(
                    "TRL's fused LM head would score this rank's rows of a vocabulary hf_parallel split as the whole "
                    "vocabulary: its forward was patched by an add_fused_lm_head imported before hf_parallel's load; "
                    "import TRL's trainers through trl (trl.SFTTrainer, ...)"
                )
            return kernel.apply(*args)

    @functools.wraps(add_fused_lm_head)
    def add_fused_head(model, *args, **kwargs):
        where = fused_split(model) if is_parallel(model) else None  # refused here, before any step
        run = fused_runner(model) if is_parallel(model) else None
        add_fused_lm_head(model, *args, **kwargs)
        if where is None and run is None:
            return
        fused = model.forward

        @functools.wraps(fused)
        def forward(*args, **kwargs):
            if not kwargs.get("fused_lm_head"):
                return fused(*args, **kwargs)
            token = split.set(where)
            try:
                return fused(*args, **kwargs) if run is None else run(fused, args, kwargs)
            finally:
                split.reset(token)

        model.forward = forward

    utils._ChunkedLogProbFunction = Kernel
    for name, module in list(sys.modules.items()):
        if name.startswith("trl.") and getattr(module, "add_fused_lm_head", None) is add_fused_lm_head:
            module.add_fused_lm_head = add_fused_head


def install_token_count(module: str, *, replicas, is_parallel) -> None:
    """Once ``module`` (a key of ``TOKEN_COUNTING``) is imported: its trainer's ``num_tokens`` counts a batch
    once per ``replicas(model)`` ranks."""
    trainer = TOKEN_COUNTING[module].get()
    original_init = trainer.__init__

    @functools.wraps(original_init)
    def __init__(self, model=None, *args, **kwargs):
        original_init(self, model, *args, **kwargs)
        if is_parallel(self.model):
            self._tp_size = replicas(self.model)

    trainer.__init__ = __init__
