"""The rollout engine's prefill cache and attention.

``SlotCache`` is a ``transformers`` ``Cache`` with preallocated buffers
``[layers, rows, kv_heads, capacity, head_dim]``: a prefill forward writes its new
keys/values at slots ``[length, length + q)`` in place (no concatenation per chunk; or at
per-query slots, see ``write_index``) and attends to the slice ``[:length + q]``. Rows of
different prompt lengths are left-padded and the padding is hidden by the engine's
additive attention mask. The running batch copies what it keeps
from it into its :class:`~treerl.rollout.shared.SharedPrefixCache`.

Decode steps of models decoded through their HF forward pass ``rollout_prefix=<that
cache>`` through the model's kwargs, and :func:`rollout_attention` then runs
:func:`~treerl.rollout.shared.fork_attention` (the prompt, the fork segments and the rows'
own tokens, merged by log-sum-exp).

The engine always passes a ready 4-D additive mask ``[rows, 1, q, length + q]``, so the
model's own mask building is skipped, and routes attention through
:func:`rollout_attention` (registered as ``"treerl_rollout"``): SDPA, where a one-token
query folds the query heads of each KV head into the query-length axis
(``[B, Hkv, groups, D]``), so grouped-query attention never materialises repeated K/V.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.cache_utils import Cache, CacheLayerMixin

from ..hf_attention import attention_routed, register
from .shared import fork_attention

ATTN_NAME = "treerl_rollout"

# SDPA kernels the rollout may use. cuDNN attention is left out: it builds a plan per new
# shape (~1 ms of CPU per call), and eager decoding changes the key length every step.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class _SlotLayer(CacheLayerMixin):
    """One layer's keys/values ``[B, Hkv, capacity, D]`` (views of its :class:`SlotCache`'s
    buffers) and its fill length."""

    is_sliding = False

    def __init__(self, owner: "SlotCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.owner.allocate(b, h, d, value_states.shape[-1], key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the forward's ``q`` new keys/values ``[B, Hkv, q, D]`` at slots
        ``[length, length + q)``, or where the owner's ``write_index [B, q]`` says; return
        slots ``[:length + q]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        end = self.length + q
        if end > self.owner.capacity:
            raise RuntimeError(f"rollout KV cache overflow: {end} slots needed, capacity {self.owner.capacity}")
        index = self.owner.write_index
        if index is None:
            self.keys[:, :, self.length : end] = key_states
            self.values[:, :, self.length : end] = value_states
        else:
            index = index[:, None, :, None]
            self.keys.scatter_(2, index.expand(b, h, q, key_states.shape[-1]), key_states)
            self.values.scatter_(2, index.expand(b, h, q, value_states.shape[-1]), value_states)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.owner.capacity


class SlotCache(Cache):
    """Preallocated KV cache of ``num_layers`` layers, ``capacity`` slots per row: one
    buffer per keys and values, ``all_keys [layers, B, Hkv, capacity, D]`` (each layer's
    ``keys``/``values`` are views), so a row's K/V of every layer moves in one copy.

    ``write_index`` (``[B, q]`` or None): set by the engine before a forward to write query
    ``j`` of row ``b`` at slot ``write_index[b, j]`` instead of ``length + j`` (a left-padded
    prefill sends its padding queries' K/V to a slot no real query attends)."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[_SlotLayer(self, i) for i in range(num_layers)])
        self.capacity = capacity
        self.write_index: torch.Tensor | None = None
        self.all_keys: torch.Tensor | None = None
        self.all_values: torch.Tensor | None = None

    def allocate(self, rows: int, kv_heads: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        """The buffers (zeros: unwritten slots are masked, and 0 x (masked weight 0) must not be NaN)."""
        if self.all_keys is not None:
            return
        n = len(self.layers)
        self.attach(torch.zeros(n, rows, kv_heads, self.capacity, head_dim, dtype=dtype, device=device),
                    torch.zeros(n, rows, kv_heads, self.capacity, value_dim, dtype=dtype, device=device))

    def attach(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Use ``keys/values [layers, rows, kv_heads, capacity, D]`` as the buffers (finite
        values in every slot: see :meth:`allocate`)."""
        self.all_keys, self.all_values = keys, values
        for layer, k, v in zip(self.layers, keys, values):
            layer.keys, layer.values = k, v
            layer.dtype, layer.device = keys.dtype, keys.device
            layer.is_initialized = True

    @property
    def length(self) -> int:
        """Slots filled (same for every layer between forwards)."""
        return self.layers[0].length

    @length.setter
    def length(self, n: int) -> None:
        for layer in self.layers:
            layer.length = n

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)


def rollout_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA with the engine's additive mask. ``query [B, Hq, q, D]``, ``key/value
    [B, Hkv, L, D]``, mask ``[B, 1, q, L]``; returns ``[B, q, Hq, D]``. Decode steps pass
    ``rollout_prefix=<SharedPrefixCache>`` (through the model's kwargs): then ``key/value``
    are the rows' own slots and the prompt and fork levels come from that cache."""
    if attention_mask is None:
        raise RuntimeError("treerl rollout attention called without the engine's attention mask")
    shared = kwargs.get("rollout_prefix")
    if shared is not None:
        groups = query.shape[0] // shared.G
        pk, pv = shared.prefix(module.layer_idx, groups)
        return fork_attention(query, key, value, attention_mask, pk, pv, shared.prefix_mask,
                              shared.fork_levels(module.layer_idx, groups),
                              scaling if scaling is not None else query.shape[-1] ** -0.5, shared.G,
                              shared.backend(key.shape[2], pk.shape[2])), None
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    with sdpa_kernel(SDPA_BACKENDS):
        if q == 1 and hq != hkv:
            groups = hq // hkv
            out = F.scaled_dot_product_attention(
                query.reshape(b, hkv, groups, d), key, value, attn_mask=attention_mask, scale=scaling
            )
            return out.reshape(b, hq, 1, -1).transpose(1, 2).contiguous(), None
        if hq != hkv:
            key = key.repeat_interleave(hq // hkv, dim=1)
            value = value.repeat_interleave(hq // hkv, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


register(ATTN_NAME, rollout_attention)


def rollout_attention_enabled(model: torch.nn.Module):
    """Route every attention module of ``model`` through :func:`rollout_attention` (a
    context manager: :func:`treerl.hf_attention.attention_routed`)."""
    return attention_routed(model, ATTN_NAME)
