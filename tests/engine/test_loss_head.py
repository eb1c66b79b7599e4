"""The chunked loss head against the dense log-softmax, in float64: values and gradients."""

from __future__ import annotations

import pytest
import torch

from helpers.forests import rows_token_grad
from treerl.engine.loss_head import token_logprobs


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 100])  # several chunks (the weight's gradient accumulated), or one
def test_chunked_loss_head_matches_dense_log_softmax(entropy, chunk_rows):
    torch.manual_seed(0)
    T, H, V, temperature = 10, 6, 13, 0.7
    hidden = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (T,))
    g_logprob, g_entropy = torch.randn(T, dtype=torch.float64), torch.randn(T, dtype=torch.float64)

    logprob, ent = token_logprobs(hidden, weight, targets, temperature=temperature, with_entropy=entropy,
                                  chunk_elements=chunk_rows * V)
    loss = (logprob * g_logprob).sum() + ((ent * g_entropy).sum() if entropy else 0.0)
    got = torch.autograd.grad(loss, (hidden, weight))

    logp = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    ref_logprob = logp.gather(1, targets[:, None])[:, 0]
    ref_ent = -(logp.exp() * logp).sum(-1)
    ref_loss = (ref_logprob * g_logprob).sum() + ((ref_ent * g_entropy).sum() if entropy else 0.0)
    ref = torch.autograd.grad(ref_loss, (hidden, weight))

    assert torch.allclose(logprob, ref_logprob, rtol=1e-12, atol=1e-12)
    if entropy:
        assert torch.allclose(ent, ref_ent, rtol=1e-12, atol=1e-12)
    for g, r in zip(got, ref):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12)


def test_chunked_loss_head_weight_only_and_hidden_only():
    """A frozen head (LoRA: no weight gradient) and a frozen input: the other gradient alone, as dense."""
    torch.manual_seed(1)
    hidden = torch.randn(9, 4, dtype=torch.float64)
    weight = torch.randn(11, 4, dtype=torch.float64)
    targets = torch.randint(0, 11, (9,))
    for grad_hidden in (True, False):
        h, w = hidden.clone().requires_grad_(grad_hidden), weight.clone().requires_grad_(not grad_hidden)
        logprob, _ = token_logprobs(h, w, targets, chunk_elements=2 * 11)
        (g,) = torch.autograd.grad(logprob.sum(), h if grad_hidden else w)
        h2, w2 = hidden.clone().requires_grad_(grad_hidden), weight.clone().requires_grad_(not grad_hidden)
        ref = torch.log_softmax(h2 @ w2.t(), -1).gather(1, targets[:, None]).sum()
        (r,) = torch.autograd.grad(ref, h2 if grad_hidden else w2)
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12)


def test_chunked_loss_head_no_rows_gives_zero_weight_gradient():
    """A call with no rows (e.g. a one-token sequence: nothing to predict) adds nothing to the head's gradient."""
    hidden = torch.zeros(0, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    logprob, _ = token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.int64), chunk_elements=2 * 11)
    (g,) = torch.autograd.grad(logprob.sum() + 0.0 * weight.sum(), weight)
    assert torch.equal(g, torch.zeros_like(weight))


def test_chunked_loss_head_under_autocast_runs_its_products_in_the_autocast_dtype():
    """Under autocast (an fp32 model, ``train.autocast_bf16``) the backward's vocabulary-sized products run in
    bf16, as ``a @ b`` does there (``out=`` and ``addmm_`` bypass autocast), and the gradients keep fp32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Products(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
                self.dtypes.append(args[-1].dtype)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(2)
    hidden = torch.randn(9, 8, requires_grad=True)
    weight = torch.randn(13, 8, requires_grad=True)
    targets = torch.randint(0, 13, (9,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprob, _ = token_logprobs(hidden, weight, targets, chunk_elements=4 * 13)
        with Products() as seen:
            gh, gw = torch.autograd.grad(logprob.sum(), (hidden, weight))
    assert seen.dtypes and set(seen.dtypes) == {torch.bfloat16}, seen.dtypes
    assert gh.dtype == gw.dtype == torch.float32
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = torch.autograd.grad(torch.log_softmax(h64 @ w64.t(), -1).gather(1, targets[:, None]).sum(), (h64, w64))
    for g, r in zip((gh, gw), ref):
        assert torch.allclose(g.double(), r, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 4, 100])
@pytest.mark.parametrize("frozen", [None, "hidden", "weight"])
def test_fused_token_loss_head_matches_dense(entropy, chunk_rows, frozen):
    """The head with the loss's per-row derivative asked per chunk (one logits product a chunk):
    loss, logprobs, entropies and both gradients as the dense log-softmax's, float64; the
    derivative is asked exactly once for each row, in order."""
    from treerl.engine.loss_head import token_loss_head

    torch.manual_seed(2)
    T, H, V, temperature = 11, 5, 13, 0.8
    hidden = torch.randn(T, H, dtype=torch.float64, requires_grad=frozen != "hidden")
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=frozen != "weight")
    targets = torch.randint(0, V, (T,))
    a, c = torch.randn(T, dtype=torch.float64), torch.randn(T, dtype=torch.float64)

    def term(lp, ent, rows):  # nonlinear in each row's own values
        t = a[rows] * lp + torch.exp(lp)
        return t + c[rows] * ent * ent if ent is not None else t

    seen = []
    token_grad = rows_token_grad(term, seen)
    loss, logprob, ent = token_loss_head(hidden, weight, targets, token_grad, temperature=temperature,
                                         with_entropy=entropy, chunk_elements=chunk_rows * V)
    leaves = [x for x in (hidden, weight) if x.requires_grad]
    got = torch.autograd.grad(loss, leaves)
    assert [r for s in seen for r in range(*s)] == list(range(T))

    logp = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)
    ref_lp = logp.gather(1, targets[:, None])[:, 0]
    ref_ent = -(logp.exp() * logp).sum(-1)
    ref_loss = term(ref_lp, ref_ent if entropy else None, slice(None)).sum()
    ref = torch.autograd.grad(ref_loss, leaves)
    assert torch.allclose(loss, ref_loss, rtol=1e-12, atol=1e-12)
    assert torch.allclose(logprob, ref_lp, rtol=1e-12, atol=1e-12)
    if entropy:
        assert torch.allclose(ent, ref_ent, rtol=1e-12, atol=1e-12)
    for g, r in zip(got, ref):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12)
