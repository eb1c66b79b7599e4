"""Request schemas of the OpenAI-compatible API and the JSON error they get.

Requests are pydantic models in strict mode (a string where a number belongs is an
error, not a conversion) that forbid unknown fields: every field is either honoured,
accepted because it cannot change the output (``user``, ``metadata``, ...), accepted only
at its neutral value (``presence_penalty=0``, ``response_format={"type": "text"}``, ...:
:data:`NEUTRAL`), or refused. Every refusal is an :class:`APIError` that names the field:
``{"error": {"message", "type", "param", "code"}}`` with HTTP status 400 (404 for an
unknown model). docs/SERVING.md lists every field.

treerl extensions (vLLM's names): ``prompt`` may be token ids; ``stop_token_ids``;
``top_k`` (``-1`` or ``0``: off); ``min_p``; ``include_stop_str_in_output``;
``skip_special_tokens``; ``return_token_ids`` (accepted; token ids are always returned).
"""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOP_LOGPROBS = 20  # alternatives per token (completions ``logprobs``, chat ``top_logprobs``), as vLLM


class APIError(Exception):
    """A request the server refuses: ``status`` (HTTP), ``message``, the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _none(v: Any) -> bool:
    return v is None


#: Fields accepted only at their neutral value: ``name -> (is neutral, what to do instead)``.
NEUTRAL: dict[str, tuple[Callable[[Any], bool], str]] = {
    "presence_penalty": (lambda v: v in (None, 0), "send 0 or leave it out"),
    "frequency_penalty": (lambda v: v in (None, 0), "send 0 or leave it out"),
    "logit_bias": (lambda v: not v, "leave it out"),
    "response_format": (lambda v: v in (None, {"type": "text"}), "structured output is not built; send "
                        "{\"type\": \"text\"} and validate the reply yourself"),
    "suffix": (lambda v: not v, "leave it out"),
    "store": (lambda v: not v, "completions are not stored; send false or leave it out"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "send \"auto\" or leave it out"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output: send [\"text\"]"),
    "functions": (_none, "the deprecated functions API is not served; use tools"),
    "function_call": (_none, "the deprecated functions API is not served; use tool_choice"),
    "audio": (_none, "no audio output"),
    "prediction": (_none, "predicted outputs are not served"),
    "web_search_options": (_none, "no web search"),
    "reasoning_effort": (_none, "the chat template decides reasoning; leave it out"),
    "verbosity": (_none, "leave it out"),
}


#: Chat template variables the server sets: ``chat_template_kwargs`` may not (name -> what sets it).
TEMPLATE_RESERVED = {"messages": "messages", "tools": "tools", "add_generation_prompt": "the chat endpoint",
                     "tokenize": "the chat endpoint", "conversation": "messages", "chat_template": "the model",
                     "continue_final_message": "the chat endpoint", "return_dict": "the chat endpoint"}


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """400 naming ``chat_template_kwargs.KEY`` for a variable the server sets itself."""
    for key in kwargs or {}:
        if key in TEMPLATE_RESERVED:
            raise APIError(f"chat_template_kwargs.{key}: the server sets {key!r} itself (from "
                           f"{TEMPLATE_RESERVED[key]}); leave it out", f"chat_template_kwargs.{key}")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(BaseModel):
    """Fields both completion endpoints share (sampling settings, stops, streaming)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted: it does not change the output

    def check(self) -> None:
        """Field checks beyond types (raises :class:`APIError` naming the field)."""
        for name, (neutral, instead) in NEUTRAL.items():
            if name in type(self).model_fields and not neutral(getattr(self, name)):
                raise APIError(f"{name}={getattr(self, name)!r} is not supported by treerl serve: {instead}", name)
        if self.n < 1:
            raise APIError(f"n must be >= 1, got {self.n}", "n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(f"max_tokens must be >= 1, got {self.max_tokens}", "max_tokens")
        if not self.temperature >= 0:
            raise APIError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise APIError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise APIError(f"top_k must be >= -1 (-1 or 0 = off), got {self.top_k}", "top_k")
        if not 0 <= self.min_p < 1:
            raise APIError(f"min_p must be in [0, 1) (0 = off), got {self.min_p}", "min_p")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise APIError(f"seed must be in [0, 2**63), got {self.seed}", "seed")
        for s in self.stop_strings:
            if not s:
                raise APIError("stop strings must be non-empty", "stop")
        if self.stream_options is not None:
            if not self.stream:
                raise APIError("stream_options is only allowed with stream=true", "stream_options")
            if self.stream_options.continuous_usage_stats and not self.stream_options.include_usage:
                raise APIError("stream_options.continuous_usage_stats needs include_usage=true (usage in every "
                               "chunk, as vLLM)", "stream_options.continuous_usage_stats")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (``stream_options.continuous_usage_stats`` with ``include_usage``)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def top_logprobs_k(self) -> int:
        """Alternatives per generated token to return (0: none)."""
        return 0


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one or several prompts, each text or token ids; choice
    ``i * n + j`` is prompt ``i``'s sample ``j``. ``echo``: the prompt is returned before the
    completion, with its logprobs when ``logprobs`` is set (the first token's is None);
    ``max_tokens=0`` with ``echo`` scores the prompt without generating."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        if self.echo and self.max_tokens == 0:
            self.max_tokens = None
            super().check()
            self.max_tokens = 0
        else:
            super().check()
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError("prompt is an empty list", "prompt")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}", "logprobs")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of other than n is not supported by treerl serve (leave it unset)", "best_of")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    @property
    def top_logprobs_k(self) -> int:
        return self.logprobs or 0


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # checked and rendered by treerl.serve.chat
    tool_call_id: str | None = None
    name: str | None = None


class ChatRequest(SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call (treerl.serve.tools)
    response_format: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    metadata: dict[str, str] | None = None  # accepted: it does not change the output
    prompt_cache_key: str | None = None  # accepted: the prefix cache needs no key
    safety_identifier: str | None = None  # accepted, as user

    def check(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise APIError("max_tokens and max_completion_tokens differ: send one", "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        super().check()
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise APIError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                               "top_logprobs")
            if self.top_logprobs and not self.logprobs:
                raise APIError("top_logprobs needs logprobs=true", "top_logprobs")
        check_template_kwargs(self.chat_template_kwargs)

    @property
    def top_logprobs_k(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0


class WeightsRequest(BaseModel):
    """``POST /update_weights_from_disk`` (SGLang's name): a treerl checkpoint, a run
    directory (its newest checkpoint) or a Hugging Face model directory."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model_path: str
    version: int | None = None  # default: the current version + 1


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None  # with messages: rendered as the chat endpoint renders them
    chat_template_kwargs: dict[str, Any] | None = None  # with messages, as the chat endpoint's
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("send either prompt or messages", "prompt")
        if self.messages is None and (self.tools is not None or self.chat_template_kwargs is not None):
            raise APIError("tools and chat_template_kwargs go with messages", "tools" if self.tools is not None
                           else "chat_template_kwargs")
        check_template_kwargs(self.chat_template_kwargs)
        if self.messages is not None and not self.add_generation_prompt:
            raise APIError("add_generation_prompt=false is not supported (the chat prompt ends with the "
                           "generation prompt)", "add_generation_prompt")
        if self.messages is not None and not self.messages:
            raise APIError("messages is empty", "messages")


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as an :class:`APIError` naming its field (dotted path)."""
    if not errors:
        return APIError("invalid request", None)
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # drop the union-member tags pydantic adds (e.g. 'str', 'list[int]', 'function-after[...]')
    loc = [x for x in loc if not (x.startswith(("list[", "function-", "dict[")) or x in ("str", "int", "float", "bool"))]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {e.get('msg')}", "body")
    if e.get("type") in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return APIError("the request body must be a JSON object", "body")
    if e.get("type") == "missing":
        return APIError(f"missing required field {param!r}", param)
    if e.get("type") == "extra_forbidden":
        return APIError(f"{param} is not a field treerl serve honours (docs/SERVING.md lists the fields); "
                        "leave it out", param)
    got = e.get("input")
    got = f" (got {got!r})" if not isinstance(got, (dict, list)) else ""
    return APIError(f"{param}: {e.get('msg')}{got}", param)
