"""One linear's product at decode shapes on a GPU, four ways side by side in one run: a bf16 weight
(``F.linear``), a weight kept FP8 and dequantized for the product (what ``keep_quantized=True`` does where the
package's kernel does not run), kept FP8 through that weight-only Triton kernel (``quant/kernels/fp8_weight_only.py``,
``keep_quantized=True`` on a card that runs it), and kept FP8 multiplied in FP8 with the activations
quantized (``keep_quantized="fp8"`` on Hopper: ``quant/kernels/fp8_scaled_mm.py``). Prints the recipe the
card was found to take (and why others were refused), then microseconds per product (CUDA events, median of
``--repeats`` timings of ``--calls`` products each) and ratios against bf16.

    python benchmarks/fp8_products.py [--tokens 1 16] [--shapes 4096x1536 1536x4096 768x1536]

``--sweep`` times the package's two FP8 kernels (the plain and the gathered product) at 68 launches and the
defaults (outputs a program, warps, the weight's tile as either operand, tiles loaded at once, runs of
columns, ``tl.dot`` or a GEMV, columns a step: ``fp8_weight_only.Launch``) from CUDA graphs, the GPU's time alone,
and prints the fastest beside the launches the package uses (``fp8_weight_only.PLAIN`` and ``GATHERED``: in eager,
and split as a compiled step splits them, here with torch's sum and cast unfused: an upper bound of the
compiled step's) and the host's cost of a launch: as a kept linear makes it (its plan worked out once,
``fp8_weight_only.LaunchPlans``; the kernel kept from the first launch) and worked out and launched through
``JITFunction.run`` each time (the path before both, plus the plan's tuples: about a microsecond more on a
CPU), beside ``F.linear``'s: how those defaults are chosen.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, calls: int, repeats: int) -> float:
    """Median microseconds per call of ``fn``."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(stop) * 1e3 / calls)
    return statistics.median(samples)


def graphed(fn, calls: int, repeats: int) -> float:
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls: the GPU's time
    without the host's cost of launching."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) off the capturing stream, as torch.cuda.graphs asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return timed(graph.replay, 1, repeats) / calls


def graphed_or_inf(fn, calls: int, repeats: int) -> float:
    """``graphed``, or infinity where the launch does not compile (too much shared memory, say)."""
    try:
        return graphed(fn, calls, repeats)
    except Exception as error:  # noqa: BLE001 - a sweep reports what it could not run and goes on
        print(f"  not run: {str(error).splitlines()[0][:200]}", flush=True)
        return math.inf


def host_us(fn, calls: int) -> float:
    """Microseconds of the host's time per call of ``fn`` (launches queued, not waited for)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = time.perf_counter() - start
    torch.cuda.synchronize()
    return spent * 1e6 / calls


@contextlib.contextmanager
def through_run(name: str):
    """``fp8_triton``'s launcher ``name`` going through ``JITFunction.run`` each launch (as before
    ``quant/kernels/triton_launch.py``), for the host's time of both."""
    from hf_parallel.quant.kernels import fp8_triton

    kept = getattr(fp8_triton, name)
    setattr(fp8_triton, name, kept.through_run)
    try:
        yield
    finally:
        setattr(fp8_triton, name, kept)


def fp8_box(n: int, k: int, device, experts: tuple = ()):
    """A random bf16 weight [*experts, n, k] and it kept as FP8 in 128 x 128 blocks (``KeptFP8``)."""
    from hf_parallel.quant.scaled_fp8 import KeptFP8
    from hf_parallel.quant.kernels.fp8_scaled_mm import BLOCK

    weight = torch.randn(*experts, n, k, device=device, dtype=torch.bfloat16) / k**0.5
    blocks = weight.float().view(*experts, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scales = blocks.abs().amax(dim=(-3, -1)) / 448
    stored = (blocks / scales[..., :, None, :, None]).view(*experts, n, k).to(torch.float8_e4m3fn)
    return weight, KeptFP8({}, stored, scales, (BLOCK, BLOCK), (0, 0))


def sweep(args, device) -> None:
    from hf_parallel.quant.kernels import fp8_weight_only

    # stages changed nothing on an H200 and 16 outputs a program was fastest (the loads seem not to be pipelined,
    # the card not filled): tiles loaded together (unroll) and runs of columns (split) may (4 warps: 8 on 16
    # outputs a program make way for the GEMV launches); and GEMV launches (no tl.dot: wider programs, their
    # products in registers, as one-row Triton kernels elsewhere take them) at ``fp8_weight_only.GEMV_TILES``
    launches = [fp8_weight_only.Launch(n, 4, 3, swap, unroll, split) for n in (16, 32) for swap in (False, True)
                for unroll in (1, 4) for split in (1, 2, 4, 8)]  # fmt: skip
    launches += [fp8_weight_only.Launch(n, 4, 3, False, unroll, split, dot=False, tile_k=k) for n, k in fp8_weight_only.GEMV_TILES
                 for unroll in (1, 2) for split in (1, 4, 16)]  # fmt: skip
    print("| product | rows | bf16 us | the default launch us: eager, compiled (its split) | fastest launches (us) "
          "| host us a launch: planned and kept, through run (bf16) |\n|---|---|---|---|---|---|")  # fmt: skip
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        weight, kept = fp8_box(n, k, device)
        for tokens in args.tokens:
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            compiled = fp8_weight_only.PLAIN._replace(split=fp8_weight_only.split_for(-(-n // fp8_weight_only.PLAIN.tile_n), k, 128))
            times = launch_times(lambda launch: fp8_weight_only.weight_only_product(x, kept, launch),
                                 sorted({*launches, fp8_weight_only.PLAIN, compiled}), fp8_weight_only.PLAIN, args)  # fmt: skip
            plain = graphed(lambda: F.linear(x, weight), args.calls, args.repeats)
            plans = fp8_weight_only.LaunchPlans()  # as a kept linear launches it
            host = host_us(lambda: fp8_weight_only.weight_only_product(x, kept, plans=plans), 10 * args.calls)
            with through_run("launch_weight_only_fp8"):
                run = host_us(lambda: fp8_weight_only.weight_only_product(x, kept), 10 * args.calls)
            host = f"{host:.1f}, {run:.1f} ({host_us(lambda: F.linear(x, weight), 10 * args.calls):.1f})"
            defaults = f"{times[fp8_weight_only.PLAIN]:.1f}, {times[compiled]:.1f} ({compiled.split})"
            print(f"| {n} x {k} | {tokens} | {plain:.1f} | {defaults} | {fastest(times)} | {host} |", flush=True)
    for shape in args.expert_shapes:  # the gathered product: one expert a pair
        e, n, k = map(int, shape.split("x"))
        weight, kept = fp8_box(n, k, device, (e,))
        for pairs in args.pairs:
            x = torch.randn(pairs, k, device=device, dtype=torch.bfloat16)
            ids = torch.randint(0, e, (pairs,), device=device)
            programs = pairs * -(-n // fp8_weight_only.GATHERED.tile_n)
            compiled = fp8_weight_only.GATHERED._replace(split=fp8_weight_only.split_for(programs, k, 128))
            times = launch_times(lambda launch: fp8_weight_only.weight_only_product(x, kept, launch, ids=ids),
                                 sorted({*launches, fp8_weight_only.GATHERED, compiled}), fp8_weight_only.GATHERED,
                                 args)  # fmt: skip
            plain = graphed(lambda: torch.bmm(weight[ids], x[:, :, None]), args.calls, args.repeats)
            plans = fp8_weight_only.LaunchPlans()  # as kept experts launch it
            host = host_us(lambda: fp8_weight_only.weight_only_product(x, kept, plans=plans, ids=ids), 10 * args.calls)
            with through_run("launch_gathered_weight_only_fp8"):
                run = host_us(lambda: fp8_weight_only.weight_only_product(x, kept, ids=ids), 10 * args.calls)
            defaults = f"{times[fp8_weight_only.GATHERED]:.1f}, {times[compiled]:.1f} ({compiled.split})"
            print(f"| {e} experts {n} x {k} | {pairs} pairs | {plain:.1f} (bf16: gather, bmm) | {defaults} | "
                  f"{fastest(times)} | {host:.1f}, {run:.1f} |", flush=True)  # fmt: skip


def launch_times(product, launches: list, default, args) -> dict:
    """Each launch's GPU time for ``product(launch)``, infinity where it does not compile or computes
    otherwise than the kernel's ``default`` launch (every launch must give its numbers)."""
    reference = product(default).float()
    times = {}
    for launch in launches:
        got = graphed_or_inf(lambda: product(launch), 1, 1)  # compiles it, or says why not
        if got != math.inf and not torch.allclose(product(launch).float(), reference, rtol=0,
                                                   atol=2**-6 * reference.abs().max().item()):  # fmt: skip
            print(f"  {launch} computes otherwise than {default}", flush=True)
            got = math.inf
        times[launch] = got if got == math.inf else graphed(lambda: product(launch), args.calls, args.repeats)
    return times


def fastest(times: dict) -> str:
    return ", ".join(f"{tuple(launch)} {t:.1f}" for launch, t in sorted(times.items(), key=lambda i: i[1])[:3])


def main() -> None:
    from hf_parallel.quant.kernels import fp8_weight_only
    from hf_parallel.quant.kernels.fp8_scaled_mm import block_scales, fp8_product, supports_block_fp8

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--shapes", nargs="+", default=["4096x1536", "1536x4096", "768x1536", "14336x4096"], help="NxK")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sweep", action="store_true", help="time the kernels' launches instead (see above)")
    parser.add_argument("--expert-shapes", nargs="+", default=["32x1024x1024", "32x1024x512"], help="ExNxK")
    parser.add_argument("--pairs", type=int, nargs="+", default=[4, 16])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda", torch.cuda.current_device())
    if args.sweep:
        return sweep(args, device)
    recipe = supports_block_fp8(device)
    kernel = fp8_weight_only.runs_on(device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}: {recipe}, "
          f"weight-only kernel: {kernel}")  # fmt: skip
    print("| N x K | tokens | bf16 us | kept, dequantized us | kept, kernel us | kept, FP8 products us | kernel x bf16 "
          "| FP8 products x bf16 |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        weight, kept = fp8_box(n, k, device)
        stored, scales = kept.weight, kept.scales
        for tokens in args.tokens:
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            plain = timed(lambda: F.linear(x, weight), args.calls, args.repeats)
            dequantized = timed(lambda: F.linear(x, kept.dequantize(torch.bfloat16)), args.calls, args.repeats)
            fp8 = weight_only = "-"
            if kernel:
                weight_only = timed(lambda: fp8_weight_only.weight_only_product(x, kept), args.calls, args.repeats)
            if recipe is not None and recipe.takes(k):
                scale_b = block_scales(scales, recipe.padded_scales)
                fp8 = timed(lambda: fp8_product(x, stored, scale_b, torch.bfloat16, recipe.rows), args.calls,
                            args.repeats)  # fmt: skip
            cells = [f"{t:.1f}" if t != "-" else t for t in (plain, dequantized, weight_only, fp8)]
            cells += [f"{t / plain:.2f}x" if t != "-" else t for t in (weight_only, fp8)]
            print(f"| {n} x {k} | {tokens} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
