"""A prefill window's attention through the split-key kernel (:mod:`~treerl.rollout.decode_attention`).

A serving batch's prefills are small: a conversation's next turn, a few dozen to a few hundred
new tokens (the last ``T`` slots of a left-padded cache of ``L`` slots, :class:`~treerl.rollout.
prefill.Prefiller`) over its earlier turns' ~1-3k cached keys. Through SDPA that attention runs
CUDA's memory-efficient kernel over a dense ``[B, 1, T, L]`` mask, with the keys repeated for
every query head: session 16 measured ~2.2 ms of device time an admission for Qwen3-0.6B
(28 layers), while every running row's decode waited. Here the ``G = Hq / Hkv`` query heads of
a KV head are one kernel entry's ``G x T`` queries, the keys are split into ranges to fill the
GPU, and the ranges merge by their log-sum-exps (:func:`~treerl.rollout.decode_attention.merge_ranges`).

The prefill's mask says, per row, which slots its last query sees (the row's slots from its
first, ``[first, L)``) and that each query ``q`` sees no slot past itself: the kernel takes
the last query's mask row and a causal bound, which give every real query exactly the keys
the dense mask gives it. Padding queries (a row's window slots before its new tokens; the
dense mask lets them see slot 0 only) see something else: their row's slots up to
themselves, or, before the row's first slot or in a chunk with no new token of their row,
a finite average. Their outputs are never used (they write their K/V to slot 0, which no
real query sees; the logits are the rows' last queries'; only a row's own slots are copied
out)."""

from __future__ import annotations

import functools

import torch

from .decode_attention import TARGET_PROGRAMS, merge_ranges, split_attention, split_attention_ok
from .kernel_probe import kernel_agrees
from .prefill import prefill_mask


# a window's programs to launch at least: half the decode step's (bench/prefill_attention.py, session 17 call 3, H200:
# faster or equal on all six shapes, e.g. the served run's commonest bucket 1 x 64 x 4,096 38.2 -> 29.3 us a layer,
# fewer float32 partials to write and merge; a quarter was faster on single rows, much slower on 4 x 256 x 4,096)
WINDOW_TARGET = TARGET_PROGRAMS // 2


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     target: int = WINDOW_TARGET) -> torch.Tensor:
    """``q [B, Hq, T, D]`` (the last ``T`` of ``L`` slots), ``k/v [B, Hkv, L, D]``, the additive
    prefill mask ``[B, 1, T, L]`` (query ``t`` at slot ``L - T + t``; each real query sees its
    row's slots ``[first, itself]``) -> ``[B, T, Hq, Dv]`` in ``q``'s dtype. ``target``: the
    programs to launch at least (:func:`~treerl.rollout.decode_attention.splits_for`)."""
    B, Hq, T, D = q.shape
    H, L, Dv = k.shape[1], k.shape[2], v.shape[3]
    M = Hq // H * T
    queries = q.reshape(B, H, M, D)  # KV head h's queries: its heads h x G + g, query g x T + t
    o, lse = split_attention(queries, k, v, mask[:, 0, -1], scale, causal=(L - T, T), target=target)
    if o.shape[2] == 1:  # one key range (long windows: their query blocks alone fill the GPU): no merge
        out = o[:, :, 0].to(q.dtype)
    else:  # (B x H x query blocks < target here, so Hq x T stays far below the merge grid's 65,535 limit)
        none_o = o.new_empty(B, H, 0, M, Dv)  # (no second part to merge with)
        out = merge_ranges(o, lse, none_o, lse.new_empty(B, H, 0, M), 1, q.dtype, window=True)  # [B, 1, Hq x T, Dv]
    # a tensor of its own, [B, T, Hq, Dv] contiguous (the copy contiguous() makes for T > 1): at T = 1 the transpose
    # moves no element and contiguous() would return a view of either branch's output, whose bases differ ([B, H, M,
    # Dv] / [B, 1, Hq T, Dv]); the compiled block after it guards on its input's base, so the branch a prefill of one
    # query took would pick its graph, and the other branch compiled again while rows decode (session 38, H200)
    return out.view(B, Hq, T, Dv).transpose(1, 2).clone(memory_format=torch.contiguous_format)


@functools.lru_cache(maxsize=None)
def window_attention_ok(device: str, dtype: torch.dtype, head_dim: int, value_dim: int) -> bool:
    """Whether :func:`window_attention` runs here and agrees with float64 attention under a
    prefill's mask (probed once per device, dtype and head sizes; never inside a capture)."""
    if not split_attention_ok(device, dtype, head_dim, value_dim):
        return False

    def check() -> bool:
        g = torch.Generator(device=device).manual_seed(0)
        B, Hq, H, T, L = 3, 4, 2, 40, 230  # rows of 230, 120 and 0 slots (a padding row); 40 queries, a part padding
        q = torch.randn(B, Hq, T, head_dim, device=device, dtype=dtype, generator=g)
        k = torch.randn(B, H, L, head_dim, device=device, dtype=dtype, generator=g)
        v = torch.randn(B, H, L, value_dim, device=device, dtype=dtype, generator=g)
        first = torch.tensor([1, L - 120, L], device=device)[:, None]
        new = torch.tensor([L - T, L - 25, L], device=device)[:, None]  # each row's first new token's slot
        slot = torch.arange(L - T, L, device=device)[None, :]
        mask, _ = prefill_mask(first, slot < new, L - T, L, dtype)
        s = torch.matmul(q.double(), k.double().repeat_interleave(Hq // H, 1).transpose(-1, -2)) * 0.125
        ref = torch.matmul(torch.softmax(s + mask.double(), -1), v.double().repeat_interleave(Hq // H, 1))
        got = window_attention(q, k, v, mask, 0.125).double().transpose(1, 2)
        real = (slot >= new)[:, None, :, None].expand_as(ref)  # real queries only: padding outputs are unused
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        if not (torch.isfinite(got).all() and torch.allclose(got[real], ref[real], atol=tol)):
            return False
        for T in (1, 16, 64):  # every variant (query tiles of 16, 32, 64) compiled now, not while rows wait
            x = torch.zeros(1, Hq, T, head_dim, device=device, dtype=dtype)
            window_attention(x, *(torch.zeros(1, H, 256, n, device=device, dtype=dtype) for n in (head_dim, value_dim)),
                             torch.zeros(1, 1, T, 256, device=device, dtype=dtype), 0.125)
        return True

    return kernel_agrees(check, what="the prefill window's split-key attention", reference="float64 attention",
                         where=f"{device} ({dtype}, head {head_dim}/{value_dim})",
                         fallback="prefills attend through SDPA over their dense masks (slower)")
