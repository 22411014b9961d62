"""transformers' Trainer on a parallel model, through the seams the Trainer has for models that
own their placement, and a few methods where it has none.

The seams (transformers 5.23): a model that says ``is_distributed_loading_by_transformers`` is
not wrapped in DDP nor moved, every rank joins ``save_model``, and grad accumulation defers
FSDP's reduction (``config.distributed_config`` says how many replicas there are). Accelerate's
data loader reads its ``DeviceMesh``: given one of ``dp x replica`` (``batch_mesh``), it hands every
data-parallel rank its own rows and a replica's ranks the same ones. The Trainer's loss scaling
(``num_items_in_batch`` summed over all ranks, the loss times the number of ranks) then gives the
global token mean once FSDP averages the replicas: the replica's over-count cancels. (The other
route, ``model.tp_size`` -> accelerate's ``ParallelismConfig``, is refused by accelerate on CPU.)

Where the Trainer has no seam, its method is replaced, once transformers' Trainer is imported (an
inference load never imports it), for hf_parallel's models only (any other model takes the Trainer's
own path unchanged); every method is checked first (``compat/transformers.py``: it exists, takes the
parameters it is called with, and the Trainer still calls it) and a missing one fails loudly:
- the gradient norm and clipping take every shard (``clipping.py``), not the local norm;
- the broadcast of "replicated" trainable parameters from rank 0 is replaced by placing them: a
  parallel model's parameters are shards (rank 0's would overwrite the others'); peft's adapters
  are placed like their modules (``adapters/``), and any other one hf_parallel did not place is
  refused by name;
- a model on pipeline stages is refused when the Trainer is built (one forward and one backward
  per batch cannot drive a schedule): ``hf_parallel.train_step`` trains it;
- checkpoints for resuming hold every rank's own pieces of the trainable parameters and of the
  optimizer state, placed in the full tensors (``resume.py``), beside the gathered model, where the
  Trainer would save rank 0's optimizer only (and refuses to, for a model sharded at load time);
  they resume at any layout, one rank included, and a one-process ``optimizer.pt`` resumes here.

Why a scoped replacement and not something narrower: users hand their model to the Trainer (or TRL's
subclasses of it) unchanged, so a Trainer subclass of ours would never be the one running; the
Trainer has no callback before its own resume check nor around its gradient norm. Each replaced
method decides per call, on the model (``_is_split``), so nothing changes for any other model.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ..adapters.seams import place_and_check
from ..compat import when_imported
from ..compat.accelerate import set_batch_mesh
from ..compat.trl import TOKEN_COUNTING
from ..compat.transformers import (
    CLIP_GRAD_NORM,
    GET_GRAD_NORM,
    LOAD_CHECKPOINT,
    LOAD_OPTIMIZER,
    SAVE_OPTIMIZER,
    SCHEDULER_NAME,
    SYNC_REPLICATED,
    TRAINER,
    TRAINER_INIT,
    TRAINER_STEPS,
    TRAINING_ARGUMENTS,
    declare_owned_placement,
)
from ..state import is_parallel, parallel_state
from .clipping import clip_grad_norm_
from .fused_head import install_trl_fused_head, install_trl_token_count, note_split_head
from ..checkpoint.training_state import written_layout
from .resume import load_training_state, save_training_state


@dataclass(frozen=True)
class ReplicaSizes:
    """What the Trainer reads of ``model.config.distributed_config``: how many ranks share a batch
    and how many batches a step takes (not serialised: transformers drops the attribute on save)."""

    tp_size: int  # ranks of one model replica (pp x sp x tp): they see the same batch
    fsdp_size: int
    dp_replicate_size: int

    @property
    def dp_size(self) -> int:
        return self.fsdp_size * self.dp_replicate_size


# DistributedConfig fields hf_parallel honours, and why the others are refused
_UNSUPPORTED = {
    "enable_sequence_parallel": "use sp_size=N (Ulysses sequence parallelism over the mesh's sp dimension)",
    "fsdp_plan": "hf_parallel shards every decoder layer and then the root with FSDP2; it takes no FSDP plan",
}


EP_IMPLEMENTATIONS = ("auto", "all_to_all", "all_reduce")  # DistributedConfig's names hf_parallel implements


def from_distributed_config(config, sizes: dict, tp_plan, ep_plan):
    """The mesh sizes, the plans and FSDP's policies (``from_pretrained``'s ``mixed_precision`` and
    ``fsdp_cpu_offload``, as transformers applies them: bf16 compute, fp32 reductions) of transformers'
    ``DistributedConfig``; what it asks that hf_parallel cannot do is refused by name."""
    given = {name: value for name, value in sizes.items() if value not in (None, 1)}
    if given:
        raise ValueError(
            f"from_pretrained(distributed_config=..., {', '.join(given)}=...): give the sizes once, in the "
            "DistributedConfig or as keywords"
        )
    for field, why in _UNSUPPORTED.items():
        if getattr(config, field, None):
            raise ValueError(f"DistributedConfig({field}={getattr(config, field)!r}) is not supported: {why}")
    tp = config.tp_size or None
    ep = getattr(config, "ep_size", None) or 1
    implementation = getattr(config, "ep_implementation", "auto")
    if implementation not in EP_IMPLEMENTATIONS:
        raise ValueError(
            f"DistributedConfig(ep_implementation={implementation!r}): hf_parallel implements "
            f"{', '.join(map(repr, EP_IMPLEMENTATIONS))} ('auto': 'all_reduce' where the EP group is the TP group, "
            "which shares one batch, else 'all_to_all', as transformers picks)"
        )
    # 'all_reduce': experts over the TP group, each rank on the group's batch (ep_plan="auto")
    whole_batch = implementation == "all_reduce" or (implementation == "auto" and ep == (tp or 1))
    if whole_batch and ep not in (1, tp or 1):
        raise ValueError(
            f"DistributedConfig(ep_size={ep}, tp_size={tp}, ep_implementation='all_reduce'): the experts run on "
            "the batch the TP group shares, so ep_size must equal tp_size; 'all_to_all' exchanges tokens"
        )
    sizes = dict(sizes, tp_size=tp, pp_size=config.pp_size or 1, fsdp_size=config.fsdp_size or 1,
                 dp_replicate_size=config.dp_replicate_size or 1, ep_size=1 if whole_batch else ep)  # fmt: skip
    if config.tp_plan not in (None, "auto"):
        tp_plan = config.tp_plan
    if ep > 1 and whole_batch:
        ep_plan = config.ep_plan or "auto"
    elif ep > 1 and config.ep_plan:
        raise ValueError(
            f"DistributedConfig(ep_plan={config.ep_plan!r}) with ep_size={ep}: hf_parallel takes the experts' rule "
            "from the model's plan (its moe_tp_experts rule); leave ep_plan unset"
        )
    policies = dict(mixed_precision="bf16" if config.fsdp_mixed_precision else None,
                    fsdp_cpu_offload=bool(config.fsdp_cpu_offload))  # fmt: skip
    return sizes, tp_plan, ep_plan, policies


def batch_mesh(mesh):
    """The world as accelerate's data loader reads it: ``dp_shard`` batches, each shared by the
    ``tp`` ranks of one model replica (built on the mesh's own ``dp`` and ``model`` groups).
    None with one rank per replica: accelerate's default, a batch per rank, is then right."""
    from torch.distributed.device_mesh import DeviceMesh

    if mesh.model.size == 1:
        return None
    if mesh.dp.size == 1:
        return DeviceMesh.from_group(mesh.model.group, mesh.device.type, mesh_dim_names=("tp",))
    layout = mesh.shape.groups("model")  # one row per replica
    return DeviceMesh.from_group(
        [mesh.dp.group, mesh.model.group], mesh.device.type, mesh=layout, mesh_dim_names=("dp_shard", "tp")
    )


def install_trainer_seams(model, state) -> None:
    """Tell the Trainer that a model split over several ranks owns its placement; the Trainer's
    methods that have no seam are wrapped when a program first imports the Trainer (an inference
    load never does). On one rank the Trainer's own steps run, except that a checkpoint hf_parallel
    wrote over several ranks is resumed by hf_parallel."""
    shape = state.mesh.shape
    if shape.world_size > 1:
        declare_owned_placement(model, ReplicaSizes(shape.replica_size, shape.dp_shard, shape.dp_replicate),
                                fsdp=shape.dp > 1)  # fmt: skip
        note_split_head(model, state)
        when_imported("trl.trainer.utils", install_trl_fused_head)
        for module in TOKEN_COUNTING:
            when_imported(module, functools.partial(install_trl_token_count, module))
    when_imported("transformers.trainer", _wrap_trainer)


def _is_split(model) -> bool:
    """Whether ``model`` (or the model a peft wrapper holds) is hf_parallel's, over several ranks."""
    return is_parallel(model) and parallel_state(model).mesh.world_size > 1


def _check_and_place(trainer, model) -> None:
    """After the Trainer's own ``__init__`` on a parallel model: accelerate's loaders give a
    model replica's ranks the same rows."""
    device_mesh = batch_mesh(parallel_state(model).mesh)
    if device_mesh is not None:
        set_batch_mesh(trainer.accelerator, device_mesh)


def _wrapped_init(original_init):
    """``Trainer.__init__``: unchanged for any other model; on a parallel one, pipeline stages refused,
    and the resume check passed as for a model-only save (each rank saves its optimizer, below)."""

    @functools.wraps(original_init)
    def __init__(self, model=None, args=None, *rest, **kwargs):
        if model is None or not _is_split(model):
            return original_init(self, model, args, *rest, **kwargs)
        if parallel_state(model).stage is not None:
            raise ValueError(
                f"Trainer cannot drive a model on pipeline stages ({parallel_state(model).mesh.shape}): it runs one "
                "forward and one backward per batch, a pipeline needs a schedule. Use hf_parallel.train_step(model, "
                "input_ids, labels) in your loop (GPipe or 1F1B), or load without pp_size / stage_tp_sizes"
            )
        args = args if args is not None else TRAINING_ARGUMENTS.get()(output_dir="tmp_trainer")
        resumable = not args.save_only_model
        args.save_only_model = True
        try:
            original_init(self, model, args, *rest, **kwargs)
        finally:
            args.save_only_model = not resumable
        _check_and_place(self, model)

    return __init__


def _replace_step(trainer_class, seam, replacement, on_one_rank=None) -> None:
    """``Trainer.<step>`` runs ``replacement`` on a model split over several ranks, or on hf_parallel's
    model on one rank where ``on_one_rank(trainer, *args)`` says so; the Trainer's own otherwise (the
    seam checked before anything is replaced)."""
    original = seam.get()
    name = seam.where.rpartition(".")[2]

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if _is_split(self.model) or (
            on_one_rank is not None and is_parallel(self.model) and on_one_rank(self, *args, **kwargs)
        ):
            return replacement(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    setattr(trainer_class, name, method)


def _save_state(trainer, output_dir):
    import torch

    save_training_state(trainer.model, trainer.optimizer, output_dir)
    if trainer.args.should_save:
        torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME.get()))


def _load_state(trainer, checkpoint):
    """The optimizer's and the scheduler's state, from a checkpoint of any layout (the weights were
    read by ``_load_model_state``)."""
    import torch

    if checkpoint is not None:
        load_training_state(trainer.model, trainer.optimizer, checkpoint, weights=False)
        scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME.get()), weights_only=True)
        trainer.lr_scheduler.load_state_dict(scheduler)


def _written_by_hf_parallel(trainer, checkpoint, *args, **kwargs) -> bool:
    """On one rank the Trainer's own resume would find no ``optimizer.pt`` in a checkpoint hf_parallel
    wrote over several ranks and go on with a fresh optimizer: hf_parallel's resume reads it instead."""
    return checkpoint is not None and written_layout(checkpoint) is not None


def _clip(trainer, model):
    return clip_grad_norm_(trainer.model, trainer.args.max_grad_norm)


def _grad_norm(trainer, model, grad_norm=None):
    return clip_grad_norm_(trainer.model, float("inf")) if grad_norm is None else grad_norm


def _load_model_state(trainer, checkpoint, model=None):
    load_training_state(trainer.model, None, checkpoint)


@functools.cache
def _wrap_trainer() -> None:
    """Once per process, once transformers' Trainer is imported: every seam checked, then replaced
    (one that fails leaves the Trainer as it was, and its import fails, naming it)."""
    for seam in (TRAINER, TRAINER_INIT, TRAINING_ARGUMENTS, SCHEDULER_NAME, *TRAINER_STEPS.values()):
        seam.get()
    trainer_class = TRAINER.get()
    trainer_class.__init__ = _wrapped_init(TRAINER_INIT.get())
    _replace_step(trainer_class, CLIP_GRAD_NORM, _clip)
    _replace_step(trainer_class, GET_GRAD_NORM, _grad_norm)
    _replace_step(trainer_class, SYNC_REPLICATED, lambda self, model: place_and_check(self.model))
    _replace_step(trainer_class, SAVE_OPTIMIZER, _save_state)
    _replace_step(trainer_class, LOAD_OPTIMIZER, _load_state, on_one_rank=_written_by_hf_parallel)
    _replace_step(trainer_class, LOAD_CHECKPOINT, _load_model_state, on_one_rank=_written_by_hf_parallel)
