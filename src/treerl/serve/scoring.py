"""Prompt logprobs (``echo`` with ``logprobs``): one no-grad forward of the prompt.

The forward runs in the caller's thread under the engine's device lock (a running stream
pauses between decode steps while it runs) with an explicit additive causal mask, so it
computes the same attention whichever attention mode the model is in (the rollout
engine's, while a stream runs, or its own). Logprobs are of the model's distribution
(temperature 1, no truncation), as vLLM's ``prompt_logprobs``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PromptScores:
    """``logprobs[i]``: log p(prompt[i] | prompt[:i]) for ``i >= 1`` (``[P - 1]``; the first
    token has none); ``top_ids`` / ``top_logprobs``: the ``k`` most likely tokens at each of
    those positions (``[P - 1, k]``)."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def _logits(engine, ids: list[int], last: int) -> torch.Tensor:
    """The logits predicting the last ``last`` tokens of ``ids`` ``[last, V]`` (the engine's
    logit dtype), from one forward (the caller holds the device lock)."""
    model = engine.model
    dtype = next(model.parameters()).dtype
    P = len(ids)
    x = torch.as_tensor([ids], device=engine.device)
    causal = torch.ones(P, P, dtype=torch.bool, device=engine.device).tril()
    mask = torch.zeros(P, P, dtype=dtype, device=engine.device).masked_fill(~causal, torch.finfo(dtype).min)
    out = model(input_ids=x, position_ids=torch.arange(P, device=engine.device)[None],
                attention_mask=mask[None, None], use_cache=False, logits_to_keep=last + 1)
    return out.logits[0, :-1].to(engine.logit_dtype)


def _scores(logp: torch.Tensor, targets: torch.Tensor, k: int) -> PromptScores:
    lp = logp.gather(1, targets[:, None])[:, 0]
    if k:
        top_lp, top_ids = logp.topk(k, dim=-1)
    else:
        top_lp = top_ids = torch.empty(len(targets), 0)
    return PromptScores(lp.tolist(), top_ids.tolist(), top_lp.tolist())


def score_prompt(engine, ids: list[int], k: int = 0) -> PromptScores:
    """Score ``ids`` (token ids, already checked against the vocabulary and context)."""
    with engine.device_lock, torch.no_grad():
        logp = torch.log_softmax(_logits(engine, ids, len(ids) - 1), -1)  # [P - 1, V]
        return _scores(logp, torch.as_tensor(ids[1:], device=engine.device), k)


def score_forced(engine, prompt: list[int], forced: list[int], temperature: float, k: int = 0) -> tuple[PromptScores, int]:
    """The behaviour logprobs of ``forced`` tokens after ``prompt`` (a forced tool-call
    opening): log-softmax of the logits scaled by ``temperature`` (0: as 1), the engine's
    definition for sampled tokens, with the ``k`` most likely alternatives; and the weight
    version that scored them."""
    with engine.device_lock, torch.no_grad():
        logits = _logits(engine, prompt + forced, len(forced))
        logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), -1)
        return _scores(logp, torch.as_tensor(forced, device=engine.device), k), engine.version
