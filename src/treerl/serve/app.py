"""The OpenAI-compatible HTTP API (FastAPI) over an :class:`~treerl.serve.loop.EngineLoop`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``),
``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info`` (vLLM's shapes; lm-evaluation-harness's remote tokenizer uses them),
``GET /health``, ``GET /metrics`` (Prometheus), ``POST /update_weights_from_disk``.
Responses follow the OpenAI schema and add, per choice, ``token_ids`` (the completion's
token ids, stop token included), ``token_logprobs`` (behaviour logprob of each) and
``token_versions`` (weight version that sampled each), and at the top ``prompt_token_ids``
(a list of token-id lists when a completions request has several prompts) and
``weight_version`` (the oldest version among the completion tokens).
Streamed chunks carry the same per-choice fields for their tokens, the first chunk the
prompt ids. ``text`` / ``content`` is the decoded completion (special tokens skipped unless
``skip_special_tokens=false``) cut before the stop string unless
``include_stop_str_in_output``; streamed deltas concatenate to the same text
(:mod:`treerl.serve.detok`).

Every error, whatever its path (a refused field, an unknown route or method, an internal
error), is ``{"error": {"message", "type", "param", "code"}}``. Tokenizing, chat templating,
prompt scoring and decoding run in worker threads, never on the event loop. A streaming
client that disconnects has its rows cancelled (:meth:`EngineLoop.cancel`).

The hook points: :func:`chat_prompt` turns a chat request into prompt ids, :func:`chat_choice`
and :func:`completion_choice` turn a completion into a choice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..rollout import Completion, SamplingParams
from .chat import ChatRenderer, ChatTurn
from .detok import TextStream, completion_text
from .limits import ServeLimits
from .loop import EngineLoop
from .metrics import CONTENT_TYPE, ServeMetrics
from .protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, SamplingRequest,
                       TokenizeRequest, WeightsRequest, validation_error)
from .scoring import PromptScores, score_forced, score_prompt


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
    metrics: ServeMetrics = field(init=False)

    def __post_init__(self):
        if self.chat is None:
            self.chat = ChatRenderer(self.tokenizer)
        self.metrics = ServeMetrics(lambda: (self.loop.stats, self.loop.engine_stats(), self.engine.version,
                                             self.loop.busy))
        self.metrics.counters_from("chat_tool_calls", "tool-call parsing of chat replies (ToolStats)",
                                   self.chat.tool_stats.snapshot)

    @property
    def engine(self):
        return self.loop.engine


ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/tokenizer_info", "/detokenize",
          "/health",
          "/metrics", "/update_weights_from_disk")


class _CountResponses:
    """ASGI middleware: count responses by route (known routes; others as ``other``) and status."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_responses.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="treerl serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.treerl = state
    _install_error_handlers(app)
    app.add_middleware(_CountResponses, metrics=state.metrics)

    @app.get("/health")
    async def health():
        s = state.loop.stats
        return {"status": "ok", "model": state.model_name, "weight_version": state.engine.version,
                "busy_requests": state.loop.busy, "stats": dataclasses.asdict(s),
                "engine": dataclasses.asdict(state.loop.engine_stats()), "chat": state.chat.stats()}

    @app.get("/metrics")
    async def metrics():
        return Response(await run_in_threadpool(state.metrics.exposition), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "owned_by": "treerl", "created": 0,
                "max_model_len": state.engine.max_positions}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise APIError(f"model {model_id!r} is not served here; this server serves {state.model_name!r}",
                           "model", status=404, code="model_not_found")
        return model_card()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = _parse(TokenizeRequest, await request.body())
        _check_model(state, req.model, optional=True)

        def work() -> dict:
            if req.messages is not None:
                ids = chat_prompt(state, ChatRequest.model_construct(messages=req.messages)).ids
            else:
                ids = _encode(state, req.prompt, "prompt", req.add_special_tokens)
            strs = [state.tokenizer.decode([t]) for t in ids] if req.return_token_strs else None
            return {"count": len(ids), "max_model_len": state.engine.max_positions, "tokens": ids, "token_strs": strs}

        return await run_in_threadpool(work)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = state.tokenizer
        info = {name: getattr(tok, name, None) for name in ("eos_token", "bos_token", "pad_token", "unk_token")}
        return info | {"tokenizer_class": type(tok).__name__, "chat_template": getattr(tok, "chat_template", None),
                       "model_max_length": state.engine.max_positions}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = _parse(DetokenizeRequest, await request.body())
        _check_model(state, req.model, optional=True)
        _check_ids(state, req.tokens, "tokens", check_context=False, allow_empty=True)
        return {"prompt": await run_in_threadpool(state.tokenizer.decode, req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await request.body())
        _check_model(state, req.model)
        prompts = await run_in_threadpool(_completion_prompts, state, req)
        if req.stream:
            return _stream(state, req, prompts, chat=False)
        params = [_sampling_params(state, req, len(ids)) for ids in prompts] if req.max_tokens != 0 else None
        results = await _run(state, prompts, params, request) if params is not None else [[] for _ in prompts]
        # (a JSONResponse: FastAPI's encoder would walk every token id and logprob in Python, on the event loop)
        return JSONResponse(await run_in_threadpool(_completion_body, state, req, prompts, results))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = _parse(ChatRequest, await request.body())
        _check_model(state, req.model)
        turn = await run_in_threadpool(chat_prompt, state, req)
        ids = _check_ids(state, turn.ids + turn.forced, "messages")
        if req.stream:
            if turn.forced:
                raise APIError(f"tool_choice={json.dumps(req.tool_choice)} is not served with stream=true (a forced "
                               "call is answered whole): send stream=false", "tool_choice")
            return _stream(state, req, [ids], chat=True, turn=turn)
        params = _sampling_params(state, req, len(ids))
        [samples] = await _run(state, [ids], [params], request)

        def body() -> dict:
            done = _with_forced(state, turn, samples, params) if turn.forced else samples
            choices = [chat_choice(state, req, turn, j, c) for j, c in enumerate(done)]
            return _response("chatcmpl", "chat.completion", state, [turn.ids], [done], choices)

        return JSONResponse(await run_in_threadpool(body))

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


def _install_error_handlers(app: FastAPI) -> None:
    """The OpenAI error shape on every path, FastAPI's own shapes never."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.url.path}: see /v1/models, /v1/completions, /v1/chat/completions"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        err = APIError(message, None, status=exc.status_code,
                       type="invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(err.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def request_validation(request: Request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        err = APIError(f"internal server error: {type(exc).__name__}: {exc}", None, status=500, type="server_error")
        return JSONResponse(err.body(), status_code=500)


# ---------------------------------------------------------------------- requests -> prompts
def _parse(model: type, body: bytes):
    try:
        req = model.model_validate_json(body or b"")
    except ValidationError as err:
        raise validation_error(err.errors(include_url=False)) from None
    if hasattr(req, "check"):
        req.check()
    return req


def _check_model(state: ServeState, name: str | None, optional: bool = False) -> None:
    if (name is None and optional) or name == state.model_name:
        return
    raise APIError(f"model {name!r} is not served here; this server serves {state.model_name!r}",
                   "model", status=404, code="model_not_found")


def _encode(state: ServeState, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text prompt, with the tokenizer's special tokens (e.g. bos) as
    ``encode(text)`` adds them."""
    state.limits.check_chars(len(text), param)  # before tokenizing
    state.limits.check_chars(len(text), param)  # before tokenizing
    try:
        return [int(t) for t in state.tokenizer.encode(text, add_special_tokens=add_special_tokens)]
    except ValueError as err:
        raise APIError(f"{param} cannot be tokenized: {err}", param) from None


def _check_ids(state: ServeState, ids: list[int], param: str, *, check_context: bool = True,
               allow_empty: bool = False, room: int = 1) -> list[int]:
    """``ids`` checked against the vocabulary and (``check_context``) the context, leaving
    ``room`` positions to generate into (0: scoring only)."""
    if not ids and not allow_empty:
        raise APIError(f"{param} is empty", param)
    vocab = state.engine.vocab_size
    if ids and not (min(ids) >= 0 and max(ids) < vocab):
        i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
        raise APIError(f"{param}: token id {t} at position {i} is outside the vocabulary [0, {vocab})", param)
    context = state.engine.max_positions
    if check_context and context is not None and len(ids) > context - room:
        why = " (room for one generated token)" if room == 1 else ""
        raise APIError(f"{param} has {len(ids)} tokens; the model's context is {context} tokens, so a prompt may "
                       f"have at most {context - room}{why}", param)
    return ids


def _completion_prompts(state: ServeState, req: CompletionRequest) -> list[list[int]]:
    prompts = req.prompts
    out = []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        ids = _encode(state, p, param) if isinstance(p, str) else p
        out.append(_check_ids(state, ids, param, room=0 if req.max_tokens == 0 else 1))
    return out


def chat_prompt(state: ServeState, req: ChatRequest) -> ChatTurn:
    """The hook where a chat request becomes prompt token ids (template, tools, token-exact
    history: :mod:`treerl.serve.chat`; runs in a worker thread)."""
    state.limits.check_chars(sum(len(m.content) if isinstance(m.content, str) else
                                 sum(len(str(p.get("text", ""))) for p in m.content or ()) for m in req.messages),
                             "messages")  # before tokenizing
    return state.chat.prompt(req)


def _sampling_params(state: ServeState, req: SamplingRequest, prompt_len: int) -> SamplingParams:
    """The request's settings for one prompt of ``prompt_len`` tokens."""
    state.limits.check_request(req.n, req.max_tokens)
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
    return SamplingParams(n=req.n, temperature=float(req.temperature), top_p=float(req.top_p),
                          top_k=max(0, req.top_k), min_p=float(req.min_p), max_new_tokens=int(max_tokens),
                          stop_token_ids=stops, stop_strings=list(req.stop_strings),
                          decode=state.tokenizer if req.stop_strings else None, seed=req.seed,
                          top_logprobs=min(req.top_logprobs_k, vocab))


# ---------------------------------------------------------------------- generation
def _generation_error(err: BaseException) -> APIError:
    status = 503 if "shutting down" in str(err) or "stopped" in str(err) else 500
    return APIError(f"generation failed: {type(err).__name__}: {err}", None, status=status, type="server_error")


# SamplingParams fields -> the request fields that set them
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "stop_strings": "stop", "top_logprobs": "logprobs"}


def _submit(state: ServeState, futures: list[Future], ids: list[int], params: SamplingParams, listener=None) -> None:
    """Submit one prompt (its future appended to ``futures``); settings the engine refuses
    (``ValueError`` naming the field) are a 400, and cancel what was already submitted."""
    try:
        futures.append(state.loop.submit(ids, params, listener=listener))
    except ValueError as err:
        _cancel(state, futures)
        words = str(err).split()
        field = words[0].strip("`'\":,") if words else ""
        param = _PARAM_NAMES.get(field, field) if field in {f.name for f in dataclasses.fields(SamplingParams)} else None
        raise APIError(str(err), param) from None


async def _run(state: ServeState, prompts: list[list[int]], params: list[SamplingParams],
               request: Request) -> list[list[Completion]]:
    """Submit each prompt; wait for all. A client that disconnects before they finish (or a
    cancelled handler) cancels its rows: they stop at the engine's next host sync and free
    their K/V; the answer (499) goes nowhere."""
    futures: list[Future] = []
    for ids, p in zip(prompts, params):
        _submit(state, futures, ids, p)
    results = asyncio.gather(*(_awaitable(f) for f in futures))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not results.done() and gone.exception() is None:
            _cancel(state, futures)
            results.cancel()
            raise APIError("the client disconnected before its completions finished", None, status=499,
                           code="client_disconnected")
        return list(await results)  # (a receive that failed: no disconnect seen, the results awaited)
    except asyncio.CancelledError:
        _cancel(state, futures)
        results.cancel()
        raise
    except APIError:
        raise
    except Exception as err:  # noqa: BLE001 - the client gets a JSON error, the server goes on
        _cancel(state, futures)
        raise _generation_error(err) from None
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client of ``request`` (whose body was read) has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _awaitable(f: Future) -> asyncio.Future:
    """An asyncio future with ``f``'s outcome; cancelling it leaves ``f`` to the engine loop
    (``asyncio.wrap_future`` would cancel ``f`` itself: :meth:`EngineLoop.cancel` would then
    see it done and leave its rows running)."""
    aloop = asyncio.get_running_loop()
    out = aloop.create_future()

    def copy(done: Future) -> None:
        if out.cancelled():
            return
        if done.exception() is not None:
            out.set_exception(done.exception())
        else:
            out.set_result(done.result())

    def on_done(done: Future) -> None:  # (the engine thread, or this one if already done)
        try:
            aloop.call_soon_threadsafe(copy, done)
        except RuntimeError:  # the event loop is closed: nobody waits any more
            pass

    f.add_done_callback(on_done)
    return out


def _cancel(state: ServeState, futures: list[Future]) -> None:
    for f in futures:
        if not f.done():
            state.loop.cancel(f)


# ---------------------------------------------------------------------- completions -> choices
def _tolist(x: Any) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _token_fields(ids: list[int], logprobs: list[float], versions: list[int]) -> dict:
    return {"token_ids": ids, "token_logprobs": logprobs, "token_versions": versions}


def _completion_token_fields(c: Completion) -> dict:
    return _token_fields(c.completion_ids.tolist(), c.logprobs.tolist(), c.versions.tolist())


def _top(x: Any) -> tuple[list[list[int]], list[list[float]]] | None:
    """Top logprobs as ``(ids [T, k], logprobs [T, k])`` lists, or None. ``x``: that pair
    (tensors or lists: ``Completion.top_logprobs``) or per token ``[(id, logprob)] x k``
    (``TokenDelta.top_logprobs``)."""
    if x is None:
        return None
    if isinstance(x, tuple) and len(x) == 2 and hasattr(x[0], "shape"):
        return _tolist(x[0]), _tolist(x[1])
    return [[int(a) for a, _ in row] for row in x], [[float(b) for _, b in row] for row in x]


def _piece(state: ServeState, t: int) -> str:
    return state.tokenizer.decode([t])


def completion_logprobs(state: ServeState, ids: list[int], lps: list[float | None],
                        top: tuple[list[list[int]], list[list[float]]] | None, k: int, offset: int = 0) -> dict:
    """The completions API's ``logprobs`` object for tokens ``ids`` (``lps``: their logprobs,
    None where there is none; ``top``: ``k`` alternatives per token, rows aligned with the
    tokens that have a logprob). Each ``top_logprobs`` dict holds the alternatives and the
    token itself."""
    pieces = [_piece(state, t) for t in ids]
    offsets = []
    for p in pieces:
        offsets.append(offset)
        offset += len(p)
    tops = None
    if k:
        tops, row = [], 0
        for t, p, lp in zip(ids, pieces, lps):
            if lp is None:
                tops.append(None)
                continue
            d = {_piece(state, a): float(b) for a, b in zip(top[0][row], top[1][row])} if top else {}
            d.setdefault(p, float(lp))
            tops.append(d)
            row += 1
    return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(state: ServeState, ids: list[int], lps: list[float],
                  top: tuple[list[list[int]], list[list[float]]] | None) -> dict:
    """The chat API's ``logprobs`` object (``content``: one entry per token)."""

    def entry(t: int, lp: float) -> dict:
        p = _piece(state, t)
        return {"token": p, "logprob": float(lp), "bytes": list(p.encode())}

    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        alts = [entry(a, b) for a, b in zip(top[0][i], top[1][i])] if top else []
        content.append(entry(t, lp) | {"top_logprobs": alts})
    return {"content": content}


def _text(state: ServeState, req: SamplingRequest, c: Completion) -> str:
    return completion_text(state.tokenizer, c.completion_ids.tolist(), c.stop,
                           skip_special_tokens=req.skip_special_tokens, include_stop_str=req.include_stop_str_in_output)


def _with_forced(state: ServeState, turn: ChatTurn, samples: list[Completion], params: SamplingParams) -> list[Completion]:
    """The samples of a forced tool call (``turn.forced``) with the forced opening as the
    first tokens of their completions, as the model was conditioned on them (the prompt is
    the conversation's; the next turn's prompt extends prompt + completion). Their logprobs
    are the model's at the request's temperature (:func:`~treerl.serve.scoring.score_forced`:
    one more forward of the prompt), their version the weights that scored them."""
    k = len(turn.forced)
    scores, version = score_forced(state.engine, turn.ids, turn.forced, params.temperature, params.top_logprobs)
    ids = torch.as_tensor(turn.forced, dtype=torch.int64)
    out = []
    for c in samples:
        top = c.top_logprobs
        if top is not None:
            top = (torch.cat([torch.as_tensor(scores.top_ids, dtype=top[0].dtype).reshape(k, -1), top[0]]),
                   torch.cat([torch.as_tensor(scores.top_logprobs, dtype=top[1].dtype).reshape(k, -1), top[1]]))
        out.append(dataclasses.replace(
            c, prompt_ids=torch.as_tensor(turn.ids, dtype=torch.int64), completion_ids=torch.cat([ids, c.completion_ids]),
            logprobs=torch.cat([torch.as_tensor(scores.logprobs, dtype=c.logprobs.dtype), c.logprobs]),
            versions=torch.cat([torch.full((k,), version, dtype=c.versions.dtype), c.versions]), top_logprobs=top))
    return out


def chat_choice(state: ServeState, req: ChatRequest, turn: ChatTurn, index: int, c: Completion) -> dict:
    """The hook where a completion becomes a chat choice (tool calls parsed, its tokens
    recorded for the next turn: :meth:`ChatRenderer.reply <treerl.serve.chat.ChatRenderer.reply>`)."""
    logprobs = None
    if req.logprobs:
        logprobs = chat_logprobs(state, c.completion_ids.tolist(), c.logprobs.tolist(),
                                 _top(getattr(c, "top_logprobs", None)))
    message, finish = state.chat.reply(turn, _text(state, req, c), c.finish_reason, c.completion_ids.tolist())
    return {"index": index, "message": message, "finish_reason": finish, "stop_reason": c.stop,
            "logprobs": logprobs} | _completion_token_fields(c)


def completion_choice(state: ServeState, req: CompletionRequest, index: int, prompt: str | list[int],
                      prompt_ids: list[int], c: Completion | None, scores: PromptScores | None) -> dict:
    """The hook where a completion (None: ``max_tokens=0``) becomes a completions choice;
    with ``echo`` the prompt (and, with ``logprobs``, its ``scores``) comes first."""
    ids = c.completion_ids.tolist() if c is not None else []
    lps = c.logprobs.tolist() if c is not None else []
    top = _top(getattr(c, "top_logprobs", None)) if c is not None else None
    text = _text(state, req, c) if c is not None else ""
    head = ""
    if req.echo:
        head = prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt_ids)
    logprobs = None
    if req.logprobs is not None:
        k = req.logprobs
        if req.echo:
            all_ids, all_lps = prompt_ids + ids, [None, *scores.logprobs, *lps]
            all_top = (scores.top_ids + (top[0] if top else [[]] * len(ids)),
                       scores.top_logprobs + (top[1] if top else [[]] * len(ids))) if k else None
            logprobs = completion_logprobs(state, all_ids, all_lps, all_top, k)
        else:
            logprobs = completion_logprobs(state, ids, lps, top, k)
    fields = _token_fields(ids, lps, c.versions.tolist() if c is not None else [])
    return {"index": index, "text": head + text, "logprobs": logprobs,
            "finish_reason": c.finish_reason if c is not None else "length",
            "stop_reason": c.stop if c is not None else None} | fields


def _completion_body(state: ServeState, req: CompletionRequest, prompts: list[list[int]],
                     results: list[list[Completion]]) -> dict:
    scores = [score_prompt(state.engine, ids, req.logprobs or 0) if req.echo and req.logprobs is not None else None
              for ids in prompts]
    choices = []
    for i, (p, ids, samples) in enumerate(zip(req.prompts, prompts, results)):
        for j in range(req.n):
            c = samples[j] if samples else None
            choices.append(completion_choice(state, req, i * req.n + j, p, ids, c, scores[i]))
    return _response("cmpl", "text_completion", state, prompts, results, choices)


def _usage(prompts: list[list[int]], generated: int) -> dict:
    p = sum(len(ids) for ids in prompts)
    return {"prompt_tokens": p, "completion_tokens": generated, "total_tokens": p + generated}


def _prompt_ids_field(prompts: list[list[int]]) -> list:
    return prompts[0] if len(prompts) == 1 else prompts


def _response(prefix: str, obj: str, state: ServeState, prompts: list[list[int]], results: list[list[Completion]],
              choices: list[dict]) -> dict:
    samples = [c for r in results for c in r]
    versions = [c.min_version for c in samples if len(c)]
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": state.model_name, "choices": choices, "usage": _usage(prompts, sum(len(c) for c in samples)),
            "prompt_token_ids": _prompt_ids_field(prompts),
            "weight_version": min(versions) if versions else state.engine.version}


# ---------------------------------------------------------------------- streaming
@dataclass
class _StreamChoice:
    text: TextStream
    sent_tokens: int = 0


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _Stream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends (finished, the client
    gone, or cancelled before the first chunk)."""

    def __init__(self, content, on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _stream(state: ServeState, req: SamplingRequest, prompts: list[list[int]], *, chat: bool,
            turn: ChatTurn | None = None) -> StreamingResponse:
    """An SSE response: chunks as tokens reach the host, ``data: [DONE]`` last. The prompts
    are submitted before the response starts (a refused setting is still a 400)."""
    params = [_sampling_params(state, req, len(ids)) for ids in prompts]
    aloop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def post(item) -> None:  # from the engine thread
        try:
            aloop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass

    futures: list[Future] = []
    for i, (ids, p) in enumerate(zip(prompts, params)):
        _submit(state, futures, ids, p, lambda delta, i=i: post((i, delta)))
        futures[-1].add_done_callback(lambda f, i=i: post((i, None)))
    return _Stream(_chunks(state, req, prompts, futures, queue, chat, turn), lambda: _cancel(state, futures))


async def _chunks(state: ServeState, req: SamplingRequest, prompts: list[list[int]], futures: list[Future],
                  queue: asyncio.Queue, chat: bool, turn: ChatTurn | None) -> AsyncIterator[str]:
    """The chunks. A chat request with tools streams its tokens but holds its text: the whole
    reply (content and parsed ``tool_calls``) comes in the last chunk of each choice."""
    n, k = req.n, req.top_logprobs_k
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    choices = [_StreamChoice(TextStream(state.tokenizer, req.stop_strings, skip_special_tokens=req.skip_special_tokens,
                                        include_stop_str=req.include_stop_str_in_output))
               for _ in range(len(prompts) * n)]
    first = [True]
    hold = chat and turn is not None and bool(turn.tools)

    def chunk(choice_list: list[dict], **extra) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": choice_list}
        if req.include_usage:
            body["usage"] = None
        if first[0]:
            body["prompt_token_ids"] = _prompt_ids_field(prompts)
            first[0] = False
        return _sse(body | extra)

    def choice(index: int, text: str, ids: list, lps: list, versions: list, top, finish=None, stop=None,
               tool_calls=None) -> dict:
        if chat:
            delta = {"content": text} if text else {}
            if tool_calls:
                delta["tool_calls"] = [{"index": i} | call for i, call in enumerate(tool_calls)]
            out = {"index": index, "delta": delta,
                   "logprobs": chat_logprobs(state, ids, lps, top) if req.logprobs and ids else None}
        else:
            out = {"index": index, "text": text,
                   "logprobs": completion_logprobs(state, ids, lps, top, k) if req.logprobs is not None and ids
                   else None}
        out |= {"finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = stop
        return out | _token_fields(ids, lps, versions)

    if chat:  # the role first, as OpenAI does
        yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for j in range(len(choices))])
    pending, generated = len(futures), 0
    while pending:
        i, delta = await queue.get()
        if delta is not None:
            index = i * n + delta.branch[0]
            sc = choices[index]
            ids = _tolist(delta.token_ids)
            text = "" if hold else sc.text.push(ids)
            sc.sent_tokens += len(ids)
            yield chunk([choice(index, text, ids, _tolist(delta.logprobs), _tolist(delta.versions),
                                _top(delta.top_logprobs))])
            continue
        pending -= 1
        f = futures[i]
        if f.cancelled() or f.exception() is not None:
            err = _generation_error(f.exception() if not f.cancelled() else RuntimeError("cancelled"))
            yield _sse(err.body())
            break
        for j, c in enumerate(f.result()):  # what no delta brought: the rest of the text and tokens
            index, sc = i * n + j, choices[i * n + j]
            rest = slice(sc.sent_tokens, None)
            top = _top(getattr(c, "top_logprobs", None))
            top = (top[0][rest], top[1][rest]) if top else None
            final = await run_in_threadpool(_text, state, req, c)
            finish, calls = c.finish_reason, None
            if chat:  # tool calls parsed, the tokens recorded for the next turn
                message, finish = await run_in_threadpool(state.chat.reply, turn, final, c.finish_reason,
                                                          c.completion_ids.tolist())
                calls = message.get("tool_calls")
                text = (message.get("content") or "") if hold else sc.text.finish(final)
            else:
                text = sc.text.finish(final)
            yield chunk([choice(index, text, c.completion_ids[rest].tolist(), c.logprobs[rest].tolist(),
                                c.versions[rest].tolist(), top, finish, c.stop, calls)])
            generated += len(c)
    else:
        if req.include_usage:
            yield chunk([], usage=_usage(prompts, generated))
    yield "data: [DONE]\n\n"
