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
prompt scoring and the decoding of long replies run in worker threads; work of at most
:data:`~treerl.serve.requests.INLINE_TOKENS` tokens (token-id prompts checked, a short reply
decoded and its body built) runs on the event loop, cheaper than a thread's hop. A streaming
client that disconnects has its rows cancelled (:meth:`EngineLoop.cancel`).

The routes are here; the rest in small modules: the shared state (:mod:`.state`), requests
checked and submitted (:mod:`.requests`: the hook :func:`~treerl.serve.requests.chat_prompt`
turns a chat request into prompt ids), completions turned into choices (:mod:`.choices`: the
hooks :func:`~treerl.serve.choices.chat_choice` and
:func:`~treerl.serve.choices.completion_choice`) and streamed responses (:mod:`.streaming`).
"""

from __future__ import annotations

import dataclasses
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from .choices import chat_choice, completion_body, response_body, with_forced
from .metrics import CONTENT_TYPE, ServeMetrics
from .protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                       WeightsRequest, validation_error)
from .requests import (INLINE_PROMPT_IDS, chat_prompt, check_ids, check_model, completion_prompts, encode,
                       internal_error, off_loop, parse_request, run_prompts, sampling_params)
from .state import ServeState
from .streaming import stream_response

__all__ = ["ServeState", "create_app"]


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


class _InternalErrors:
    """ASGI middleware: an exception that no handler took, raised before the response started,
    is answered here with the OpenAI-shaped 500 (its traceback logged) and the connection stays
    open. (Starlette's outermost middleware sends the same answer and then raises again, and
    uvicorn closes the connection of an application that raised: a client that sent its next
    request on the kept-alive connection got a reset.) After the response started, the
    exception goes on: the answer is cut short and the connection closed."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watching_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        except Exception as exc:  # noqa: BLE001 - the client gets a JSON error, the server goes on
            if started:
                raise
            logging.getLogger("uvicorn.error").error("treerl serve: internal error on %s", scope.get("path"),
                                                     exc_info=exc)
            await JSONResponse(internal_error(exc).body(), status_code=500)(scope, receive, send)


def create_app(state: ServeState) -> FastAPI:
    app = FastAPI(title="treerl serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.treerl = state
    _install_error_handlers(app)
    app.add_middleware(_InternalErrors)
    app.add_middleware(_CountResponses, metrics=state.metrics)  # (outside: counts the 500s too)

    @app.get("/health")
    async def health():
        s = state.loop.stats
        return {"status": "ok", "model": state.model_name, "weight_version": state.engine.version,
                "busy_requests": state.loop.busy, "stats": dataclasses.asdict(s),
                "engine": dataclasses.asdict(state.loop.engine_stats()), "chat": state.chat.stats(),
                "host": state.loop.host_stats()}

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
        req = parse_request(TokenizeRequest, await request.body())
        check_model(state, req.model, optional=True)

        def work() -> dict:
            if req.messages is not None:
                chat = ChatRequest.model_construct(  # (tool_choice none: the same prompt as auto, no parser needed)
                    messages=req.messages, tools=req.tools, tool_choice="none" if req.tools else None,
                    chat_template_kwargs=req.chat_template_kwargs)
                ids = chat_prompt(state, chat).ids
            else:
                ids = encode(state, req.prompt, "prompt", req.add_special_tokens)
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
        req = parse_request(DetokenizeRequest, await request.body())
        check_model(state, req.model, optional=True)
        check_ids(state, req.tokens, "tokens", check_context=False, allow_empty=True)
        return {"prompt": await run_in_threadpool(state.tokenizer.decode, req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_request(CompletionRequest, await request.body())
        check_model(state, req.model)
        # token ids are only checked (vocabulary, context: ~20 ns an id), text is tokenized in a worker
        small = all(not isinstance(p, str) for p in req.prompts) and sum(map(len, req.prompts)) <= INLINE_PROMPT_IDS
        prompts = await off_loop(0 if small else None, completion_prompts, state, req)
        if req.stream:
            return stream_response(state, req, prompts, chat=False)
        params = [sampling_params(state, req, len(ids)) for ids in prompts] if req.max_tokens != 0 else None
        results = await run_prompts(state, prompts, params, request) if params is not None else [[] for _ in prompts]
        # (a JSONResponse: FastAPI's encoder would walk every token id and logprob in Python, on the event loop)
        small = not req.echo and req.logprobs is None  # (echo scores the prompt; logprobs: a piece per token)
        return await off_loop(_tokens(results) if small else None,
                              lambda: JSONResponse(completion_body(state, req, prompts, results)))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_request(ChatRequest, await request.body())
        check_model(state, req.model)
        turn = await run_in_threadpool(chat_prompt, state, req)
        ids = check_ids(state, turn.ids + turn.forced, "messages")
        if turn.call_ends:  # parallel_tool_calls=false: the generation stops at the end of the first call
            req.stop = [*req.stop_strings, *(e for e in turn.call_ends if e not in req.stop_strings)]
        if req.stream:
            return stream_response(state, req, [ids], chat=True, turn=turn)
        params = sampling_params(state, req, len(ids))
        [samples] = await run_prompts(state, [ids], [params], request)

        def body() -> JSONResponse:
            done = with_forced(state, turn, samples, params) if turn.forced else samples
            choices = [chat_choice(state, req, turn, j, c) for j, c in enumerate(done)]
            return JSONResponse(response_body("chatcmpl", "chat.completion", state, [turn.ids], [done], choices))

        small = not turn.forced and not req.logprobs  # (a forced call is scored: one forward)
        return await off_loop(_tokens([samples]) if small else None, body)

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request):
        req = parse_request(WeightsRequest, await request.body())
        if state.load_weights is None:
            raise APIError("this server does not load weights", "model_path", status=403)
        try:
            version = await run_in_threadpool(state.load_weights, req.model_path, req.version)
        except (OSError, ValueError, KeyError) as err:
            raise APIError(f"cannot load weights from {req.model_path}: {err}", "model_path") from None
        return {"success": True, "weight_version": version, "message": f"loaded {req.model_path}"}

    return app


def _tokens(results) -> int:
    """Generated tokens of ``results`` (per prompt, its completions)."""
    return sum(len(c) for r in results for c in r)


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

    @app.exception_handler(Exception)  # (what _InternalErrors does not see: an error in a middleware outside it)
    async def internal(request: Request, exc: Exception):
        return JSONResponse(internal_error(exc).body(), status_code=500)
