"""Serving a split model: transformers' continuous batching over the TP group, and ``hf-parallel serve``."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from distributed import free_port, run_ranks

pytestmark = pytest.mark.distributed


def _one_process(path):
    """One process's greedy tokens for the workers' prompts (plain transformers)."""
    import serving_workers
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return serving_workers.greedy_tokens(model)


def test_continuous_batching_at_tp_equals_one_process(tiny_root, tmp_path):
    """generate_batch at TP=2: 9 query / 3 KV heads split unevenly (6/3, KV 2/1, as SmolLM2), one KV head
    replicated (multi-query), experts over the TP group (Qwen3-MoE) and FP8 weights kept quantized. Greedy
    tokens equal one process's; each rank's cache holds its own KV heads; streamed tokens grow to the same; a
    sampled batch is the same on every rank; the cache is sized from this rank's share of the host."""
    import serving_workers
    from tiny_models import make_checkpoint, make_fp8_checkpoint

    cases = {
        "llama": (make_checkpoint("llama", tiny_root), {}),
        "multi_query": (make_checkpoint("llama_multi_query", tiny_root), {}),
        "qwen3_moe_ep": (make_checkpoint("qwen3_moe", tiny_root), {"ep_plan": "auto"}),
        "llama_fp8_kept": (make_fp8_checkpoint("llama_fp8", tiny_root), {"keep_quantized": True}),
    }
    outs = run_ranks(2, serving_workers.continuous_batching, cases, out_dir=str(tmp_path))
    expected = {name: _one_process(path) for name, (path, _) in cases.items() if name != "llama_fp8_kept"}
    kv_heads = {"llama": [[2], [1]], "multi_query": [[1], [1]], "qwen3_moe_ep": [[1], [1]],
                "llama_fp8_kept": [[1], [1]]}  # fmt: skip
    for rank, out in enumerate(outs):
        for name, result in out.items():
            assert result["batched"] is not None, (rank, name, "a kept manager's second batch differs")
            assert result["batched"] == result["generate"], (rank, name)
            assert result["batched"] == expected.get(name, result["generate"]), (rank, name)
            assert result["kv_heads"] == kv_heads[name][rank], (rank, name, result["kv_heads"])
        first = out["llama"]
        assert first["streamed"][-1] == first["batched"][1] and len(first["streamed"]) > 1, first["streamed"]
        assert all(a == b[: len(a)] for a, b in zip(first["streamed"], first["streamed"][1:]))
        assert first["sampled"] == outs[0]["llama"]["sampled"], rank
        assert first["memory_fraction"] == pytest.approx(0.6 / 2), first["memory_fraction"]


def test_continuous_batching_refused_by_name_where_it_cannot_run(tiny_root, tmp_path):
    """Sequence parallelism, pipeline stages and ``ep_size`` (data-parallel attention): refused by name on every
    rank, never empty outputs."""
    import serving_workers
    from tiny_models import make_checkpoint

    path, moe = make_checkpoint("llama", tiny_root), make_checkpoint("qwen3_moe", tiny_root)
    cases = {"sp": (path, {"sp_size": 2}), "stages": (path, {"pp_size": 2}),
             "ep": (moe, {"dp_replicate_size": 2, "ep_size": 2})}  # fmt: skip
    for rank, out in enumerate(run_ranks(2, serving_workers.refused, cases, out_dir=str(tmp_path))):
        assert "sequence and context parallelism are not supported" in out["sp"], (rank, out["sp"])
        assert "pipeline stages are not supported" in out["stages"], (rank, out["stages"])
        assert "ep_size (data-parallel attention, tokens exchanged" in out["ep"], (rank, out["ep"])


def test_a_failing_rank_fails_every_ranks_requests(tiny_root, tmp_path):
    """A memory budget sizes each rank's cache (twice the budget, about twice the cache: transformers keeps
    the rest for the batch's buffers and the attention's peak, a share of it growing with the cache); one
    rank's forward raises mid-batch: generate_batch raises on every rank, none hangs (the others' wait is
    bounded by HF_PARALLEL_TIMEOUT)."""
    import serving_workers
    from tiny_models import make_checkpoint

    path = make_checkpoint("llama", tiny_root)
    for rank, out in enumerate(run_ranks(2, serving_workers.failing_rank, path, out_dir=str(tmp_path))):
        assert out["error"] is not None and "requests failed" in out["error"], (rank, out["error"])
        small, large = out["cache_bytes"]["8"], out["cache_bytes"]["16"]  # under budgets of 8 and 16 MiB
        assert 0 < small < 8 * 2**20 and 1.5 < large / small < 3 and large < 16 * 2**20, out


# -- hf-parallel serve ---------------------------------------------------------------------------------
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVED = "smollm2"
KEY = "test-key"
QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hello.", "What is the capital of France?",
             "Count to three.", "Name an animal."]  # fmt: skip
NEW = 10


def _launch(path: str, port: int, log) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2 -m hf_parallel serve`` (float32, an API key), once /health answers."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
               "hf_parallel", "serve", path, "--dtype", "float32", "--port", str(port), "--api-key", KEY,
               "--served-model-name", SERVED, "--max-batch-tokens", "1024"]  # fmt: skip
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              cwd="/tmp", start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited with {server.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            time.sleep(1)
    raise AssertionError("the server did not answer /health in 300 s")


def _one_process_answers(path: str) -> dict[str, str]:
    """One process's greedy answer to each question (plain transformers, the chat template)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    answers = {}
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]  # fmt: skip
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        answers[question] = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return answers


def _metrics(url: str) -> dict[str, float]:
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return {name: float(value) for name, value in (line.split() for line in lines)}


def _chat(client, question: str, **kwargs):
    return client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": question}],
                                          max_tokens=NEW, temperature=0, **kwargs)  # fmt: skip


@pytest.mark.slow
def test_serve_answers_openai_clients_as_one_process_would(smollm2, tmp_path):
    """The official openai client against ``hf-parallel serve`` at TP=2 (SmolLM2, 9/3 heads split 6/3):
    64 chat requests from 16 threads each get one process's greedy answer (none lost or mixed up); streamed
    deltas join to the same, and so does the Responses API; completions and models answer; bad input gets a
    4xx naming it and the server keeps serving (examples/serve_client.py too); a client leaving mid-stream
    frees its slot; SIGTERM ends every rank in seconds."""
    import concurrent.futures

    import openai
    import psutil

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "server.log", "w") as log:
        server = _launch(smollm2, port, log)
        try:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
            expected = _one_process_answers(smollm2)
            with concurrent.futures.ThreadPoolExecutor(16) as pool:
                asked = [QUESTIONS[i % len(QUESTIONS)] for i in range(64)]
                answers = list(pool.map(lambda q: _chat(client, q).choices[0].message.content, asked))
            assert [a == expected[q] for q, a in zip(asked, answers)] == [True] * 64, list(zip(asked, answers))
            stream = _chat(client, QUESTIONS[0], stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected[QUESTIONS[0]]
            text = client.completions.create(model=SERVED, prompt="1, 2, 3,", max_tokens=4, temperature=0)
            assert text.choices[0].text and [m.id for m in client.models.list()] == [SERVED]
            response = client.responses.create(model=SERVED, input=QUESTIONS[2], max_output_tokens=NEW, temperature=0)
            assert response.output_text == expected[QUESTIONS[2]], response.output_text
            _bad_inputs_refused(client, url)
            env = {**os.environ, "BASE_URL": f"{url}/v1", "API_KEY": KEY, "MODEL": SERVED, "PROMPT": QUESTIONS[0],
                   "NEW_TOKENS": str(NEW)}  # fmt: skip
            example = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "serve_client.py")], env=env,
                                     capture_output=True, text=True, timeout=120)  # fmt: skip
            assert example.stdout == f"{expected[QUESTIONS[0]]}\n" * 2, example.stdout + example.stderr[-2000:]
            _leaving_client_frees_its_slot(url)
            assert _chat(client, QUESTIONS[1]).choices[0].message.content == expected[QUESTIONS[1]]
            metrics = _metrics(url)
            assert metrics["hf_parallel_requests_finished_total"] >= 67 and metrics["hf_parallel_requests_running"] == 0
            ranks = psutil.Process(server.pid).children(recursive=True)
            start = time.monotonic()
            server.send_signal(signal.SIGTERM)  # to torchrun, which passes it on to the ranks
            _, alive = psutil.wait_procs(ranks, timeout=30)
            assert not alive and time.monotonic() - start < 30, alive
            server.wait(timeout=30)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)


def _bad_inputs_refused(client, url: str) -> None:
    import openai

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    assert httpx.post(f"{url}/v1/chat/completions", content="{not json", headers=headers).status_code == 422
    assert httpx.post(f"{url}/v1/chat/completions", json={"max_tokens": 4}, headers=headers).status_code == 400
    assert httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                      ).status_code == 401  # fmt: skip
    for kwargs, status, words in [
        (dict(max_tokens=0), 400, "max_tokens=0"),
        (dict(model="no-such-model"), 404, "does not exist"),
        (dict(temperature=0.7), 400, "temperature=0.7"),
        (dict(stop=["\n"]), 400, "stop="),
        (dict(response_format={"type": "json_object"}), 400, "response_format="),
        (dict(messages=[{"role": "user", "content": "word " * 9000}]), 400, "maximum context length is 8192"),
    ]:
        call = dict(model=SERVED, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW, temperature=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(**(call | kwargs))
        assert refused.value.status_code == status and words in refused.value.message, (kwargs, refused.value)


def _leaving_client_frees_its_slot(url: str) -> None:
    """A stream of 2000 tokens read for two chunks, then closed: the request leaves the batch unfinished."""
    before = _metrics(url)["hf_parallel_requests_finished_total"]
    body = {"model": SERVED, "messages": [{"role": "user", "content": "Count from 1 to 1000."}], "max_tokens": 2000,
            "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as response:  # fmt: skip
        chunks = response.iter_lines()
        next(chunks), next(chunks)
    deadline, idle = time.monotonic() + 60, 0
    while idle < 5 and time.monotonic() < deadline:  # (it may be scheduled after the client left, then cancelled)
        metrics = _metrics(url)
        idle = idle + 1 if metrics["hf_parallel_requests_running"] + metrics["hf_parallel_requests_waiting"] == 0 else 0
        time.sleep(0.2)
    after = _metrics(url)
    assert after["hf_parallel_requests_running"] == 0 and after["hf_parallel_requests_waiting"] == 0, after
    assert after["hf_parallel_requests_finished_total"] == before, after


@pytest.mark.slow
def test_serve_a_rank_that_dies_ends_the_server_with_503(smollm2, tmp_path):
    """Rank 1 killed mid-request: the request in flight answers 503 and torchrun exits non-zero, in seconds."""
    import psutil

    port = free_port()
    with open(tmp_path / "server.log", "w") as log:
        server = _launch(smollm2, port, log)
        try:
            reply = {}
            body = {"prompt": "1, 2, 3, 4,", "max_tokens": 2000, "temperature": 0}
            ask = threading.Thread(target=lambda: reply.update(response=httpx.post(
                f"http://127.0.0.1:{port}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                timeout=60)))  # fmt: skip
            ask.start()
            deadline = time.monotonic() + 30
            while _metrics(f"http://127.0.0.1:{port}")["hf_parallel_requests_running"] < 1:  # in the batch
                assert time.monotonic() < deadline and ask.is_alive(), reply
                time.sleep(0.1)
            ranks = {p.environ().get("RANK"): p for p in psutil.Process(server.pid).children(recursive=True)}
            start = time.monotonic()
            ranks["1"].kill()
            ask.join(60)
            assert reply["response"].status_code == 503, reply["response"].text
            assert server.wait(timeout=60) != 0 and time.monotonic() - start < 30
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
