"""One benchmark run of one implementation, under torchrun (``--impl single`` with one process).

Writes ``<out>/<impl>-rank<r>.json`` (and rank 0's last-position logits as safetensors) for run.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import traceback

import torch
import transformers
from measure import CountCollectives, cpu_seconds, peak_rss_bytes, reset_peak_rss, rss_bytes

IMPORT_RSS = rss_bytes()  # a bare `import torch, transformers`, before anything of ours


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def load(impl: str, path: str, dtype: torch.dtype):
    if impl.startswith("hf_parallel"):  # hf_parallel_kept: a quantized checkpoint's weights kept quantized
        import hf_parallel

        kept = dict(keep_quantized=True) if impl == "hf_parallel_kept" else {}
        return hf_parallel.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=dtype, **kept)
    tp = dict(tp_plan="auto") if impl == "transformers" else {}
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **tp)


def local_param_bytes(model) -> int:
    """Bytes of this rank's weights (``hf_parallel.memory.weights_held``: kept quantized weights as held); a run
    of transformers alone counts its parameters without importing hf_parallel."""
    if "hf_parallel" in sys.modules:
        from hf_parallel.memory import weights_held

        return weights_held(model)
    locals_ = (param.to_local() if hasattr(param, "to_local") else param for param in model.parameters())
    return sum(local.nbytes for local in locals_ if local.device.type != "meta")  # transformers' TP: DTensors


def timed(fn):
    barrier()
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def count_one_decode_step(impl: str, model, token, cache) -> dict:
    """Collectives of one more (untimed) decode step. transformers' are counted at the dispatcher;
    hf_parallel's by its own counter, which also sees the shared-memory transport the dispatcher
    does not (with HF_PARALLEL_SHM=0 both counters agree)."""
    if impl.startswith("hf_parallel"):
        from hf_parallel.distributed.comm import COUNTS

        before = dict(COUNTS)
        model(token, past_key_values=cache, use_cache=True)
        delta = {op: COUNTS[op] - before.get(op, 0) for op in COUNTS}
        ops = {op: n for op, n in delta.items() if not op.endswith(":bytes") and n}
        sent = sum(n for op, n in delta.items() if op.endswith(":bytes"))
        return {"collectives_per_token": sum(ops.values()), "bytes_per_token": sent, "collective_ops": ops}
    with CountCollectives() as counter:
        model(token, past_key_values=cache, use_cache=True)
    return {"collectives_per_token": counter.calls, "bytes_per_token": counter.bytes, "collective_ops": counter.ops}


def shared_setup(path: str) -> None:
    """What any tensor-parallel ``from_pretrained`` of this checkpoint does first, whichever library:
    import transformers' config and modeling code (for the 1 GB Llama 1.3-3.8 s and ~145 MiB: it
    pulls in DTensor, dynamo, sympy) and join the process group. Timed apart, so the table shows both
    the cold-process load and the load itself; the barrier keeps one rank's slow imports out of the
    other's load."""
    config = transformers.AutoConfig.from_pretrained(path)
    transformers.AutoModelForCausalLM._model_mapping[type(config)]
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        torch.distributed.init_process_group("gloo")
    barrier()


@torch.inference_mode()
def run(args, result: dict) -> None:
    dtype = getattr(torch, args.dtype)
    _, result["setup_s"] = timed(lambda: shared_setup(args.model))
    result["setup_rss"] = rss_bytes()
    reset_peak_rss()
    cpu_before = cpu_seconds()
    model, result["load_after_setup_s"] = timed(lambda: load(args.impl, args.model, dtype))
    user, system = (after - before for after, before in zip(cpu_seconds(), cpu_before))
    result["load_cpu_s"], result["load_system_s"] = user + system, system
    result["load_s"] = result["setup_s"] + result["load_after_setup_s"]
    result["load_peak_rss"] = peak_rss_bytes()
    result["load_rss_above_setup"] = result["load_peak_rss"] - result["setup_rss"]
    result["rss_after_load"] = rss_bytes()
    result["shard_bytes"] = local_param_bytes(model)
    held = [p for p in model.parameters() if p.device.type != "meta"]  # not the placeholders of kept weights
    result["largest_tensor_bytes"] = max(p.numel() * p.element_size() for p in held)

    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    # as generate's prefill: the KV cache plus the last position's logits only (logits_to_keep=1)
    out, result["first_prefill_s"] = timed(lambda: model(prompt, use_cache=True, logits_to_keep=1))
    result["rss_after_prefill"] = rss_bytes()  # weights resident now, however lazily they were loaded
    prefill_times = []
    for _ in range(args.repeats):  # warm: pages faulted in, allocator caches filled
        out, seconds = timed(lambda: model(prompt, use_cache=True, logits_to_keep=1))
        prefill_times.append(seconds)
    result["prefill_s"] = statistics.median(prefill_times)
    logits = out.logits[0, -1].float().contiguous()

    cache, token, tokens, decode_times = out.past_key_values, out.logits[:, -1:].argmax(-1), [], []
    barrier()
    for _ in range(args.decode_tokens):
        start = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        decode_times.append(time.perf_counter() - start)
        tokens.append(int(token))
    result["decode_s_per_token"] = sum(decode_times) / len(decode_times)
    result["tokens"] = tokens
    result["rss_after_decode"] = rss_bytes()
    result.update(count_one_decode_step(args.impl, model, token, cache))
    if result["rank"] == 0:
        from safetensors.torch import save_file

        save_file({"logits": logits}, os.path.join(args.out, f"{args.impl}-logits.safetensors"))

    save_dir = os.path.join(args.out, f"{args.impl}-saved")
    del out, cache
    result["rss_before_save"] = rss_bytes()
    reset_peak_rss()
    _, result["save_s"] = timed(lambda: model.save_pretrained(save_dir))
    barrier()
    result["save_peak_rss"] = peak_rss_bytes()
    result["save_rss_added"] = result["save_peak_rss"] - result["rss_before_save"]
    result["saved_bytes"] = sum(
        os.path.getsize(os.path.join(save_dir, f)) for f in os.listdir(save_dir) if f.endswith(".safetensors")
    )
    barrier()
    if result["rank"] == 0:
        shutil.rmtree(save_dir, ignore_errors=True)
    if args.impl == "hf_parallel":
        measure_distributed_save(model, args.out, result)


CONSOLIDATE = """import json, sys
from measure import peak_rss_bytes, reset_peak_rss, rss_bytes
import hf_parallel
before = rss_bytes()
reset_peak_rss()
done = hf_parallel.consolidate(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({**done, "import_rss": before, "peak_rss": peak_rss_bytes()}))
"""


def measure_distributed_save(model, out: str, result: dict) -> None:
    """Per-rank save (time, each rank's peak RSS), then on rank 0: consolidation in a fresh process
    (time, peak RSS above its imports) against a plain ``cp`` of the same rank files."""
    import subprocess

    save_dir = os.path.join(out, "hf_parallel-distributed")
    reset_peak_rss()
    _, result["distributed_save_s"] = timed(lambda: model.save_pretrained(save_dir, distributed=True))
    barrier()
    result["distributed_save_peak_rss"] = peak_rss_bytes()
    if result["rank"] == 0:
        full, copy = os.path.join(out, "hf_parallel-consolidated"), os.path.join(out, "cp-copy")
        run = subprocess.run(
            [sys.executable, "-c", CONSOLIDATE, save_dir, full], capture_output=True, text=True, check=True
        )
        done = json.loads(run.stdout.strip().splitlines()[-1])
        os.makedirs(copy, exist_ok=True)
        files = [os.path.join(save_dir, f) for f in os.listdir(save_dir) if f.endswith(".safetensors")]
        start = time.perf_counter()
        subprocess.run(["cp", *files, copy], check=True)
        result["cp_s"] = time.perf_counter() - start
        result["consolidate_s"], result["consolidate_bytes"] = done["seconds"], done["bytes"]
        result["consolidate_rss_above_import"] = done["peak_rss"] - done["import_rss"]
        for path in (full, copy):
            shutil.rmtree(path, ignore_errors=True)
    barrier()
    if result["rank"] == 0:
        shutil.rmtree(save_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["single", "hf_parallel", "hf_parallel_kept", "transformers"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", 0))
    result = dict(impl=args.impl, rank=rank, world_size=int(os.environ.get("WORLD_SIZE", 1)), import_rss=IMPORT_RSS)
    result["threads"] = torch.get_num_threads()
    try:
        run(args, result)
    except Exception as error:  # the table reports what failed instead of dropping the row
        result["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        traceback.print_exc()
    with open(os.path.join(args.out, f"{args.impl}-rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
