"""Streamed responses (server-sent events): chunks as tokens reach the host, the same
per-choice fields as a whole response, ``data: [DONE]`` last; a client that disconnects
has its rows cancelled."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from .chat import ChatTurn
from .choices import (chat_logprobs, choice_text, completion_logprobs, echo_head, forced_scores, prompt_ids_field,
                      token_fields, tolist, top_lists, usage, with_forced)
from .detok import TextStream
from .handoff import handoff
from .protocol import SamplingRequest
from .requests import cancel, generation_error, internal_error, off_loop, sampling_params, submit
from .state import ServeState
from .tools import ContentStream


@dataclass
class _StreamChoice:
    text: TextStream
    content: ContentStream | None = None  # (a chat request with tools: the content that is not a call)
    sent_tokens: int = 0
    text_offset: int = 0  # (completions' logprobs: the pieces' length so far, an echoed prompt's included)


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


def stream_response(state: ServeState, req: SamplingRequest, prompts: list[list[int]], *, chat: bool,
            turn: ChatTurn | None = None) -> StreamingResponse:
    """An SSE response: chunks as tokens reach the host, ``data: [DONE]`` last. The prompts
    are submitted before the response starts (a refused setting is still a 400)."""
    # (echo with max_tokens=0: the prompts scored and echoed, nothing generated)
    params = [sampling_params(state, req, len(ids)) for ids in prompts] if req.max_tokens != 0 else []
    to_loop = handoff()  # (the deltas of one engine sync share one wake-up of the event loop)
    queue: asyncio.Queue = asyncio.Queue()

    def post(item) -> None:  # from the engine thread
        to_loop.post(queue.put_nowait, item)  # (dropped if the event loop is closed: nobody listens any more)

    futures: list[Future] = []
    for i, (ids, p) in enumerate(zip(prompts, params)):
        submit(state, futures, ids, p, lambda delta, i=i: post((i, delta)))
        futures[-1].add_done_callback(lambda f, i=i: post((i, None)))
    return _Stream(_chunks(state, req, prompts, params, futures, queue, chat, turn), lambda: cancel(state, futures))


async def _chunks(*args) -> AsyncIterator[str]:
    """:func:`_chunk_body`'s chunks; an exception after the stream began ends it with an error event (OpenAI's
    error shape; the traceback logged) and ``data: [DONE]``, not with a connection cut short."""
    try:
        async for piece in _chunk_body(*args):
            yield piece
    except Exception as exc:  # noqa: BLE001 - the client gets the error, the server goes on
        logging.getLogger("uvicorn.error").error("treerl serve: internal error in a stream", exc_info=exc)
        yield _sse(internal_error(exc).body())
        yield "data: [DONE]\n\n"


async def _chunk_body(state: ServeState, req: SamplingRequest, prompts: list[list[int]], params: list,
                      futures: list[Future], queue: asyncio.Queue, chat: bool,
                      turn: ChatTurn | None) -> AsyncIterator[str]:
    """The chunks. A chat request with tools streams its tokens, and its text up to where a call
    may open (:class:`~treerl.serve.tools.ContentStream`); the parsed ``tool_calls`` (or the held
    text, when it holds no call that parses) come in the last chunk of each choice. A forced call's
    opening (``tool_choice`` required or a named function) is the first chunk's tokens, scored as
    the reply answered whole scores them."""
    n, k = req.n, req.top_logprobs_k
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    tools = chat and turn is not None and bool(turn.tools)
    choices = [_StreamChoice(TextStream(state.tokenizer, req.stop_strings, skip_special_tokens=req.skip_special_tokens,
                                        include_stop_str=req.include_stop_str_in_output),
                             ContentStream(state.chat.tool_format, turn.tools, turn.tool_choice) if tools else None)
               for _ in range(len(prompts) * n)]
    first = [True]
    forced = turn.forced if chat and turn is not None else []
    shown = [turn.ids] if forced else prompts  # (the prompt as reported: the conversation's, without the opening)

    sent = [0]  # tokens in the chunks so far, every choice (a forced opening included)

    def chunk(choice_list: list[dict], **extra) -> str:
        body = {"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": choice_list}
        if req.include_usage:  # (continuous: the usage so far in every chunk, as vLLM; else in the last only)
            sent[0] += sum(len(c.get("token_ids", ())) for c in choice_list)
            body["usage"] = usage(shown, sent[0]) if req.continuous_usage else None
        if first[0]:
            body["prompt_token_ids"] = prompt_ids_field(shown)
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
            logprobs = None
            if req.logprobs is not None and ids:  # (text_offset: from the start of the choice's text, as whole)
                logprobs = completion_logprobs(state, ids, lps, top, k, choices[index].text_offset)
                choices[index].text_offset += sum(map(len, logprobs["tokens"]))
            out = {"index": index, "text": text, "logprobs": logprobs}
        out |= {"finish_reason": finish}
        if finish is not None:
            out["stop_reason"] = stop
        return out | token_fields(ids, lps, versions)

    if chat:  # the role first, as OpenAI does
        yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for j in range(len(choices))])
    scored = None
    if forced:  # (one forward of the prompt, while the rows decode)
        scored = await off_loop(None, forced_scores, state, turn, params[0])
        scores, version = scored
        top = (scores.top_ids, scores.top_logprobs) if params[0].top_logprobs else None
        yield chunk([choice(j, "", list(forced), list(scores.logprobs), [version] * len(forced), top)
                     for j in range(len(choices))])
    if not chat and req.echo:  # each choice's prompt first (with logprobs: the prompt's, one forward a prompt)
        for i, ids in enumerate(prompts):
            text, logprobs = await off_loop(None, echo_head, state, req, req.prompts[i], ids)
            for j in range(n):
                choices[i * n + j].text_offset = sum(map(len, logprobs["tokens"])) if logprobs else 0
            yield chunk([{"index": i * n + j, "text": text, "logprobs": logprobs, "finish_reason": None}
                         | token_fields([], [], []) for j in range(n)])
        if not futures:  # max_tokens=0: the prompts only
            yield chunk([{"index": j, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
                         | token_fields([], [], []) for j in range(len(choices))])
    pending, generated = len(futures), 0
    while pending:
        i, delta = await queue.get()
        if delta is not None:
            index = i * n + delta.branch[0]
            sc = choices[index]
            ids = tolist(delta.token_ids)
            text = sc.text.push(ids)
            if sc.content is not None:
                text = sc.content.push(text)
            sc.sent_tokens += len(ids)
            yield chunk([choice(index, text, ids, tolist(delta.logprobs), tolist(delta.versions),
                                top_lists(delta.top_logprobs))])
            continue
        pending -= 1
        f = futures[i]
        if f.cancelled() or f.exception() is not None:
            err = generation_error(f.exception() if not f.cancelled() else RuntimeError("cancelled"))
            yield _sse(err.body())
            break
        for j, c in enumerate(f.result()):  # what no delta brought: the rest of the text and tokens
            index, sc = i * n + j, choices[i * n + j]
            rest = slice(sc.sent_tokens, None)
            top = top_lists(getattr(c, "top_logprobs", None))
            top = (top[0][rest], top[1][rest]) if top else None
            whole = c  # (a forced call's: with its opening, as the model was conditioned on it)
            if forced:
                [whole] = await off_loop(None, with_forced, state, turn, [c], params[i], scored)
            final = await off_loop(len(whole), choice_text, state, req, whole)
            finish, calls = c.finish_reason, None
            if chat:  # tool calls parsed, the tokens recorded for the next turn
                message, finish = await off_loop(len(whole), state.chat.reply, turn, final, whole.finish_reason,
                                                 whole.completion_ids.tolist(), whole.stop)
                calls = message.get("tool_calls")
            # (with tools: the content not sent yet, what the text stream held back included)
            text = sc.content.finish(message) if sc.content is not None else sc.text.finish(final)
            yield chunk([choice(index, text, c.completion_ids.tolist()[rest], c.logprobs.tolist()[rest],
                                c.versions.tolist()[rest], top, finish, c.stop, calls)])  # (lists: no torch op)
            generated += len(whole)
    else:
        if req.include_usage:
            yield chunk([], usage=usage(shown, generated))
    yield "data: [DONE]\n\n"
