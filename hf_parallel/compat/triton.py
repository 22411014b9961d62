"""Every internal of Triton hf_parallel uses, and why.

A launch through ``JITFunction.run`` (``kernel[grid](...)``) binds every argument, computes its
specialization and the cache key, and checks the kernel's globals before the compiled kernel runs: several
times the host's time of the compiled kernel's own launch (facebookexperimental/triton#1231). A decode step in
eager waits on the host, and kept FP8 linears launch the package's kernel seven times a layer. Triton's
maintainers advise keeping the compiled kernel that ``kernel[grid](...)`` returns and calling it again where
its inputs cannot change it (triton-lang/triton#6064): ``tensor/triton_launch.py`` does, through these seams:
- ``JITFunction.run`` returns the ``CompiledKernel`` it launched (the first launch of each key goes through it);
- ``CompiledKernel.__getitem__(grid)(*arguments)`` launches it on the current stream, every argument in the
  kernel's order, constexprs too, as ``run`` passes them (since Triton 3.3; ``triton_launch`` checks the
  version);
- ``JITFunction.arg_names``: that order.

And one the FP8 kernels' GEMV launch (``fp8_triton._add``) sums with: ``tl.standard._sum_combine``, ``tl.sum``'s
combine. ``tl.reduce`` with it is ``tl.sum`` compiled for a GPU; Triton's interpreter sums it with numpy, where any
other combine is called element by element (minutes for the tests' products), and ``tl.sum`` itself, jitted
when Triton was imported, cannot run in the interpreter of a process that imported Triton before asking for it.
Where it is gone, the GEMV sums with ``tl.sum``: the same when compiled.
"""

from __future__ import annotations

from . import Seam

RUN = Seam("triton", "triton.runtime.jit:JITFunction.run", "(returns the kernel it launched: kept for the next)",
           reads=("device_caches", "packed_metadata"))  # fmt: skip
COMPILED_KERNEL = Seam("triton", "triton.compiler.compiler:CompiledKernel", "(a kernel compiled, launched again)")
LAUNCH = Seam("triton", "triton.compiler.compiler:CompiledKernel.__getitem__",
              "(launches it again: the grid, then every argument in order)",
              reads=("run", "packed_metadata"))  # fmt: skip
SUM_COMBINE = Seam("triton", "triton.language.standard:_sum_combine",
                   "(tl.sum's combine: a GEMV's sum, numpy's in Triton's interpreter)")
ARG_NAMES = Seam("triton", "triton.runtime.jit:JITFunction.__init__", "(the arguments' order, constexprs too)",
                 reads=("arg_names",))  # fmt: skip
