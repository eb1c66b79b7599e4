"""The loss head's chunk kernels (Triton, :mod:`treerl.engine.head_kernel`) against float64: the
forward's log-sum-exp, target log-probability and entropy, and the gradient of the logits, rows
longer and shorter than the kernels' blocks, any temperature. On a GPU, or on the CPU with ``TRITON_INTERPRET=1`` (every CI run takes it
that way through ``tests/rollout/test_kernels_interpreted.py``)."""

from __future__ import annotations

import os

import pytest
import torch

from treerl.engine import head_kernel
from treerl.engine.loss_head import _chunk_forward, _chunk_grad_logits


def _runs() -> bool:
    return head_kernel.triton is not None and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")


def _dtypes():
    return [torch.bfloat16, torch.float16, torch.float32] if torch.cuda.is_available() else [torch.float32, torch.float16]


pytestmark = pytest.mark.skipif(not _runs(), reason="needs triton and a CUDA GPU (or TRITON_INTERPRET=1)")


def _chunk(vocab: int, dtype: torch.dtype, rows: int = 5):
    """Logits [rows, vocab] (one row nearly one-hot), targets (the last column, the peak), on the kernels' device."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(vocab)
    raw = (torch.randn(rows, vocab, generator=gen, device=device) * 4).to(dtype)
    raw[1, 7] = 40.0  # its exponentials underflow but one
    targets = torch.randint(0, vocab, (rows,), generator=gen, device=device)
    targets[0], targets[1] = vocab - 1, 7  # the last column (inside the last, partial block), the peak
    return raw, targets, gen


def _row_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got.double() - ref).abs().reshape(len(ref), -1).amax(1)


def _within(got, ref, torch32, scale, name):
    """Per row: no further from float64 than the float32 torch path (x3), plus 4 float32 ulps of the row's
    ``scale`` (its largest term: a difference of two such terms is what it rounds; a bias of 1e-4 fails)."""
    err, err32 = _row_errors(got, ref), _row_errors(torch32, ref)
    bound = 3 * err32 + 4 * torch.finfo(torch.float32).eps * scale
    assert (err <= bound).all(), (name, err.tolist(), bound.tolist())


@pytest.mark.parametrize("vocab, block", [(1000, 256), (512, 256), (300, 512), (151936, 8192)])
@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("entropy", [False, True])
def test_chunk_forward_matches_float64(vocab, block, dtype, entropy):
    if vocab > 10_000 and not torch.cuda.is_available():
        pytest.skip("a whole Qwen vocabulary: on a GPU (the interpreter takes minutes)")
    raw, targets, _ = _chunk(vocab, dtype)
    inv_temperature = 1 / 0.7
    got = head_kernel.chunk_forward(raw, targets, inv_temperature, entropy, block=block, warps=4)
    ref = _chunk_forward(raw.double(), targets, inv_temperature, True)
    torch32 = _chunk_forward(raw.float(), targets, inv_temperature, True)
    assert all(x.dtype == torch.float32 and x.shape == (len(raw),) for x in got[:2])
    assert (got[2] is not None) == entropy
    scale = raw.double().abs().amax(1) * inv_temperature + ref[0].abs()
    for name, g, r, t in zip(("lse", "logprob", "entropy"), got, ref, torch32):
        if g is not None:
            _within(g, r, t, scale, name)


@pytest.mark.parametrize("vocab, block", [(1000, 256), (300, 512), (151936, 4096)])
@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.parametrize("entropy", [False, True])
def test_chunk_gradient_matches_float64(vocab, block, dtype, entropy):
    """The logits' gradient from the forward's lse and entropy, against float64 (in float64's own lse and
    entropy), no further from it than the float32 torch path; in ``raw``'s dtype."""
    if vocab > 10_000 and not torch.cuda.is_available():
        pytest.skip("a whole Qwen vocabulary: on a GPU (the interpreter takes minutes)")
    raw, targets, gen = _chunk(vocab, dtype)
    inv_temperature = 1 / 0.7
    g_lp = torch.randn(len(raw), generator=gen, device=raw.device)
    g_ent = torch.randn(len(raw), generator=gen, device=raw.device) if entropy else None
    lse, _, ent = head_kernel.chunk_forward(raw, targets, inv_temperature, entropy)
    got = head_kernel.chunk_grad_logits(raw, targets, lse, g_lp, g_ent, inv_temperature, ent, block=block, warps=4)
    assert got.dtype == raw.dtype and got.shape == raw.shape
    lse64, _, ent64 = _chunk_forward(raw.double(), targets, inv_temperature, True)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    ref = _chunk_grad_logits(raw.double(), targets, lse64, g_lp.double(), d(g_ent), inv_temperature, ent64)
    lse32, _, ent32 = _chunk_forward(raw.float(), targets, inv_temperature, True)
    torch32 = _chunk_grad_logits(raw.float(), targets, lse32, g_lp, g_ent, inv_temperature, ent32).to(dtype)
    # p = exp(x - lse) rounds like its exponent, of the size of the row's largest logit and its lse
    exponent = raw.double().abs().amax(1) * inv_temperature + lse64.abs()
    scale = (g_lp.abs() + (0.0 if g_ent is None else g_ent.abs() * (ent64.float() + 60))).double() * inv_temperature
    scale = scale * exponent
    _within(got, ref, torch32, scale, "gradient")


def test_no_rows_and_a_non_contiguous_chunk():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lse, lp, ent = head_kernel.chunk_forward(torch.zeros(0, 64, device=device), torch.zeros(0, dtype=torch.long,
                                             device=device), 1.0, True)
    assert lse.shape == lp.shape == ent.shape == (0,)
    raw = torch.randn(64, 6, device=device).t()  # [6, 64] with columns strided
    targets = torch.arange(6, device=device)
    got = head_kernel.chunk_forward(raw, targets, 1.0, False, block=32, warps=1)
    ref = _chunk_forward(raw.double(), targets, 1.0, False)
    assert torch.allclose(got[0].double(), ref[0], atol=1e-5) and torch.allclose(got[1].double(), ref[1], atol=1e-5)


def test_strided_row_inputs():
    """Targets and per-row gradients that are views (a stride of 2, a broadcast scalar's stride of 0) read as
    their values."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    raw, targets, _ = _chunk(300, torch.float32, rows=4)
    spread = torch.stack([targets, targets], 1).reshape(-1)[::2]  # stride 2
    assert spread.stride(0) == 2
    lse, lp, _ = head_kernel.chunk_forward(raw, spread, 1.0, False, block=128, warps=1)
    ref_lse, ref_lp, _ = _chunk_forward(raw.double(), targets, 1.0, False)
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    g = torch.ones((), device=device).expand(4)  # stride 0 (the gradient of a sum)
    got = head_kernel.chunk_grad_logits(raw, spread, lse, g, None, 1.0, None, block=128, warps=1)
    ref = _chunk_grad_logits(raw.double(), targets, ref_lse, g.double(), None, 1.0, None)
    assert torch.allclose(got.double(), ref, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("entropy", [False, True])
def test_both_heads_through_the_kernels_match_float64(monkeypatch, fused, entropy):
    """The recomputing head (``token_logprobs``) and the fused one (``token_loss_head``) with their compiled chunks
    on these kernels (on the CPU: the interpreter's, the device check patched), several chunks, temperature 0.7:
    values and gradients no further from float64 than the eager float32 heads (x3)."""
    from helpers.forests import rows_token_grad
    from treerl.engine import loss_head

    if not torch.cuda.is_available():
        monkeypatch.setattr(loss_head, "triton_takes", lambda t: t.dtype == torch.float32)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(1)
    T, H, V = 12, 16, 300
    hidden = torch.randn(T, H, generator=gen, device=device) / 2
    weight = torch.randn(V, H, generator=gen, device=device) / 2
    targets = torch.randint(0, V, (T,), generator=gen, device=device)
    a = torch.randn(T, generator=gen, device=device, dtype=torch.float64)

    def term(lp, ent, rows):
        t = a[rows].to(lp.dtype) * lp + torch.exp(lp)
        return t + 0.3 * ent * ent if ent is not None else t

    def run(h, w, compiled):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        kw = dict(temperature=0.7, with_entropy=entropy, chunk_elements=5 * V, compiled=compiled)
        if fused:
            loss, lp, ent = loss_head.token_loss_head(h, w, targets, rows_token_grad(term), **kw)
        else:
            lp, ent = loss_head.token_logprobs(h, w, targets, **kw)
            loss = term(lp, ent if entropy else None, slice(None)).sum()
        loss.backward()
        return [x.detach().double() for x in (lp, loss, h.grad, w.grad)]

    calls = []
    forward = loss_head.triton_forward
    monkeypatch.setattr(loss_head, "triton_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    ref = run(hidden.double(), weight.double(), compiled=False)
    got, eager = run(hidden, weight, compiled=True), run(hidden, weight, compiled=False)
    assert len(calls) == 3  # (three chunks, through the kernel)
    for name, g, e, r in zip(("logprob", "loss", "hidden grad", "weight grad"), got, eager, ref):
        err, err_eager = (g - r).abs().max().item(), (e - r).abs().max().item()
        assert err <= 3 * err_eager + 1e-6 * r.abs().max().item(), (name, err, err_eager)
