"""Attention of one chain piece after a prefix, through the fused SDPA kernels (issue 24).

A model call whose segment is one chain (:attr:`treerl.engine.attention.TreeAttention.causal`)
after the K/V of its ancestors (the prefix, ``P`` keys) has a mask of two plain parts: every
query sees every prefix key, and its own keys causally. Its attention is the merge of

- ``A_prefix``: full (unmasked) attention of the queries to the prefix keys, and
- ``A_own``: causal attention of the queries to their own keys (a square: top-left aligned),

each with its log-sum-exp ``l``: ``lse = logaddexp(l1, l2)``,
``out = o1 e^(l1 - lse) + o2 e^(l2 - lse)``. Both parts are what the fastest fused kernels do
(cuDNN's and flash's SDPA take no tree mask, and cuDNN's causal mask is top-left aligned only).

The backward needs no differentiable log-sum-exp: a flash-attention backward given the
*merged* output and log-sum-exp (``P = exp(S - lse)``, ``D = rowsum(dO * O)``) yields exactly
its part's dQ, dK, dV (the ring-attention identity); dQ is the sum of both parts'.

Kernels (:data:`KERNELS`, tried in order): cuDNN's, flash's and the memory-efficient SDPA
aten ops that return the log-sum-exp and have explicit backward ops. The aten ops skip the
checks that ``F.scaled_dot_product_attention`` makes before it picks a kernel, so this module
makes them itself: :func:`refuses` (head dims and head counts, torch's ``sdp_utils.cpp`` limits)
before a kernel is ever called, and the lengths below. The first use for a
(device, dtype, heads, KV heads, head dim) probes the kernels on small odd-length inputs against the
plain-torch implementation (output, log-sum-exp convention and gradients, with K/V heads
as they are (GQA) and, failing that, repeated to every query head); the first that passes
serves every later call (:data:`PROBED` keeps why the others failed). If none does (ops missing,
inputs refused), :func:`chain_attention` returns ``None`` after one warning, and the caller runs
the tree mask as before. On the CPU the same merge and backward run with the plain-torch parts
(:data:`MATH`: what the float64 tests check exactly). On CUDA only half-precision inputs take the
fused kernels (the kernels' dtypes); float32/float64 calls return ``None`` without a warning (the
tree mask path is exact there).

**Lengths on a grid** (:class:`~treerl.engine.kernel_plans.Layout`, ``Kernel.align``: :data:`ALIGN`, 128 for cuDNN). cuDNN's
SDPA refuses key length 1 (torch's dispatch never hands it one), cuDNN before 9.15.1 was wrong on
lengths that are not multiples of 128 (torch's sdp_utils.cpp prefers cuDNN only from there on;
NVIDIA cudnn-frontend#160: NaN gradients), and it builds an execution plan per new shape. So the
kernel calls of an aligned kernel run on lengths that are multiples of ``align``, exactly:
``front = prefix % align`` prefix keys move from the full part to the causal part, whose
queries get ``front`` dummy rows in front (zero queries) and dummy rows and zero keys at the end,
up to ``rows``, a multiple of ``align``; the full part takes the first ``prefix - front`` keys
(a multiple of ``align``; none: no full part) with the same padded queries. Real query ``i`` sits
at row ``front + i`` of the causal part, whose top-left causal mask shows it the moved prefix keys
and its own keys up to itself; a dummy key at the end is seen by dummy rows only. The backward
gives the dummy rows a zero output gradient, so they add nothing to any dK/dV (``dS = P (dO V^T -
rowsum(dO O)) = 0``), and their dQ and the dummy keys' dK/dV are dropped. Costs: fewer than
``2 align`` dummy rows per call, and copies of the queries and the causal part's K/V (none when
the prefix and the queries are already multiples of ``align``, as the 2,048-token pieces of a
long prompt are). Distinct kernel shapes are then (rows, prefix keys) pairs on the grid;
:mod:`treerl.engine.kernel_plans` counts them per kernel and bounds the plans cuDNN builds in one
engine call and in a process (~270 ms each on an H100; :class:`Layout` lives there too): a call
of a new shape beyond it runs through the next kernel that passed the probe (flash), exactly the
same math, and a later call plans it.

Costs beside the two kernels: the merge (elementwise over [N, H, D] in float32), dQ summed
and the prefix's and own dK/dV concatenated (a copy of the keys' gradients, ~126 MB for 30k
keys of 8 x 128 in bf16). A kernel without GQA gets K/V repeated to every query head (a copy
of 2 x keys x heads x head dim per layer and call, ~250 MB at 30k keys, made again in the
backward, and dK/dV summed back): the probe prefers the heads as they are. cuDNN builds (and
caches) an execution plan per new shape and strides: the first call of each (queries, prefix)
length pays it (bench/chain_attention.py's ``first_ms``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .kernel_plans import Layout, planned

aten = torch.ops.aten

# Probe order on CUDA; a name left out is never used (bench/chain_attention.py times each).
KERNELS: tuple[str, ...] = ("cudnn", "flash", "efficient")
FUSED_DTYPES = (torch.bfloat16, torch.float16)
# Kernels whose calls run on lengths padded to multiples of this (Layout; others: as they are).
ALIGN: dict[str, int] = {"cudnn": 128}
# Largest head dim each fused kernel takes here (torch's sdp_utils.cpp; cuDNN's 256 needs recent
# cuDNN on sm90/sm100 only: 128, the families treerl supports use 64 or 128), all multiples of 8.
HEAD_DIM_LIMIT: dict[str, int] = {"cudnn": 128, "flash": 256, "efficient": 256}

# part forward: (q [B,H,N,D], k [B,Hk,M,D], v, causal, scale) -> (out [B,H,N,D], raw lse, extra)
# part backward: (dout, q, k, v, out, raw lse, extra, causal, scale) -> (dq, dk, dv)
PartForward = Callable[..., tuple[torch.Tensor, torch.Tensor, tuple]]
PartBackward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Kernel:
    """One attention part's forward and backward. ``expand_kv``: K/V heads are repeated to
    every query head before the kernel and dK/dV summed back (kernels without GQA).
    ``align``: its calls run on lengths padded to multiples of this (:class:`Layout`)."""

    name: str
    forward: PartForward
    backward: PartBackward
    expand_kv: bool = False
    align: int = 1

    @property
    def label(self) -> str:
        return self.name + ("-expanded" if self.expand_kv else "")

    def run_forward(self, q, k, v, causal: bool, scale: float):
        if self.expand_kv:
            k, v = _expand(k, v, q.shape[1] // k.shape[1])
        return self.forward(q, k, v, causal, scale)

    def run_backward(self, dout, q, k, v, out, lse, extra, causal: bool, scale: float):
        groups = q.shape[1] // k.shape[1]
        if self.expand_kv:
            k, v = _expand(k, v, groups)
        dq, dk, dv = self.backward(dout, q, k, v, out, lse, extra, causal, scale)
        if self.expand_kv and groups > 1:
            dk, dv = (x.unflatten(1, (-1, groups)).sum(2) for x in (dk, dv))
        return dq, dk, dv


def fused_kernel(name: str, expand_kv: bool = False) -> Kernel:
    """The fused kernel ``name`` of :data:`FUSED` as the engine runs it (its :data:`ALIGN`)."""
    return Kernel(name, *FUSED[name], expand_kv=expand_kv, align=ALIGN.get(name, 1))


def refuses(name: str, heads: int, kv_heads: int, dim: int) -> str | None:
    """Why the fused kernel ``name`` must not be called on heads like these, or None (the
    limits torch's SDPA dispatch checks before it calls a kernel; the aten ops called directly
    check less and may fail badly). Lengths: :class:`Layout` keeps cuDNN's on its grid."""
    if name not in HEAD_DIM_LIMIT:
        return None  # not one of the fused kernels (a test's)
    if dim % 8 or dim > HEAD_DIM_LIMIT[name]:
        return f"head dim {dim} (takes multiples of 8 up to {HEAD_DIM_LIMIT[name]})"
    if heads % kv_heads:
        return f"{heads} heads over {kv_heads} KV heads"
    if name == "cudnn" and heads > 65535:
        return f"{heads} heads (at most 65535)"
    return None


def _expand(k: torch.Tensor, v: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V heads repeated to the query heads (query head h reads KV head h // groups, as HF's repeat_kv)."""
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


def lse_rows(raw: torch.Tensor, n: int) -> torch.Tensor:
    """[B, H, n] view of a kernel's log-sum-exp: cuDNN's [B, H, n, 1], flash's [B, H, n], the
    memory-efficient kernel's [B, H, n rounded up to 32]."""
    return raw[..., 0] if raw.dim() == 4 else raw[..., :n]


# ------------------------------------------------------------------ plain torch
def _scores(q, k, causal: bool | torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled scores [B, H, N, M] in float32 at least; ``causal``: top-left causal, or a
    [N, M] boolean visibility mask (a group's own part, :mod:`treerl.engine.group_attention`)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)) * scale
    if isinstance(causal, torch.Tensor):
        return s.masked_fill(~causal, float("-inf"))
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, -1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1).to(s.dtype)
    return (torch.exp(s - lse[..., None]) @ v).to(q.dtype), lse, ()


def _math_backward(dout, q, k, v, out, lse, extra, causal, scale):
    groups = q.shape[1] // k.shape[1]
    s = _scores(q, k, causal, scale)
    dtype = s.dtype
    p = torch.exp(s - lse_rows(lse, q.shape[2]).to(dtype)[..., None])
    dout, out, q = dout.to(dtype), out.to(dtype), q.to(dtype)
    ke, ve = (x.repeat_interleave(groups, 1).to(dtype) for x in (k, v))
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ ve.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    dq = (ds @ ke) * scale
    dk = (ds.transpose(-1, -2) @ q) * scale
    if groups > 1:
        dk, dv = (x.unflatten(1, (-1, groups)).sum(2) for x in (dk, dv))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


MATH = Kernel("math", _math_forward, _math_backward)


# ------------------------------------------------------------- SDPA aten ops
def _cudnn_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse, (seed, offset, cum_q, cum_k, max_q, max_k)


def _cudnn_backward(dout, q, k, v, out, lse, extra, causal, scale):
    seed, offset, cum_q, cum_k, max_q, max_k = extra
    return aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)


def _flash_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(dout, q, k, v, out, lse, extra, causal, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    return aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _efficient_forward(q, k, v, causal, scale):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal,
                                                                          scale=scale)
    return out, lse, (seed, offset)


def _efficient_backward(dout, q, k, v, out, lse, extra, causal, scale):
    seed, offset = extra
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


FUSED: dict[str, tuple[PartForward, PartBackward]] = {
    "cudnn": (_cudnn_forward, _cudnn_backward),
    "flash": (_flash_forward, _flash_backward),
    "efficient": (_efficient_forward, _efficient_backward),
}


# ------------------------------------------------------------ merge, backward
def merge_into(out: torch.Tensor, raw_lse: torch.Tensor, rows: int, start: int, other: torch.Tensor,
               other_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a part's ``out`` [B, H, rows, D] and kernel log-sum-exp ``raw_lse`` (its format,
    :func:`lse_rows`) with another part's ``other`` [B, H, m, D] and ``other_lse`` [B, H, m]
    on rows ``start`` to ``start + m``: ``lse = logaddexp(l1, l2)``, ``o1 e^(l1 - lse) +
    o2 e^(l2 - lse)`` (in float32 at least) -> new (out, log-sum-exp) in ``out``'s layout and
    ``raw_lse``'s format (what the kernel's backward reads); the other rows as they were."""
    m = other.shape[2]
    l1 = lse_rows(raw_lse, rows).narrow(2, start, m)
    lse = torch.logaddexp(l1, other_lse)
    dtype = torch.promote_types(out.dtype, torch.float32)
    merged = out.narrow(2, start, m).to(dtype) * torch.exp(l1 - lse)[..., None].to(dtype)
    merged += other.to(dtype) * torch.exp(other_lse - lse)[..., None].to(dtype)
    result = torch.empty_like(out) if m == rows else out.clone()  # (keeps the kernel's layout)
    result.narrow(2, start, m).copy_(merged)
    packed = raw_lse.clone()  # the kernel's format (padding rows included)
    lse_rows(packed, rows).narrow(2, start, m).copy_(lse)
    return result, packed


@dataclass(frozen=True)
class Extras:
    """What :func:`chain_backward` needs beside the inputs: each part's kernel extras, the
    layout, and (padded layouts) the merged output and log-sum-exp of every row."""

    full: tuple | None
    own: tuple
    layout: Layout
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None


def chain_forward(kernel: Kernel, q, k, v, prefix: int, scale: float):
    """q [B, H, N, D], k/v [B, Hk, prefix + N, D] -> (out [B, H, N, D] laid out as the kernel's,
    merged log-sum-exp (:func:`lse_rows` reads its N rows), :class:`Extras`)."""
    layout = Layout.of(q.shape[2], prefix, kernel.align)
    rows, k_own, v_own = layout.inputs(q, k, v)
    own = kernel.run_forward(rows, k_own, v_own, True, scale)
    if layout.full_keys == 0:
        out, lse = own[0], own[1]
        extras = Extras(None, own[2], layout)
    else:
        full = kernel.run_forward(rows, k[:, :, :layout.full_keys], v[:, :, :layout.full_keys], False, scale)
        out, lse = merge_into(own[0], own[1], layout.rows, 0, full[0], lse_rows(full[1], layout.rows))
        extras = Extras(full[2], own[2], layout)
    if not layout.padded:
        return out, lse, extras
    extras = Extras(extras.full, extras.own, layout, out, lse)
    return layout.real(out), layout.real(lse_rows(lse, layout.rows)), extras


def chain_backward(kernel: Kernel, dout, q, k, v, out, lse, extras: Extras, prefix: int, scale: float):
    """dQ, dK, dV of :func:`chain_forward` given its merged output and log-sum-exp."""
    layout = extras.layout
    rows, k_own, v_own = layout.inputs(q, k, v)
    if layout.padded:
        out, lse = extras.out, extras.lse
        dout = layout.padded_grad(dout, out)
    dq, dk, dv = kernel.run_backward(dout, rows, k_own, v_own, out, lse, extras.own, True, scale)
    own = layout.front + layout.n  # the causal part's real keys
    if layout.padded:
        dk, dv = dk[:, :, :own], dv[:, :, :own]
    if layout.full_keys:
        keys = layout.full_keys
        dq_full, dk_full, dv_full = kernel.run_backward(dout, rows, k[:, :, :keys], v[:, :, :keys], out, lse,
                                                        extras.full, False, scale)
        dq = dq + dq_full
        dk, dv = torch.cat([dk_full, dk], 2), torch.cat([dv_full, dv], 2)
    return layout.real(dq), dk, dv


class ChainAttention(torch.autograd.Function):
    """Autograd of :func:`chain_forward` / :func:`chain_backward` (saves q, k, v, the merged
    output and log-sum-exp: what a flash attention saves)."""

    @staticmethod
    def forward(ctx, q, k, v, prefix: int, scale: float, kernel: Kernel):
        out, lse, extras = chain_forward(kernel, q, k, v, prefix, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prefix, ctx.scale, ctx.kernel, ctx.extras = prefix, scale, kernel, extras
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv = chain_backward(ctx.kernel, dout, q, k, v, out, lse, ctx.extras, ctx.prefix, ctx.scale)
        return dq, dk, dv, None, None, None


# ------------------------------------------------------------------ selection
_chosen: dict[tuple, Kernel | None] = {}
# Per probed (device, dtype, heads, KV heads, head dim, names): the kernel chosen (its label, or
# None) and why each kernel before it was rejected (what a benchmark prints).
PROBED: dict[str, dict] = {}
def kernel_for(q: torch.Tensor, k: torch.Tensor, causal: bool = True) -> Kernel | None:
    """The kernel for inputs like these (q [B, H, N, D] of one chain piece, or with
    ``causal=False`` of a group, k [B, Hk, P + N, D]), or None: probed once per device, dtype
    and head shape, then :func:`planned` for the shape."""
    if q.device.type == "cpu":
        return MATH
    if q.device.type != "cuda" or q.dtype not in FUSED_DTYPES:
        return None
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[3]
    kernel = select(q.device, q.dtype, heads, kv_heads, dim)
    if kernel is None:
        return None
    rest = tuple(name for name in KERNELS if name != kernel.name)
    return planned(kernel, q, k, lambda: select(q.device, q.dtype, heads, kv_heads, dim, rest) if rest else None,
                   causal)


def select(device, dtype, heads: int, kv_heads: int, dim: int, names: tuple[str, ...] | None = None,
           fused: dict[str, tuple[PartForward, PartBackward]] | None = None) -> Kernel | None:
    """:func:`probe`'s choice, probed once per arguments; None after one warning saying why."""
    names = KERNELS if names is None else names
    key = (str(device), dtype, heads, kv_heads, dim, names, id(fused))
    if key not in _chosen:
        _chosen[key], errors = probe(device, dtype, heads, kv_heads, dim, names, fused)
        PROBED[f"{device} {dtype} {heads}/{kv_heads}x{dim} {','.join(names)}"] = dict(
            chosen=None if _chosen[key] is None else _chosen[key].label, rejected=errors)
        if _chosen[key] is None:
            warnings.warn(
                f"treerl chain attention: no fused SDPA kernel took {dtype} inputs of {heads} heads / "
                f"{kv_heads} KV heads x {dim} ({'; '.join(errors)}); chain pieces after a prefix run "
                "with the tree mask (slower). treerl.engine.attention.CHAIN_AFTER_PREFIX = False skips "
                "this probe.", RuntimeWarning, stacklevel=2)
    return _chosen[key]


def probe(device, dtype, heads: int, kv_heads: int, dim: int, names=KERNELS,
          fused: dict[str, tuple[PartForward, PartBackward]] | None = None) -> tuple[Kernel | None, list[str]]:
    """The first of ``names`` whose chain attention matches :data:`MATH` (computed in float32)
    on small odd-length inputs laid out as the engine's, with K/V heads as given, else
    repeated; and why each rejected one failed. A kernel that :func:`refuses` the heads is
    never called."""
    fused = FUSED if fused is None else fused
    errors = []
    for name in names:
        if name not in fused:
            errors.append(f"{name}: unknown")
            continue
        why = refuses(name, heads, kv_heads, dim) if fused is FUSED else None
        if why is not None:
            errors.append(f"{name}: refuses {why}")
            continue
        for expand in (False, True) if kv_heads != heads else (False,):
            kernel = Kernel(name, *fused[name], expand_kv=expand, align=ALIGN.get(name, 1) if fused is FUSED else 1)
            try:
                err = _probe_error(kernel, device, dtype, heads, kv_heads, dim)
            except Exception as exc:  # a missing op or refused inputs: try the next
                errors.append(f"{kernel.label}: {type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120] if str(exc) else ''}")
                continue
            if err is None:
                return kernel, errors
            errors.append(f"{kernel.label}: {err}")
    return None, errors


def _probe_error(kernel: Kernel, device, dtype, heads: int, kv_heads: int, dim: int) -> str | None:
    """None if ``kernel``'s chain attention matches the float32 math on three small shapes
    (odd lengths; one on the grid of an aligned kernel), else what differs. Plain tensors, no
    autograd (the probe may run inside a model call)."""
    gen = torch.Generator().manual_seed(0)
    tol = 2e-2 if dtype in FUSED_DTYPES else 1e-4
    for n, prefix in ((77, 131), (1, 64), (128, 256)):
        # the engine's layout: q [1, H, N, D] a view of [1, N, H, D]; K/V cut from one [1, Hk, P + N, D]
        q = torch.randn(1, n, heads, dim, generator=gen).transpose(1, 2).to(device, dtype)
        k, v = (torch.randn(1, kv_heads, prefix + n, dim, generator=gen).to(device, dtype) for _ in range(2))
        dout = torch.randn(1, n, heads, dim, generator=gen).transpose(1, 2).to(device, dtype)
        scale = dim ** -0.5
        with torch.no_grad():
            out, lse, extras = chain_forward(kernel, q, k, v, prefix, scale)
            grads = chain_backward(kernel, dout, q, k, v, out, lse, extras, prefix, scale)
            f32 = [x.float() for x in (q, k, v, dout)]
            ref_out, ref_lse, ref_extras = chain_forward(MATH, *f32[:3], prefix, scale)
            ref = chain_backward(MATH, f32[3], *f32[:3], ref_out, ref_lse, ref_extras, prefix, scale)
        checks = [("output", out, ref_out), ("log-sum-exp", lse_rows(lse, n), ref_lse)]
        checks += list(zip(("dq", "dk", "dv"), grads, ref))
        for what, got, want in checks:
            if got.shape != want.shape:
                return f"{what} of shape {tuple(got.shape)}, expected {tuple(want.shape)} ({n} after {prefix})"
            err = float((got.float() - want).abs().max()) / max(float(want.abs().max()), 1.0)
            if not math.isfinite(err) or err > tol:
                return (f"{what} differs from the float32 math by {err:.3g} (relative to its largest value; "
                        f"{n} after {prefix})")
    return None


def chain_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None,
                    kernel: Kernel | None = None) -> torch.Tensor | None:
    """query [1, H, N, D] of one chain, key/value [1, Hk, P + N, D] (the prefix's then its own)
    -> [1, H, N, D], or None where no kernel takes these inputs (the caller masks).
    ``kernel``: :func:`kernel_for`'s choice, if the caller asked already."""
    kernel = kernel_for(query, key) if kernel is None else kernel
    if kernel is None:
        return None
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    return ChainAttention.apply(query, key, value, key.shape[2] - query.shape[2], scale, kernel)
