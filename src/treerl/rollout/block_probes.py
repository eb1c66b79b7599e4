"""The decode step's probes (:mod:`~treerl.rollout.blocks`): each kernel path against the modules' math or against
its own launches in turn, on the first layer of the step that first takes it, before that path serves any step."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .layer_math import _gated_tail, _heads, _pre, _qk_norms, _qkv, _qkv_rope, _small_tail, _tail_norm
from .rope_kernel import rope_write


def _agree(want: tuple, got: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    """Two tails' outputs within their dtype's rounding, relative to their largest value (float32: 1e-5, or
    TF32's where cuBLAS runs float32 products in TF32; 16-bit: 4 units of its last place)."""
    if dtype == torch.float32:
        tol = 4 * 2.0 ** -11 if torch.backends.cuda.matmul.allow_tf32 and device.type == "cuda" else 1e-5
    else:
        tol = 4 * torch.finfo(dtype).eps
    return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol,
                                                     atol=tol * a.float().abs().max().item()) for a, b in zip(want, got))


def _probe_attention(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A random attention output ``[B, 1, heads x head size]`` for the tail probes (seeded)."""
    gen = torch.Generator(device=hidden.device).manual_seed(0)
    return torch.randn(hidden.shape[0], 1, layer.self_attn.o_proj.in_features, device=hidden.device,
                       dtype=hidden.dtype, generator=gen)


def _tail_agrees(tail, layer: torch.nn.Module, hidden: torch.Tensor, fused, following: torch.nn.Module) -> bool:
    """``tail(attn)`` (a kernel path's block tail on the first layer) against :func:`_tail_norm` (eager) on this
    step's hidden states and a random attention output (:func:`_agree`)."""
    attn = _probe_attention(layer, hidden)
    want = _tail_norm(layer, hidden, attn, fused.gate_up_w[0], fused.gate_up_b[0], fused.o_w[0], fused.down_w[0],
                      following)
    return _agree(want, tail(attn), hidden.dtype, hidden.device)


def _small_agrees(residual_norm, layer: torch.nn.Module, hidden: torch.Tensor, fused,
                  weights: tuple, following: torch.nn.Module) -> bool:
    """:func:`_small_tail` (with the step's ``residual_norm``: compiled where the step's is) against
    :func:`_tail_norm` (:func:`_tail_agrees`)."""
    return _tail_agrees(lambda attn: _small_tail(residual_norm, layer, hidden, attn, weights, following), layer,
                        hidden, fused, following)


def _gated_agrees(front, back, layer: torch.nn.Module, hidden: torch.Tensor, fused,
                  following: torch.nn.Module) -> bool:
    """:func:`_gated_tail` (with the step's ``front``/``back``: compiled where the step's parts are) against
    :func:`_tail_norm` (:func:`_tail_agrees`)."""
    return _tail_agrees(lambda attn: _gated_tail(front, back, layer, hidden, attn, fused.gate_up_w[0], fused.o_w[0],
                                                 fused.down_w[0], following), layer, hidden, fused, following)


def _chain_agrees(residual_norm, layer: torch.nn.Module, hidden: torch.Tensor, weights: tuple,
                  following: torch.nn.Module) -> bool:
    """:func:`_small_tail` as a chain against its launches in turn (``residual_norm``'s sums and norms) on
    the first layer (:func:`_agree`): eager, then captured in a CUDA graph (as the step runs it) and
    replayed on three other inputs, each replay against the launches in turn on that input (a link
    that read its input before the kernel before it had written it would give the previous replay's
    values)."""
    attn = _probe_attention(layer, hidden)

    def tail(h, a, chain):
        return _small_tail(residual_norm, layer, h, a, weights, following, chain)

    if not _agree(tail(hidden, attn, False), tail(hidden, attn, True), hidden.dtype, hidden.device):
        return False
    h_in, a_in = hidden.clone(), attn.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = tail(h_in, a_in, True)
    for scale in (-1.0, 0.5, 2.0):
        h_in.copy_(hidden * scale)
        a_in.copy_(attn.flip(0) * scale)
        graph.replay()
        if not _agree(tail(h_in, a_in, False), got, hidden.dtype, hidden.device):
            return False
    return True


def _rope_kernel_agrees(layer, hidden, cos, sin, G, w_qkv, b_qkv, store) -> bool:
    """:func:`~treerl.rollout.rope_kernel.rope_write` against :func:`_pre` (eager) on one
    layer's inputs, each writing a scratch pool (block 0, row ``i`` at slot ``i``): every
    output within its dtype's rounding (float32: 1e-5; half precision and a float8 store's: 2
    units of its last place, relative to the output's largest value)."""
    D = cos.shape[-1]
    Dv = store.ov.shape[-1]
    B = hidden.shape[0]
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16) or D & (D - 1) or Dv & (Dv - 1) or B % G:
        return False  # (float64: the kernel computes in float32)
    try:
        pools = [[torch.zeros(1, p.shape[1], B, p.shape[3], dtype=p.dtype, device=p.device) for p in (store.ok, store.ov)]
                 for _ in range(2)]
        block = torch.zeros(B, dtype=torch.int64, device=hidden.device)
        offset = torch.arange(B, device=hidden.device)
        want = _pre(layer, hidden, cos, sin, G, w_qkv, b_qkv, *pools[0], block, offset)
        got = rope_write(_qkv(layer, hidden, w_qkv, b_qkv), cos, sin, *_qk_norms(layer), *_heads(layer), G,
                         *pools[1], block, offset)
        def tol(dtype: torch.dtype) -> float:  # (a float8 store's values: 2 units of float8's last place)
            return 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps

        pairs = list(zip(want, got)) + list(zip(pools[0], pools[1]))
        return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol(b.dtype),
                                                         atol=tol(b.dtype) * b.float().abs().max().item())
                   for a, b in pairs)
    except Exception:  # noqa: BLE001 - any failure: the compiled torch path
        return False


def _qkv_link_agrees(layer: torch.nn.Module, x: torch.Tensor, w_qkv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, G: int, store, splits: int) -> bool:
    """:func:`_qkv_rope` linked (the product's partials over ``splits`` ranges) against in turn on the first layer's
    weights, into scratch pools (block 0, row
    ``i`` at slot ``i``; :func:`_agree`, within its tolerance: the reference is cuBLAS's product, then the rope
    kernel): eager, then captured in a CUDA graph and replayed on three other inputs, each replay against that
    reference on that input."""
    B = x.shape[0]
    block = torch.zeros(B, dtype=torch.int64, device=x.device)
    offset = torch.arange(B, device=x.device)

    def run(x_in: torch.Tensor, linked: bool) -> list[torch.Tensor]:
        pools = SimpleNamespace(ok=torch.zeros(1, store.ok.shape[1], B, store.ok.shape[3], dtype=store.ok.dtype,
                                               device=x.device),
                                ov=torch.zeros(1, store.ov.shape[1], B, store.ov.shape[3], dtype=store.ov.dtype,
                                               device=x.device))
        out = _qkv_rope(layer, x_in, w_qkv, None, cos, sin, G, pools, block, offset, linked, splits=splits)
        return [*out, pools.ok, pools.ov]

    if not _agree(run(x, False), run(x, True), x.dtype, x.device):
        return False
    x_in = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run(x_in, True)
    for scale in (-1.0, 0.5, 2.0):
        x_in.copy_(x.flip(0) * scale)
        graph.replay()
        if not _agree(run(x_in, False), got, x.dtype, x.device):
            return False
    return True
