"""The data dimensions: FSDP2 (``fully_shard``) over ``dp_shard`` x ``sp``, HSDP over ``dp_replicate``.

Applied to the empty model (its parameters on meta, of each rank's TP shapes) before any weight is
read, in torchtitan's order: every decoder layer, then the root (embeddings, final norm, head); the
load then fills each rank's FSDP rows in place (``checkpoint/loading.py``). The TP shards are plain
tensors, so FSDP sees each rank's TP shard as the whole parameter and shards it further over the
data-parallel ranks at the same TP position.

The sequence dimension is folded into FSDP's shard group (torchtitan's ``dp_shard_cp``): each
sequence rank saw other tokens, so the gradient sum SP needs is exactly FSDP's reduce-scatter, and
the per-parameter SP all-reduce disappears (``GradientSums.register_under_fsdp`` leaves it out). FSDP divides
by the data-parallel size only (SP is a sum; data-parallel ranks average, as the Trainer's loss
scaling and a plain ``loss.backward()`` expect); on gloo, which lacks PREMUL_SUM, as SUM then divide.
Pipeline stages keep parameters unsharded between micro-batches (``reshard_after_forward=False``).
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch
from torch import nn

from ..compat.torch import reshards_after_forward
from ..core.layers import find_layer_list
from . import comm
from .devices import free_bytes, memory_id


def layers_to_shard(model: nn.Module, mesh) -> nn.ModuleList:
    """The decoder layers FSDP wraps one by one; a model without them is refused (checked before
    any weight is read)."""
    try:
        return model.get_submodule(find_layer_list(model))
    except (ValueError, AttributeError) as error:
        raise ValueError(
            f"fsdp_size={mesh.shape.dp_shard}, dp_replicate_size={mesh.shape.dp_replicate}: "
            f"{type(model).__name__} has no list of repeated layers to shard one by one ({error})"
        ) from None


def ends_of_their_own(model: nn.Module) -> list[nn.Module]:
    """The input embedding and the LM head, when they share no weight (untied): each gets its own
    FSDP group, so it is whole only while it runs (torchtitan's order), not for the root's whole
    forward and backward. Tied, they stay in the root's group."""
    ends = [model.get_input_embeddings(), model.get_output_embeddings()]
    weights = [{id(p) for p in end.parameters()} if end is not None else set() for end in ends]
    if weights[0] & weights[1]:
        return []
    return [end for end, held in zip(ends, weights) if held]


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
FREED_TO_THE_OS_FROM = 8 << 20  # bytes: blocks this large (gathered layers, not activations) are mapped alone


def return_freed_blocks_to_the_os() -> None:
    """On a CPU host, FSDP frees each layer's gathered parameters and gradients after use; glibc
    raises its mmap threshold after the first such free and then keeps those blocks in its heap, so
    a rank's memory grows back towards the unsharded model. A fixed threshold maps blocks of 8 MiB
    and more (gathered layers) alone and returns them when freed, while activations stay on the
    heap: a lower peak per rank at the same speed, where a lower threshold would make every
    activation a fresh mapping and slow each step. Set before loading."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, FREED_TO_THE_OS_FROM)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def fsdp_policies(mesh, compute_dtype: torch.dtype | None, cpu_offload: bool) -> dict:
    """``fully_shard``'s policies: mixed precision as transformers and torchtitan train (parameters
    gathered in ``compute_dtype``, gradients reduced in float32 into float32 master weights), and the
    shards kept in host memory between uses (FSDP2's offload, which needs an accelerator: refused by name
    on a CPU mesh)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    policies = {}
    if compute_dtype is not None:
        policies["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        if mesh.device.type == "cpu":
            raise ValueError(
                "fsdp_cpu_offload=True on a CPU mesh: FSDP2 offloads an accelerator's shards to host memory, and "
                "these ranks compute on the host already"
            )
        policies["offload_policy"] = CPUOffloadPolicy()
    return policies


def expert_shard_dim(local_experts: int, holders: int) -> int:
    """The dim FSDP shards a rank's experts along over the ``holders`` ranks holding the same ones: the experts'
    own (dim 0), unless fewer than the holders, where some would hold none (and another a whole expert): then
    dim 1, each expert's rows (torchtitan's placement for the same case)."""
    return 0 if local_experts >= holders else 1


def shard_experts(experts: list[nn.Module], mesh, policies: dict) -> None:
    """Experts under ``ep_size`` (each rank's whole experts) sharded by FSDP2 over the ranks holding the same
    ones (``ep_replicas``, along ``expert_shard_dim``), before their layers are: each layer's own group then
    leaves them out. Their gradients are summed there and divided by the data-parallel size, as the dense layers'
    are (each saw the tokens of its whole EP group, each rank's loss a mean over its own batch), reduced in
    float32 (in float16, torch 2.13 would divide a one-rank group's twice)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    holders = mesh["ep_replicas"].size
    policies = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32), **policies}
    for module in experts:
        dim = expert_shard_dim(next(module.parameters()).shape[0], holders)
        fully_shard(module, mesh=mesh.expert_device_mesh(), shard_placement_fn=lambda _, dim=dim: Shard(dim),
                    **policies)  # fmt: skip
        module.set_gradient_divide_factor(float(mesh.shape.dp))
        # a factor is a PREMUL_SUM, which gloo lacks: SUM, then divide (on one rank torch 2.13 runs no
        # collective and divides by the factor itself, and would divide twice if forced)
        if mesh.device.type == "cpu" and holders > 1:
            module.set_force_sum_reduction_for_comms(True)


def shard_data_parallel(model: nn.Module, mesh, gradients, sequence, keep_unsharded: bool, policies: dict,
                        experts: list[nn.Module] = ()):  # fmt: skip
    """FSDP2 over the mesh's data dimensions, then every gradient sum recorded so far registered on
    the parameters FSDP computes with (the sequence group's left to FSDP's reduce-scatter).
    ``keep_unsharded``: pipeline stages run several micro-batches per step through their own forward,
    which is returned with FSDP's root hooks on it (else None). ``policies``: ``fsdp_policies``'.
    ``experts``: the experts modules of ``ep_size`` (``shard_experts``)."""
    from torch.distributed.fsdp import fully_shard

    layer_list = layers_to_shard(model, mesh)
    shard_experts(list(experts), mesh, policies)
    names = {id(param): name for name, param in model.named_parameters()}
    device_mesh = mesh.device_mesh()
    wrapped = [layer for layer in layer_list if any(True for _ in layer.parameters())]
    ends = ends_of_their_own(model)
    # what runs last in the forward runs first in the backward: gathering it again would be waste
    last = {id(m) for m in (wrapped[-1:] + [e for e in ends if e is model.get_output_embeddings()])}
    wrapped += ends
    for layer in wrapped:
        reshard = not keep_unsharded and id(layer) not in last
        fully_shard(layer, mesh=device_mesh, reshard_after_forward=reshard, **policies)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=not keep_unsharded, **policies)
    if not keep_unsharded:  # (a pipeline stage's modules stay whole anyway)
        gathered_through_generate(model, mesh, [layer for layer in wrapped if id(layer) in last])
    for module in (*wrapped, model):
        if mesh.sp.size > 1:  # FSDP would divide by its groups' sizes, SP's included: SP is a sum
            # (not set otherwise: with a one-rank shard group, torch 2.13 divides a set factor twice)
            module.set_gradient_divide_factor(float(mesh.shape.dp))
            if mesh.device.type == "cpu":  # a factor is a PREMUL_SUM, which gloo lacks: SUM, then divide
                module.set_force_sum_reduction_for_comms(True)
    stage_forward = None
    if keep_unsharded:  # FSDP's root hooks go on the forward a stage runs its micro-batches through
        from torch.distributed.fsdp import register_fsdp_forward_method

        model.stage_forward = model.forward
        register_fsdp_forward_method(model, "stage_forward")
        stage_forward = model.stage_forward
    gradients.register_under_fsdp(model, names, done_by_fsdp=None if sequence is None else sequence.group)
    return stage_forward


def reshard_all(model: nn.Module) -> None:
    """Every FSDP module of ``model`` sharded: a forward leaves some whole (the last layer, an untied head, a
    stage's modules), and under mixed precision those hold FSDP's bf16 copies in place of the masters."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


WHOLE_WHILE_GENERATING = 0.8  # of the memory free as a generate starts, what its layers kept whole may take


def gathered_through_generate(model: nn.Module, mesh, whole_after_forward: list[nn.Module]) -> None:
    """``model.generate`` under FSDP gathers each module's parameters once per call. FSDP's hooks would gather
    each module again at every token's forward and free it after (every parameter copied per token, even where
    a shard group has one rank); for the call, the modules that reshard after their forward do not, so the
    first forward gathers each and the later ones find them whole. The call's end puts each setting back and
    shards those modules again, and ``whole_after_forward``, which ``fully_shard`` keeps whole after a forward
    for the backward (the last layer, an untied head) that generate does not run; any other module its user set
    to stay whole stays so. A rank holds its TP shard of every layer whole while generating, as TRL and
    DeepSpeed gather a model for generation; where the ranks sharing one memory (a host's, or one accelerator's)
    would need more than ``WHOLE_WHILE_GENERATING`` of what is free there, or a rank cannot tell, every rank
    gathers per token as FSDP does: the ranks of a shard group must all keep or all gather, or their gathers
    would not pair up, so each call decides from every rank's figures, the same on all."""
    from torch.distributed.fsdp import FSDPModule

    generate, depth = model.generate, [0]
    modules = [module for module in model.modules() if isinstance(module, FSDPModule)]

    @functools.wraps(generate)
    def generate_gathered_once(*args, **kwargs):
        if depth[0]:  # a generate inside one (an assistant's, a custom loop's): the outer call's setting holds
            return generate(*args, **kwargs)
        changed = [module for module in modules if reshards_after_forward(module)] if _fits(model, mesh) else []
        for module in changed:
            module.set_reshard_after_forward(False, recurse=False)
        depth[0] += 1
        try:
            return generate(*args, **kwargs)
        finally:
            depth[0] -= 1
            for module in changed:
                module.set_reshard_after_forward(True, recurse=False)
            for module in (*changed, *whole_after_forward):  # the rank holds its shards again
                module.reshard()

    model.generate = generate_gathered_once


def _fits(model: nn.Module, mesh) -> bool:
    """Whether every memory the ranks compute in holds what its ranks keep whole through a generate: each rank's
    parameters at their unsharded size (as stored: an upper bound under mixed precision). One all-gather of
    (memory, free bytes, bytes needed) over the world, so every rank decides alike."""
    needed = sum(param.numel() * param.element_size() for param in model.parameters())
    free = free_bytes(mesh.device)
    mine = torch.tensor([[memory_id(mesh.device), -1.0 if free is None else free, needed]], dtype=torch.float64,
                        device=mesh.device)  # fmt: skip
    if mesh.world.group is None:
        everyone = mine
    else:
        everyone = comm.all_gather_now(mine, 0, [1] * mesh.world.size, mesh.world.group)
    homes: dict = {}
    for home, free, needed in everyone.tolist():  # (one host read a call)
        if free < 0:
            return False  # a rank that cannot tell: FSDP's own per-token gathers, which need nothing more
        known, total = homes.get(home, (free, 0.0))
        homes[home] = (min(known, free), total + needed)
    return all(total <= WHOLE_WHILE_GENERATING * free for free, total in homes.values())


class LayerwiseUnshard:
    """FSDP's modules made whole one at a time, as a save reaches their parameters: the root (embeddings,
    final norm, head) for the whole save, each decoder layer only while its tensors are gathered, so a
    rank holds its TP shard of one layer unsharded, not of the model. Every rank of a data-parallel group
    calls ``need`` for the same parameters in the same order (unsharding is collective over the group);
    without FSDP it does nothing. ``masters``: under mixed precision FSDP unshards the bf16 copies it
    computes with; the save gathers each float32 master instead (one parameter at a time)."""

    def __init__(self, model: nn.Module, masters: bool = False):
        from torch.distributed.fsdp import FSDPModule

        self.model, self.masters = model, masters
        self.root = model if isinstance(model, FSDPModule) and not masters else None
        self.owner: dict[str, nn.Module] = {}  # parameter name -> the innermost FSDP module that manages it
        for path, module in model.named_modules():
            if isinstance(module, FSDPModule):
                prefix = f"{path}." if path else ""
                self.owner.update({prefix + name: module for name, _ in module.named_parameters()})
        self.current = None
        self.whole: tuple[str, torch.Tensor] | None = None  # (name, master) gathered last, under ``masters``

    def __enter__(self) -> LayerwiseUnshard:
        if self.root is not None:
            self.root.unshard()
        if self.masters:
            reshard_all(self.model)
        return self

    def need(self, name: str) -> None:
        """The module that manages parameter ``name`` whole (and the one before it sharded again)."""
        module = self.owner.get(name)
        if self.masters:
            param = self.model.get_parameter(name) if module is not None else None
            self.whole = (name, param.full_tensor()) if hasattr(param, "full_tensor") else None
            return
        if module is None or module is self.root or module is self.current:
            return
        if self.current is not None:
            self.current.reshard()
        module.unshard()
        self.current = module

    def tensor(self, name: str) -> torch.Tensor:
        """The parameter or buffer called ``name``, whole over the data-parallel ranks once ``need``-ed."""
        if self.whole is not None and self.whole[0] == name:
            return self.whole[1]
        module, _, attr = name.rpartition(".")
        return getattr(self.model.get_submodule(module), attr)

    def __exit__(self, *exc) -> None:
        for module in (self.current, self.root):
            if module is not None:
                module.reshard()
        self.current = self.whole = None
