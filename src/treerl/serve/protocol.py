"""Request schemas of the OpenAI-compatible API and the JSON error they get.

Requests are pydantic models in strict mode (a string where a number belongs is an
error, not a conversion); fields the API defines but treerl does not use are accepted and
ignored when they keep their neutral value, refused otherwise (``stream=true``, penalties,
``logit_bias``, ``best_of > n``). Every refusal is an :class:`APIError` that names the
field: ``{"error": {"message", "type", "param", "code"}}`` with HTTP status 400 (404 for an
unknown model).

treerl extensions (vLLM uses the same names where it has them): ``prompt`` may be token ids;
``stop_token_ids``; ``top_k`` (``-1`` or ``0``: off); ``include_stop_str_in_output``;
``return_token_ids`` (accepted; token ids are always returned).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """A request the server refuses: ``status`` (HTTP), ``message``, the offending ``param``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class SamplingRequest(BaseModel):
    """Fields both completion endpoints share (sampling settings, stops, ignored extras)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool | None = None
    seed: int | None = None  # accepted, not honoured (one random stream per running batch)
    stream: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check(self) -> None:
        """Field checks beyond types (raises :class:`APIError` naming the field)."""
        if self.stream:
            raise APIError("stream=true is not supported by treerl serve; send stream=false", "stream")
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
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"{name} is not supported by treerl serve (send 0)", name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported by treerl serve", "logit_bias")
        for s in self.stop_strings:
            if not s:
                raise APIError("stop strings must be non-empty", "stop")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, text or token ids."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the sampled tokens' logprobs (top alternatives are not returned)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            if len(self.prompt) != 1:
                raise APIError("treerl serve takes one prompt per request (a string or a list of token ids); "
                               "send several requests instead (they join one batch)", "prompt")
        if self.logprobs is not None and not 0 <= self.logprobs <= 5:
            raise APIError(f"logprobs must be in [0, 5], got {self.logprobs}", "logprobs")
        if self.echo:
            raise APIError("echo=true is not supported by treerl serve", "echo")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of is not supported by treerl serve (leave it unset)", "best_of")
        if self.suffix:
            raise APIError("suffix is not supported by treerl serve", "suffix")

    @property
    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            return p[0]
        return p


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
    tools: list[dict[str, Any]] | None = None  # tools / tool_choice: checked by treerl.serve.tools
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise APIError("max_tokens and max_completion_tokens differ: send one", "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        super().check()
        if self.top_logprobs:
            raise APIError("top_logprobs is not supported by treerl serve (the sampled tokens' logprobs are "
                           "returned with logprobs=true)", "top_logprobs")
        if self.parallel_tool_calls is False:
            raise APIError("parallel_tool_calls=false is not supported (a reply may hold several tool calls); "
                           "leave it unset", "parallel_tool_calls")


class WeightsRequest(BaseModel):
    """``POST /update_weights_from_disk`` (SGLang's name): a treerl checkpoint, a run
    directory (its newest checkpoint) or a Hugging Face model directory."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model_path: str
    version: int | None = None  # default: the current version + 1


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic error as an :class:`APIError` naming its field (dotted path)."""
    if not errors:
        return APIError("invalid request", None)
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    # drop the union-member tags pydantic adds (e.g. 'str', 'list[int]', 'function-after[...]')
    loc = [x for x in loc if not (x.startswith(("list[", "function-")) or x in ("str", "int", "float", "bool"))]
    param = ".".join(loc) or None
    if e.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {e.get('msg')}", "body")
    if e.get("type") == "missing":
        return APIError(f"missing required field {param!r}", param)
    got = e.get("input")
    got = f" (got {got!r})" if not isinstance(got, (dict, list)) else ""
    return APIError(f"{param}: {e.get('msg')}{got}", param)
