"""A Triton kernel launched again without ``JITFunction.run``'s work each call (``compat/triton.py``: about
12.5 us of the host's time a launch, where a decode step in eager waits on the host).

Triton still chooses the kernel: the first launch of each key goes through ``kernel[grid](...)``, which
compiles or finds the kernel that Triton's own specialization picks, and returns it; a later launch with the
same key calls that kernel. The key holds all Triton specializes on for NVIDIA's cards, and more: each
integer's value (Triton: whether it is 1, or divisible by 16), each tensor's dtype and address modulo 256
(Triton: whether it is divisible by 16), the constexprs, warps and stages, and the current device. Arguments
with one key therefore get the kernel ``kernel[grid]`` would launch for them. A changed Triton setting
(``knobs``: debug, instrumentation) after a key's first launch is not seen by that key.

A launch comes ``Bound``: its grid and the arguments after its leading tensors (a kept weight, its scales,
sizes, constexprs) worked out once with their part of the key, so a kept weight's product launched again
computes the key of its input and output only (the host's time again). A bound tensor's address is the one
it had when bound: a kept weight's storage is never swapped.

Inside a compiled step every launch is ``kernel[grid](...)``, which the graph captures as a kernel of its own;
on ROCm too, where Triton also specializes a tensor on whether its storage spans under 2 GB. Under
Triton's interpreter, ``kernel[grid]`` returns no kernel, so every launch goes through it. Where Triton no
longer has what this relies on (or is older than 3.3, whose launches left the constexprs out), every launch
goes through it too, with one warning naming what changed; and so from the first kept kernel that refuses its
arguments (its launcher parses them before launching anything).
"""

from __future__ import annotations

import functools
import warnings
from typing import NamedTuple

import torch

from ...compat import DependencyChanged
from ...compat import triton as triton_seams


class Bound(NamedTuple):
    """A launch's grid and every argument after its leading tensors (``fixed``: the kernel's next parameters,
    then its ``constexprs`` in its order), worked out once for every launch that shares them (``bind``: a
    kept weight's product for inputs of one shape). ``key``: what a kept kernel's key holds of them, None
    inside a compiled step (a traced tensor has no address)."""

    grid: tuple  # three sizes
    fixed: tuple
    constexprs: dict
    warps: int
    stages: int
    key: object | None


def bind(grid: tuple, fixed: tuple, constexprs: dict, warps: int, stages: int) -> Bound:
    """``Bound``, its key worked out here (in eager) rather than at each launch, and stood for by one object
    (``_BOUND_KEYS``: a launch's key then hashes that object, not twenty-odd values)."""
    key = None
    if not torch.compiler.is_compiling():
        key = (*map(_specialized, fixed), *map(_specialized, constexprs.values()), warps, stages)
        key = _BOUND_KEYS.setdefault(key, object())  # one step (the GIL's): two threads get one object
    return Bound(grid, fixed, constexprs, warps, stages, key)


_BOUND_KEYS: dict[tuple, object] = {}  # every bound key seen: a process binds a few per kept weight and shape


class CachedLaunch:
    """``kernel[grid](*tensors, *fixed, **constexprs, num_warps=warps, num_stages=stages)`` for a ``Bound``
    launch, the kernel kept per key after its first launch (``kernels``): the bound part's key, the current
    device, and each leading tensor's dtype and address modulo 256."""

    def __init__(self, kernel):
        self.kernel, self.kernels, self.off = kernel, {}, False

    def through_run(self, bound: Bound, *tensors: torch.Tensor):
        """Triton's own launch (``JITFunction.run``): the compiled kernel it launched, or None (interpreter)."""
        return self.kernel[bound.grid](*tensors, *bound.fixed, **bound.constexprs, num_warps=bound.warps,
                                       num_stages=bound.stages)  # fmt: skip

    def __call__(self, bound: Bound, *tensors: torch.Tensor) -> None:
        if torch.compiler.is_compiling() or torch.version.hip or self.off or _compiled_kernel() is None:
            self.through_run(bound, *tensors)
            return
        device = torch.cuda.current_device() if tensors[0].is_cuda else -1
        key = (bound.key, device, *[(t.dtype, t.data_ptr() % 256) for t in tensors])
        compiled = self.kernels.get(key)
        if compiled is not None:
            try:
                compiled[bound.grid](*tensors, *bound.fixed, *bound.constexprs.values())
                return
            except TypeError as error:  # its launcher parses other arguments (before launching): run's from now on
                self.off, self.kernels = True, {}
                warnings.warn(f"hf_parallel: {self.kernel} launches through JITFunction.run each time: a kept "
                              f"kernel refused its arguments ({error})", stacklevel=3)  # fmt: skip
                return self(bound, *tensors)
        names, given = self.kernel.arg_names[len(tensors) + len(bound.fixed):], list(bound.constexprs)
        if names != given or len(bound.grid) != 3 or bound.key is None:  # a caller's mistake
            raise TypeError(f"{self.kernel.arg_names}: a cached launch passes the constexprs last, in this order, "
                            f"a grid of three sizes and a key bound in eager; given {given}, grid {bound.grid}, "
                            f"key {bound.key}")  # fmt: skip
        compiled = self.through_run(bound, *tensors)
        if isinstance(compiled, _compiled_kernel()):
            self.kernels[key] = compiled


def _specialized(argument):
    """What of an argument the key holds: a tensor's dtype and address modulo 256, else its type and value
    (``True`` and ``1`` apart)."""
    if isinstance(argument, torch.Tensor):
        return argument.dtype, argument.data_ptr() % 256
    return type(argument), argument


@functools.cache
def _compiled_kernel():
    """Triton's ``CompiledKernel`` class where every seam a cached launch uses holds, else None (warned once).
    Triton before 3.3 launched a kernel with its arguments but the constexprs, which a cached launch passes."""
    import triton

    try:
        if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 3):
            raise DependencyChanged(f"triton {triton.__version__} launches without the constexprs (3.3 and later "
                                    f"pass them)")  # fmt: skip
        for seam in (triton_seams.RUN, triton_seams.LAUNCH, triton_seams.ARG_NAMES):
            seam.get()
        return triton_seams.COMPILED_KERNEL.get()
    except (DependencyChanged, ValueError) as error:  # ValueError: a version this cannot read
        warnings.warn(f"hf_parallel: Triton kernels launch through JITFunction.run each time: {error}", stacklevel=3)
        return None
