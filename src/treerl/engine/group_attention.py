"""Attention of a group of leaves after a prefix: the prefix through a fused kernel (issue 24).

A model call whose segment is a small tree (several leaves: a GRPO group's responses, or some
of them) after the K/V of its ancestors (the prefix, ``P`` keys) has a mask of two parts:
every query sees every prefix key (:attr:`treerl.engine.attention.TreeAttention.group`
checks it), and its own keys under the tree mask. Its attention is the merge of

- ``A_prefix``: full attention of the queries to the prefix keys: one dense rectangle through
  the fused SDPA kernel of :mod:`treerl.engine.chain_attention` (``Kernel.run_forward(...,
  causal=False)``; cuDNN's on its grid of 128: :class:`~treerl.engine.kernel_plans.Layout`
  with ``causal=False``: ``front = P % align`` prefix keys move to the own part, and the
  queries run with dummy zero rows after them up to a multiple of ``align``), and
- ``A_own``: the queries against the moved prefix keys and their own keys under the tree mask,
  by the caller's ``own`` function (flex attention on CUDA, the plain-torch math on the CPU),
  returning its output and *differentiable* log-sum-exp,

merged by log-sum-exp (:func:`~treerl.engine.chain_attention.merge_into`).

**Backward** (:class:`GroupMerge`, an autograd function of ``(q, prefix K/V, o_own, l_own)``):
the fused part's dQ, dK, dV by its kernel's backward given the *merged* output and
log-sum-exp (the ring-attention identity, as a chain's parts; dummy rows get a zero output
gradient), and for the own part the gradients of the merge with respect to its output and
log-sum-exp, ``w = exp(l_own - lse)``::

    dL/do_own = dO w        dL/dl_own = w rowsum(dO (o_own - out))

from which autograd continues into the own part's backward (flex's backward takes a
log-sum-exp gradient: it subtracts it from ``rowsum(dO O)``; its Triton backward does since
torch 2.5, the FLASH backend's does not, and treerl runs flex with ``BACKEND="TRITON"``).
Both sum to the merged attention's exact gradient: the own part's
``P_own (w dO V^T - w rowsum(dO o_own) + w rowsum(dO (o_own - out)))`` is the merged
``P (dO V^T - rowsum(dO out))`` on its keys.

Costs beside the two attentions: the merge and its backward (elementwise over [N, H, D] in
float32), copies of the queries and of the fused part's output with dummy rows (none for a
kernel without grid, or queries on it), and the own part's output and log-sum-exp held for
its backward (flex holds them anyway).
"""

from __future__ import annotations

from typing import Callable

import torch

from .chain_attention import Kernel, lse_rows, merge_into
from .kernel_plans import Layout

# own(q [B, H, N, D], k [B, Hk, M, D], v, first key, scale) -> (out [B, H, N, D], lse [B, H, N]), both
# differentiable: the queries' attention to the keys from ``first`` on under the tree mask
OwnPart = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, float], tuple[torch.Tensor, torch.Tensor]]


class GroupMerge(torch.autograd.Function):
    """The fused part over the prefix keys, merged with the own part's ``o_own`` / ``l_own``.
    Saves q, the prefix K/V, the merged output and log-sum-exp (all rows: the kernel's
    backward reads them), and ``o_own``."""

    @staticmethod
    def forward(ctx, q, k, v, o_own, l_own, layout: Layout, scale: float, kernel: Kernel):
        rows = layout.queries(q)
        out, raw, extras = kernel.run_forward(rows, k, v, False, scale)
        out, lse = merge_into(out, raw, layout.rows, layout.lead, o_own, l_own.to(raw.dtype))
        ctx.save_for_backward(q, k, v, out, lse, o_own, l_own)
        ctx.layout, ctx.scale, ctx.kernel, ctx.extras = layout, scale, kernel, extras
        return layout.real(out)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, o_own, l_own = ctx.saved_tensors
        layout = ctx.layout
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = ctx.kernel.run_backward(layout.padded_grad(dout, out), layout.queries(q), k, v, out, lse,
                                             ctx.extras, False, ctx.scale)
        dtype = torch.promote_types(dout.dtype, torch.float32)
        w = torch.exp(l_own.to(dtype) - layout.real(lse_rows(lse, layout.rows)).to(dtype))[..., None]
        d = dout.to(dtype)
        grad_o = (d * w).to(o_own.dtype)
        grad_l = (w * d * (o_own.to(dtype) - layout.real(out).to(dtype))).sum(-1).to(l_own.dtype)
        return layout.real(dq), dk, dv, grad_o, grad_l, None, None, None


def group_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                    own: OwnPart, kernel: Kernel) -> torch.Tensor | None:
    """query [1, H, N, D] of a group, key/value [1, Hk, P + N, D] (the prefix's, every one seen
    by every query, then its own) -> [1, H, N, D]; None where ``kernel``'s grid leaves no full
    prefix keys (a prefix shorter than its ``align``: the caller masks)."""
    n = query.shape[2]
    layout = Layout.of(n, key.shape[2] - n, kernel.align, causal=False)
    keys = layout.full_keys
    if keys == 0:
        return None
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    o_own, l_own = own(query, key[:, :, keys:], value[:, :, keys:], keys, scale)
    return GroupMerge.apply(query, key[:, :, :keys], value[:, :, :keys], o_own, l_own, layout, scale, kernel)
