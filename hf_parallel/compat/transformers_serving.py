"""transformers' serving internals hf_parallel uses: continuous batching's manager and ``transformers serve``'s app.

Continuous batching at tensor parallelism is transformers' own (one rank schedules and broadcasts its
decisions over a CPU group; ``generation/continuous_batching/distributed.py``), but its manager reads the
TP group from ``model._device_mesh`` and sizes the paged cache from the config's KV heads divided by the TP
size (refusing uneven splits). A split model has neither: so the manager is made by transformers, then
handed a ``DistributedHelper`` built (by transformers' own code) over the model's TP group before its first
batch, and the cache reads this rank's head counts from that helper (a subclass of transformers' cache, the
attention integrations test ``isinstance`` against it). Nothing changes for a model in one process.

``transformers serve`` builds its FastAPI app from a model manager and handlers; ``hf-parallel serve``
builds the same app with a manager that already holds the split model and a continuous-batching manager
every rank started together (the handlers would otherwise start one lazily, on rank 0 alone).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from . import Seam

_CB = "transformers.generation.continuous_batching"
CB_INIT = Seam("transformers", f"{_CB}.continuous_api:ContinuousMixin.init_continuous_batching",
               "(the manager made as transformers makes it; a kept one returned as is)",
               reads=("_cached_continuous_batching_manager",),
               parameters=("generation_config", "continuous_batching_config", "workload_hints"))  # fmt: skip
CB_GENERATE_BATCH = Seam("transformers", f"{_CB}.continuous_api:ContinuousMixin.generate_batch",
                         "(its results checked for failed requests)", parameters=("inputs", "generation_config"))
CB_MANAGER = Seam("transformers", f"{_CB}.continuous_api:ContinuousBatchingManager",
                  "(its distributed helper replaced before its first batch; its cache made by name)",
                  reads=("distributed_helper", "is_tp_driver", "PagedAttentionCache", "batch_processor"))  # fmt: skip
CB_HELPER = Seam("transformers", f"{_CB}.distributed:DistributedHelper", "(built over the model's TP group)",
                 parameters=("device_mesh", "cpu_group_timeout", "tp_plan"))  # fmt: skip
CB_CACHE = Seam("transformers", f"{_CB}.cache:PagedAttentionCache", "(sized from this rank's heads)",
                parameters=("config", "continuous_batching_config", "device", "distributed_helper"))  # fmt: skip
CB_CACHE_HEADS = Seam("transformers", f"{_CB}.cache:PagedAttentionCache.__init__", "(this rank's KV heads)",
                      reads=("find_num_key_value_heads", "are_kv_heads_tp_ed", "tp_all_reduce_min"))  # fmt: skip
CB_MEMORY = Seam("transformers", f"{_CB}.utils:get_device_and_memory_breakdown", "(the memory the cache sizes from)")
CB_MEMORY_READ = Seam("transformers", f"{_CB}.cache:PagedAttentionMemoryHandler.get_available_memory",
                      "(the fraction of the memory it is given)",
                      reads=("get_device_and_memory_breakdown", "max_memory_percent"))  # fmt: skip
CB_DEFAULT_PERCENT = Seam("transformers", f"{_CB}.initialization:resolve_max_memory_percent",
                          "(transformers' default share of free memory)",
                          parameters=("cb_config", "has_logit_processors", "device"))  # fmt: skip
CB_CONFIG = Seam("transformers", "transformers.generation.configuration_utils:ContinuousBatchingConfig",
                 "(the memory and timeout knobs)")
CB_SCHEDULER = Seam("transformers", f"{_CB}.scheduler:Scheduler", "(the queue's length, for /metrics)",
                    reads=("waiting_requests", "active_requests"))  # fmt: skip
CB_DELIVERY = Seam("transformers", f"{_CB}.continuous_api:ContinuousBatchProcessor",
                   "(finished requests counted where it delivers them)", reads=("output_router", "deliver_batch"))
CB_FAILED = Seam("transformers", f"{_CB}.continuous_api:OutputRouter.fail_and_deliver",
                 "(failed requests counted where it delivers them)", reads=("deliver",))  # fmt: skip
CB_FAIL_ALL = Seam("transformers", f"{_CB}.continuous_api:ContinuousBatchProcessor.fail_all_requests",
                   "(a stuck loop's requests failed from outside it)", reads=("_handle_request_error",))  # fmt: skip
RANK_CONFIG = "hf_parallel_rank_config"  # the helper's attribute: this rank's view of the text config
RANK_AWARE = "hf_parallel_rank_aware"  # set on the cache class installed in transformers' manager module


def init_manager(model, generation_config, continuous_batching_config, workload_hints):
    """The manager transformers' ``init_continuous_batching`` makes (the model's cached one if kept)."""
    return CB_INIT.get()(model, generation_config, continuous_batching_config, workload_hints)


def kept_manager(model):
    """The manager ``init_continuous_batching`` returns as is (one kept by ``persistent_manager=True``), or None."""
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    return manager if isinstance(manager, CB_MANAGER.get()) else None


def generate_batch(model, inputs, *args, **kwargs) -> dict:
    """transformers' ``generate_batch`` (which enters through the model's ``init_continuous_batching``)."""
    return CB_GENERATE_BATCH.get()(model, inputs, *args, **kwargs)


def continuous_batching_config(config=None):
    """A copy of ``config`` (a new default one if None): the copy is resolved and updated by the manager."""
    return copy.deepcopy(config) if config is not None else CB_CONFIG.get()()


def device_free_memory() -> int:
    """The memory transformers sizes the cache from: the device's total less what is in use (on the host:
    the machine's memory less this process's)."""
    _, total, reserved, allocated = CB_MEMORY.get()()
    return total - max(allocated, reserved)


def default_memory_fraction(config, device) -> float:
    """transformers' share of free memory for the cache and the batch (0.6 on the host, 0.8 on a GPU with
    logits processors, which we assume)."""
    CB_MEMORY_READ.get()
    probe = copy.deepcopy(config)
    CB_DEFAULT_PERCENT.get()(cb_config=probe, has_logit_processors=True, device=device)
    return probe.max_memory_percent


def hand_over_tp_group(manager, device_mesh, cpu_group_timeout, rank_config) -> None:
    """Give ``manager`` the TP group of ``device_mesh`` (a 1-D ``tp`` DeviceMesh) before its first batch:
    transformers' helper over it (its own CPU group, the driver, the shared seed) reading ``rank_config``
    (this rank's heads) for the cache. Every rank of the group calls it together (the CPU group is made)."""
    if manager.batch_processor is not None:
        raise RuntimeError("the continuous batching manager already has a batch processor: hand it the TP group first")
    _install_rank_cache()
    helper = CB_HELPER.get()(device_mesh=device_mesh, cpu_group_timeout=cpu_group_timeout, tp_plan={})
    setattr(helper, RANK_CONFIG, rank_config)
    manager.distributed_helper = helper
    manager.is_tp_driver = helper.is_tp_driver


def _install_rank_cache() -> None:
    """transformers' manager makes its cache by the module's name ``PagedAttentionCache``: that name becomes
    a subclass sizing itself from this rank's config where the helper carries one (else unchanged)."""
    manager_module = __import__(CB_MANAGER.get().__module__, fromlist=["PagedAttentionCache"])
    CB_CACHE_HEADS.get()
    base = CB_CACHE.get()
    if getattr(manager_module.PagedAttentionCache, RANK_AWARE, False):
        return

    class RankPagedCache(base):
        """transformers' paged cache with this rank's attention heads (a helper without a rank config: as is)."""

        hf_parallel_rank_aware = True

        def __init__(self, config, continuous_batching_config, device, distributed_helper, **kwargs):
            rank_config = getattr(distributed_helper, RANK_CONFIG, None)
            try:
                super().__init__(rank_config or config, continuous_batching_config, device, distributed_helper,
                                 **kwargs)  # fmt: skip
            except ValueError as error:
                if rank_config is None or "Invalid values" not in str(error):
                    raise
                raise ValueError(
                    f"continuous batching: the memory this rank gives it (kv_cache_memory_bytes, or its share of "
                    f"free memory) does not hold the batch's buffers and a cache ({error}): give it more, or lower "
                    "ContinuousBatchingConfig(max_batch_tokens=...)"
                ) from error
            if rank_config is not None and distributed_helper.cpu_comm_group is not None:
                _same_geometry(self, distributed_helper)

    manager_module.PagedAttentionCache = RankPagedCache


def _same_geometry(cache, helper) -> None:
    """Every rank's scheduler decides alone from the broadcast requests: the caches must agree on the
    geometry it reads, or one rank's batch would differ from another's."""
    mine = torch.tensor(cache_geometry(cache), dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(helper.tp_size)]
    dist.all_gather(everyone, mine, group=helper.cpu_comm_group)
    if any(not torch.equal(other, mine) for other in everyone):
        raise ValueError(
            "continuous batching on a split model: the ranks' paged caches differ in (sectors, tokens per sector, "
            f"batch tokens, tokens a request reads): {[tuple(g.tolist()) for g in everyone]}; set "
            "ContinuousBatchingConfig(num_blocks=..., max_batch_tokens=...) to size them alike"
        )


def cache_geometry(cache) -> tuple[int, int, int, int]:
    """(sectors, tokens a sector holds, batch tokens, tokens a request can read) of a paged cache: what the
    scheduler decides with, so it must be the same on every rank."""
    return cache.num_sectors, cache.tokens_per_sector, cache.max_batch_tokens, cache.max_tokens_read


# -- transformers serve's app ------------------------------------------------------------------------
_SERVE = "transformers.cli.serving"
SERVE_APP = Seam("transformers", f"{_SERVE}.server:build_server", "(the OpenAI-compatible app)",
                 parameters=("model_manager", "chat_handler", "completion_handler", "response_handler",
                             "transcription_handler", "systemone_handler", "generation_state"))  # fmt: skip
SERVE_MODELS = Seam("transformers", f"{_SERVE}.model_manager:ModelManager", "(holding the loaded split model)",
                    reads=("loaded_models", "force_model", "process_model_name"))  # fmt: skip
SERVE_STATE = Seam("transformers", f"{_SERVE}.utils:GenerationState", "(the started manager handed over)",
                   reads=("_cb_manager", "_cb_model_id"))  # fmt: skip
SERVE_CB = Seam("transformers", f"{_SERVE}.utils:CBGenerateManager", "(wrapping the started manager)", reads=("_cb",))
SERVE_HANDLERS = {
    route: Seam("transformers", where, "(the OpenAI routes' handlers)",
                parameters=("model_manager", "generation_state"))
    for route, where in {
        "/v1/chat/completions": f"{_SERVE}.chat_completion:ChatCompletionHandler",
        "/v1/completions": f"{_SERVE}.completion:CompletionHandler",
        "/v1/responses": f"{_SERVE}.response:ResponseHandler",
    }.items()
}
SERVE_IGNORED = Seam("transformers", f"{_SERVE}.utils:BaseHandler._validate_request",
                     "(the fields a handler ignores, which a split model's server refuses)", reads=("_unused_fields",))
SERVE_MESSAGES = Seam("transformers", f"{_SERVE}.utils:BaseHandler.get_processor_inputs_from_messages",
                      "(a chat's messages as the handler templates them)", parameters=("messages", "modality"))
SERVE_MODALITY = Seam("transformers", f"{_SERVE}.model_manager:Modality", "(a text model's)")
SERVE_ALIVE = Seam("transformers", f"{_SERVE}.utils:GenerationState.is_cb_alive", "(/health)", reads=("is_alive",))
SERVE_ROUTES_DROPPED = ("/load_model", "/reset", "/v1/systemone", "/v1/audio/transcriptions")  # hub loads, others


class _Held:
    """What transformers serve's model manager keeps per model, for a model that is never unloaded."""

    def __init__(self, model, processor):
        self.model, self.processor = model, processor

    def reset_timer(self) -> None:
        pass

    def delete_model(self) -> None:
        pass


def openai_app(model, tokenizer, name: str, manager, shutdown) -> tuple[object, dict]:
    """transformers serve's FastAPI app for ``model`` (already loaded) served as ``name`` through ``manager``
    (a started continuous-batching manager). Its hub-loading and unrelated routes are dropped; ``shutdown``
    runs when the app stops. Returns the app and its handlers by route."""
    models = SERVE_MODELS.get()(device=str(model.device), model_timeout=-1)
    models.force_model = name
    models.loaded_models[models.process_model_name(name)] = _Held(model, tokenizer)
    models.get_gen_models = lambda: [{"id": name, "object": "model", "created": 0, "owned_by": "hf_parallel"}]
    models.shutdown = shutdown
    state = SERVE_STATE.get()(continuous_batching=True, cb_config=manager.continuous_batching_config)
    state._cb_manager = SERVE_CB.get()(manager.continuous_batching_config)
    state._cb_manager._cb = manager
    SERVE_ALIVE.get()
    state._cb_manager.is_alive = lambda: manager.is_running() and manager.background_thread_status.fatal_error is None
    state._cb_model_id = models.process_model_name(name)
    handlers = {route: seam.get()(model_manager=models, generation_state=state) for route, seam in
                SERVE_HANDLERS.items()}  # fmt: skip
    app = SERVE_APP.get()(models, handlers["/v1/chat/completions"], handlers["/v1/completions"],
                          handlers["/v1/responses"], None, None, state)  # fmt: skip
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in SERVE_ROUTES_DROPPED]
    return app, handlers


def ignored_fields(handlers: dict) -> dict:
    """Each route's fields its transformers serve handler does not handle (it warns once, then goes on)."""
    SERVE_IGNORED.get()
    return {route: set(handler._unused_fields) for route, handler in handlers.items()}


def chat_messages(messages: list) -> list:
    """OpenAI chat messages as transformers serve's chat handler hands them to the chat template (a text model's:
    content parts joined into text)."""
    return SERVE_MESSAGES.get()(messages, SERVE_MODALITY.get().LLM)


def waiting_and_running(manager) -> tuple[int, int]:
    """Requests a manager's scheduler holds waiting and running (0, 0 before its first batch)."""
    CB_SCHEDULER.get()
    processor = manager.batch_processor
    if processor is None:
        return 0, 0
    return len(processor.scheduler.waiting_requests), len(processor.scheduler.active_requests)


def fail_in_flight(processor, error: Exception) -> None:
    """End every request a manager's batch processor (taken before ``stop``, which lets go of it) holds with
    ``error``, from outside its generation thread: for a thread that waits in a collective with a rank that is
    gone, and will not end them itself."""
    if processor is not None:
        CB_FAIL_ALL.get()
        processor.fail_all_requests(error)


def count_finished(manager, record) -> None:
    """Call ``record(output)`` for every finished output the manager delivers (from its generation thread)."""
    CB_DELIVERY.get(), CB_FAILED.get()
    router = manager.output_router
    deliver, deliver_batch = router.deliver, router.deliver_batch

    def counted(output):
        if output.is_finished():
            record(output)
        deliver(output)

    def counted_batch(outputs):
        for output in outputs:
            if output.is_finished():
                record(output)
        deliver_batch(outputs)

    router.deliver, router.deliver_batch = counted, counted_batch
