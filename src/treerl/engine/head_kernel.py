"""The loss head's chunk kernels on CUDA, in Triton: the forward (a row's log-sum-exp, its
target's log-probability and optionally its entropy) and the gradient of the logits, each in
one read of a chunk's logits.

:func:`treerl.engine.loss_head._chunk_forward` compiled by inductor reads a chunk's logits
twice (the maximum, then the sum of exponentials): 0.29 ms a chunk of 883 x 151,936 bf16
logits on an H200 (session 23), where one read takes ~0.06 ms at the HBM's rate. Here one
program per row runs an online log-sum-exp over blocks of the row (the running maximum
rescales the running sums), in float32, as the compiled torch does.

Same math as ``_chunk_forward``: ``x = raw * inv_temperature`` in float32,
``lse = log sum exp x``, ``logprob = x[target] - lse``, ``entropy = lse - sum softmax(x) x``.

The gradient is ``_chunk_grad_logits``'s, elementwise, over (row, block of columns) programs:
inductor's version of it ran at 1.3-1.5 TB/s (0.37-0.42 ms a chunk, session 23).

Targets must be valid columns (``0 <= target < V``: the engine refuses other token ids before
any call, :mod:`treerl.engine.checks`); the kernels do not check them.
"""

from __future__ import annotations

import contextlib

import torch

from ..compiled import ENGINE_OFF, CompileError

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only torch has no triton
    triton = None

BLOCK = 8192  # logits a forward program reads per step of its row (session 23's sweep: 8192 x 8 warps best)
WARPS = 8
GRAD_BLOCK = 4096  # columns of one gradient program
GRAD_WARPS = 8

if triton is not None:

    @triton.jit
    def _lse_kernel(Raw, Targets, Lse, Logprob, Entropy, V, stride, inv_temperature,
                    BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = Raw + row * stride
        cols = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)  # running maximum
        s = tl.zeros((), tl.float32)  # sum exp(x - m)
        sx = tl.zeros((), tl.float32)  # sum exp(x - m) x
        for start in range(0, V, BLOCK):
            inside = start + cols < V
            x = tl.load(base + start + cols, mask=inside, other=float("-inf")).to(tl.float32) * inv_temperature
            m_new = tl.maximum(m, tl.max(x, 0))
            rescale = tl.exp(m - m_new)
            e = tl.exp(x - m_new)
            s = s * rescale + tl.sum(e, 0)
            if ENTROPY:
                sx = sx * rescale + tl.sum(e * tl.where(inside, x, 0.0), 0)
            m = m_new
        lse = m + tl.log(s)
        target = tl.load(Targets + row)
        x_target = tl.load(base + target).to(tl.float32) * inv_temperature
        tl.store(Lse + row, lse)
        tl.store(Logprob + row, x_target - lse)
        if ENTROPY:
            tl.store(Entropy + row, lse - sx / s)

    @triton.jit
    def _grad_kernel(Raw, Targets, Lse, GradLogprob, Entropy, GradEntropy, Out, V, stride, out_stride,
                     inv_temperature, BLOCK: tl.constexpr, ENTROPY: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < V
        x = tl.load(Raw + row * stride + cols, mask=inside, other=0.0).to(tl.float32) * inv_temperature
        g = tl.load(GradLogprob + row)
        logp = x - tl.load(Lse + row)
        probs = tl.exp(logp)
        other = probs * (-g)
        grad = tl.where(cols == tl.load(Targets + row), other + g, other)
        if ENTROPY:
            grad = grad - tl.load(GradEntropy + row) * probs * (logp + tl.load(Entropy + row))
        tl.store(Out + row * out_stride + cols, (grad * inv_temperature).to(Out.dtype.element_ty), mask=inside)


_DEVICE_ERRORS = tuple(e for e in (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", None)) if e is not None)


def _tile(block: int, vocab: int) -> int:
    """The kernel's block of columns: at most the row's length (a small vocabulary runs no masked lanes)."""
    return min(block, triton.next_power_of_2(vocab))


@contextlib.contextmanager
def _launch(raw: torch.Tensor, what: str):
    """Around a kernel launch: on ``raw``'s device (Triton launches on the current one), and a
    compiler failure (Triton's errors, or its MLIR passes' RuntimeError) as a :class:`CompileError`
    saying how to run without it. The device's own errors (out of memory, an earlier kernel's fault
    surfacing here) pass as they are: they are not this kernel's."""
    with torch.cuda.device(raw.device) if raw.is_cuda else contextlib.nullcontext():
        try:
            yield
        except (triton.errors.TritonError, RuntimeError) as err:
            if isinstance(err, _DEVICE_ERRORS):
                raise
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CompileError(f"the loss head's Triton {what} kernel failed: {first}; {ENGINE_OFF}") from err


def available(logits_like: torch.Tensor) -> bool:
    """Whether the kernel takes chunks of this device and dtype: CUDA, 16 or 32 bits."""
    return triton is not None and logits_like.is_cuda and logits_like.dtype in (torch.bfloat16, torch.float16,
                                                                                  torch.float32)


def chunk_forward(raw: torch.Tensor, targets: torch.Tensor, inv_temperature: float, with_entropy: bool,
                  block: int = BLOCK, warps: int = WARPS):
    """raw [rows, V] logits (hidden @ weight.t(), CUDA), targets [rows] int64 -> (lse, logprob,
    entropy or None), each [rows] float32. ``block``/``warps``: the kernel's tile (benchmarks)."""
    rows, vocab = raw.shape
    raw = raw if raw.stride(1) == 1 else raw.contiguous()  # (a product's output: contiguous)
    targets = targets.contiguous()  # (the kernels read one element a row)
    lse = torch.empty(rows, dtype=torch.float32, device=raw.device)
    logprob = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if with_entropy else None
    if rows:
        with _launch(raw, "forward"):
            _lse_kernel[(rows,)](raw, targets, lse, logprob, entropy if with_entropy else lse, vocab, raw.stride(0),
                                 float(inv_temperature), BLOCK=_tile(block, vocab), ENTROPY=with_entropy,
                                 num_warps=warps)
    return lse, logprob, entropy


def chunk_grad_logits(raw: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad_logprob: torch.Tensor,
                      grad_entropy: torch.Tensor | None, inv_temperature: float, entropy: torch.Tensor | None,
                      block: int = GRAD_BLOCK, warps: int = GRAD_WARPS) -> torch.Tensor:
    """d loss / d raw [rows, V] in ``raw``'s dtype, from the chunk forward's ``lse`` and (with
    ``grad_entropy``) ``entropy``, float32 [rows] each, and d loss / d logprob (/ entropy) [rows]."""
    rows, vocab = raw.shape
    raw = raw if raw.stride(1) == 1 else raw.contiguous()
    targets = targets.contiguous()
    out = torch.empty(rows, vocab, dtype=raw.dtype, device=raw.device)
    with_entropy = grad_entropy is not None
    f32 = lambda t: t.to(torch.float32).contiguous()  # noqa: E731
    lse, grad_logprob = f32(lse), f32(grad_logprob)
    ent, g_ent = (f32(entropy), f32(grad_entropy)) if with_entropy else (lse, lse)
    if rows:
        block = _tile(block, vocab)
        with _launch(raw, "gradient"):
            _grad_kernel[(rows, triton.cdiv(vocab, block))](
                raw, targets, lse, grad_logprob, ent, g_ent, out, vocab, raw.stride(0), out.stride(0),
                float(inv_temperature), BLOCK=block, ENTROPY=with_entropy, num_warps=warps)
    return out
