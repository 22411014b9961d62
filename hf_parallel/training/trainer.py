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

Where the Trainer has no seam, ``install_trainer_seams`` wraps the method, for hf_parallel's
models only (any other model takes the Trainer's own path unchanged):
- the gradient norm and clipping take every shard (``clipping.py``), not the local norm;
- the broadcast of "replicated" trainable parameters from rank 0 is replaced by placing them: a
  parallel model's parameters are shards (rank 0's would overwrite the others'); peft's adapters
  are placed like their modules (``adapters/``), and any other one hf_parallel did not place is
  refused by name;
- a model on pipeline stages is refused when the Trainer is built (one forward and one backward
  per batch cannot drive a schedule): ``hf_parallel.train_step`` trains it;
- checkpoints for resuming hold every rank's own parameter shards and optimizer state
  (``resume.py``) beside the gathered model, where the Trainer would save rank 0's optimizer only
  (and refuses to, for a model sharded at load time).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from ..adapters.seams import place_and_check
from ..state import is_parallel, parallel_state


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
    "fsdp_cpu_offload": "hf_parallel keeps FSDP's shards on the device",
    "fsdp_mixed_precision": "load with dtype=... instead; FSDP computes in the parameters' dtype",
}


def from_distributed_config(config, sizes: dict, tp_plan, ep_plan):
    """The mesh sizes and plans of transformers' ``DistributedConfig``; what it asks that
    hf_parallel cannot do is refused by name."""
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
    if ep not in (1, tp or 1):
        raise ValueError(
            f"DistributedConfig(ep_size={ep}, tp_size={tp}): hf_parallel spreads experts over the TP group, so "
            "ep_size must equal tp_size"
        )
    sizes = dict(sizes, tp_size=tp, pp_size=config.pp_size or 1, fsdp_size=config.fsdp_size or 1,
                 dp_replicate_size=config.dp_replicate_size or 1)  # fmt: skip
    if config.tp_plan not in (None, "auto"):
        tp_plan = config.tp_plan
    if ep > 1:
        ep_plan = config.ep_plan or "auto"
    return sizes, tp_plan, ep_plan


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
    """Tell the Trainer that the model owns its placement, and wrap the Trainer's methods that
    have no seam (once per process)."""
    shape = state.mesh.shape
    model._is_distributed_loading_by_transformers = True
    model.config.distributed_config = ReplicaSizes(shape.replica_size, shape.dp_shard, shape.dp_replicate)
    if shape.dp > 1:
        model._is_fsdp_managed_module = True
    _wrap_trainer()


@functools.cache
def _wrap_trainer() -> None:
    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.trainer import SCHEDULER_NAME

    from .clipping import clip_grad_norm_
    from .resume import load_training_state, save_training_state

    original_init = Trainer.__init__

    @functools.wraps(original_init)
    def __init__(self, model=None, args=None, *rest, **kwargs):
        if model is None or not is_parallel(model):
            return original_init(self, model, args, *rest, **kwargs)
        if parallel_state(model).stage is not None:
            raise ValueError(
                f"Trainer cannot drive a model on pipeline stages ({parallel_state(model).mesh.shape}): it runs one "
                "forward and one backward per batch, a pipeline needs a schedule. Use hf_parallel.train_step(model, "
                "input_ids, labels) in your loop (GPipe or 1F1B), or load without pp_size / stage_tp_sizes"
            )
        args = args if args is not None else TrainingArguments(output_dir="tmp_trainer")
        # The Trainer refuses to checkpoint the optimizer of a model sharded at load time; hf_parallel
        # saves each rank's (below), so the check is passed as if only the model were saved.
        resumable = not args.save_only_model
        args.save_only_model = True
        try:
            original_init(self, model, args, *rest, **kwargs)
        finally:
            args.save_only_model = not resumable
        if self.accelerator.state.device_mesh is None:
            self.accelerator.state.device_mesh = batch_mesh(parallel_state(model).mesh)

    Trainer.__init__ = __init__

    def wrap(name, replacement):
        original = getattr(Trainer, name, None)
        if original is None:  # a transformers without this step (the seams are those of 5.23)
            return

        @functools.wraps(original)
        def method(self, *args, **kwargs):
            if is_parallel(self.model):
                return replacement(self, *args, **kwargs)
            return original(self, *args, **kwargs)

        setattr(Trainer, name, method)

    wrap("_clip_grad_norm", lambda self, model: clip_grad_norm_(self.model, self.args.max_grad_norm))
    wrap(
        "_get_grad_norm",
        lambda self, model, grad_norm=None: (
            clip_grad_norm_(self.model, float("inf")) if grad_norm is None else grad_norm
        ),
    )
    wrap("_sync_replicated_trainable_parameters", lambda self, model: place_and_check(self.model))

    def save_state(self, output_dir):
        save_training_state(self.model, self.optimizer, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def load_state(self, checkpoint):
        if checkpoint is not None:
            load_training_state(self.model, self.optimizer, checkpoint)
            scheduler = torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
            self.lr_scheduler.load_state_dict(scheduler)

    wrap("_save_optimizer_and_scheduler", save_state)
    wrap("_load_optimizer_and_scheduler", load_state)
    wrap(
        "_load_from_checkpoint", lambda self, checkpoint, model=None: load_training_state(self.model, None, checkpoint)
    )
