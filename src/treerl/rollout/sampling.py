"""Token sampling: temperature, top-k, top-p, and the behaviour logprob of each sample.

Behaviour logprobs (what RL's importance weights need) are the log-softmax of the
**temperature-scaled logits before top-k/top-p truncation**, i.e. exactly what a trainer
recomputes with ``log_softmax(logits / T)``. With truncation the token was drawn from the
renormalised truncated distribution, whose logprob is higher by ``-log(kept mass)``; we
do not report that one. Greedy decoding (``T = 0``) reports ``log_softmax(logits)`` (T = 1).

All functions work on ``[B, V]`` logits in a float dtype (float32 or float64) and never
synchronise with the host.
"""

from __future__ import annotations

import torch

from .compiled import LazyCompiled
from .params import SamplingParams


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``[B, V]`` logits with everything below the k-th largest of each row set to -inf
    (ties with the k-th are kept). ``k <= 0`` or ``k >= V`` leaves the logits unchanged."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``[B, V]`` logits keeping, per row, the smallest set of most likely tokens whose
    probability mass reaches ``p`` (a token is dropped when the mass of the tokens ranked
    above it is already >= p; the most likely token is always kept). Others -> -inf."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[B, V]`` probabilities actually sampled from (temperature, then top-k, then top-p)."""
    scaled = logits / params.temperature
    return torch.softmax(apply_top_p(apply_top_k(scaled, params.top_k), params.top_p), dim=-1)


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``[B, V]`` logits.

    Returns ``tokens [B]`` (int64) and ``logprobs [B]`` (behaviour logprobs, see the
    module docstring) in ``logits.dtype``.
    """
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        logp_all = torch.log_softmax(logits, dim=-1)
    elif (params.top_k <= 0 or params.top_k >= logits.shape[-1]) and params.top_p >= 1.0:
        # no truncation: the race on log-probabilities (argmax log p_i - log E_i), without the
        # probabilities: at 1,024 rows x 152k tokens each pass over the logits costs ~0.3 ms
        logp_all = torch.log_softmax(logits if params.temperature == 1.0 else logits / params.temperature, dim=-1)
        race = torch.empty_like(logp_all).exponential_(generator=generator)
        tokens = (_race_argmax_compiled if logits.is_cuda else _race_argmax)(logp_all, race)
    else:
        scaled = logits / params.temperature
        logp_all = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(apply_top_p(apply_top_k(scaled, params.top_k), params.top_p), dim=-1)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) is distributed as p.
        race = torch.empty_like(probs).exponential_(generator=generator)
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        tokens = (probs / race).argmax(dim=-1)
    logprobs = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def _race_argmax(logp: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """``argmax(logp - log E)`` per row: a sample of ``softmax(logp)`` (``E ~ Exp(1)``)."""
    return (logp - race.clamp(min=torch.finfo(race.dtype).tiny).log()).argmax(dim=-1)


_race_argmax_compiled = LazyCompiled(_race_argmax, "sampling race")  # one fused pass on CUDA
