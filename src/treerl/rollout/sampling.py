"""Token sampling: temperature, top-k, top-p, min-p, and the behaviour logprob of each sample.

Behaviour logprobs (what RL's importance weights need) are the log-softmax of the
**temperature-scaled logits before top-k/top-p truncation**, i.e. exactly what a trainer
recomputes with ``log_softmax(logits / T)``. With truncation the token was drawn from the
renormalised truncated distribution, whose logprob is higher by ``-log(kept mass)``; we
do not report that one. Greedy decoding (``T = 0``) reports ``log_softmax(logits)`` (T = 1).

All functions work on ``[B, V]`` logits in a float dtype (float32 or float64) and never
synchronise with the host. :func:`sample` applies one set of settings to every row (the
fast path); :func:`sample_rows` takes each row's own settings as ``[B]`` tensors, and draws
the noise of *seeded* rows from their own seeds (:func:`row_seed`), so that a seeded row's
sample does not depend on the other rows of the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from ..compiled import SAMPLING_OFF, LazyCompiled
from .params import SamplingParams
from .types import to_device


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


def apply_min_p(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """``[B, V]`` logits keeping, per row, the tokens at least ``p`` times as likely as the
    most likely one (``p`` a float or ``[B]``; 0 keeps all). Others -> -inf."""
    if not isinstance(p, torch.Tensor):
        if p <= 0:
            return logits
        p = torch.full(logits.shape[:1], p, dtype=logits.dtype, device=logits.device)
    floor = logits.amax(dim=-1, keepdim=True) + torch.log(p.to(logits.dtype))[:, None]  # -inf where p = 0
    return logits.masked_fill(logits < floor, float("-inf"))


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``[B, V]`` probabilities actually sampled from (temperature, then top-k, top-p, min-p)."""
    scaled = logits / params.temperature
    return torch.softmax(apply_min_p(apply_top_p(apply_top_k(scaled, params.top_k), params.top_p), params.min_p),
                         dim=-1)


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
    elif (params.top_k <= 0 or params.top_k >= logits.shape[-1]) and params.top_p >= 1.0 and params.min_p <= 0:
        # no truncation: the race on log-probabilities (argmax log p_i - log E_i), without the
        # probabilities: at 1,024 rows x 152k tokens each pass over the logits costs ~0.3 ms
        logp_all = torch.log_softmax(logits if params.temperature == 1.0 else logits / params.temperature, dim=-1)
        race = torch.empty_like(logp_all).exponential_(generator=generator)
        tokens = (_race_argmax_compiled if logits.is_cuda else _race_argmax)(logp_all, race)
    else:
        scaled = logits / params.temperature
        logp_all = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(apply_min_p(apply_top_p(apply_top_k(scaled, params.top_k), params.top_p),
                                          params.min_p), dim=-1)
        # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) is distributed as p.
        race = torch.empty_like(probs).exponential_(generator=generator)
        race.clamp_(min=torch.finfo(race.dtype).tiny)
        tokens = (probs / race).argmax(dim=-1)
    logprobs = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, logprobs


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor,
    generator: torch.Generator | None = None, seeds: dict[int, int] | None = None, truncate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``[B, V]`` logits with each row's own settings:
    ``temperature`` (0: greedy), ``top_p``, ``top_k`` (0: off) and ``min_p`` as ``[B]``
    tensors on the logits' device. ``seeds``: ``{row: seed}`` rows whose noise comes from
    their own seed (:func:`row_seed`) instead of ``generator``. ``truncate``: whether any row
    has top-k, top-p or min-p (known on the host: no sync here). Returns ``tokens [B]`` and
    behaviour ``logprobs [B]`` (as :func:`sample`)."""
    V = logits.shape[-1]
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    scaled = logits / t[:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)
    kept = scaled
    if truncate:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        k = torch.where((top_k > 0) & (top_k < V), top_k, V).to(torch.int64)
        kth = sorted_logits.gather(-1, (k - 1)[:, None])
        sorted_kept = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))  # top-k (ties kept)
        probs = torch.softmax(sorted_kept, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = (mass_before >= top_p.to(probs.dtype)[:, None]) & (top_p < 1)[:, None]  # top-p
        drop[:, 0] = False
        drop |= sorted_kept == float("-inf")
        kept = scaled.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), float("-inf"))
        kept = apply_min_p(kept, min_p.to(logits.dtype))
    race = torch.empty_like(logp_all).exponential_(generator=generator)
    if seeds:  # seeded rows: their own noise, from their seeds alone, in one batched pass
        rows = to_device(np.asarray(list(seeds), dtype=np.int64), race.device)
        row_seeds = to_device(np.asarray(list(seeds.values()), dtype=np.int64), race.device)
        race[rows] = seeded_exponential(row_seeds, V).to(race.dtype)
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    tokens = torch.where(greedy, logits.argmax(dim=-1), (kept - race.log()).argmax(dim=-1))
    return tokens, logp_all.gather(-1, tokens[:, None]).squeeze(-1)


_MASK64 = (1 << 64) - 1


def row_seed(seed: int, branch: tuple[int, ...], step: int) -> int:
    """The seed of one seeded row's token: a hash (splitmix64 steps) of the group's
    ``seed``, the row's ``branch`` and the token's index ``step``, in ``[0, 2^63)``."""
    x = int(seed) & _MASK64
    for v in (*branch, -1, step):
        x = (x + 0x9E3779B97F4A7C15 + (int(v) & _MASK64)) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x >> 1


def _signed(c: int) -> int:
    """A 64-bit constant as the int64 torch holds it (two's complement)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def seeded_exponential(row_seeds: torch.Tensor, V: int) -> torch.Tensor:
    """``[R, V]`` float64 Exp(1) noise that depends only on each row's seed (``row_seeds
    [R]`` int64, from :func:`row_seed`) and the token index: a splitmix64 hash of (seed,
    token) per element (int64 products wrap, as the hash wants), its top 53 bits a uniform
    ``u`` in (0, 1), noise ``-log u``. No generator, no loop over rows."""
    x = row_seeds[:, None] + torch.arange(1, V + 1, dtype=torch.int64, device=row_seeds.device) * _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shift_right(x, 31)
    u = (_shift_right(x, 11).to(torch.float64) + 0.5) / float(1 << 53)
    return -torch.log(u)


def _race_argmax(logp: torch.Tensor, race: torch.Tensor) -> torch.Tensor:
    """``argmax(logp - log E)`` per row: a sample of ``softmax(logp)`` (``E ~ Exp(1)``)."""
    return (logp - race.clamp(min=torch.finfo(race.dtype).tiny).log()).argmax(dim=-1)


# one fused pass on CUDA (sampling with top_k, top_p or min_p runs eagerly)
_race_argmax_compiled = LazyCompiled(_race_argmax, "sampling race", SAMPLING_OFF)
