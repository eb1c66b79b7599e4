"""KeptAttention: saved tensors on the inputs' storage come from the recompute."""

from __future__ import annotations

import pytest
import torch

from treerl.engine.kept_attention import KeptAttention


def attend(q, k):
    return torch.sin(q) * k.exp()  # saves q (sin), k's exp and a product's inputs


def make(gen):
    q = torch.randn(2, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 5, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    return q, k


def test_backward_reads_recomputed_inputs_and_holds_the_rest(gen):
    q, k = make(gen)
    g = torch.randn(2, 5, 3, dtype=torch.float64, generator=gen)
    want = torch.autograd.grad(attend(q, k), (q, k), g)
    qv, kv = q.transpose(1, 2), k.transpose(1, 2)  # views: notes keep their strides
    kept = KeptAttention((qv, kv))
    out = kept.run(lambda a, b: attend(a.transpose(1, 2), b.transpose(1, 2)), qv, kv)
    assert kept.views_saved >= 1
    recomputed = [x.detach().clone() for x in (qv, kv)]  # same values, same strides, new storage
    assert torch.equal(kept.recompute(*recomputed), out.detach())
    got = torch.autograd.grad(out, (q, k), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)


def test_recomputed_values_are_what_the_backward_sees(gen):
    q, k = make(gen)
    kept = KeptAttention((q, k))
    out = kept.run(attend, q, k)
    # a recompute that differed would show in the gradient: here it is deliberately zero
    kept.recompute(torch.zeros_like(q), k.detach())
    (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out), retain_graph=True)
    torch.testing.assert_close(dq, torch.cos(torch.zeros_like(q)) * k.detach().exp())


def test_misuse_is_refused(gen):
    q, k = make(gen)
    kept = KeptAttention((q, k))
    out = kept.run(attend, q, k)
    with pytest.raises(RuntimeError, match="before its block's recompute"):
        out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="differently"):
        kept.recompute(q.detach().transpose(1, 2), k.detach())
    kept.recompute(q.detach(), k.detach())
    with pytest.raises(RuntimeError, match="recomputed twice"):
        kept.recompute(q.detach(), k.detach())
