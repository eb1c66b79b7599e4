"""The prefill forward for the families treerl decodes itself (dense Qwen2, Qwen3, Llama),
block by block, as the decode step (:mod:`treerl.rollout.blocks`) runs.

A prefill forward through Hugging Face's modules dispatches ~100 operations per layer
(~45 kernels: norms, RoPE and reshapes as separate eager ops); a serving batch admits a
request or two every few decode steps, each a prefill of a few hundred new tokens, so on a
GPU that forward is launch-bound (~3,000 dispatches for a 28-layer model) and its host time,
not its FLOPs, stalls the decode steps around it. Here each layer runs as

1. ``pre`` — input norm, the Q/K/V projections as one product (the decode step's fused
   copies, :class:`~treerl.rollout.blocks.FusedProjections`), Q/K norms (Qwen3), RoPE;
2. the keys/values written into the prefill's :class:`~treerl.rollout.kv.SlotCache`'s
   buffers at the forward's write slots and attention over its filled slots with the
   engine's additive mask (SDPA; grouped-query heads repeated, as
   :func:`~treerl.rollout.kv.rollout_attention` does);
3. the block's rest (:func:`~treerl.rollout.blocks._tail`: output projection, residual,
   norm, MLP, residual);

the same math as the modules' forward, reordered. On CUDA the whole stack of layers is one
compiled function (:func:`_prefill_layers`, ``torch.compile`` with dynamic shapes): one
dynamo entry and one graph per prefill forward, not two per layer. Per-layer compiled
regions cost ~0.6 ms of host time each on an H100 host (dynamo's guards, the AOT wrappers,
inductor's launcher), ~35 ms per 28-layer prefill: in a serving run (64 agents,
``bench/profile_engine_thread.py``) admissions took 65% of the engine thread's time while
the device idled. Mixture-of-experts models and other causal LMs prefill through their
Hugging Face forward."""

from __future__ import annotations

import sys

import torch
from torch.nn.attention import sdpa_kernel

from ..compiled import DECODE_OFF, LazyCompiled
from .blocks import DecodeBlocks, _tail
from .kv import SDPA_BACKENDS, SlotCache


def _prefill_pre(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 w_qkv: torch.Tensor, b_qkv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [B, T, H]`` -> ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]`` (post-RoPE) and
    ``v [B, Hkv, T, Dv]``. ``w_qkv``/``b_qkv``: the Q, K, V projections as one."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    D = attn.head_dim
    kv = attn.config.num_key_value_heads * D
    q, k, v = torch.nn.functional.linear(x, w_qkv, b_qkv).split([w_qkv.shape[0] - 2 * kv, kv, kv], dim=-1)
    shape = (*hidden.shape[:-1], -1, D)
    q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    return q, k, v


def _prefill_layers(layers: torch.nn.ModuleList, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    fused: tuple[list, ...], all_keys: torch.Tensor, all_values: torch.Tensor, index: torch.Tensor,
                    mask: torch.Tensor, end: int) -> torch.Tensor:
    """Every layer of one prefill forward: ``hidden [B, T, H]`` -> ``[B, T, H]`` (before the
    final norm). ``fused``: the decode blocks' ``(qkv_w, qkv_b, o_w, gate_up_w, gate_up_b,
    down_w)`` lists; ``all_keys/all_values [layers, B, Hkv, C, D]``: the cache's buffers,
    query ``t`` of row ``b`` writes its K/V at slot ``index[b, t]``; attention over slots
    ``[:end]`` with the additive ``mask [B, 1, T, end]``."""
    qkv_w, qkv_b, o_w, gate_up_w, gate_up_b, down_w = fused
    B, T, _ = hidden.shape
    for i, layer in enumerate(layers):
        q, k, v = _prefill_pre(layer, hidden, cos, sin, qkv_w[i], qkv_b[i])
        at = index[:, None, :, None]
        all_keys[i].scatter_(2, at.expand(-1, k.shape[1], -1, k.shape[3]), k)
        all_values[i].scatter_(2, at.expand(-1, v.shape[1], -1, v.shape[3]), v)
        keys, values = all_keys[i, :, :, :end], all_values[i, :, :, :end]
        if q.shape[1] != keys.shape[1]:  # grouped-query heads
            keys = keys.repeat_interleave(q.shape[1] // keys.shape[1], dim=1)
            values = values.repeat_interleave(q.shape[1] // values.shape[1], dim=1)
        with sdpa_kernel(SDPA_BACKENDS):  # (not cuDNN: a plan per new shape, ~1 ms of host each)
            attn = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                                    scale=layer.self_attn.scaling)
        hidden = _tail(layer, hidden, attn.transpose(1, 2).reshape(B, T, -1), gate_up_w[i], gate_up_b[i], o_w[i],
                       down_w[i])
    return hidden


_LAYERS = LazyCompiled(_prefill_layers, "prefill blocks", DECODE_OFF)


class PrefillForward:
    """A prefill forward through the model's own modules and the decode step's fused
    projection copies (``decode``: the engine's :class:`~treerl.rollout.blocks.DecodeBlocks`,
    refreshed whenever the parameters may have changed). ``compile``: the layers through
    ``torch.compile`` (:func:`_prefill_layers`). Call :meth:`applies` first."""

    def __init__(self, decode: DecodeBlocks, compile: bool):
        self.decode = decode
        self.layers = _LAYERS if compile else _prefill_layers

    @staticmethod
    def applies(decode: DecodeBlocks | None) -> bool:
        """Dense blocks only (a mixture-of-experts layer prefills through its HF forward)."""
        return decode is not None and all(w is not None for w in decode.fused.gate_up_w)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """``ids/pos [B, T]`` (the queries of one forward), additive ``mask [B, 1, T, L]``
        (``L``: the cache's slots after this forward), ``cache`` (keys/values written at its
        ``write_index``, else after its filled slots; as :meth:`SlotCache.update
        <treerl.rollout.kv.SlotCache.update>`) -> the logits after the last query ``[B, V]``."""
        base, f = self.decode.base, self.decode.fused
        hidden = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(hidden, pos)
        B, T = ids.shape
        attn = base.layers[0].self_attn
        kv_heads, D = attn.config.num_key_value_heads, attn.head_dim
        cache.allocate(B, kv_heads, D, D, hidden.dtype, hidden.device)
        end = cache.length + T
        if end > cache.capacity:
            raise RuntimeError(f"rollout KV cache overflow: {end} slots needed, capacity {cache.capacity}")
        index = cache.write_index
        if index is None:
            index = torch.arange(cache.length, end, device=ids.device)[None].expand(B, T)
        hidden = self.layers(base.layers, hidden, cos, sin, (f.qkv_w, f.qkv_b, f.o_w, f.gate_up_w, f.gate_up_b, f.down_w),
                             cache.all_keys, cache.all_values, index, mask, end)
        cache.length = end
        return self.decode.model.lm_head(base.norm(hidden[:, -1:]))[:, -1]
