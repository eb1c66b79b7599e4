"""Token log-probabilities and entropies from hidden states, in vocabulary-sized chunks.

Never materialises [tokens x vocab] logits for the whole batch: the forward keeps only
the per-token log-sum-exp, and the backward recomputes each chunk's logits. This is the
one loss head every engine mode uses.

With ``token_grad`` (a loss whose derivative per token is known once that token's logprob
is: a sum of per-token terms, or gradients injected from an earlier pass) the head takes
its gradients in its forward, chunk by chunk, while each chunk's logits are at hand: one
logits product per chunk instead of two (the fused linear cross-entropy of Liger et al.).
"""

from __future__ import annotations

import torch

from ..compiled import ENGINE_OFF, LazyCompiled
from .head_kernel import available as triton_takes, chunk_forward as triton_forward, chunk_grad_logits as triton_grad

DEFAULT_CHUNK_ELEMENTS = 1 << 27  # logits elements per chunk (512 MiB in float32)


def compute_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Logits are reduced in float32, or float64 for a float64 model."""
    return torch.promote_types(param_dtype, torch.float32)


def head_rows(chunk_elements: int, weight: torch.Tensor) -> int:
    """Rows of one logits chunk of at most ``chunk_elements`` elements (at least one row)."""
    return max(1, chunk_elements // weight.shape[0])


def _chunks(n: int, rows: int):
    for start in range(0, n, rows):
        yield slice(start, min(n, start + rows))


def _chunk_forward(raw, targets, inv_temperature: float, with_entropy: bool):
    """One chunk of rows from its logits ``raw`` = hidden @ weight.t() [rows, V] (model dtype):
    (lse, logprob, entropy or None), reduced in float32/64."""
    logits = raw.to(compute_dtype(raw.dtype)) * inv_temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprob = logits.gather(1, targets[:, None])[:, 0] - lse
    entropy = None
    if with_entropy:
        probs = torch.softmax(logits, dim=-1)
        entropy = lse - (probs * logits).sum(-1)
    return lse, logprob, entropy


def _chunk_grad_logits(raw, targets, lse, grad_logprob, grad_entropy, inv_temperature: float, entropy):
    """d loss / d ``raw`` (= hidden @ weight.t()) of one chunk, in ``raw``'s dtype; ``entropy``:
    the chunk forward's (used with ``grad_entropy``). One pointwise pass over the logits."""
    logits = raw.to(lse.dtype) * inv_temperature
    logp = logits - lse[:, None]
    probs = logp.exp()
    # d logprob / d logits = onehot - p. The target's term by a column comparison, not scatter_add:
    # the same arithmetic (-p g + g), one pointwise pass (a scatter makes inductor write the chunk in
    # float32 first, then convert it: 0.66 of the head's ~0.95 ms a chunk on the H200, session 23)
    g = grad_logprob[:, None]
    other = probs * (-g)
    column = torch.arange(raw.shape[1], device=raw.device)
    grad_logits = torch.where(column[None, :] == targets[:, None], other + g, other)
    if grad_entropy is not None:
        # d H / d logits = -p * (log p + H)
        grad_logits = grad_logits - grad_entropy[:, None] * probs * (logp + entropy[:, None])
    return (grad_logits * inv_temperature).to(raw.dtype)


_COMPILED = (LazyCompiled(_chunk_forward, "loss head's chunk forward", ENGINE_OFF),
             LazyCompiled(_chunk_grad_logits, "loss head's chunk gradient", ENGINE_OFF))


def _kernels(compiled: bool, hidden: torch.Tensor):
    """The chunk functions (forward, gradient), eager or compiled: on CUDA :mod:`.head_kernel`'s
    Triton kernels (one read of the logits each), elsewhere inductor's (one fused pass over the
    logits instead of ~6 eager ones)."""
    if not compiled:
        return _chunk_forward, _chunk_grad_logits
    if triton_takes(hidden):
        return triton_forward, triton_grad
    return _COMPILED


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out = a @ b`` (``out += a @ b`` with ``accumulate``) written by the product itself. Under
    autocast (which ``out=`` and ``addmm_`` bypass) or with other dtypes, the product runs as
    ``a @ b`` does there (e.g. bf16 for an fp32 model) and is then copied or added into ``out``."""
    if torch.is_autocast_enabled(out.device.type) or not a.dtype == b.dtype == out.dtype:
        product = a @ b
        out.add_(product) if accumulate else out.copy_(product)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def _head_grads(hidden, weight, grad_logits, c: slice, grad_hidden, grad_weight, first: bool) -> None:
    """A chunk's ``grad_logits`` into ``grad_hidden[c]`` and ``grad_weight`` (either may be None)."""
    if grad_hidden is not None:
        _mm_into(grad_hidden[c], grad_logits, weight, accumulate=False)
    # [vocab x hidden] per chunk: the first written, the others added by the product itself (beta = 1:
    # one pass over the weight's gradient, where a product then an add took three; session 12's grpo
    # profile had those adds at ~26 ms of a 1.43 s step on an H200)
    if grad_weight is not None:
        _mm_into(grad_weight, grad_logits.t(), hidden[c], accumulate=not first)


def _grad_buffers(hidden, weight, want_hidden: bool, want_weight: bool):
    grad_hidden = hidden.new_empty(hidden.shape) if want_hidden else None  # (contiguous: mm out=)
    grad_weight = None
    if want_weight:  # (no rows: no chunk writes it)
        grad_weight = torch.empty_like(weight) if hidden.shape[0] else torch.zeros_like(weight)
    return grad_hidden, grad_weight


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temperature: float, rows: int, with_entropy: bool,
                compiled: bool):
        dtype = compute_dtype(weight.dtype)
        n = hidden.shape[0]
        logprob = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        forward_chunk, _ = _kernels(compiled, hidden)
        for c in _chunks(n, rows):
            lse[c], logprob[c], ent = forward_chunk(hidden[c] @ weight.t(), targets[c], inv_temperature, with_entropy)
            if with_entropy:
                entropy[c] = ent
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)  # (entropy: empty without it)
        ctx.inv_temperature, ctx.rows, ctx.compiled = inv_temperature, rows, compiled
        ctx.mark_non_differentiable(lse)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        grad_hidden, grad_weight = _grad_buffers(hidden, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        with_entropy = grad_entropy is not None and grad_entropy.numel() > 0
        _, grad_chunk = _kernels(ctx.compiled, hidden)
        for i, c in enumerate(_chunks(hidden.shape[0], ctx.rows)):
            grad_logits = grad_chunk(hidden[c] @ weight.t(), targets[c], lse[c], grad_logprob[c],
                                     grad_entropy[c] if with_entropy else None, ctx.inv_temperature,
                                     entropy[c] if with_entropy else None)
            _head_grads(hidden, weight, grad_logits, c, grad_hidden, grad_weight, first=i == 0)
        return grad_hidden, grad_weight, None, None, None, None, None


class _FusedTokenLoss(torch.autograd.Function):
    """The head's forward and backward in one pass over the chunks: the loss's gradient per
    row is asked of ``token_grad`` as soon as a chunk's logprobs exist, so its logits are
    used once. Output: (loss, logprob, entropy); only the loss is differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, token_grad, inv_temperature: float, rows: int, with_entropy: bool,
                compiled: bool, want_hidden: bool, want_weight: bool):
        dtype = compute_dtype(weight.dtype)
        n = hidden.shape[0]
        logprob = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=dtype, device=hidden.device)
        loss = torch.zeros((), dtype=torch.float64, device=hidden.device)  # (the parts' sum: the step's loss)
        grad_hidden, grad_weight = _grad_buffers(hidden, weight, want_hidden, want_weight)
        forward_chunk, grad_chunk = _kernels(compiled, hidden)
        for i, c in enumerate(_chunks(n, rows)):
            raw = hidden[c] @ weight.t()
            lse, logprob[c], ent = forward_chunk(raw, targets[c], inv_temperature, with_entropy)
            if with_entropy:
                entropy[c] = ent
            part, g_lp, g_ent = token_grad(c.start, c.stop, logprob[c], ent)
            loss += part.detach().to(torch.float64)
            if grad_hidden is None and grad_weight is None:
                continue
            g_ent = None if g_ent is None or not with_entropy else g_ent.to(dtype)
            grad_logits = grad_chunk(raw, targets[c], lse, g_lp.to(dtype), g_ent, inv_temperature,
                                     None if g_ent is None else ent)
            del raw
            _head_grads(hidden, weight, grad_logits, c, grad_hidden, grad_weight, first=i == 0)
        ctx.grads = (grad_hidden, grad_weight)
        ctx.mark_non_differentiable(logprob, entropy)
        return loss, logprob, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_logprob, _grad_entropy):
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None  # (freed with the graph, not held to the end of the backward)
        scale = lambda g: None if g is None else g * grad_loss.to(g.dtype)  # noqa: E731  (1 from .backward())
        return scale(grad_hidden), scale(grad_weight), None, None, None, None, None, None, None, None


def token_loss_head(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_grad,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The loss head with the loss's per-row derivative known per chunk: (loss, logprob [T],
    entropy [T] or empty); ``loss`` [] (float64) carries the gradients of ``hidden`` and ``weight``.

    ``token_grad(start, stop, logprob, entropy) -> (loss_part, d loss/d logprob, d loss/d
    entropy or None)`` for rows ``start:stop`` (``entropy`` None without ``with_entropy``):
    the loss must be a sum over rows of terms each depending on its row's logprob and
    entropy alone. The gradients are computed in this call (one logits product per chunk,
    where :func:`token_logprobs` then a backward take two); ``loss.backward()`` passes them on.
    """
    rows = head_rows(chunk_elements, weight)
    grad = torch.is_grad_enabled()
    return _FusedTokenLoss.apply(hidden, weight, targets, token_grad, 1.0 / temperature, rows, with_entropy, compiled,
                                 grad and hidden.requires_grad, grad and weight.requires_grad)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log p(target | hidden) and the entropy of p(. | hidden), per row.

    hidden [T, H] (model dtype), weight [V, H] (the LM head), targets [T] int64.
    Returns (logprob [T], entropy [T] or empty) in float32 (float64 for a float64 model).
    ``compiled``: run each chunk's elementwise work as compiled kernels (CUDA).
    """
    rows = head_rows(chunk_elements, weight)
    return _TokenLogprobs.apply(hidden, weight, targets, 1.0 / temperature, rows, with_entropy, compiled)
