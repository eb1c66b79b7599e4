"""Token log-probabilities and entropies from hidden states, in vocabulary-sized chunks.

Never materialises [tokens x vocab] logits for the whole batch: the forward keeps only
the per-token log-sum-exp, and the backward recomputes each chunk's logits. This is the
one loss head every engine mode uses.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_ELEMENTS = 1 << 27  # logits elements per chunk (512 MiB in float32)


def compute_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Logits are reduced in float32, or float64 for a float64 model."""
    return torch.promote_types(param_dtype, torch.float32)


def _chunks(n: int, rows: int):
    for start in range(0, n, rows):
        yield slice(start, min(n, start + rows))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temperature: float, rows: int, with_entropy: bool):
        dtype = compute_dtype(weight.dtype)
        n = hidden.shape[0]
        logprob = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        for c in _chunks(n, rows):
            logits = (hidden[c] @ weight.t()).to(dtype) * inv_temperature
            lse[c] = torch.logsumexp(logits, dim=-1)
            logprob[c] = logits.gather(1, targets[c, None])[:, 0] - lse[c]
            if with_entropy:
                probs = torch.softmax(logits, dim=-1)
                entropy[c] = lse[c] - (probs * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.inv_temperature, ctx.rows = inv_temperature, rows
        ctx.mark_non_differentiable(lse)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        t = ctx.inv_temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        with_entropy = grad_entropy is not None and grad_entropy.numel() > 0
        for c in _chunks(hidden.shape[0], ctx.rows):
            logits = (hidden[c] @ weight.t()).to(lse.dtype) * t
            logp = logits - lse[c, None]
            probs = logp.exp()
            # d logprob / d logits = onehot - p
            grad_logits = probs * (-grad_logprob[c, None])
            grad_logits.scatter_add_(1, targets[c, None], grad_logprob[c, None])
            if with_entropy:
                # d H / d logits = -p * (log p + H)
                ent = -(probs * logp).sum(-1, keepdim=True)
                grad_logits -= grad_entropy[c, None] * probs * (logp + ent)
            grad_logits = (grad_logits * t).to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[c] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.t() @ hidden[c]
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log p(target | hidden) and the entropy of p(. | hidden), per row.

    hidden [T, H] (model dtype), weight [V, H] (the LM head), targets [T] int64.
    Returns (logprob [T], entropy [T] or empty) in float32 (float64 for a float64 model).
    """
    rows = max(1, chunk_elements // weight.shape[0])
    return _TokenLogprobs.apply(hidden, weight, targets, 1.0 / temperature, rows, with_entropy)
