"""A request of the HTTP API checked and turned into prompt ids and sampling settings
(one :class:`~treerl.serve.protocol.APIError` line naming the field otherwise), and the
prompts submitted to the engine loop. :func:`chat_prompt` is the hook where a chat request
becomes prompt ids."""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import Future

from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from ..rollout import Completion, SamplingParams
from .chat import ChatTurn
from .handoff import handoff
from .protocol import APIError, ChatRequest, CompletionRequest, SamplingRequest, validation_error
from .state import ServeState


def parse_request(model: type, body: bytes):
    try:
        req = model.model_validate_json(body or b"")
    except ValidationError as err:
        raise validation_error(err.errors(include_url=False)) from None
    if hasattr(req, "check"):
        req.check()
    return req


def check_model(state: ServeState, name: str | None, optional: bool = False) -> None:
    if (name is None and optional) or name == state.model_name:
        return
    raise APIError(f"model {name!r} is not served here; this server serves {state.model_name!r}",
                   "model", status=404, code="model_not_found")


def encode(state: ServeState, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a text prompt, with the tokenizer's special tokens (e.g. bos) as
    ``encode(text)`` adds them."""
    state.limits.check_chars(len(text), param)  # before tokenizing
    try:
        return [int(t) for t in state.tokenizer.encode(text, add_special_tokens=add_special_tokens)]
    except ValueError as err:
        raise APIError(f"{param} cannot be tokenized: {err}", param) from None


def check_ids(state: ServeState, ids: list[int], param: str, *, check_context: bool = True,
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


def completion_prompts(state: ServeState, req: CompletionRequest) -> list[list[int]]:
    prompts = req.prompts
    out = []
    for i, p in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        ids = encode(state, p, param) if isinstance(p, str) else p
        out.append(check_ids(state, ids, param, room=0 if req.max_tokens == 0 else 1))
    return out


def chat_prompt(state: ServeState, req: ChatRequest) -> ChatTurn:
    """The hook where a chat request becomes prompt token ids (template, tools, token-exact
    history: :mod:`treerl.serve.chat`; runs in a worker thread)."""
    state.limits.check_chars(sum(len(m.content) if isinstance(m.content, str) else
                                 sum(len(str(p.get("text", ""))) for p in m.content or ()) for m in req.messages),
                             "messages")  # before tokenizing
    return state.chat.prompt(req)


def sampling_params(state: ServeState, req: SamplingRequest, prompt_len: int) -> SamplingParams:
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


# ---------------------------------------------------------------------- off the event loop
#: Work of at most this many tokens (checking token-id prompts, decoding a reply and building
#: its body) runs on the event loop: a worker thread's hop (:func:`run_in_threadpool`: about
#: 0.1 ms of CPU and four thread wake-ups, each a GIL handoff with the engine thread) costs
#: more than the work. Tokenizing text, templating, scoring and larger replies run in a worker.
INLINE_TOKENS = 2048
#: Token-id prompts of at most this many ids in all are checked on the event loop (about 1.5 ms).
INLINE_PROMPT_IDS = 1 << 16


async def off_loop(tokens: int | None, fn, *args):
    """``fn(*args)``, on the event loop when its work is ``tokens`` tokens or fewer, else in a
    worker thread (None: always in a worker thread)."""
    if tokens is not None and tokens <= INLINE_TOKENS:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


# ---------------------------------------------------------------------- generation
def internal_error(exc: BaseException) -> APIError:
    return APIError(f"internal server error: {type(exc).__name__}: {exc}", None, status=500, type="server_error")


def generation_error(err: BaseException) -> APIError:
    status = 503 if "shutting down" in str(err) or "stopped" in str(err) else 500
    return APIError(f"generation failed: {type(err).__name__}: {err}", None, status=status, type="server_error")


# SamplingParams fields -> the request fields that set them
_PARAM_NAMES = {"max_new_tokens": "max_tokens", "stop_strings": "stop", "top_logprobs": "logprobs"}


def submit(state: ServeState, futures: list[Future], ids: list[int], params: SamplingParams, listener=None) -> None:
    """Submit one prompt (its future appended to ``futures``); settings the engine refuses
    (``ValueError`` naming the field) are a 400, and cancel what was already submitted."""
    try:
        futures.append(state.loop.submit(ids, params, listener=listener))
    except ValueError as err:
        cancel(state, futures)
        words = str(err).split()
        field = words[0].strip("`'\":,") if words else ""
        param = _PARAM_NAMES.get(field, field) if field in {f.name for f in dataclasses.fields(SamplingParams)} else None
        raise APIError(str(err), param) from None


async def run_prompts(state: ServeState, prompts: list[list[int]], params: list[SamplingParams],
                      request: Request) -> list[list[Completion]]:
    """Submit each prompt; wait for all. A client that disconnects before they finish (or a
    cancelled handler) cancels its rows: they stop at the engine's next host sync and free
    their K/V; the answer (499) goes nowhere."""
    futures: list[Future] = []
    for ids, p in zip(prompts, params):
        submit(state, futures, ids, p)
    waits = [_awaitable(f) for f in futures]
    one = len(waits) == 1  # (most requests: no gathering future)
    results = waits[0] if one else asyncio.gather(*waits)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not results.done() and gone.exception() is None:
            cancel(state, futures)
            results.cancel()
            raise APIError("the client disconnected before its completions finished", None, status=499,
                           code="client_disconnected")
        done = await results  # (a receive that failed: no disconnect seen, the results awaited)
        return [done] if one else list(done)
    except asyncio.CancelledError:
        cancel(state, futures)
        results.cancel()
        raise
    except APIError:
        raise
    except Exception as err:  # noqa: BLE001 - the client gets a JSON error, the server goes on
        cancel(state, futures)
        raise generation_error(err) from None
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    """Returns once the client of ``request`` (whose body was read) has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _awaitable(f: Future) -> asyncio.Future:
    """An asyncio future with ``f``'s outcome; cancelling it leaves ``f`` to the engine loop
    (``asyncio.wrap_future`` would cancel ``f`` itself: :meth:`EngineLoop.cancel` would then
    see it done and leave its rows running). The outcome reaches the event loop through its
    :class:`~treerl.serve.handoff.Handoff` (the requests that finish at one engine sync share
    one wake-up)."""
    aloop = asyncio.get_running_loop()
    out = aloop.create_future()
    to_loop = handoff(aloop)

    def copy(done: Future) -> None:
        if out.cancelled():
            return
        if done.exception() is not None:
            out.set_exception(done.exception())
        else:
            out.set_result(done.result())

    def on_done(done: Future) -> None:  # (the engine thread, or this one if already done)
        to_loop.post(copy, done)  # (dropped if the event loop is closed: nobody waits any more)

    f.add_done_callback(on_done)
    return out


def cancel(state: ServeState, futures: list[Future]) -> None:
    for f in futures:
        if not f.done():
            state.loop.cancel(f)
