"""The host's time the package spends on a kept FP8 product before Triton launches it, on any machine (no card:
Triton's compiled kernel is replaced by a stand-in that launches nothing, so what is timed is this package's
Python and torch's allocation of the output). A decode step in eager waits on the host, and kept FP8 linears
launch the kernel seven times a layer; the card's own share (Triton's launcher, the kernel) is timed by
``fp8_products.py --sweep`` on a GPU.

    python benchmarks/launch_host.py [--shape 4096x1536] [--calls 20000]

Prints microseconds per product (best of 5 rounds): as kept modules launch it (``fp8_weight_only.LaunchPlans``: the
launch worked out at the first product of a shape, the kernel kept from its first launch), and worked out
again each call (what ``runs_on``'s checks do), beside ``torch.empty`` of the output alone.
"""

from __future__ import annotations

import argparse
import time
import types

import torch


def stand_in_source():
    """``fp8_triton`` with both kernels' launches going to a stand-in compiled kernel (``CachedLaunch`` keeps it
    as it keeps Triton's), which launches nothing."""
    from triton.compiler.compiler import CompiledKernel

    from hf_parallel.quant.kernels import fp8_triton
    from hf_parallel.quant.kernels.triton_launch import CachedLaunch

    class StandIn(CompiledKernel):
        def __init__(self):  # nothing compiled, nothing to unload
            pass

        def __del__(self):
            pass

        def __getitem__(self, grid):
            return lambda *arguments: None

    class Kernel:  # ``kernel[grid](...)`` as ``JITFunction.run`` is called: returns the kernel it launched
        def __init__(self, jit):
            self.arg_names = jit.arg_names

        def __getitem__(self, grid):
            return lambda *arguments, **options: StandIn()

    return types.SimpleNamespace(
        INTERPRETED=False, triton=fp8_triton.triton,
        launch_weight_only_fp8=CachedLaunch(Kernel(fp8_triton.weight_only_fp8)),
        launch_gathered_weight_only_fp8=CachedLaunch(Kernel(fp8_triton.gathered_weight_only_fp8)),
    )  # fmt: skip


def host_us(fn, calls: int) -> float:
    """Microseconds a call of ``fn``, the best of five rounds of ``calls`` (after a warm-up)."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4096x1536", help="outputs x inputs of one linear (a 128-block multiple)")
    parser.add_argument("--experts", type=int, default=8, help="experts of the gathered product's stack")
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args(argv)

    from hf_parallel.quant.scaled_fp8 import KeptFP8
    from hf_parallel.quant.kernels import fp8_weight_only

    fp8_weight_only._source = stand_in_source()
    outputs, inputs = map(int, args.shape.split("x"))
    weight = torch.zeros(outputs, inputs, dtype=torch.float8_e4m3fn)
    scales = torch.ones(outputs // 128, inputs // 128)
    kept = KeptFP8({}, weight, scales, (128, 128), (0, 0))
    stacked = KeptFP8({}, weight.expand(args.experts, -1, -1), scales.expand(args.experts, -1, -1), (128, 128), (0, 0))
    x, pairs = torch.zeros(1, 1, inputs, dtype=torch.bfloat16), torch.zeros(2, inputs, dtype=torch.bfloat16)
    ids = torch.tensor([1, 3])
    plans, stack_plans = fp8_weight_only.LaunchPlans(), fp8_weight_only.LaunchPlans()  # each kept weight's own, as modules hold them
    rows = {
        f"plain {outputs} x {inputs}, one row": (
            lambda: fp8_weight_only.weight_only_product(x, kept, plans=plans), lambda: fp8_weight_only.weight_only_product(x, kept),
            (1, 1, outputs)),
        f"gathered {args.experts} experts, two pairs": (
            lambda: fp8_weight_only.weight_only_product(pairs, stacked, plans=stack_plans, ids=ids),
            lambda: fp8_weight_only.weight_only_product(pairs, stacked, ids=ids), (2, outputs)),
    }  # fmt: skip
    print(f"host us a kept FP8 product before Triton's launcher (torch {torch.__version__}, CPU stand-in kernel)")
    print("| product | as kept modules launch it | worked out each call | torch.empty of its output |")
    print("|---|---|---|---|")
    for name, (planned, each_call, shape) in rows.items():
        empty = host_us(lambda: torch.empty(shape, dtype=torch.bfloat16), args.calls)
        print(f"| {name} | {host_us(planned, args.calls):.2f} | {host_us(each_call, args.calls):.2f} | {empty:.2f} |")


if __name__ == "__main__":
    main()
