"""Attention helpers of the exactness tests of the fused-kernel routes (group attention, root
split): a dense masked reference, random float64 inputs, a relative check, a recording kernel."""

from __future__ import annotations

import torch

import treerl.engine.chain_attention as chain


def dense_reference(q, k, v, visible, scale):
    """Autograd through a dense softmax: q [1, H, N, D], k/v [1, Hk, M, D], ``visible`` [N, M]."""
    groups = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(groups, 1) for x in (k, v))
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1) @ v


def inputs(gen, heads, kv_heads, n, keys, dim, dtype=torch.float64):
    """Random q [1, heads, n, dim] (the engine's transposed layout), k/v [1, kv_heads, keys, dim]."""
    q = torch.randn(1, n, heads, dim, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, kv_heads, keys, dim, generator=gen, dtype=dtype).requires_grad_() for _ in range(2))
    return q, k, v


def assert_rel(got, want, tol=1e-9):
    """``got`` within ``tol`` of ``want``'s largest magnitude."""
    diff, scale = float((got - want).detach().abs().max()), float(want.detach().abs().max())
    assert diff <= tol * scale + 1e-12, (diff, scale)


def recording(kernel: chain.Kernel, calls: list) -> chain.Kernel:
    """``kernel`` noting the (queries, keys, causal) of each of its part calls."""

    def forward(q, k, v, causal, scale):
        calls.append((q.shape[2], k.shape[2], causal))
        return kernel.forward(q, k, v, causal, scale)

    def backward(dout, q, k, v, out, lse, extra, causal, scale):
        calls.append((q.shape[2], k.shape[2], causal))
        return kernel.backward(dout, q, k, v, out, lse, extra, causal, scale)

    return chain.Kernel(kernel.name, forward, backward, kernel.expand_kv, kernel.align)
