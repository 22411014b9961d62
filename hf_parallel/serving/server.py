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
import contextlib
import hmac
import importlib.util
import logging
import os
import signal
import threading
import time

import torch.distributed as dist

from ..compat import transformers_serving as serving
from .requests import Refused, RequestRules

logger = logging.getLogger("hf_parallel.serve")

STOP_TIMEOUT_S = 2.0  # a stopping manager's thread is given this long to end its step (else a rank is gone)
FAILURE_GRACE_S = 1.0  # after the generation loop dies, requests in flight get their 503 before the exit
RATE_WINDOW_S = 10.0  # tokens/s is over the finished requests of this window
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        with self.lock:
            counts = (("requests_waiting", waiting), ("requests_running", running),
                      ("requests_finished_total", self.finished), ("requests_failed_total", self.failed),
                      ("generated_tokens_total", self.tokens), ("generated_tokens_per_second", round(rate, 3)))
        return "".join(f"hf_parallel_{name} {value}\n" for name, value in counts)


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


SERVING_PACKAGES = ("fastapi", "uvicorn", "openai")  # transformers serve's app, its server, the types it imports


def check_serving_packages() -> None:
    """Refuse ``serve`` before a model loads where the ``serving`` extra is not installed, naming what is missing
    (rank 0 would fail only once its app starts, the others waiting on it)."""
    missing = [name for name in SERVING_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise SystemExit(f"hf-parallel serve needs {', '.join(missing)}: pip install 'hf_parallel[serving]'")


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
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in STOP_SIGNALS}
    try:
        while manager.is_running() and not stop.wait(0.2):
            pass
        if manager.is_running():
            manager.stop(block=True, timeout=STOP_TIMEOUT_S, hard_stop=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 1 if manager.background_thread_status.fatal_error is not None else 0


def _answer(model, tokenizer, name, manager, metrics, host, port, api_key, temperature) -> int:
    """Rank 0: transformers serve's app over ``manager`` until a signal or the generation loop's death."""
    import uvicorn

    stopping, stuck, once = threading.Event(), threading.Event(), threading.Lock()

    def drain():
        """Stop every rank's manager; the requests in flight fail (503, or an error event in a stream). A loop
        that does not stop is waiting on a rank that is gone (torchrun's SIGTERM after a rank died): its
        requests are failed from here."""
        with once:  # a second caller waits for the first to have finished
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

        @contextlib.contextmanager
        def capture_signals(self):  # uvicorn's re-raises the signal after serving: this returns an exit code
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    app, handlers = serving.openai_app(model, tokenizer, name, manager, drain)
    rules = RequestRules(name, tokenizer, getattr(model.config.get_text_config(), "max_position_embeddings", None),
                         temperature, max(model.generation_config.max_new_tokens or 0, 1024),
                         serving.ignored_fields(handlers))  # fmt: skip
    for route, handler in handlers.items():
        handler.handle_request = _checked(handler.handle_request, route, rules, manager)
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
            (waiting, running), rate = serving.waiting_and_running(manager), metrics.tokens_per_second()
            if waiting or running or rate:
                logger.info("%d waiting, %d running, %.1f tokens/s", waiting, running, rate)
        stopping.wait(0.2)


def _checked(handle, route: str, rules: RequestRules, manager):
    """``handle`` (a transformers serve handler's ``handle_request``) behind the request rules; a request failed
    because the generation loop is dying answers 503 (transformers fails the requests before it records the
    loop's error, so its handler can answer 500 for them)."""

    async def handle_request(body: dict, request_id: str):
        try:
            rules.check(body, route)
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
        given = request.headers.get("authorization", "").encode()
        if request.url.path.startswith("/v1") and not hmac.compare_digest(given, f"Bearer {api_key}".encode()):
            return JSONResponse({"error": {"message": "Invalid or missing API key", "type": "invalid_request_error",
                                           "code": "invalid_api_key"}}, status_code=401)  # fmt: skip
        return await call_next(request)
