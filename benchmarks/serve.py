"""Serving: throughput and latency of OpenAI-compatible servers under 1, 8 and 16 concurrent clients.

    python benchmarks/serve.py [--model DIR] [--tp 2] [--clients 1 8 16] [--requests 16] [--max-tokens 32]
                               [--skip-transformers] [--out serve.json]

In one invocation, on the same checkpoint (default: the embedded SmolLM2-135M-Instruct, float32):

- ``hf-parallel serve`` at TP=``--tp`` under torchrun (continuous batching over the TP group);
- ``transformers serve --continuous-batching`` in one process (the same continuous batching, all cores);

each answers ``--requests`` chat requests (distinct prompts that do not end early, ``max_tokens`` tokens,
greedy) at each concurrency: ``clients`` threads, each sending its next request when its last one ends, every
answer streamed. Per server and concurrency: the wall time of all requests, generated tokens/s (the answers'
tokens, counted with the tokenizer), and p50/p95 time to first token and time per output token (after the
first). "One after another" is concurrency 1.

The issue's goal, printed met or not: at hf_parallel's TP, 8 concurrent requests finish in at most 0.7x the
time the same 8 take one after another (the 8-client run's time for its first 8 requests is not separable, so
the comparison is made per request: wall time / requests at 8 clients over the same at 1 client).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GOAL_CONCURRENT_OVER_SEQUENTIAL = 0.7  # 8 concurrent requests' time over the same 8 one after another, at most


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], port: int, env: dict, log_path: str) -> subprocess.Popen:
    """Start a server and wait for its /health (5 minutes at most)."""
    import httpx

    log = open(log_path, "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                              cwd="/tmp")  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{command[:6]} exited with {server.returncode}: see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(1)
    raise RuntimeError(f"{command[:6]} did not answer /health in 300 s: see {log_path}")


def stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)


def one_request(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat request: (time to first token, end, text)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    start, first, parts = time.perf_counter(), None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            delta = (chunk.get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta:
                first = first or time.perf_counter()
                parts.append(delta)
    return {"start": start, "first": first or time.perf_counter(), "end": time.perf_counter(), "text": "".join(parts)}


def load(url: str, model: str, prompts: list[str], clients: int, max_tokens: int, tokenizer) -> dict:
    """Every prompt sent by ``clients`` threads; the run's time, tokens/s and latencies."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(lambda p: one_request(url, model, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    tokens = [len(tokenizer(d["text"], add_special_tokens=False)["input_ids"]) for d in done]
    ttft = sorted(d["first"] - d["start"] for d in done)
    tpot = sorted((d["end"] - d["first"]) / max(n - 1, 1) for d, n in zip(done, tokens))
    return {"clients": clients, "requests": len(prompts), "seconds": round(wall, 3),
            "seconds_per_request": round(wall / len(prompts), 4), "tokens": sum(tokens),
            "tokens_per_second": round(sum(tokens) / wall, 2),
            "ttft_p50_s": round(statistics.median(ttft), 4), "ttft_p95_s": round(_p95(ttft), 4),
            "tpot_p50_s": round(statistics.median(tpot), 4), "tpot_p95_s": round(_p95(tpot), 4)}  # fmt: skip


def _p95(values: list[float]) -> float:
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def servers(args, path: str, port: int) -> dict[str, list[str]]:
    """Each server's command line, by name."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.tp}"]
    found = {f"hf_parallel serve TP={args.tp}": torchrun + [
        "-m", "hf_parallel", "serve", path, "--dtype", "float32", "--port", str(port), "--served-model-name", "m",
        "--max-batch-tokens", str(args.max_batch_tokens)]}  # fmt: skip
    if not args.skip_transformers:
        found["transformers serve --continuous-batching"] = [
            sys.executable, "-m", "transformers.cli.transformers", "serve", path, "--continuous-batching", "--dtype",
            "float32", "--port", str(port), "--cb-max-batch-tokens", str(args.max_batch_tokens),
            "--cb-max-memory-percent", "0.3"]  # fmt: skip
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests at each concurrency")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=1024)
    parser.add_argument("--skip-transformers", action="store_true", help="hf-parallel serve only")
    parser.add_argument("--out", default="serve.json")
    args = parser.parse_args()
    import transformers

    from hf_parallel.commands.default_model import default_checkpoint

    path = args.model or default_checkpoint()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompts = [f"Write a long story about a dragon called Ember {n}." for n in range(args.requests)]  # none ends early
    cores = os.cpu_count() or 1
    results: dict[str, list[dict]] = {}
    for name, command in servers(args, path, port := free_port()).items():
        threads = max(1, cores // args.tp) if name.startswith("hf_parallel") else cores
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        server = start(command, port, env, os.path.join(os.path.dirname(os.path.abspath(args.out)), "serve.log"))
        try:
            model = "m" if name.startswith("hf_parallel") else path
            load(f"http://127.0.0.1:{port}", model, prompts[:2], 1, 4, tokenizer)  # warm-up
            results[name] = [load(f"http://127.0.0.1:{port}", model, prompts, clients, args.max_tokens, tokenizer)
                             for clients in args.clients]  # fmt: skip
        finally:
            stop(server)
        for row in results[name]:
            print(f"{name:45s} {row['clients']:3d} clients: {row['seconds']:7.2f}s  {row['tokens_per_second']:7.1f} "
                  f"tok/s  TTFT p50 {row['ttft_p50_s']:.3f}s p95 {row['ttft_p95_s']:.3f}s  TPOT p50 "
                  f"{row['tpot_p50_s']:.4f}s p95 {row['tpot_p95_s']:.4f}s", flush=True)  # fmt: skip
    summary = {"model": path, "tp": args.tp, "max_tokens": args.max_tokens, "results": results, "goals": goals(results)}
    for goal in summary["goals"]:
        print(("MET    " if goal["met"] else "NOT MET ") + goal["what"])
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=2)


def goals(results: dict[str, list[dict]]) -> list[dict]:
    """8 concurrent requests against one after another, per request, at hf_parallel's TP."""
    out = []
    for name, rows in results.items():
        by_clients = {row["clients"]: row for row in rows}
        if name.startswith("hf_parallel") and 1 in by_clients and 8 in by_clients:
            ratio = by_clients[8]["seconds_per_request"] / by_clients[1]["seconds_per_request"]
            out.append({"what": f"{name}: 8 concurrent requests take {ratio:.2f}x the time of 8 one after another "
                                f"(goal <= {GOAL_CONCURRENT_OVER_SEQUENTIAL})", "ratio": round(ratio, 3),
                        "met": ratio <= GOAL_CONCURRENT_OVER_SEQUENTIAL})  # fmt: skip
    return out


if __name__ == "__main__":
    main()
