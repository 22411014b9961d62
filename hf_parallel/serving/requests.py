"""What ``hf-parallel serve`` refuses before a request reaches the continuous batch, and why.

transformers serve's handlers turn a request's fields into a generation config, and warn once (then go on)
about fields they do not handle. Behind continuous batching one generation config, made when the server
starts, serves every request: a request's own temperature, ``top_p``, ``stop``, penalties or seed would be
dropped without a word, and the output would not be what the client asked for. So a field that changes the
answer is accepted only at its neutral value (or the server's), and refused with a 4xx naming it otherwise;
so are what would fail inside the batch (``max_tokens <= 0``, a prompt past the context) and what the handlers
answer with a 500 (a missing prompt). Errors are in OpenAI's format, so clients show the message.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compat import transformers_serving as serving

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
MAX_TOKENS = {CHAT: ("max_completion_tokens", "max_tokens"), COMPLETIONS: ("max_tokens",),
              RESPONSES: ("max_output_tokens",)}  # fmt: skip
PROMPT = {CHAT: "messages", COMPLETIONS: "prompt", RESPONSES: "input"}
# fields transformers serve copies into a request's generation config (ignored behind the batch's one config)
BATCH_WIDE = {"top_p", "stop", "frequency_penalty", "logit_bias", "generation_config", "seed"}
# OpenAI fields a handler neither reads nor lists as unused (so it would not even warn)
UNREAD = {CHAT: {"verbosity"}, COMPLETIONS: set(), RESPONSES: {"conversation", "reasoning", "context_management"}}
HARMLESS = {"user", "store", "metadata", "service_tier", "stream_options"}  # ignored, and change no answer
NEUTRAL = {"top_p": (1,), "stop": ([], ""), "frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
           "n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,), "top_logprobs": (0,),
           "tool_choice": ("auto",), "parallel_tool_calls": (True,), "response_format": ({"type": "text"},),
           "modalities": (["text"],), "truncation": ("disabled",), "include": ([],),
           "background": (False,)}  # fmt: skip


class Refused(Exception):
    """A request refused (before it reaches the batch, or when the batch cannot serve it), answered in
    OpenAI's error format."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self):
        from fastapi.responses import JSONResponse

        kind = {404: "not_found_error", 503: "service_unavailable"}.get(self.status, "invalid_request_error")
        error = {"message": self.message, "type": kind, "param": self.param, "code": None}
        return JSONResponse({"error": error}, status_code=self.status)


@dataclass(frozen=True)
class RequestRules:
    """What a request is checked against: the name served, the tokenizer and context length the prompt is
    measured with, the batch's one temperature, transformers serve's default length for a request that does
    not say (the model's ``max_new_tokens``, at least 1024), and each route's fields its handler ignores."""

    name: str
    tokenizer: object
    context: int | None
    temperature: float
    default_new_tokens: int
    ignored: dict  # route -> the fields its handler does not handle

    def check(self, body: dict, route: str) -> None:
        """Raise ``Refused`` for a body the batch cannot honour; fill in what transformers serve would leave
        to its own defaults where those are wrong here (the Responses API's ``stream``, a length past the
        context, a greedy request's seed)."""
        if route == RESPONSES:
            body.setdefault("stream", False)  # OpenAI's default (transformers serve's handler streams when unset)
        if body.get("model") not in (None, self.name):
            raise Refused(404, f"The model {body['model']!r} does not exist: this server serves {self.name!r}", "model")
        prompt_field = PROMPT[route]
        if not body.get(prompt_field):
            raise Refused(400, f"{route}: {prompt_field!r} is required", prompt_field)
        max_tokens = self._max_tokens(body, route)
        self._sampling(body)
        for field in sorted((self.ignored.get(route, set()) | UNREAD[route] | BATCH_WIDE) - HARMLESS):
            if not _neutral(field, body.get(field)):
                raise Refused(400, f"{field}={body[field]!r} is not supported by this server's continuous batch "
                                   "(one generation config serves every request)", field)  # fmt: skip
        prompt_tokens = self._prompt_tokens(body, route)
        if self.context is None or prompt_tokens is None:
            return
        if prompt_tokens + (max_tokens or 1) > self.context:
            raise Refused(400, f"This model's maximum context length is {self.context} tokens; the prompt has "
                               f"{prompt_tokens} and {max_tokens or 1} more were asked for", prompt_field)  # fmt: skip
        if max_tokens is None:
            body[MAX_TOKENS[route][-1]] = min(self.default_new_tokens, self.context - prompt_tokens)

    def _max_tokens(self, body: dict, route: str) -> int | None:
        keys = [key for key in MAX_TOKENS[route] if body.get(key) is not None]
        value = body[keys[0]] if keys else None
        if value is not None and (type(value) is not int or value <= 0):
            raise Refused(400, f"{keys[0]}={value!r}: a positive integer of tokens to generate", keys[0])
        return value

    def _sampling(self, body: dict) -> None:
        """The batch's one temperature. Where nothing is sampled, a seed and ``top_p`` change no answer and are
        dropped (a seed would make transformers serve reseed rank 0 alone); where the batch samples, a seed
        would part rank 0's tokens from the other ranks': refused."""
        asked = body.get("temperature")
        if asked is not None and (not isinstance(asked, (int, float)) or float(asked) != self.temperature):
            raise Refused(400, f"temperature={asked!r}: this server decodes every request at temperature "
                               f"{self.temperature} (one setting for the continuous batch: hf-parallel serve "
                               "--temperature)", "temperature")  # fmt: skip
        if self.temperature == 0:
            body.pop("seed", None)
            body.pop("top_p", None)

    def _prompt_tokens(self, body: dict, route: str) -> int | None:
        """The prompt's length in tokens as the handler will build it (None: a form only the handler reads)."""
        prompt = body[PROMPT[route]]
        if route == COMPLETIONS:
            if not isinstance(prompt, str):
                raise Refused(400, f"{COMPLETIONS}: 'prompt' must be a string", "prompt")
            return len(self.tokenizer(prompt)["input_ids"])
        if route == RESPONSES:
            if not isinstance(prompt, str) or body.get("tools"):  # (its handler reshapes tools first)
                return None
            instructions = body.get("instructions")
            prompt = [{"role": "system", "content": instructions}] * bool(instructions)
            prompt = prompt + [{"role": "user", "content": body[PROMPT[route]]}]
        try:
            messages = serving.chat_messages(prompt)
            kwargs = body.get("chat_template_kwargs") or {}
            ids = self.tokenizer.apply_chat_template(messages, tools=body.get("tools"), add_generation_prompt=True,
                                                     tokenize=True, return_dict=True, **kwargs)  # fmt: skip
        except Exception:  # a form only the handler's own path reads: it answers for it
            return None
        return len(ids["input_ids"])


def _neutral(field: str, value) -> bool:
    """Whether ``value`` asks for nothing: absent, or the field's default (``0`` is not ``False``)."""
    if value is None:
        return True
    for default in NEUTRAL.get(field, ()):
        alike = _number(value) and _number(default) or type(value) is type(default)
        if alike and value == default:
            return True
    return False


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
