"""The streaming decode step's forward for the families treerl runs itself (Qwen2, Qwen3,
Llama), block by block.

Through Hugging Face's modules one decode step of a 28-layer model launches ~1,900
kernels (norms, RoPE, reshapes and the two-level attention's merge are dozens of small
eager ops per layer); at 64 rows that makes the step launch-bound (8.3 ms on an H100
against a 1.3 ms bandwidth floor). Here each layer runs as

1. ``pre`` — input norm, Q/K/V projections, Q/K norms (Qwen3), RoPE, and the two query
   layouts of :func:`~treerl.rollout.shared.split_queries`;
2. the new token's K/V written into the row store, and the two attention parts (the
   group's queries against its prompt, each row against its own tokens), each one kernel
   with its log-sum-exp (:func:`~treerl.rollout.shared.attend_with_lse`);
3. ``post`` — the LSE merge, output projection, residual, norm, MLP, residual;

with ``pre`` and ``post`` compiled (regional ``torch.compile``, dynamic shapes: one graph
each serves every layer and every batch bucket; parameters are graph inputs), so a layer
is ~18 kernels. The modules and weights are the model's own (HF checkpoints, in-place
weight updates and a model shared with the trainer all keep working); the math is the
modules' own forward, reordered. Any other causal LM decodes through its HF forward.
"""

from __future__ import annotations

import sys

import torch

from .compiled import LazyCompiled
from .shared import SharedPrefixCache, attend_with_lse, merge_parts, split_queries

OWN_DECODE_FAMILIES = ("Qwen2Model", "Qwen3Model", "LlamaModel")


def _pre(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, G: int):
    """``hidden [B, 1, H]`` -> ``q_own [B, Hkv, gq, D]``, ``q_pre [B/G, Hkv, G gq, D]``,
    ``k, v [B, Hkv, 1, D]`` (post-RoPE)."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(x).view(shape)
    k = attn.k_proj(x).view(shape)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    q, k = sys.modules[type(attn).__module__].apply_rotary_pos_emb(q, k, cos, sin)
    q_own, q_pre = split_queries(q, k.shape[1], G)
    return q_own.contiguous(), q_pre.contiguous(), k, v


def _post(layer: torch.nn.Module, hidden: torch.Tensor, o_own: torch.Tensor, l_own: torch.Tensor,
          o_pre: torch.Tensor, l_pre: torch.Tensor, G: int) -> torch.Tensor:
    """The merged attention output through the rest of the block: ``hidden [B, 1, H]`` out."""
    attn = merge_parts(o_own, l_own, o_pre, l_pre, G, hidden.dtype)
    hidden = hidden + layer.self_attn.o_proj(attn.reshape(*hidden.shape[:-1], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


_PRE, _POST = LazyCompiled(_pre, "decode blocks"), LazyCompiled(_post, "decode blocks")


class DecodeForward:
    """One decode step of the running batch through the model's own modules (see the
    module docstring). ``compile``: the ``pre``/``post`` parts through ``torch.compile``.
    Call :meth:`applies` first: other families decode through their HF forward."""

    def __init__(self, model: torch.nn.Module, compile: bool):
        self.model, self.base = model, model.base_model
        self.pre, self.post = (_PRE, _POST) if compile else (_pre, _post)

    @staticmethod
    def applies(model: torch.nn.Module) -> bool:
        return type(getattr(model, "base_model", None)).__name__ in OWN_DECODE_FAMILIES

    @property
    def compiled(self) -> bool:
        """Both parts run compiled (False before the first step, or after a fallback)."""
        return all(getattr(f, "compiled", False) for f in (self.pre, self.post))

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cache: SharedPrefixCache, own_mask: torch.Tensor,
                 prefix_mask: torch.Tensor) -> torch.Tensor:
        """``ids/pos [B, 1]`` (``B = hg x G`` rows), the cache with its ``write_index`` set,
        ``own_mask [B, 1, 1, L]``, ``prefix_mask [hg, 1, 1, P]`` -> next-token logits ``[B, V]``."""
        base, G = self.base, cache.G
        hidden = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(hidden, pos)
        backend = cache.backend(own_mask.shape[-1], prefix_mask.shape[-1])
        for i, layer in enumerate(base.layers):
            q_own, q_pre, k, v = self.pre(layer, hidden, cos, sin, G)
            own_k, own_v = cache.update(k, v, i)
            pk, pv = cache.prefix(i, q_pre.shape[0])
            scale = layer.self_attn.scaling
            o_pre, l_pre = attend_with_lse(q_pre, pk, pv, prefix_mask, scale, backend)
            o_own, l_own = attend_with_lse(q_own, own_k, own_v, own_mask, scale, backend)
            hidden = self.post(layer, hidden, o_own, l_own, o_pre, l_pre, G)
        return self.model.lm_head(base.norm(hidden)[:, -1])
