"""Every internal of torch hf_parallel uses, and why.

- A module's parameter dict, swapped for the length of one call (``parameters_replaced``): a whole
  parameter inside a split computation counts on one rank only (GPT-OSS's expert biases).
- A module's set of non-persistent buffers (``is_persistent_buffer``): the save writes what
  ``state_dict`` would, without building a state dict of shards.
- The global module registration hook: how hf_parallel learns that peft put a wrapper in place.
- FSDP2 keeps, after its first all-gather, one unsharded parameter per sharded one and reuses it:
  the gradient sums hf_parallel registers go on that parameter once (``tensor/gradients.py``).
- FSDP2 shards dim 0 as ``torch.chunk`` does: the global gradient norm weighs each row of a slice by
  the TP pieces it holds (``training/clipping.py``).
- An op registered as an ordered effect keeps its place among the others in a compiled graph: the
  collectives (``distributed/ops.py``), which inductor could otherwise reorder differently on each rank.
- Which backward a gradient hook runs in, a callback at that backward's end, and the hooks a parameter
  carries: the bucketed gradient sums (``tensor/gradients.py``) are waited at the end of each backward,
  and a parameter someone else hooks after them is summed in its own hook, so theirs see the sum.
- The two steps of ``torch.nn.utils.clip_grad_norm_``, found by name in its module when it runs (the norm,
  the scaling): on a split model the norm is the global one (``training/clipping.py``), whoever calls it.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

from . import Seam

MODULE_PARAMETERS = Seam("torch", "torch.nn:Module.__getattr__", "(a module's parameters, swapped for one call)",
                         reads=("_parameters",))  # fmt: skip
NON_PERSISTENT = Seam("torch", "torch.nn:Module.register_buffer", "(which buffers a state dict leaves out)",
                      reads=("_non_persistent_buffers_set",))  # fmt: skip
REGISTRATION_HOOK = Seam("torch", "torch.nn.modules.module:register_module_module_registration_hook",
                         "(to follow peft's wrappers)", parameters=("hook",))  # fmt: skip
FSDP_UNSHARDED_PARAM = Seam("torch", "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam.init_unsharded_param",
                            "(FSDP2 creates a module's unsharded parameter once and reuses it)",
                            reads=("_unsharded_param",))  # fmt: skip


@contextmanager
def parameters_replaced(module, values: dict):
    """``module`` computes with ``values`` (name -> tensor) in place of those parameters, for the block."""
    MODULE_PARAMETERS.get()
    saved = {name: module._parameters[name] for name in values}
    module._parameters.update(values)
    try:
        yield saved
    finally:
        module._parameters.update(saved)


def is_persistent_buffer(module, attr: str) -> bool:
    NON_PERSISTENT.get()
    return attr not in module._non_persistent_buffers_set


def on_module_registered(hook) -> None:
    """``hook(parent, name, module)`` runs whenever any module is set as a submodule (torch's global hook)."""
    REGISTRATION_HOOK.get()(hook)


FSDP_CHUNKS = Seam("torch", "torch.distributed.fsdp._fully_shard._fsdp_param:FSDPParam._init_sharded_param",
                   "(FSDP2 gives shard i the rows torch.chunk does)", reads=("_chunk_with_empty",))  # fmt: skip


def check_fsdp_reuses_unsharded_parameters() -> None:
    FSDP_UNSHARDED_PARAM.get()


FSDP_RESHARD_SETTING = Seam("torch",
                            "torch.distributed.fsdp._fully_shard._fully_shard:FSDPModule.set_reshard_after_forward",
                            "(whether a module reshards after its forward, read where torch's own setter writes it: "
                            "generate keeps the layers whole for a call, then puts each back as it was)",
                            reads=("_get_fsdp_state", "_fsdp_param_groups", "post_forward_mesh_info"))  # fmt: skip


def reshards_after_forward(module) -> bool:
    """Whether the FSDP2 module ``module`` frees its gathered parameters after each forward (``fully_shard``'s
    ``reshard_after_forward``, as ``set_reshard_after_forward`` last set it)."""
    FSDP_RESHARD_SETTING.get()
    return any(group.post_forward_mesh_info is not None for group in module._get_fsdp_state()._fsdp_param_groups)


def fsdp_row_range(rows: int, index: int, size: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` FSDP2 gives shard ``index`` of ``size`` of a tensor with ``rows`` rows."""
    return fsdp_rows(rows, 0, index, size).start, fsdp_rows(rows, 0, index + 1, size).start


def fsdp_shard_dim(param) -> int:
    """The dim FSDP2 shards ``param`` (its sharded DTensor) along: 0, unless placed otherwise (experts)."""
    return next((p.dim for p in reversed(param.placements) if hasattr(p, "dim")), 0)


def fsdp_rows(full_rows: int, shard_rows: int, index: int, size: int) -> slice:
    """The dim-0 rows FSDP2 gives shard ``index`` of ``size`` (``torch.chunk``'s split)."""
    FSDP_CHUNKS.get()
    chunk = -(-full_rows // size)
    return slice(min(index * chunk, full_rows), min(index * chunk, full_rows) + shard_rows)


ORDERED_EFFECT = Seam("torch", "torch.library:_register_effectful_op",
                      "(collectives run in program order in a compiled graph, the same on every rank)",
                      parameters=("op", "effect"))  # fmt: skip


def keep_in_order(op: str) -> None:
    """``op`` (a qualified name) runs where the program put it, relative to every other ordered op:
    AOT autograd threads a token through them, so no pass of the compiler moves one past another."""
    import torch

    ORDERED_EFFECT.get()(op, torch.library.EffectType.ORDERED)


WILL_EXECUTE = Seam("torch", "torch._C:_will_engine_execute_node",
                    "(whether a backward accumulates a parameter's gradient, or autograd.grad hands it back)")  # fmt: skip
GRAPH_TASK = Seam("torch", "torch._C:_current_graph_task_id", "(which backward a gradient hook runs in)")
BACKWARD_END = Seam("torch", "torch.autograd.variable:Variable._execution_engine.queue_callback",
                    "(a callback at the end of the running backward)")  # fmt: skip
TENSOR_HOOKS = Seam("torch", "torch._tensor:Tensor.register_hook", "(the hooks a parameter carries)",
                    reads=("_backward_hooks",))  # fmt: skip
ACCUMULATED_HOOKS = Seam("torch", "torch._tensor:Tensor.register_post_accumulate_grad_hook",
                         "(the hooks a parameter carries)", reads=("_post_accumulate_grad_hooks",))  # fmt: skip


def current_backward() -> int:
    """The running backward's id (each nested backward, as reentrant checkpointing runs, its own)."""
    return GRAPH_TASK.get()()


def at_backward_end(callback) -> None:
    """``callback()`` once the running backward has finished (not if it raises)."""
    BACKWARD_END.get()(callback)


def hook_counts(param) -> tuple[int, int]:
    """How many gradient hooks ``param`` carries: before and after accumulation."""
    TENSOR_HOOKS.get()
    ACCUMULATED_HOOKS.get()
    return len(param._backward_hooks or ()), len(param._post_accumulate_grad_hooks or ())


def grad_accumulator(param):
    """The autograd node that accumulates ``param``'s gradient into ``.grad`` (DDP's way to reach it)."""
    return param.view_as(param).grad_fn.next_functions[0][0]


def will_accumulate(accumulator) -> bool:
    """Inside a backward: whether it runs ``accumulator`` (``backward()`` does; ``autograd.grad`` returns the
    gradient instead)."""
    try:
        return WILL_EXECUTE.get()(accumulator)
    except RuntimeError as error:  # torch asks this of a leaf inside autograd.grad, which accumulates nothing
        if "autograd.grad" in str(error):
            return False
        raise


# torch's clip_grad_norm_ finds these two by name in its module when it runs: replacing them there reaches
# every caller of torch's function, one that bound it by ``from torch.nn.utils import clip_grad_norm_`` too
TOTAL_NORM = Seam("torch", "torch.nn.utils.clip_grad:_get_total_norm", "(the gradient norm torch's clipping uses)",
                  parameters=("tensors", "norm_type", "error_if_nonfinite", "foreach"))  # fmt: skip
CLIP_WITH_NORM = Seam("torch", "torch.nn.utils.clip_grad:_clip_grads_with_norm_", "(how torch's clipping scales)",
                      parameters=("parameters", "max_norm", "total_norm", "foreach"))  # fmt: skip
CLIP_GRAD_NORM = Seam("torch", "torch.nn.utils.clip_grad:clip_grad_norm_", "(torch's clipping, made global)",
                      reads=("_get_total_norm", "_clip_grads_with_norm_"))  # fmt: skip


def route_gradient_clipping(total_norm, clip_with_norm) -> None:
    """``torch.nn.utils.clip_grad_norm_`` (and ``get_total_norm``, ``clip_grads_with_norm_``) ask
    ``total_norm(grads, norm_type, error_if_nonfinite)`` and ``clip_with_norm(parameters, max_norm, norm)``
    first; each returns ``NotImplemented`` for tensors that are none of its business, and torch's own runs.
    Installed once; a second call changes nothing."""
    import torch
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

    CLIP_GRAD_NORM.get()
    own_norm, own_clip = TOTAL_NORM.get(), CLIP_WITH_NORM.get()
    if getattr(clip_grad._get_total_norm, "__wrapped__", None) is own_norm:
        return

    @functools.wraps(own_norm)
    def routed_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        norm = total_norm([tensors] if isinstance(tensors, torch.Tensor) else list(tensors), norm_type,
                          error_if_nonfinite)  # fmt: skip
        return own_norm(tensors, norm_type, error_if_nonfinite, foreach) if norm is NotImplemented else norm

    @functools.wraps(own_clip)
    def routed_clip(parameters, max_norm, total_norm, foreach=None):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if clip_with_norm(parameters, max_norm, total_norm) is NotImplemented:
            own_clip(parameters, max_norm, total_norm, foreach)

    clip_grad._get_total_norm = utils.get_total_norm = routed_norm
    clip_grad._clip_grads_with_norm_ = utils.clip_grads_with_norm_ = routed_clip
