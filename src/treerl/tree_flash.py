"""Tree attention as a few variable-length flash-attention calls merged by log-sum-exp.

The tree rule (DESIGN.md: query ``q`` sees key ``k`` iff ``k <= q < subtree_end[k]``) splits
a call's keys into *runs*: maximal ranges of consecutive keys of one node (consecutive tree
indices, one subtree end ``E``). A run ``[s, e)`` is seen

- causally by its own queries (the node's tokens of this call), and
- entirely by every query in ``[e, E)`` (the node's descendants in this call).

So tree attention is exactly one causal varlen call over the call's node runs (queries and
keys the same ranges) plus, per *level*, one non-causal varlen call of each run's descendant
queries against the run's keys. Descendant ranges of different runs are nested or disjoint
(a laminar family); a level holds disjoint ones, so each query meets each level at most
once, and a call has as many levels as its deepest node has ancestors with keys (GRPO: 1).
The parts' outputs are merged by their log-sum-exps. The backward is the ring-attention
identity: each part's flash backward, given the *merged* output and log-sum-exp, returns
that part's exact share of dQ, dK, dV. No tile is computed across a node boundary and no
K/V is copied per sequence: only the descendant queries of each level are gathered.

Kernels: on CUDA (bf16/fp16) PyTorch's flash-attention varlen ops; elsewhere an exact
math version of the same two functions (any dtype, float64 in the tests), so the CPU tests
run this module's decomposition, merge and backward as the GPU does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class VarlenPart:
    """One varlen call: sequences ``i`` are queries ``q_rows[cu_q[i]:cu_q[i+1]]`` against
    keys ``k_rows[cu_k[i]:cu_k[i+1]]`` (row indices into the call's queries / keys; ``None``:
    all rows in order). ``causal``: bottom-right aligned causal mask within each sequence."""

    cu_q: torch.Tensor  # [n + 1] int32
    cu_k: torch.Tensor  # [n + 1] int32
    max_q: int
    max_k: int
    causal: bool
    q_rows: torch.Tensor | None = None  # [total_q] int64
    k_rows: torch.Tensor | None = None  # [total_k] int64


@dataclass
class TreeParts:
    """The varlen calls of one model call (shared by all layers): ``own`` first, then one
    non-causal part per level."""

    own: VarlenPart
    levels: list[VarlenPart]


def _runs(index: np.ndarray, end: np.ndarray) -> list[tuple[int, int]]:
    """Maximal row ranges ``[a, b)`` of consecutive tree indices with one subtree end."""
    if len(index) == 0:
        return []
    cut = np.flatnonzero((np.diff(index) != 1) | (np.diff(end) != 0)) + 1
    bounds = np.concatenate([[0], cut, [len(index)]])
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def _part(q_ranges: list[tuple[int, int]], k_ranges: list[tuple[int, int]], causal: bool, device,
          gather: bool) -> VarlenPart:
    q_len = np.asarray([b - a for a, b in q_ranges], dtype=np.int64)
    k_len = np.asarray([b - a for a, b in k_ranges], dtype=np.int64)
    cu = lambda n: torch.as_tensor(np.concatenate([[0], np.cumsum(n)]), dtype=torch.int32, device=device)  # noqa: E731
    rows = lambda rs: torch.as_tensor(np.concatenate([np.arange(a, b) for a, b in rs]), device=device)  # noqa: E731
    return VarlenPart(cu(q_len), cu(k_len), int(q_len.max()), int(k_len.max()), causal,
                      rows(q_ranges) if gather else None, rows(k_ranges) if gather else None)


def tree_parts(q_index: torch.Tensor, k_index: torch.Tensor, k_end: torch.Tensor) -> TreeParts:
    """Plan the varlen calls of one model call. ``q_index`` [Nq]: one contiguous range of
    tree indices; ``k_index``/``k_end`` [Nk]: the prefix keys (earlier calls) then the
    queries' own keys (the last ``Nq`` keys are the queries' tokens)."""
    qi, ki, ke = (t.detach().cpu().numpy().astype(np.int64) for t in (q_index, k_index, k_end))
    nq, nk = len(qi), len(ki)
    q0 = int(qi[0]) if nq else 0
    if nq and not (np.diff(qi) == 1).all():
        raise ValueError("tree_parts: a call's queries must be one contiguous range of tree indices")
    if nk < nq or not (ki[nk - nq :] == qi).all():
        raise ValueError("tree_parts: the last keys of a call must be its queries' own tokens")
    own = _runs(ki[nk - nq :], ke[nk - nq :])  # rows of the queries == rows of the own keys - (nk - nq)
    # descendant queries of each run: tree indices [index after the run, subtree end)
    seen = []  # (q range, k range)
    prefix = _runs(ki[: nk - nq], ke[: nk - nq])
    for a, b in prefix + [(a + nk - nq, b + nk - nq) for a, b in own]:
        lo, hi = max(int(ki[b - 1]) + 1 - q0, 0), min(int(ke[a]) - q0, nq)
        if hi > lo:
            seen.append(((lo, hi), (a, b)))
    seen.sort(key=lambda s: (s[0][0], -s[0][1]))
    levels: list[list] = []
    open_: list[tuple[int, int]] = []  # (q end, level) of the enclosing ranges
    for (lo, hi), k in seen:
        while open_ and open_[-1][0] <= lo:
            open_.pop()
        depth = len(open_)
        if depth == len(levels):
            levels.append([])
        levels[depth].append(((lo, hi), k))
        open_.append((hi, depth))
    device = q_index.device
    own_part = _part(own, own, True, device, gather=False)
    parts = [_part([q for q, _ in lv], [k for _, k in lv], False, device, gather=True) for lv in levels]
    return TreeParts(own_part, parts)


# ----------------------------------------------------------------------------- kernels
def _math_forward(q, k, v, part: VarlenPart, scale: float):
    """Exact attention per sequence: ``q`` [Tq, H, D], ``k``/``v`` [Tk, Hkv, D] ->
    out [Tq, H, Dv], lse [H, Tq] (float32 for low precision, else q's dtype)."""
    H, rep = q.shape[1], q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape[0], H, v.shape[-1])
    lse = torch.full((H, q.shape[0]), float("-inf"), dtype=_lse_dtype(q), device=q.device)
    for (qa, qb), (ka, kb) in zip(_pairs(part.cu_q), _pairs(part.cu_k)):
        s, _ = _scores(q[qa:qb], k[ka:kb], rep, scale, part.causal)
        m = torch.logsumexp(s, dim=-1)  # [H, q]
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)
        out[qa:qb] = torch.einsum("hqk,khd->qhd", p.to(v.dtype), v[ka:kb].repeat_interleave(rep, dim=1))
        lse[:, qa:qb] = m.to(lse.dtype)
    return out, lse


def _math_backward(dout, q, k, v, out, lse, part: VarlenPart, scale: float):
    """The exact gradients of one part given the merged ``out``/``lse`` (ring identity)."""
    rep = q.shape[1] // k.shape[1]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (qa, qb), (ka, kb) in zip(_pairs(part.cu_q), _pairs(part.cu_k)):
        kk, vv = k[ka:kb].repeat_interleave(rep, dim=1), v[ka:kb].repeat_interleave(rep, dim=1)
        s, _ = _scores(q[qa:qb], k[ka:kb], rep, scale, part.causal)
        p = torch.exp(s - lse[:, qa:qb, None].to(s.dtype)).nan_to_num(0.0).to(q.dtype)  # [H, q, k]
        do = dout[qa:qb]
        dvv = torch.einsum("hqk,qhd->khd", p, do)
        dp = torch.einsum("qhd,khd->hqk", do, vv)
        delta = (do * out[qa:qb]).sum(-1).transpose(0, 1)  # [H, q]
        ds = p * (dp - delta[..., None]) * scale
        dq[qa:qb] = torch.einsum("hqk,khd->qhd", ds, kk)
        dkk = torch.einsum("hqk,qhd->khd", ds, q[qa:qb])
        dk[ka:kb] = dkk.unflatten(1, (-1, rep)).sum(2)
        dv[ka:kb] = dvv.unflatten(1, (-1, rep)).sum(2)
    return dq, dk, dv


def _pairs(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


def _scores(q, k, rep: int, scale: float, causal: bool):
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(rep, dim=1)).to(_lse_dtype(q)) * scale
    if causal:  # bottom-right aligned
        nq, nk = q.shape[0], k.shape[0]
        allowed = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None] + (nk - nq)
        s = s.masked_fill(~allowed, float("-inf"))
    return s, None


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype


def flash_available(device: torch.device, dtype: torch.dtype) -> bool:
    """PyTorch's flash-attention varlen kernels run here (CUDA, bf16/fp16, sm80+)."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(device)[0] >= 8)


def _flash_forward(q, k, v, part: VarlenPart, scale: float):
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, part.cu_q, part.cu_k, part.max_q, part.max_k, 0.0, part.causal, False, scale=scale)
    return out, lse


def _flash_backward(dout, q, k, v, out, lse, part: VarlenPart, scale: float):
    rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, part.cu_q, part.cu_k, part.max_q, part.max_k, 0.0, part.causal, rng,
        torch.empty(0, device=q.device), scale=scale)
    return dq, dk, dv


def _kernels(q: torch.Tensor):
    return (_flash_forward, _flash_backward) if flash_available(q.device, q.dtype) else (_math_forward, _math_backward)


def _sub(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows)


class _TreeFlash(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, parts: TreeParts, scale: float):
        fwd, _ = _kernels(q)
        nk_own = q.shape[0]
        k_own, v_own = k[k.shape[0] - nk_own :], v[v.shape[0] - nk_own :]
        out, lse = fwd(q, k_own, v_own, parts.own, scale)
        if parts.levels:
            acc = out.to(lse.dtype)
            for part in parts.levels:
                o_l, l_l = fwd(_sub(q, part.q_rows), _sub(k, part.k_rows), _sub(v, part.k_rows), part, scale)
                rows = part.q_rows
                l_old = lse[:, rows]
                l_new = torch.logaddexp(l_old, l_l)
                w_old = torch.exp(l_old - l_new).transpose(0, 1)[..., None]  # [q, H, 1]
                w_l = torch.exp(l_l - l_new).transpose(0, 1)[..., None]
                acc[rows] = acc[rows] * w_old + o_l.to(acc.dtype) * w_l
                lse[:, rows] = l_new
            out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.scale = parts, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        parts, scale = ctx.parts, ctx.scale
        _, bwd = _kernels(q)
        dout = dout.contiguous()
        nq = q.shape[0]
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dq, dk_own, dv_own = bwd(dout, q, k[k.shape[0] - nq :], v[v.shape[0] - nq :], out, lse, parts.own, scale)
        dk[k.shape[0] - nq :] = dk_own
        dv[v.shape[0] - nq :] = dv_own
        for part in parts.levels:
            rows = part.q_rows
            dq_l, dk_l, dv_l = bwd(dout[rows], q[rows], _sub(k, part.k_rows), _sub(v, part.k_rows), out[rows],
                                   lse[:, rows].contiguous(), part, scale)
            dq.index_add_(0, rows, dq_l)
            dk.index_add_(0, part.k_rows, dk_l)
            dv.index_add_(0, part.k_rows, dv_l)
        return dq, dk, dv, None, None


def tree_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, parts: TreeParts,
                         scale: float) -> torch.Tensor:
    """``q`` [Nq, H, D], ``k``/``v`` [Nk, Hkv, D] (prefix keys, then the queries' own) ->
    out [Nq, H, Dv]: exact tree attention (see the module docstring)."""
    return _TreeFlash.apply(q, k, v, parts, float(scale))
