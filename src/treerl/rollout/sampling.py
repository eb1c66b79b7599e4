"""Token sampling: temperature, top-k, top-p, min-p, and the behaviour logprob of each sample.

Behaviour logprobs (what RL's importance weights need) are the log-softmax of the
**temperature-scaled logits before top-k/top-p truncation**, i.e. exactly what a trainer
recomputes with ``log_softmax(logits / T)``. With truncation the token was drawn from the
renormalised truncated distribution, whose logprob is higher by ``-log(kept mass)``; we
do not report that one. Greedy decoding (``T = 0``) reports ``log_softmax(logits)`` (T = 1).

All functions work on ``[B, V]`` logits in a float dtype and never synchronise with the host;
16-bit logits (the running batch's, as the head computed them) are widened to float32 before
any arithmetic, so every result is the one a float32 copy of them would give. :func:`sample` applies one set of settings to every row (the
fast path); :func:`sample_rows` takes each row's own settings as ``[B]`` tensors, and draws
the noise of *seeded* rows from their own seeds (:func:`row_seed`), so that a seeded row's
sample does not depend on the other rows of the batch.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .params import SamplingParams
from .kernel_probe import kernel_agrees
from .race_kernel import race_kernel, triton
from .types import to_device


def widened(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in float32, or as they are when already float32 or wider (exact: a widening)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


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
    scaled = widened(logits) / params.temperature
    return torch.softmax(apply_min_p(apply_top_p(apply_top_k(scaled, params.top_k), params.top_p), params.min_p),
                         dim=-1)


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    tokens: torch.Tensor | None = None, logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``[B, V]`` logits.

    Returns ``tokens [B]`` (int64) and ``logprobs [B]`` (behaviour logprobs, see the
    module docstring) in float32, or the logits' dtype when wider (untruncated sampling:
    written into ``tokens``/``logp`` when given, see :func:`race_sample`).
    """
    if params.greedy or not _truncates(params, logits.shape[-1]):
        seeds = draw_seeds(logits.shape[0], generator, logits.device)
        return race_sample(logits, _constant(params.temperature, logits.device), seeds, tokens, logp)
    scaled = widened(logits) / params.temperature
    logp_all = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(apply_min_p(apply_top_p(apply_top_k(scaled, params.top_k), params.top_p),
                                      params.min_p), dim=-1)
    # Exponential race: argmax p_i / E_i with E_i ~ Exp(1) is distributed as p (one pass of the
    # generator's noise: the hash of race_noise costs ~20 integer passes over [B, V])
    race = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    out = (probs / race).argmax(dim=-1)
    return out, logp_all.gather(-1, out[:, None]).squeeze(-1)


def _truncates(params: SamplingParams, V: int) -> bool:
    return 0 < params.top_k < V or params.top_p < 1.0 or params.min_p > 0


_CONSTANTS: dict = {}


def _constant(value: float, device: torch.device) -> torch.Tensor:
    """A one-element float32 tensor of ``value`` on ``device`` (made once: no copy per step)."""
    key = (str(device), float(value))
    if key not in _CONSTANTS:
        _CONSTANTS[key] = torch.tensor([float(value)], dtype=torch.float32, device=device)
    return _CONSTANTS[key]


def draw_seeds(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """``[n]`` int64 row seeds in ``[0, 2^62)`` from ``generator`` (on ``device``: no sync):
    the noise of unseeded rows (:func:`race_noise`)."""
    return torch.randint(0, 1 << 62, (n,), generator=generator, device=device, dtype=torch.int64)


def race_reference(logits: torch.Tensor, temperature: torch.Tensor, row_seeds: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The untruncated race in torch: ``x = logits / t`` (``temperature [B]`` or one value;
    ``t = 0``: greedy, scaled by 1), the token ``argmax x`` (greedy) or ``argmax(x - log E)``
    with the rows' noise ``E`` (:func:`race_noise`: a sample of ``softmax(x)``), and its
    logprob ``x_tok - logsumexp(x)``, computed in float32 (or the logits' dtype when wider,
    as the kernel). Returns ``tokens [B]``, ``logp [B]`` in that dtype."""
    logits = widened(logits)
    t = temperature.to(logits.dtype).reshape(-1)
    greedy = t == 0
    scaled = logits * (1.0 / torch.where(greedy, torch.ones_like(t), t))[:, None]
    gumbel = -race_noise(row_seeds, logits.shape[-1]).log().to(logits.dtype)
    race = torch.where(greedy[:, None], scaled, scaled + gumbel)
    tokens = race.argmax(dim=-1)
    return tokens, scaled.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, row_seeds: torch.Tensor,
                tokens: torch.Tensor | None = None, logp: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`race_reference`, on CUDA in one pass over the logits
    (:mod:`~treerl.rollout.race_kernel`, where it runs and matches the reference); the
    results are written into ``tokens``/``logp`` (``[B]``) when given."""
    if (logits.is_cuda and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and logits.stride(-1) == 1 and _kernel_ok(str(logits.device))):
        into = logp if logp is not None and logp.dtype == torch.float32 else None  # (the kernel writes float32)
        tok, lp = race_kernel(logits, temperature, row_seeds, tokens, into)
    else:
        tok, lp = race_reference(logits, temperature, row_seeds)
    if tokens is not None and tok is not tokens:
        tok = tokens.copy_(tok)
    if logp is not None and lp is not logp:
        lp = logp.copy_(lp)
    return tok, lp


@functools.lru_cache(maxsize=None)
def _kernel_ok(device: str) -> bool:
    """Whether :func:`~treerl.rollout.race_kernel.race_kernel` runs on ``device`` and agrees
    with :func:`race_reference` (probed once per device on 6 rows of 5,000 columns: greedy,
    hot and cold rows, two splits each; never inside a capture)."""
    if triton is None:
        return False

    def check() -> bool:
        g = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(6, 5000, device=device, generator=g) * 3
        temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.0], device=device)
        seeds = draw_seeds(6, g, logits.device)
        want_tok, want_lp = race_reference(logits, temperature, seeds)
        tok, lp = race_kernel(logits, temperature, seeds, splits=2)
        return torch.equal(tok, want_tok) and torch.allclose(lp, want_lp, atol=1e-4)

    return kernel_agrees(check, what="the one-pass sampling kernel", reference="the torch reference", where=device,
                         fallback="sampling runs as torch operations (slower)")


def sample_rows(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor,
    generator: torch.Generator | None = None, seeds: dict[int, int] | None = None, truncate: bool = True,
    tokens: torch.Tensor | None = None, logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``[B, V]`` logits with each row's own settings:
    ``temperature`` (0: greedy), ``top_p``, ``top_k`` (0: off) and ``min_p`` as ``[B]``
    tensors on the logits' device. ``seeds``: ``{row: seed}`` rows whose noise comes from
    their own seed (:func:`row_seed`) instead of ``generator``. ``truncate``: whether any row
    has top-k, top-p or min-p (known on the host: no sync here; without, the rows race in
    one pass, :func:`race_sample`, writing into ``tokens``/``logp`` when given). Returns
    ``tokens [B]`` and behaviour ``logprobs [B]`` (as :func:`sample`)."""
    V = logits.shape[-1]
    rows = row_seeds = None
    if seeds:  # seeded rows: their own noise, from their seeds alone
        rows = to_device(np.asarray(list(seeds), dtype=np.int64), logits.device)
        row_seeds = to_device(np.asarray(list(seeds.values()), dtype=np.int64), logits.device)
    if not truncate:
        all_seeds = draw_seeds(logits.shape[0], generator, logits.device)
        if seeds:
            all_seeds[rows] = row_seeds
        return race_sample(logits, temperature, all_seeds, tokens, logp)
    logits = widened(logits)
    greedy = temperature == 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).to(logits.dtype)
    scaled = logits / t[:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)
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
    race = torch.empty_like(logp_all).exponential_(generator=generator)  # unseeded rows: the generator's noise
    if seeds:
        race[rows] = race_noise(row_seeds, V).to(race.dtype)
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    out = torch.where(greedy, logits.argmax(dim=-1), (kept - race.log()).argmax(dim=-1))
    return out, logp_all.gather(-1, out[:, None]).squeeze(-1)


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


def race_noise(row_seeds: torch.Tensor, V: int) -> torch.Tensor:
    """``[R, V]`` float32 Exp(1) noise that depends only on each row's seed (``row_seeds
    [R]`` int64: :func:`row_seed` or :func:`draw_seeds`) and the token index: a splitmix64
    hash of (seed, token) per element (int64 products wrap, as the hash wants), its top 23
    bits ``b`` a uniform ``u = (2b + 1) / 2^24`` in (0, 1) (exact in float32), noise ``-log u``
    (at most 16.6 in ``-log E``: the cap of torch's float32 ``exponential_``). No generator, no
    loop over rows; :mod:`~treerl.rollout.race_kernel` makes the same bits on the GPU."""
    x = row_seeds[:, None] + torch.arange(1, V + 1, dtype=torch.int64, device=row_seeds.device) * _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shift_right(x, 31)
    u = (_shift_right(x, 41).to(torch.float32) * 2 + 1) * 2.0**-24
    return -torch.log(u)
