"""The OpenAI-compatible HTTP API (FastAPI) over an :class:`~treerl.serve.loop.EngineLoop`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``POST /update_weights_from_disk``. Responses follow the OpenAI schema and
add, per choice, ``token_ids`` (the completion's token ids, stop token included),
``token_logprobs`` (behaviour logprob of each) and ``token_versions`` (weight version
that sampled each), and at the top ``prompt_token_ids`` and ``weight_version`` (the oldest
version among the completion tokens). ``text`` / ``content`` is the decoded completion
without special tokens and, unless ``include_stop_str_in_output``, cut before the stop
string. Bad requests get HTTP 400 (404: unknown model) with ``{"error": {..., "param"}}``.
``/health`` reports the loop's request counters and, under ``engine``, the rollout engine's
(:meth:`EngineLoop.engine_stats <treerl.serve.loop.EngineLoop.engine_stats>`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from ..rollout import Completion
from ..rollout import SamplingParams
from .chat import ChatRenderer
from .limits import ServeLimits
from .loop import EngineLoop
from .protocol import APIError, ChatRequest, CompletionRequest, SamplingRequest, WeightsRequest, validation_error


@dataclass
class ServeState:
    """What the handlers need. ``load_weights(path, version) -> version`` applies a
    checkpoint (see :func:`treerl.serve.weights.load_weights_into`)."""

    loop: EngineLoop
    tokenizer: Any
    model_name: str = "treerl"
    default_max_tokens: int = 256
    load_weights: Callable[[str, int | None], int] | None = None
    chat: ChatRenderer | None = None  # prompts and replies of /v1/chat/completions (default: no tool parser)
    limits: ServeLimits = field(default_factory=ServeLimits)  # caps per request (security: n, max_tokens, chars)

    def __post_init__(self):
        if self.chat is None:
            self.chat = ChatRenderer(self.tokenizer)

    @property
    def engine(self):
        return self.loop.engine


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="treerl serve", docs_url=None, redoc_url=None)
    app.state.treerl = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health():
        s = state.loop.stats
        return {"status": "ok", "model": state.model_name, "weight_version": state.engine.version,
                "busy_requests": state.loop.busy,
                "stats": {"requests": s.requests, "completed": s.completed, "failed": s.failed,
                          "samples": s.samples, "tokens": s.tokens, "streams": s.streams},
                "engine": dataclasses.asdict(state.loop.engine_stats()), "chat": state.chat.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "owned_by": "treerl",
                                             "max_model_len": state.engine.max_positions}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await request.body())
        prompt = req.single_prompt
        if isinstance(prompt, str):  # tokenized in a worker thread: the event loop keeps serving others
            prompt = await run_in_threadpool(_encode, state, prompt, "prompt")
        ids = _check_ids(state, prompt, "prompt")
        samples, key = await _generate(state, req, ids)
        choices = []
        for j, c in enumerate(samples):
            text = _text(state, c, req.include_stop_str_in_output)
            choice = {"index": j, "text": text, "finish_reason": c.finish_reason, "stop_reason": c.stop,
                      "logprobs": _completion_logprobs(state, c) if req.logprobs is not None else None}
            choices.append(choice | _token_fields(c))
        return _response("cmpl", "text_completion", state, ids, samples, choices)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = _parse(ChatRequest, await request.body())
        # before tokenizing: the messages' characters (their JSON, an upper bound) against the context
        state.limits.check_chars(sum(len(m.model_dump_json(exclude_none=True)) for m in req.messages), "messages")
        # template, tools, token-exact history (treerl.serve.chat), off the event loop
        turn = await run_in_threadpool(state.chat.prompt, req)
        ids = _check_ids(state, turn.ids, "messages")
        samples, key = await _generate(state, req, ids)
        choices = []
        for j, c in enumerate(samples):
            message, finish = state.chat.reply(turn, _text(state, c, req.include_stop_str_in_output),
                                               c.finish_reason, c.completion_ids.tolist())
            choice = {"index": j, "message": message, "finish_reason": finish, "stop_reason": c.stop,
                      "logprobs": _chat_logprobs(state, c) if req.logprobs else None}
            choices.append(choice | _token_fields(c))
        return _response("chatcmpl", "chat.completion", state, ids, samples, choices)

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request):
        req = _parse(WeightsRequest, await request.body())
        if state.load_weights is None:
            raise APIError("this server does not load weights", "model_path", status=403)
        try:
            version = await run_in_threadpool(state.load_weights, req.model_path, req.version)
        except (OSError, ValueError, KeyError) as err:
            raise APIError(f"cannot load weights from {req.model_path}: {err}", "model_path") from None
        return {"success": True, "weight_version": version, "message": f"loaded {req.model_path}"}

    return app


# ---------------------------------------------------------------------- helpers
def _parse(model: type, body: bytes):
    try:
        req = model.model_validate_json(body or b"")
    except ValidationError as err:
        raise validation_error(err.errors(include_url=False)) from None
    if hasattr(req, "check"):
        req.check()
    return req


def _encode(state: ServeState, text: str, param: str) -> list[int]:
    """Token ids of a text prompt, with the tokenizer's special tokens (e.g. bos) as
    ``encode(text)`` adds them."""
    state.limits.check_chars(len(text), param)  # before tokenizing
    try:
        return [int(t) for t in state.tokenizer.encode(text, add_special_tokens=True)]
    except ValueError as err:
        raise APIError(f"{param} cannot be tokenized: {err}", param) from None


def _check_ids(state: ServeState, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise APIError(f"{param} is empty", param)
    vocab = state.engine.vocab_size
    for i, t in enumerate(ids):
        if not 0 <= t < vocab:
            raise APIError(f"{param}: token id {t} at position {i} is outside the vocabulary [0, {vocab})", param)
    context = state.engine.max_positions
    if context is not None and len(ids) >= context:
        raise APIError(f"{param} has {len(ids)} tokens; the model's context is {context} tokens, so a prompt may "
                       f"have at most {context - 1} (room for one generated token)", param)
    return ids


def _sampling_params(state: ServeState, req: SamplingRequest, prompt_len: int) -> SamplingParams:
    context = state.engine.max_positions
    room = None if context is None else context - prompt_len
    if req.max_tokens is None:
        max_tokens = state.default_max_tokens if room is None else min(state.default_max_tokens, room)
    else:
        max_tokens = req.max_tokens
        if room is not None and max_tokens > room:
            raise APIError(f"max_tokens={max_tokens} is beyond the context: the prompt has {prompt_len} tokens and "
                           f"the model's context is {context}, so at most {room} can be generated", "max_tokens")
    stops = list(req.stop_token_ids or [])
    vocab = state.engine.vocab_size
    for t in stops:
        if not 0 <= t < vocab:
            raise APIError(f"stop_token_ids: {t} is outside the vocabulary [0, {vocab})", "stop_token_ids")
    eos = getattr(state.tokenizer, "eos_token_id", None)
    if eos is not None and eos not in stops:
        stops.append(eos)
    return SamplingParams(n=req.n, temperature=float(req.temperature), top_p=float(req.top_p), top_k=max(0, req.top_k),
                          max_new_tokens=int(max_tokens), stop_token_ids=sorted(stops),
                          stop_strings=list(req.stop_strings or ()))


async def _generate(state: ServeState, req: SamplingRequest, ids: list[int]) -> tuple[list[Completion], SamplingParams]:
    if req.model != state.model_name:
        raise APIError(f"model {req.model!r} is not served here; this server serves {state.model_name!r}",
                       "model", status=404, code="model_not_found")
    state.limits.check_request(req.n, req.max_tokens)
    key = _sampling_params(state, req, len(ids))
    try:
        samples = await asyncio.wrap_future(state.loop.submit(ids, key))
    except Exception as err:  # noqa: BLE001 - the client gets a JSON error, the server goes on
        status = 503 if "shutting down" in str(err) or "stopped" in str(err) else 500
        raise APIError(f"generation failed: {type(err).__name__}: {err}", None, status=status,
                       type="server_error") from None
    return samples, key


def _text(state: ServeState, c: Completion, include_stop: bool) -> str:
    text = state.tokenizer.decode(c.completion_ids.tolist(), skip_special_tokens=True)
    if isinstance(c.stop, str) and not include_stop:
        cut = text.find(c.stop)
        if cut >= 0:
            text = text[:cut]
    return text


def _token_fields(c: Completion) -> dict:
    return {"token_ids": c.completion_ids.tolist(), "token_logprobs": c.logprobs.tolist(),
            "token_versions": c.versions.tolist()}


def _pieces(state: ServeState, c: Completion) -> list[str]:
    return [state.tokenizer.decode([t]) for t in c.completion_ids.tolist()]


def _completion_logprobs(state: ServeState, c: Completion) -> dict:
    pieces = _pieces(state, c)
    offsets, at = [], 0
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": pieces, "token_logprobs": c.logprobs.tolist(), "top_logprobs": None, "text_offset": offsets}


def _chat_logprobs(state: ServeState, c: Completion) -> dict:
    return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
                        for p, lp in zip(_pieces(state, c), c.logprobs.tolist())]}


def _response(prefix: str, obj: str, state: ServeState, ids: list[int], samples: list[Completion],
              choices: list[dict]) -> dict:
    generated = sum(len(c) for c in samples)
    versions = [c.min_version for c in samples if len(c)]
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": state.model_name, "choices": choices,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": generated, "total_tokens": len(ids) + generated},
            "prompt_token_ids": ids, "weight_version": min(versions) if versions else state.engine.version}
