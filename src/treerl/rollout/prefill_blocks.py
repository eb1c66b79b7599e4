"""The prefill forward for the families treerl decodes itself (dense Qwen2, Qwen3, Llama),
block by block, as the decode step (:mod:`treerl.rollout.blocks`) runs.

A prefill forward through Hugging Face's modules dispatches ~100 operations per layer
(~45 kernels: norms, RoPE and reshapes as separate eager ops); a serving batch admits a
request or two every few decode steps, each a prefill of a few hundred new tokens, so on a
GPU that forward is launch-bound (~3,000 dispatches for a 28-layer model) and its host time,
not its FLOPs, stalls the decode steps around it. Here each layer runs as

1. ``pre`` — input norm, the Q/K/V projections as one product (the decode step's fused
   copies, :class:`~treerl.rollout.blocks.FusedProjections`), Q/K norms (Qwen3), RoPE;
2. the keys/values written into the prefill's :class:`~treerl.rollout.kv.SlotCache` and
   attention through :func:`~treerl.rollout.window_attention.window_attention` on a GPU where
   its kernel agrees with float64 (:func:`window_kernel_ok`), else
   :func:`~treerl.rollout.kv.rollout_attention` (SDPA under the engine's mask);
3. the block's rest (:func:`~treerl.rollout.layer_math._tail`: output projection, residual,
   norm, MLP, residual);

with ``pre`` and the rest compiled on CUDA (regional ``torch.compile``, dynamic shapes), the
same math as the modules' forward, reordered. Mixture-of-experts models and other causal
LMs prefill through their Hugging Face forward."""

from __future__ import annotations

import torch

from ..compiled import DECODE_OFF, LazyCompiled
from .blocks import DecodeBlocks
from .layer_math import _tail, qkv_rope
from .kv import SlotCache, rollout_attention
from .prefill import prefill_mask
from .window_attention import window_attention, window_attention_ok


def _prefill_pre(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 w_qkv: torch.Tensor, b_qkv: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [B, T, H]`` -> ``q [B, Hq, T, D]``, ``k [B, Hkv, T, D]`` (post-RoPE) and
    ``v [B, Hkv, T, Dv]`` (:func:`~treerl.rollout.layer_math.qkv_rope`)."""
    q, k, v = qkv_rope(layer, hidden, cos, sin, w_qkv, b_qkv)
    return q, k, v.transpose(1, 2)


_PRE, _TAIL = LazyCompiled(_prefill_pre, "prefill blocks", DECODE_OFF), LazyCompiled(_tail, "prefill blocks", DECODE_OFF)

# (rows, queries) of PrefillForward.warm's prefills: dynamo compiles a size of 1 apart from larger ones (its 0/1
# specialisation), so each of rows and queries is met at 1 and above; 3 and 5 equal no size of a model (duck sizing
# would tie a larger one to it, and a later prefill of other sizes would compile again). Larger first: the general
# graphs compiled first carry no guard from a size the others happen to share.
WARM_SHAPES = ((3, 5), (1, 5), (3, 1), (1, 1))


def window_kernel_ok(decode: DecodeBlocks) -> bool:
    """Whether the model's prefills attend through :func:`window_attention` (CUDA, a kernel that
    agrees with float64 for its dtype and head sizes: probed once)."""
    p = next(decode.model.parameters())
    D = decode.base.layers[0].self_attn.head_dim
    return p.device.type == "cuda" and window_attention_ok(str(p.device), p.dtype, D, D)


class PrefillForward:
    """A prefill forward through the model's own modules and the decode step's fused
    projection copies (``decode``: the engine's :class:`~treerl.rollout.blocks.DecodeBlocks`,
    refreshed whenever the parameters may have changed). ``compile``: ``pre`` and the
    block's rest through ``torch.compile``. Call :meth:`applies` first."""

    def __init__(self, decode: DecodeBlocks, compile: bool):
        self.decode = decode
        self.pre, self.tail = (_PRE, _TAIL) if compile else (_prefill_pre, _tail)
        self.window = window_kernel_ok(decode)

    @staticmethod
    def applies(decode: DecodeBlocks | None) -> bool:
        """Dense blocks only (a mixture-of-experts layer prefills through its HF forward)."""
        return decode is not None and all(w is not None for w in decode.fused.gate_up_w)

    @property
    def compiled(self) -> bool:
        """Whether ``pre`` and the block's rest run through ``torch.compile``."""
        return self.pre is not _prefill_pre

    def warm(self) -> int:
        """Compile ``pre`` and the block's rest for every class of prefill shapes dynamo tells apart
        (:data:`WARM_SHAPES`: 1 and more rows, 1 and more queries), on token 0 into a scratch cache, so that no
        prefill of a running server waits for a compile: a class first met mid-run compiles for seconds while
        every running row waits (session 38, H200: a prefill of 14 rows of one new token each, the first of its
        class, stalled the serving benchmark 4.9-8.8 s). Run under ``no_grad`` as the engine's prefills are (the
        grad mode is one of dynamo's guards). Returns the forwards run (0 when not compiled)."""
        if not self.compiled:
            return 0
        p = next(self.decode.model.parameters())
        for rows, queries in WARM_SHAPES:
            slots = 1 + queries  # slot 0 as a prefill's (padding queries' only key), then the queries' own
            first = torch.ones(rows, 1, dtype=torch.int64, device=p.device)
            pad = torch.zeros(rows, queries, dtype=torch.bool, device=p.device)
            mask, index = prefill_mask(first, pad, 1, slots, p.dtype)
            cache = SlotCache(len(self.decode.base.layers), slots)
            cache.length, cache.write_index = 1, index
            ids = torch.zeros(rows, queries, dtype=torch.int64, device=p.device)
            pos = torch.arange(queries, device=p.device).repeat(rows, 1)
            try:
                self(ids, pos, mask, cache)
            finally:
                cache.write_index = None
        return len(WARM_SHAPES)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """``ids/pos [B, T]`` (the queries of one forward), additive ``mask [B, 1, T, L]``
        (``L``: the cache's slots after this forward), ``cache`` (keys/values written where
        :meth:`SlotCache.update <treerl.rollout.kv.SlotCache.update>` says) -> the logits
        after the last query ``[B, V]``."""
        base, f = self.decode.base, self.decode.fused
        hidden = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(hidden, pos)
        B, T = ids.shape
        for i, layer in enumerate(base.layers):
            q, k, v = self.pre(layer, hidden, cos, sin, f.qkv_w[i], f.qkv_b[i])
            keys, values = cache.update(k, v, i)
            if self.window:
                attn = window_attention(q, keys, values, mask, layer.self_attn.scaling)
            else:
                attn, _ = rollout_attention(layer.self_attn, q, keys, values, mask, layer.self_attn.scaling)
            hidden = self.tail(layer, hidden, attn.reshape(B, T, -1), f.gate_up_w[i], f.gate_up_b[i], f.o_w[i],
                               f.down_w[i])
        return self.decode.model.lm_head(base.norm(hidden[:, -1:]))[:, -1]
