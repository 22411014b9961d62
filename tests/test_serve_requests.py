"""What ``hf-parallel serve`` refuses before a request reaches the continuous batch (pure: no ranks), and the
memory each rank gives the paged cache."""

import pytest
import torch

from hf_parallel.serving import batching
from hf_parallel.serving.requests import CHAT, COMPLETIONS, RESPONSES, Refused, RequestRules



def _ignored() -> dict:
    """Each route's fields its transformers serve handler ignores (the handlers' own lists)."""
    from hf_parallel.compat import transformers_serving as serving

    return {route: set(seam.get()._unused_fields) for route, seam in serving.SERVE_HANDLERS.items()}


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(smollm2)


def refusal(body: dict, route: str = CHAT, tokenizer=None, temperature=0.0):
    """The (status, param, message) a body is refused with (a context of 64 tokens); None when it passes (the
    body as filled in)."""
    try:
        RequestRules("m", tokenizer, 64, temperature, 1024, _ignored()).check(body, route)
    except Refused as refused:
        return refused.status, refused.param, refused.message
    return None


def hi(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize("body, status, param, words", [
    ({"messages": []}, 400, "messages", "'messages' is required"),
    (hi(model="other"), 404, "model", "does not exist"),
    (hi(max_tokens=0), 400, "max_tokens", "a positive integer"),
    (hi(max_completion_tokens=-3), 400, "max_completion_tokens", "a positive integer"),
    (hi(max_tokens=True), 400, "max_tokens", "a positive integer"),
    (hi(temperature=0.7), 400, "temperature", "hf-parallel serve --temperature"),
    (hi(temperature="hot"), 400, "temperature", "hf-parallel serve --temperature"),
    (hi(stop=["\n"]), 400, "stop", "not supported"),
    (hi(n=2), 400, "n", "not supported"),
    (hi(frequency_penalty=0.5), 400, "frequency_penalty", "not supported"),
    (hi(response_format={"type": "json_object"}), 400, "response_format", "not supported"),
    (hi(generation_config="{}"), 400, "generation_config", "not supported"),
    (hi(max_tokens=60), 400, "messages", "maximum context length is 64 tokens"),
    (hi(messages=[{"role": "user", "content": "word " * 80}]), 400, "messages", "maximum context length"),
])  # fmt: skip
def test_requests_the_batch_cannot_honour_are_refused_naming_the_field(tokenizer, body, status, param, words):
    got = refusal(body, tokenizer=tokenizer)
    assert got is not None and got[:2] == (status, param) and words in got[2], got


def test_a_request_within_the_rules_passes_and_gets_a_bounded_length(tokenizer):
    """Neutral values, harmless fields and a greedy request's seed pass (the seed dropped: transformers serve
    would reseed rank 0 alone); a sampling server refuses a seed; 0 is not False; the Responses API does not
    stream unless asked; content given as parts is measured as the handler templates it."""
    body = hi(temperature=0, top_p=0.9, n=1, stop=None, user="u", seed=3, logprobs=False, presence_penalty=0,
              response_format={"type": "text"}, tool_choice="auto", parallel_tool_calls=True)  # fmt: skip
    assert refusal(body, tokenizer=tokenizer) is None and "seed" not in body and "top_p" not in body
    assert refusal(hi(verbosity="high"), tokenizer=tokenizer)[:2] == (400, "verbosity")  # read by no handler
    prompt = len(tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_dict=True,
                                               tokenize=True)["input_ids"])  # fmt: skip
    assert body["max_tokens"] == 64 - prompt  # what is left of the context (transformers serve's 1024 is more)
    assert refusal(hi(temperature=0.5), tokenizer=tokenizer, temperature=0.5) is None
    assert refusal(hi(seed=3), tokenizer=tokenizer, temperature=0.5)[:2] == (400, "seed")
    assert refusal(hi(top_p=0.9), tokenizer=tokenizer, temperature=0.5)[:2] == (400, "top_p")
    assert refusal({"prompt": "1, 2", "logprobs": 0}, COMPLETIONS, tokenizer)[:2] == (400, "logprobs")
    responses = {"model": "m", "input": "hi"}
    assert refusal(responses, RESPONSES, tokenizer) is None and responses["stream"] is False
    assert refusal({"prompt": ["a", "b"]}, COMPLETIONS, tokenizer)[:2] == (400, "prompt")
    parts = hi(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert refusal(parts, tokenizer=tokenizer) is None and parts["max_tokens"] == body["max_tokens"]


def test_each_rank_gives_the_cache_its_budget_or_its_share_of_free_memory():
    """A budget becomes transformers' fraction of the free memory; without one, transformers' own default
    (0.6 of the host's on a CPU) for a rank alone; a size the user set is left to them."""
    from hf_parallel.compat import transformers_serving as serving
    from hf_parallel.distributed.mesh import Mesh

    mesh = Mesh.dry_run(tp_size=1)
    config = serving.continuous_batching_config()
    batching._budget(config, torch.device("cpu"), mesh, None)
    assert config.max_memory_percent == pytest.approx(0.6)
    config = serving.continuous_batching_config()
    batching._budget(config, torch.device("cpu"), mesh, 1024**2)
    assert config.max_memory_percent * serving.device_free_memory() == pytest.approx(1024**2, rel=0.2)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes with ContinuousBatchingConfig"):
        batching._budget(serving.continuous_batching_config(serving.CB_CONFIG.get()(num_blocks=8)),
                         torch.device("cpu"), mesh, 1024**2)  # fmt: skip
    with pytest.raises(ValueError, match="bytes free"):
        batching._budget(serving.continuous_batching_config(), torch.device("cpu"), mesh, 10**18)


def test_serve_names_the_missing_serving_packages_before_loading(monkeypatch):
    """Without the ``serving`` extra, ``serve`` stops before a model loads, naming what is missing and the extra."""
    import importlib.util

    from hf_parallel.serving import server

    server.check_serving_packages()  # installed here: nothing to say
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else found(name, *a))
    with pytest.raises(SystemExit, match=r"hf-parallel serve needs uvicorn: pip install 'hf_parallel\[serving\]'"):
        server.check_serving_packages()
