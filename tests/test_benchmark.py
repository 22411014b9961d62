"""The benchmark runs end to end on a tiny checkpoint: both implementations side by side, counted
collectives, agreement with the single process. (It asserts no timings: those belong to benchmarks/.)"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_runs_side_by_side(tiny_paths, tmp_path):
    out = tmp_path / "bench"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "run.py"), "--models", tiny_paths["llama_tied_kvrep"]]
    command += ["--out", str(out), "--dtype", "float32", "--prompt-len", "16", "--decode-tokens", "3", "--repeats", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((out / "results.json").read_text())["results"][tiny_paths["llama_tied_kvrep"]]
    ours, theirs = rows["hf_parallel tp2"], rows["transformers tp2"]
    assert "error" not in ours and "error" not in theirs, (ours.get("error"), theirs.get("error"))
    layers = ours["num_layers"]
    assert ours["collectives_per_token"] == 2 * layers + 2  # per layer 2, embedding 1, logits 1
    assert theirs["collectives_per_token"] == 2 * layers + 2
    for row in (ours, theirs):
        assert row["max_abs_logit_diff"] < 1e-5 and row["tokens_agreeing"] == 3
        assert row["shard_bytes"] < rows["single"]["shard_bytes"]
    assert (out / "results.png").stat().st_size > 0 and "| load time" in (out / "results.md").read_text()
    assert ours["consolidate_bytes"] == rows["single"]["shard_bytes"] and ours["cp_s"] > 0
    assert "consolidate throughput >= 0.5 x cp" in (out / "results.md").read_text()


def test_long_context_benchmark_runs_one_process_and_sequence_parallel(tiny_paths, tmp_path):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "long_context.py"), "--model", tiny_paths["llama"]]
    command += ["--seqs", "32", "64", "--sp", "2", "--packed", "16", "--tiled-mlp", "8", "--tiled-loss", "8"]
    command += ["--decode", "2", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    summary = json.loads((tmp_path / "long_context.json").read_text())
    for name in ("one process", "hf_parallel SP=2", "hf_parallel CP=2", "hf_parallel CP=2 + tiled MLP + tiled loss",
                 "one process, decode", "hf_parallel SP=2, decode"):  # fmt: skip
        rows = summary["results"][name]
        assert sorted(rows) == ["32", "64"] and all(row["tokens_per_s"] > 0 for row in rows.values()), rows
    assert "longest sequence under" in done.stdout and "peak growth at CP=2 (32 -> 64)" in done.stdout
    assert "tokens/s at CP=2 against SP=2 (seq 64)" in done.stdout
    assert "decode step growth at SP=2 against one process's (32 -> 64)" in done.stdout


def test_pipeline_benchmark_runs_every_configuration(tiny_paths, tmp_path):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "pipeline.py"), "--model", tiny_paths["llama"]]
    command += ["--batch", "4", "--prompt-len", "8", "--new-tokens", "3", "--micro-batches", "0", "2"]
    command += ["--dtype", "float32", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = json.loads((tmp_path / "pipeline.json").read_text())["table"]
    assert set(table) == {
        "one process",
        "hf_parallel TP=2",
        "transformers PP=2",
        "hf_parallel PP=2 M=auto",
        "hf_parallel PP=2 M=2",
        "hf_parallel PP=2 M=auto over gloo",  # the A/B of the stages' shared-memory pipes
    }
    for name, row in table.items():
        assert row is not None and row["tokens_per_s"] > 0, (name, row)
        if name != "transformers PP=2":  # (whose pipeline gets left-padded rows wrong in transformers 5.23)
            assert row["same_tokens"] and row["rows_same"] == 4, (name, row)
    assert 0 <= table["hf_parallel PP=2 M=2"]["bubble_measured"] <= 1
    assert table["hf_parallel PP=2 M=2"]["bubble_theory"] == 1 / 3
    assert "best PP vs TP" in done.stdout and "best PP vs transformers' PP" in done.stdout
    assert "shared-memory pipes over gloo" in done.stdout


def test_save_import_and_launch_host_benchmarks_run(tiny_paths, tmp_path):
    """save.py: every configuration saves (with and without O_DIRECT) and reports its ratio and
    rank 0's profile; imports.py: both entry points measured."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "save.py"), "--model", tiny_paths["llama"]]
    command += ["--rounds", "1", "--dir", str(tmp_path / "saves"), "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = json.loads((tmp_path / "save.json").read_text())["table"]
    assert all(row is not None and row["median"] > 0 for row in table.values()), table
    assert "target hf_parallel VTP [2,1] <= 1.2x one process" in done.stdout
    assert all("write" in row["profiles"][0] for name, row in table.items() if name.startswith("hf_parallel"))
    imports = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "imports.py"), "--runs", "1"], capture_output=True, text=True
    )
    assert imports.returncode == 0 and "import RSS, hf_parallel over transformers" in imports.stdout, imports.stderr
    hosts = subprocess.run(  # a kept FP8 product's host time, a stand-in for Triton's kernel: both products
        [sys.executable, os.path.join(ROOT, "benchmarks", "launch_host.py"), "--calls", "20"], capture_output=True,
        text=True,
    )  # fmt: skip
    rows = [line.strip("| ").split(" | ") for line in hosts.stdout.splitlines() if line.startswith(("| pl", "| ga"))]
    assert hosts.returncode == 0 and len(rows) == 2 and all(float(us) > 0 for row in rows for us in row[1:]), hosts


def test_training_benchmark_runs_every_configuration(tiny_paths, tmp_path):
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "training.py"), "--model", tiny_paths["llama"]]
    command += ["--rows", "4", "--seq", "8", "--steps", "1", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = json.loads((tmp_path / "training.json").read_text())["table"]
    assert set(table) == {
        "one process",
        "hf_parallel FSDP=2",
        "hf_parallel TP=2",
        "transformers FSDP=2",
        "transformers TP=2",
    }
    for name in ("one process", "hf_parallel FSDP=2", "hf_parallel TP=2"):
        row = table[name]
        assert row["tokens_per_s"] > 0 and row["peak_rss_mib"] > 0, (name, row)
        assert row["loss_error"] < 1e-5, (name, row)  # the same losses as one process
    assert "per-rank peak RSS, hf_parallel FSDP=2 / one process" in done.stdout


def test_experts_benchmark_runs_every_configuration(tmp_path):
    """benchmarks/experts.py at EP=2 on a tiny MoE: one process, ``ep_size`` under FSDP and the TP-group EP train and
    decode, the same losses as one process, each EP rank holding half the experts at compute time; under ``ep_size`` a
    step's peak measured beside ``step_memory``'s formula, the pairs that arrived within its bound."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "experts.py"), "--layers", "2", "--hidden", "32"]
    command += ["--experts", "4", "--rows", "4", "--seq", "8", "--steps", "1", "--decode", "2", "--sizes", "2"]
    kinds = ["one process", "hf_parallel ep_size=2 fsdp", "hf_parallel TP-group EP=2"]  # (each run launches ranks)
    done = subprocess.run([*command, "--only", *kinds, "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_PARALLEL_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    table = json.loads((tmp_path / "experts.json").read_text())["table"]
    assert set(table) == set(kinds)
    for name, row in table.items():
        assert row["train_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0, (name, row)
        assert row["loss_error"] < 1e-5, (name, row)
        assert row["expert_bytes_fraction"] == (1.0 if name == "one process" else 0.5), (name, row)
    memory = table["hf_parallel ep_size=2 fsdp"]  # the step's peak measured beside the formula, pairs and all
    assert 0 < memory["pairs_arrived"] <= memory["pairs_bound"] == 2 * 2 * 8 * 2, memory  # 2 EP ranks x 2 rows x 8 x 2
    assert memory["step_formula_mib"] > memory["formula_without_pairs_mib"] and memory["step_peak_mib"] > 0, memory
    assert "train_tokens_per_s ep_size=2 fsdp / TP-group EP" in done.stdout and "step memory" in done.stdout


def test_decode_benchmark_runs_eager_and_compiled_side_by_side(tiny_paths, tmp_path):
    """benchmarks/decode.py: one process and hf_parallel TP=2, each eager and compiled (static cache,
    fullgraph), and FSDP=2 eager, every run's greedy tokens one process's."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "decode.py"), "--models", tiny_paths["llama"]]
    command += ["--dtype", "float32", "--new-tokens", "4", "--prompt-len", "5", "--repeats", "1", "--out", str(tmp_path)]
    command += ["--impls", "single", "hf_parallel", "hf_parallel_fsdp"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "decode.json").read_text())[tiny_paths["llama"]]
    want = {f"{impl} {mode}" for impl in ("single", "hf_parallel") for mode in ("eager", "compiled")}
    assert set(rows) == want | {"hf_parallel_fsdp eager"}
    for key, row in rows.items():
        assert "error" not in row, (key, row.get("error"))
        assert row["tokens"] == rows["single eager"]["tokens"] and row["s_per_token"] > 0, (key, row)
    assert "| hf_parallel compiled |" in done.stdout


def test_serve_benchmark_runs_hf_parallel_serve(smollm2, tmp_path):
    """benchmarks/serve.py against hf-parallel serve alone, two requests at 1 and 8 clients: every row has
    tokens and latencies, and the goal line is printed."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "serve.py"), "--model", smollm2,
               "--skip-transformers", "--clients", "1", "8", "--requests", "2", "--max-tokens", "3",
               "--out", str(tmp_path / "serve.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "serve.json").read_text())["results"]["hf_parallel serve TP=2"]
    assert [row["clients"] for row in rows] == [1, 8]
    assert all(row["tokens"] > 0 and row["ttft_p50_s"] > 0 for row in rows), rows
    assert "8 concurrent requests take" in done.stdout
