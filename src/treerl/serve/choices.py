"""Completions turned into the API's choices and response bodies: the OpenAI fields plus
treerl's per-token ids, logprobs and weight versions. :func:`chat_choice` and
:func:`completion_choice` are the hooks where a completion becomes a choice."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import torch

from ..rollout import Completion, SamplingParams
from .chat import ChatTurn
from .detok import completion_text
from .protocol import ChatRequest, CompletionRequest, SamplingRequest
from .scoring import PromptScores, score_forced, score_prompt
from .state import ServeState


def tolist(x: Any) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def token_fields(ids: list[int], logprobs: list[float], versions: list[int]) -> dict:
    return {"token_ids": ids, "token_logprobs": logprobs, "token_versions": versions}


def _completion_token_fields(c: Completion) -> dict:
    return token_fields(c.completion_ids.tolist(), c.logprobs.tolist(), c.versions.tolist())


def top_lists(x: Any) -> tuple[list[list[int]], list[list[float]]] | None:
    """Top logprobs as ``(ids [T, k], logprobs [T, k])`` lists, or None. ``x``: that pair
    (tensors or lists: ``Completion.top_logprobs``) or per token ``[(id, logprob)] x k``
    (``TokenDelta.top_logprobs``)."""
    if x is None:
        return None
    if isinstance(x, tuple) and len(x) == 2 and hasattr(x[0], "shape"):
        return tolist(x[0]), tolist(x[1])
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


def choice_text(state: ServeState, req: SamplingRequest, c: Completion) -> str:
    return completion_text(state.tokenizer, c.completion_ids.tolist(), c.stop,
                           skip_special_tokens=req.skip_special_tokens, include_stop_str=req.include_stop_str_in_output)


def forced_scores(state: ServeState, turn: ChatTurn, params: SamplingParams) -> tuple[PromptScores, int]:
    """The behaviour logprobs of a forced tool call's opening (``turn.forced``) at the
    request's temperature, and the weight version that scored them
    (:func:`~treerl.serve.scoring.score_forced`: one more forward of the prompt)."""
    return score_forced(state.engine, turn.ids, turn.forced, params.temperature, params.top_logprobs)


def with_forced(state: ServeState, turn: ChatTurn, samples: list[Completion], params: SamplingParams,
                scored: tuple[PromptScores, int] | None = None) -> list[Completion]:
    """The samples of a forced tool call (``turn.forced``) with the forced opening as the
    first tokens of their completions, as the model was conditioned on them (the prompt is
    the conversation's; the next turn's prompt extends prompt + completion). Their logprobs
    are the model's at the request's temperature (``scored``, or :func:`forced_scores`), their
    version the weights that scored them."""
    k = len(turn.forced)
    scores, version = scored if scored is not None else forced_scores(state, turn, params)
    ids = torch.as_tensor(turn.forced, dtype=torch.int64)
    out = []
    for c in samples:
        top = c.top_logprobs
        if top is not None:
            top = (torch.cat([torch.as_tensor(scores.top_ids, dtype=top[0].dtype).reshape(k, -1), top[0]]),
                   torch.cat([torch.as_tensor(scores.top_logprobs, dtype=top[1].dtype).reshape(k, -1), top[1]]))
        out.append(dataclasses.replace(
            c, prompt_ids=torch.as_tensor(turn.ids, dtype=torch.int64),
            completion_ids=torch.cat([ids, c.completion_ids]),
            logprobs=torch.cat([torch.as_tensor(scores.logprobs, dtype=c.logprobs.dtype), c.logprobs]),
            versions=torch.cat([torch.full((k,), version, dtype=c.versions.dtype), c.versions]), top_logprobs=top))
    return out


def chat_choice(state: ServeState, req: ChatRequest, turn: ChatTurn, index: int, c: Completion) -> dict:
    """The hook where a completion becomes a chat choice (tool calls parsed, its tokens
    recorded for the next turn: :meth:`ChatRenderer.reply <treerl.serve.chat.ChatRenderer.reply>`)."""
    logprobs = None
    if req.logprobs:
        logprobs = chat_logprobs(state, c.completion_ids.tolist(), c.logprobs.tolist(),
                                 top_lists(getattr(c, "top_logprobs", None)))
    message, finish = state.chat.reply(turn, choice_text(state, req, c), c.finish_reason, c.completion_ids.tolist(),
                                       c.stop)
    return {"index": index, "message": message, "finish_reason": finish, "stop_reason": c.stop,
            "logprobs": logprobs} | _completion_token_fields(c)


def _echo_text(state: ServeState, prompt: str | list[int], prompt_ids: list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt_ids)


def echo_head(state: ServeState, req: CompletionRequest, prompt: str | list[int],
              prompt_ids: list[int]) -> tuple[str, dict | None]:
    """A streamed choice's echo: the prompt's text and, with ``logprobs``, its logprobs object
    (its first token has none; :func:`~treerl.serve.scoring.score_prompt`)."""
    text = _echo_text(state, prompt, prompt_ids)
    if req.logprobs is None:
        return text, None
    scores = score_prompt(state.engine, prompt_ids, req.logprobs)
    top = (scores.top_ids, scores.top_logprobs) if req.logprobs else None
    return text, completion_logprobs(state, prompt_ids, [None, *scores.logprobs], top, req.logprobs)


def completion_choice(state: ServeState, req: CompletionRequest, index: int, prompt: str | list[int],
                      prompt_ids: list[int], c: Completion | None, scores: PromptScores | None) -> dict:
    """The hook where a completion (None: ``max_tokens=0``) becomes a completions choice;
    with ``echo`` the prompt (and, with ``logprobs``, its ``scores``) comes first."""
    ids = c.completion_ids.tolist() if c is not None else []
    lps = c.logprobs.tolist() if c is not None else []
    top = top_lists(getattr(c, "top_logprobs", None)) if c is not None else None
    text = choice_text(state, req, c) if c is not None else ""
    head = _echo_text(state, prompt, prompt_ids) if req.echo else ""
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
    fields = token_fields(ids, lps, c.versions.tolist() if c is not None else [])
    return {"index": index, "text": head + text, "logprobs": logprobs,
            "finish_reason": c.finish_reason if c is not None else "length",
            "stop_reason": c.stop if c is not None else None} | fields


def completion_body(state: ServeState, req: CompletionRequest, prompts: list[list[int]],
                     results: list[list[Completion]]) -> dict:
    scores = [score_prompt(state.engine, ids, req.logprobs or 0) if req.echo and req.logprobs is not None else None
              for ids in prompts]
    choices = []
    for i, (p, ids, samples) in enumerate(zip(req.prompts, prompts, results)):
        for j in range(req.n):
            c = samples[j] if samples else None
            choices.append(completion_choice(state, req, i * req.n + j, p, ids, c, scores[i]))
    return response_body("cmpl", "text_completion", state, prompts, results, choices)


def usage(prompts: list[list[int]], generated: int) -> dict:
    p = sum(len(ids) for ids in prompts)
    return {"prompt_tokens": p, "completion_tokens": generated, "total_tokens": p + generated}


def prompt_ids_field(prompts: list[list[int]]) -> list:
    return prompts[0] if len(prompts) == 1 else prompts


def response_body(prefix: str, obj: str, state: ServeState, prompts: list[list[int]], results: list[list[Completion]],
              choices: list[dict]) -> dict:
    samples = [c for r in results for c in r]
    # (min of the lists, not Completion.min_version: a torch operation releases the GIL, and on
    # the event loop each release hands it back and forth with the engine thread)
    versions = [min(c.versions.tolist()) for c in samples if len(c)]
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": state.model_name, "choices": choices, "usage": usage(prompts, sum(len(c) for c in samples)),
            "prompt_token_ids": prompt_ids_field(prompts),
            "weight_version": min(versions) if versions else state.engine.version}
