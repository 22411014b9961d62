"""One linear's product at decode shapes on a GPU, four ways side by side in one run: a bf16 weight
(``F.linear``), a weight kept FP8 and dequantized for the product (what ``keep_quantized=True`` does where the
package's kernel does not run), kept FP8 through that weight-only Triton kernel (``tensor/fp8_kernel.py``,
``keep_quantized=True`` on a card that runs it), and kept FP8 multiplied in FP8 with the activations
quantized (``keep_quantized="fp8"`` on Hopper: ``tensor/fp8_matmul.py``). Prints the recipe the
card was found to take (and why others were refused), then microseconds per product (CUDA events, median of
``--repeats`` timings of ``--calls`` products each) and ratios against bf16.

    python benchmarks/fp8_products.py [--tokens 1 16] [--shapes 4096x1536 1536x4096 768x1536]
"""

from __future__ import annotations

import argparse
import logging
import statistics

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


def main() -> None:
    from hf_parallel.checkpoint.quantized import KeptFP8
    from hf_parallel.tensor import fp8_kernel
    from hf_parallel.tensor.fp8_matmul import BLOCK, block_scales, fp8_product, supports_block_fp8

    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--shapes", nargs="+", default=["4096x1536", "1536x4096", "768x1536", "14336x4096"], help="NxK")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    device = torch.device("cuda", torch.cuda.current_device())
    recipe = supports_block_fp8(device)
    kernel = fp8_kernel.runs_on(device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}: {recipe}, "
          f"weight-only kernel: {kernel}")  # fmt: skip
    print("| N x K | tokens | bf16 us | kept, dequantized us | kept, kernel us | kept, FP8 products us | kernel x bf16 "
          "| FP8 products x bf16 |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for shape in args.shapes:
        n, k = map(int, shape.split("x"))
        weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        blocks = weight.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
        scales = blocks.abs().amax(dim=(1, 3)) / 448
        stored = (blocks / scales[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
        kept = KeptFP8({}, stored, scales, (BLOCK, BLOCK), (0, 0))
        for tokens in args.tokens:
            x = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
            plain = timed(lambda: F.linear(x, weight), args.calls, args.repeats)
            dequantized = timed(lambda: F.linear(x, kept.dequantize(torch.bfloat16)), args.calls, args.repeats)
            fp8 = weight_only = "-"
            if kernel:
                weight_only = timed(lambda: fp8_kernel.weight_only_fp8(x, kept), args.calls, args.repeats)
            if recipe is not None and recipe.takes(k):
                scale_b = block_scales(scales, recipe.padded_scales)
                fp8 = timed(lambda: fp8_product(x, stored, scale_b, torch.bfloat16, recipe.rows), args.calls,
                            args.repeats)  # fmt: skip
            cells = [f"{t:.1f}" if t != "-" else t for t in (plain, dequantized, weight_only, fp8)]
            cells += [f"{t / plain:.2f}x" if t != "-" else t for t in (weight_only, fp8)]
            print(f"| {n} x {k} | {tokens} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
