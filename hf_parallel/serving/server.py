"""``hf-parallel serve``: an OpenAI-compatible server for a split model, under torchrun.

Every rank loads its shards and starts transformers' continuous-batching manager together (creating its CPU
group is collective). Rank 0, the TP group's driver, answers HTTP with ``transformers serve``'s own app and
handlers (chat completions with the chat template and streaming, completions, responses, models, health)
and adds each request to the manager; the manager broadcasts each step's new requests and cancellations, and
every rank runs the same batch. The other ranks only follow, in the manager's generation thread.

Around transformers' handlers, what a server open to clients needs and ``transformers serve`` leaves out:
requests checked before they reach the manager (missing fields, an unknown model, ``max_tokens <= 0``, a
prompt past the context, and sampling settings the shared manager cannot honour per request: refused with a
4xx naming them, never ignored), an optional API key, ``/metrics`` (the queue, tokens/s) and a log line of
the same, and faults that end in bounded time: SIGTERM/SIGINT stop every rank (the manager's stop reaches
the others through its state broadcast), and a generation loop that dies on any rank (a rank gone, a failed
forward) fails the requests in flight with 503 and ends the server non-zero.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
import time

import torch.distributed as dist

from ..compat import transformers_serving as serving

logger = logging.getLogger("hf_parallel.serve")

STOP_TIMEOUT_S = 2.0  # a stopping manager's thread is given this long to end its step (else a rank is gone)
FAILURE_GRACE_S = 1.0  # after the generation loop dies, requests in flight get their 503 before the exit
RATE_WINDOW_S = 10.0  # tokens/s is over the finished requests of this window
MAX_TOKENS = {"/v1/chat/completions": ("max_completion_tokens", "max_tokens"), "/v1/completions": ("max_tokens",),
              "/v1/responses": ("max_output_tokens",)}  # fmt: skip
PROMPT = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/responses": "input"}
DEFAULT_NEW_TOKENS = 1024  # transformers serve's floor for a request that does not say
# settings transformers serve would copy into a request's generation config, which a continuous-batching
# manager (one config for every request) then ignores: refused unless at their neutral value
NEUTRAL = {"stop": (None, [], ""), "n": (None, 1), "logit_bias": (None, {}), "frequency_penalty": (None, 0),
           "presence_penalty": (None, 0), "top_p": (None, 1), "logprobs": (None, False), "best_of": (None, 1),
           "generation_config": (None,)}  # fmt: skip


class Metrics:
    """What ``/metrics`` and the log line report: finished and failed requests, generated tokens, and the
    tokens/s of the last ``RATE_WINDOW_S``."""

    def __init__(self):
        self.finished = self.failed = self.tokens = 0
        self.recent: collections.deque = collections.deque()  # (time, tokens) of recently finished requests
        self.lock = threading.Lock()

    def record(self, output) -> None:
        with self.lock:
            if output.error is not None:
                self.failed += 1
                return
            self.finished += 1
            self.tokens += len(output.generated_tokens)
            self.recent.append((time.monotonic(), len(output.generated_tokens)))

    def tokens_per_second(self) -> float:
        with self.lock:
            while self.recent and self.recent[0][0] < time.monotonic() - RATE_WINDOW_S:
                self.recent.popleft()
            return sum(tokens for _, tokens in self.recent) / RATE_WINDOW_S

    def prometheus(self, waiting: int, running: int) -> str:
        rate = self.tokens_per_second()
        return "".join(f"hf_parallel_{name} {value}\n" for name, value in (
            ("requests_waiting", waiting), ("requests_running", running), ("requests_finished_total", self.finished),
            ("requests_failed_total", self.failed), ("generated_tokens_total", self.tokens),
            ("generated_tokens_per_second", round(rate, 3))))  # fmt: skip


def serve(model, tokenizer, name: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          temperature: float = 0.0, max_batch_tokens: int | None = None) -> int:  # fmt: skip
    """Serve ``model`` (loaded on every rank) as ``name`` until SIGTERM/SIGINT; returns the exit code
    (non-zero when the generation loop died). Every rank calls it; rank 0 answers HTTP on ``host:port``.
    ``temperature``: 0 decodes greedily; above, every request samples at it (one setting for the batch)."""
    config = _generation_config(model, temperature)
    cb_config = serving.continuous_batching_config()
    if max_batch_tokens is not None:
        cb_config.max_batch_tokens = max_batch_tokens
    manager = model.init_continuous_batching(config, cb_config)
    metrics = Metrics()
    serving.count_finished(manager, metrics.record)
    manager.start()
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != 0:
        code = _follow(manager)
    else:
        code = _answer(model, tokenizer, name, manager, metrics, host, port, api_key, temperature)
    if manager.is_running():  # its thread waits in a collective with a rank that is gone: do not wait at exit
        logger.error("the continuous-batching loop is stuck in a collective (a rank left): exiting")
        logging.shutdown()
        os._exit(code or 1)
    return code


def _generation_config(model, temperature: float):
    """The one generation config of every request: the model's, greedy or sampling at ``temperature``."""
    config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
    config.do_sample = temperature > 0
    config.temperature = temperature if temperature > 0 else None
    config.top_p = config.top_k = None
    return config


def _follow(manager) -> int:
    """A rank other than 0: its manager's thread runs every batch; SIGTERM/SIGINT stop it (and, through the
    manager's state broadcast, every rank)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while manager.is_running() and not stop.wait(0.2):
        pass
    if manager.is_running():
        manager.stop(block=True, timeout=STOP_TIMEOUT_S, hard_stop=True)
    return 1 if manager.background_thread_status.fatal_error is not None else 0


def _answer(model, tokenizer, name, manager, metrics, host, port, api_key, temperature) -> int:
    """Rank 0: transformers serve's app over ``manager`` until a signal or the generation loop's death."""
    import uvicorn

    stopping, stuck = threading.Event(), threading.Event()

    def drain():
        """Stop every rank's manager; the requests in flight end with 503. A loop that does not stop is waiting
        on a rank that is gone (torchrun's SIGTERM after a rank died): its requests are failed from here."""
        if stopping.is_set():
            return
        stopping.set()
        error = RuntimeError("the server is stopping (SIGTERM/SIGINT, or a rank left)")
        manager.background_thread_status.record_fatal_error(error)  # transformers serve answers 503 from now
        processor = manager.batch_processor  # (stop lets go of it)
        manager.stop(block=True, timeout=STOP_TIMEOUT_S, hard_stop=True)
        if manager.is_running():
            stuck.set()
            serving.fail_in_flight(processor, error)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # before uvicorn waits for the open connections: drain them
            threading.Thread(target=drain, daemon=True).start()
            super().handle_exit(sig, frame)

    app, handlers = serving.openai_app(model, tokenizer, name, manager, drain)
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    for route, handler in handlers.items():
        handler.handle_request = _checked(handler.handle_request, route, name, tokenizer, context, temperature,
                                          manager)  # fmt: skip
    _add_metrics(app, manager, metrics)
    if api_key:
        _require_key(app, api_key)
    server = Server(uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5))
    failed = threading.Event()
    watch = threading.Thread(target=_watch, args=(manager, metrics, server, stopping, failed), daemon=True)
    watch.start()
    logger.info("serving %s on http://%s:%d/v1 (tensor parallel over %d ranks)", name, host, port,
                dist.get_world_size() if dist.is_initialized() else 1)  # fmt: skip
    server.run()
    drain()
    return 1 if failed.is_set() or stuck.is_set() else 0


def _watch(manager, metrics, server, stopping, failed) -> None:
    """Rank 0's watchdog: a generation loop that ended without a stop asked for ends the server (after
    the requests in flight got their 503); every ``RATE_WINDOW_S`` with traffic, a log line of the queue."""
    last_log = time.monotonic()
    while not stopping.is_set():
        if not manager.is_running():
            logger.error("the continuous-batching loop ended (a rank failed or left): stopping the server")
            failed.set()
            time.sleep(FAILURE_GRACE_S)
            server.should_exit = True
            return
        if time.monotonic() - last_log >= RATE_WINDOW_S:
            last_log = time.monotonic()
            waiting, running = serving.waiting_and_running(manager)
            if waiting or running or metrics.tokens_per_second():
                logger.info("%d waiting, %d running, %.1f tokens/s", waiting, running, metrics.tokens_per_second())
        stopping.wait(0.2)


def _checked(handle, route: str, name: str, tokenizer, context: int | None, temperature: float, manager):
    """``handle`` (a transformers serve handler's ``handle_request``) behind the checks of a request body; a
    request failed because the generation loop is dying answers 503 (transformers fails the requests before it
    records the loop's error, so its handler can answer 500 for them)."""

    async def handle_request(body: dict, request_id: str):
        try:
            _check(body, route, name, tokenizer, context, temperature)
        except Refused as refused:
            return refused.response()
        try:
            return await handle(body, request_id)
        except RuntimeError as error:
            if await _loop_dying(manager):
                return Refused(503, f"the generation loop ended (a rank failed or left): {error}").response()
            raise

    return handle_request


async def _loop_dying(manager) -> bool:
    """Whether the manager's loop recorded a fatal error or ended, waiting up to ``FAILURE_GRACE_S`` for it."""
    import asyncio

    deadline = time.monotonic() + FAILURE_GRACE_S
    while time.monotonic() < deadline:
        if manager.background_thread_status.fatal_error is not None or not manager.is_running():
            return True
        await asyncio.sleep(0.05)
    return False


class Refused(Exception):
    """A request refused (before it reaches the manager, or when the manager cannot serve it): answered in
    OpenAI's error format."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self):
        from fastapi.responses import JSONResponse

        kind = {404: "not_found_error", 503: "service_unavailable"}.get(self.status, "invalid_request_error")
        error = {"message": self.message, "type": kind, "param": self.param, "code": None}
        return JSONResponse({"error": error}, status_code=self.status)


def _check(body: dict, route: str, name: str, tokenizer, context: int | None, temperature: float) -> None:
    """Refuse (``Refused``: a 4xx naming the field) what would fail inside the manager or be silently ignored
    there; a request that does not say how many tokens gets transformers serve's default, within the context."""
    if route == "/v1/responses":
        body.setdefault("stream", False)  # OpenAI's default (transformers serve's handler streams when unset)
    if body.get("model") not in (None, name):
        raise Refused(404, f"The model {body['model']!r} does not exist: this server serves {name!r}", "model")
    prompt_field = PROMPT[route]
    if not body.get(prompt_field):
        raise Refused(400, f"{route}: {prompt_field!r} is required", prompt_field)
    max_keys = [key for key in MAX_TOKENS[route] if body.get(key) is not None]
    max_tokens = body[max_keys[0]] if max_keys else None
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0):
        raise Refused(400, f"{max_keys[0]}={max_tokens!r}: a positive integer of tokens to generate", max_keys[0])
    asked = body.get("temperature")
    if asked is not None and float(asked) != temperature:
        raise Refused(400, f"temperature={asked}: this server decodes every request at temperature {temperature} "
                      "(one setting for the continuous batch: hf-parallel serve --temperature)", "temperature")
    for field, neutral in NEUTRAL.items():
        if body.get(field) not in neutral:
            raise Refused(400, f"{field}={body[field]!r} is not supported by this server's continuous batching", field)
    prompt_tokens = _prompt_tokens(body[prompt_field], route, tokenizer)
    if context is not None and prompt_tokens is not None:
        wanted = max_tokens or 1
        if prompt_tokens + wanted > context:
            raise Refused(400, f"This model's maximum context length is {context} tokens; the prompt has "
                          f"{prompt_tokens} and {wanted} more were asked for", prompt_field)  # fmt: skip
        if max_tokens is None:  # transformers serve's default, within the context
            body[MAX_TOKENS[route][-1]] = min(DEFAULT_NEW_TOKENS, context - prompt_tokens)


def _prompt_tokens(prompt, route: str, tokenizer) -> int | None:
    """The prompt's length in tokens as the handler will see it (None: a form only the handler reads)."""
    try:
        if route == "/v1/chat/completions":
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)
            return len(ids["input_ids"])
        if isinstance(prompt, str):
            return len(tokenizer(prompt)["input_ids"])
    except Exception as error:  # a malformed message list: the template's words
        raise Refused(400, f"{route}: the prompt cannot be tokenized ({type(error).__name__}: {error})") from None
    if route == "/v1/completions":
        raise Refused(400, "/v1/completions: 'prompt' must be a string", "prompt")
    return None


def _add_metrics(app, manager, metrics: Metrics) -> None:
    from fastapi.responses import PlainTextResponse

    @app.get("/metrics")
    def prometheus_metrics():
        return PlainTextResponse(metrics.prometheus(*serving.waiting_and_running(manager)))


def _require_key(app, api_key: str) -> None:
    """Every ``/v1`` route asks for ``Authorization: Bearer <api_key>`` (as vLLM's ``--api-key``)."""
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def authorization(request, call_next):
        if request.url.path.startswith("/v1") and request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"message": "Invalid or missing API key", "type": "invalid_request_error",
                                           "code": "invalid_api_key"}}, status_code=401)  # fmt: skip
        return await call_next(request)
