"""A decoder layer's parts as the decode step computes them (:mod:`~treerl.rollout.blocks`): the modules' own
math in torch (the input norm and Q/K/V with RoPE, the attention merge and the block's tail, the residual norms), and
the kernel step's pieces (the Q/K/V product with the rope kernel, the small-row tail through
:mod:`~treerl.rollout.small_products`, the larger batches' tail with its SiLU gate through
:mod:`~treerl.rollout.silu_gate`), each a function of the layer's modules and weights."""

from __future__ import annotations

import sys

import torch

import treerl.rollout.small_products as small_products  # (the module: tests and benchmarks patch its settings)
from .rope_kernel import rope_write
from .silu_gate import silu_gate
from .shared import merge_parts, split_queries
from .types import raw, stored


def qkv_rope(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, w_qkv: torch.Tensor,
             b_qkv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's input norm, Q/K/V projections as one product (``w_qkv``/``b_qkv``), Q/K
    norms (Qwen3) and RoPE: ``hidden [B, T, H]`` -> ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]``
    (post-RoPE) and ``v [B, T, Hkv, Dv]``. The decode step's and the prefill's."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    D = attn.head_dim
    kv = attn.config.num_key_value_heads * D
    q, k, v = torch.nn.functional.linear(x, w_qkv, b_qkv).split([w_qkv.shape[0] - 2 * kv, kv, kv], dim=-1)
    shape = (*hidden.shape[:-1], -1, D)
    q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _pre(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, G: int,
         w_qkv: torch.Tensor, b_qkv: torch.Tensor | None, own_k: torch.Tensor, own_v: torch.Tensor,
         block: torch.Tensor, offset: torch.Tensor):
    """``hidden [B, 1, H]`` -> ``q_own [B, Hkv, gq, D]``, ``q_pre [B/G, Hkv, G gq, D]`` and the
    token's keys/values ``[B, Hkv, D]`` (post-RoPE, :func:`qkv_rope`), which are also written
    into the row store's block pools ``own_k/own_v [blocks, Hkv, Bk, D]``, row ``i`` at slot
    ``offset[i]`` of block ``block[i]``. ``w_qkv``/``b_qkv``: the Q, K, V projections as one."""
    q, k, v = qkv_rope(layer, hidden, cos, sin, w_qkv, b_qkv)
    k, v = stored(k[:, :, 0], own_k.dtype), stored(v[:, 0], own_v.dtype)
    raw(own_k)[block, :, offset] = raw(k)
    raw(own_v)[block, :, offset] = raw(v)
    q_own, q_pre = split_queries(q, own_k.shape[1], G)
    return q_own.contiguous(), q_pre.contiguous(), k, v


def _qkv(layer: torch.nn.Module, hidden: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None) -> torch.Tensor:
    """The input norm and the Q/K/V product: ``hidden [B, 1, H]`` -> ``[B, 1, (Hq + Hkv) D + Hkv Dv]``
    (:func:`_pre` up to :func:`~treerl.rollout.rope_kernel.rope_write`; its probe's)."""
    return torch.nn.functional.linear(layer.input_layernorm(hidden), w_qkv, b_qkv)


def _norm(norm: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return norm(hidden)


def _tail_norm(layer: torch.nn.Module, hidden: torch.Tensor, attn: torch.Tensor, w_gate_up: torch.Tensor | None,
               b_gate_up: torch.Tensor | None, w_o: torch.Tensor | None, w_down: torch.Tensor | None,
               following: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_tail`, and ``following`` (the next layer's input norm, or the final norm) of its
    output: ``(hidden, following(hidden))``, the residual and the norm one kernel."""
    hidden = _tail(layer, hidden, attn, w_gate_up, b_gate_up, w_o, w_down)
    return hidden, following(hidden)


def _post(layer: torch.nn.Module, hidden: torch.Tensor, o_own: torch.Tensor, l_own: torch.Tensor,
          o_pre: torch.Tensor, l_pre: torch.Tensor, G: int, w_gate_up: torch.Tensor | None,
          b_gate_up: torch.Tensor | None, w_o: torch.Tensor | None, w_down: torch.Tensor | None) -> torch.Tensor:
    """The merged attention output through the rest of the block: ``hidden [B, 1, H]`` out.
    ``w_gate_up``/``b_gate_up``: the MLP's gate and up projections as one (None: a sparse MoE
    block, run as :func:`treerl.moe.moe_forward`). ``w_o``/``w_down``: merged LoRA weights
    of the output/down projections (None: the modules themselves)."""
    attn = merge_parts(o_own, l_own, o_pre, l_pre, G, hidden.dtype)
    return _tail(layer, hidden, attn.reshape(*hidden.shape[:-1], -1), w_gate_up, b_gate_up, w_o, w_down)


def _tail(layer: torch.nn.Module, hidden: torch.Tensor, attn: torch.Tensor, w_gate_up: torch.Tensor | None,
          b_gate_up: torch.Tensor | None, w_o: torch.Tensor | None, w_down: torch.Tensor | None) -> torch.Tensor:
    """The rest of a block after attention: ``hidden [B, T, H]`` and the attention output
    ``attn [B, T, Hq x Dv]`` -> ``hidden [B, T, H]`` (output projection, residual, norm, MLP,
    residual; the weights as in :func:`_post`)."""
    hidden = _output_residual(layer, hidden, attn, w_o)
    mlp = layer.mlp
    x = layer.post_attention_layernorm(hidden)
    if w_gate_up is None:
        return hidden + mlp(x)
    gate, up = torch.nn.functional.linear(x, w_gate_up, b_gate_up).chunk(2, dim=-1)
    return hidden + _down(mlp, mlp.act_fn(gate) * up, w_down)


def _output_residual(layer: torch.nn.Module, hidden: torch.Tensor, attn: torch.Tensor,
                     w_o: torch.Tensor | None) -> torch.Tensor:
    """``hidden`` plus the output projection of ``attn`` (``w_o``: its merged LoRA weight, None: the module)."""
    o_proj = layer.self_attn.o_proj
    return hidden + (o_proj(attn) if w_o is None else torch.nn.functional.linear(attn, w_o, _bias(o_proj)))


def _down(mlp: torch.nn.Module, act: torch.Tensor, w_down: torch.Tensor | None) -> torch.Tensor:
    """The down projection of the gated activation ``act`` (``w_down``: its merged LoRA weight, None: the module)."""
    return mlp.down_proj(act) if w_down is None else torch.nn.functional.linear(act, w_down, _bias(mlp.down_proj))


def _tail_front(layer: torch.nn.Module, hidden: torch.Tensor, attn: torch.Tensor, w_gate_up: torch.Tensor,
                w_o: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_tail` up to the gate/up product (a dense, bias-free gate/up: :func:`_dense_silu`): ``(hidden after
    the output projection's residual, gate_up [B x T, 2 I])``."""
    hidden = _output_residual(layer, hidden, attn, w_o)
    x = layer.post_attention_layernorm(hidden)
    return hidden, torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), w_gate_up)


def _tail_back(layer: torch.nn.Module, hidden: torch.Tensor, act: torch.Tensor, w_down: torch.Tensor | None,
               following: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_tail_norm` after the SiLU gate ``act [B x T, I]``: the down product, its residual and
    ``following``: ``(hidden, following(hidden))``."""
    hidden = hidden + _down(layer.mlp, act, w_down).view_as(hidden)
    return hidden, following(hidden)


def _gated_tail(front, back, layer: torch.nn.Module, hidden: torch.Tensor, attn: torch.Tensor, w_gate_up: torch.Tensor,
                w_o: torch.Tensor | None, w_down: torch.Tensor | None,
                following: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_tail_norm` with the SiLU gate through :func:`~treerl.rollout.silu_gate.silu_gate` between
    ``front`` (:func:`_tail_front`) and ``back`` (:func:`_tail_back`), each compiled where the step's parts are:
    the decode steps the small-row kernels do not serve (above :data:`~treerl.rollout.small_products.MAX_ROWS`
    rows, or where they were refused). A dense layer whose gate/up product has no bias (:func:`_dense_silu`).
    ``hidden [B, 1, H]``."""
    hidden, gate_up = front(layer, hidden, attn, w_gate_up, w_o)
    return back(layer, hidden, silu_gate(gate_up), w_down, following)


def _dense_silu(layer: torch.nn.Module, fused, i: int) -> bool:
    """Whether layer ``i`` has a dense MLP whose fused gate/up product has no bias and whose activation is a plain
    SiLU (:func:`_silu`): what :func:`_gated_tail` and :func:`_small_tail` take."""
    return fused.gate_up_w[i] is not None and fused.gate_up_b[i] is None and _silu(layer.mlp)


def _residual_norm(hidden: torch.Tensor, norm: torch.nn.Module, bias: torch.Tensor | None,
                   *partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden [B, 1, H]`` plus a product given as float32 partial sums ``[B, H]`` each
    (:func:`~treerl.rollout.small_products.linear_partials`; their sum and ``bias`` rounded once to
    ``hidden``'s dtype, as ``F.linear``'s output), and ``norm`` of the result: ``(hidden, norm(hidden))``
    (compiled: the sum, residual and norm one kernel)."""
    total = partials[0]
    for part in partials[1:]:
        total = total + part
    if bias is not None:
        total = total + bias.float()
    hidden = hidden + total.to(hidden.dtype).view_as(hidden)
    return hidden, norm(hidden)


def _bias(linear: torch.nn.Module) -> torch.Tensor | None:
    return getattr(_base(linear), "bias", None)


def _hooked(module: torch.nn.Module) -> bool:
    """Whether a call of ``module`` would run hooks (its own or global ones)."""
    m = torch.nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or m._global_forward_hooks
                or m._global_forward_pre_hooks)


def _weight(linear: torch.nn.Module, merged: torch.Tensor | None) -> torch.Tensor | None:
    """The weight a product of ``linear`` multiplies by: its merged LoRA copy, or a plain hook-free
    ``Linear``'s own (None: it runs as its module)."""
    if merged is not None:
        return merged
    return linear.weight if type(linear) is torch.nn.Linear and not _hooked(linear) else None


def _silu(mlp: torch.nn.Module) -> bool:
    """Whether ``mlp``'s activation is a plain, hook-free SiLU (torch's or transformers')."""
    act = getattr(mlp, "act_fn", None)
    return (type(act) is torch.nn.SiLU or type(act).__name__ == "SiLUActivation") and not _hooked(act)


def _qk_norms(layer: torch.nn.Module) -> tuple:
    attn = layer.self_attn
    return (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else (None, None)


def _heads(layer: torch.nn.Module) -> tuple[int, int]:
    config = layer.self_attn.config
    return config.num_attention_heads, config.num_key_value_heads


def _next_norm(decoder: torch.nn.Module, i: int) -> torch.nn.Module:
    """The norm after layer ``i``'s residual: the next layer's input norm, or the final norm."""
    layers = decoder.layers
    return layers[i + 1].input_layernorm if i + 1 < len(layers) else decoder.norm


def _small_layer(layer: torch.nn.Module, fused, i: int) -> tuple | None:
    """Layer ``i``'s ``(w_o, b_o, w_gate_up, w_down, b_down)`` for :func:`_small_tail`, or None where
    it cannot run there: a sparse MLP, a gate/up bias, an activation other than SiLU, an output or
    down projection that runs as its module (hooks, not a plain ``Linear``)."""
    mlp, o_proj = layer.mlp, layer.self_attn.o_proj
    if not _dense_silu(layer, fused, i):
        return None
    w_o, w_down = _weight(o_proj, fused.o_w[i]), _weight(mlp.down_proj, fused.down_w[i])
    if w_o is None or w_down is None:
        return None
    return w_o, _bias(o_proj), fused.gate_up_w[i], w_down, _bias(mlp.down_proj)


def _small_tail(residual_norm, layer: torch.nn.Module, hidden: torch.Tensor, attn: torch.Tensor, weights: tuple,
                following: torch.nn.Module, chain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_tail_norm` through :mod:`~treerl.rollout.small_products`: the output product as
    float32 partial sums added up in ``residual_norm`` (:func:`_residual_norm`, with the post-attention
    norm), the gate/up product and SiLU gate in one kernel, the down product's partials in the second
    ``residual_norm`` (with ``following``). ``chain``: every kernel a link of a chain of dependent launches,
    the sums and norms through :func:`~treerl.rollout.small_products.residual_norm` (see
    :meth:`~treerl.rollout.blocks.DecodeBlocks._chain`). ``hidden [B, 1, H]``, ``attn [B, ..]`` -> ``(hidden, following(hidden))``."""
    w_o, b_o, w_gate_up, w_down, b_down = weights
    B = hidden.shape[0]

    def add_norm(hidden, norm, bias, partials):
        if chain:
            return small_products.residual_norm(hidden, partials, bias, norm, pdl=True)
        return residual_norm(hidden, norm, bias, *partials.unbind(0))

    hidden, x = add_norm(hidden, layer.post_attention_layernorm, b_o,
                         small_products.linear_partials(attn.reshape(B, -1), w_o, pdl=chain))
    act = small_products.gated(x.reshape(B, -1), w_gate_up, pdl=chain)
    return add_norm(hidden, following, b_down, small_products.linear_partials(act, w_down, pdl=chain))


def _qkv_rope(layer: torch.nn.Module, x: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None,
              cos: torch.Tensor, sin: torch.Tensor, G: int, store, block: torch.Tensor, offset: torch.Tensor,
              linked: bool, *, splits: int) -> tuple:
    """The kernel step's Q/K/V product and :func:`~treerl.rollout.rope_kernel.rope_write` into ``store``'s pools:
    ``(q_own, q_pre, k, v)``. ``linked``: both as links of the small-row chain
    (:meth:`~treerl.rollout.blocks.DecodeBlocks._qkv_link`), the product's partials over ``splits`` ranges of its
    inner dimension (a bias-free product only); else the product through cuBLAS, then the rope kernel."""
    if linked:
        assert b_qkv is None, "the linked Q/K/V product takes no bias (DecodeBlocks._qkv_link admits bias-free ones)"
        qkv = small_products.linear_partials(x.reshape(x.shape[0], -1), w_qkv, splits=splits, pdl=True)
        link = dict(dtype=x.dtype, pdl=True)
    else:
        qkv, link = torch.nn.functional.linear(x, w_qkv, b_qkv), {}
    return rope_write(qkv, cos, sin, *_qk_norms(layer), *_heads(layer), G, store.ok, store.ov, block, offset, **link)


def _base(linear: torch.nn.Module) -> torch.nn.Module:
    """A PEFT LoRA layer's base layer, or the layer itself."""
    return getattr(linear, "base_layer", linear)
