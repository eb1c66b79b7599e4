"""Prefill: prompts (and, for recomputes, the tokens rows fed) through the model into a
left-padded :class:`~treerl.rollout.kv.SlotCache`, in batched forwards.

:class:`Prefiller` is called by the running batch (admissions, recomputes after a weight
update, readmission of preempted groups) and through :meth:`RolloutEngine.prefill
<treerl.rollout.RolloutEngine.prefill>`. With the engine's prefix cache, a sequence that
extends a cached one is computed from its new tokens only, in the same forward as the
others (its cached K/V copied in first).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from .kv import SlotCache
from .prefill_graphs import PrefillGraphs
from .prefix_cache import PrefixEntry
from .types import RolloutStats, to_device


def prefill_mask(first: torch.Tensor, pad: torch.Tensor, q0: int, q1: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One prefill forward's additive mask ``[B, 1, c, q1]`` (``dtype``) and write slots ``[B, c]``
    for the ``c`` queries at slots ``[q0, q1)``: query ``q`` of a row sees the row's slots
    ``[first, q]`` (``first [B, 1]``: the sequence's first slot); a padding query (``pad [B, c]``)
    sees, and writes to, slot 0 only."""
    q = torch.arange(q0, q1, device=first.device)[None, :, None]  # [1, c, 1]
    keys = torch.arange(q1, device=first.device)[None, None, :]  # [1, 1, q1]
    sees = torch.where(pad[:, :, None], keys == 0, (keys <= q) & (keys >= first[:, :, None]))  # [B, c, q1]
    mask = torch.where(sees, torch.zeros((), dtype=dtype, device=first.device), torch.finfo(dtype).min)
    return mask[:, None], torch.where(pad, 0, q[:, :, 0])


def prefill_bucket(graphs: PrefillGraphs | None, lens: Sequence[int], new: Sequence[int]):
    """The :class:`~treerl.rollout.prefill_graphs.PrefillBucket` of a prefill of sequences of
    ``lens`` tokens, ``new`` of them computed (the rest from the prefix cache), or None: no
    captured prefills, nothing new (no forward), or too large for a bucket (an eager forward)."""
    W = max(new)
    return graphs.bucket(len(lens), W, 1 + max(lens)) if graphs is not None and W > 0 else None


class Prefiller:
    """Batched prefill of ``model`` (``num_layers`` layers) in forwards of at most
    ``chunk_tokens`` (padded) query tokens; logits in ``logit_dtype``. ``forward``: the
    model's forward through treerl's own blocks
    (:class:`~treerl.rollout.prefill_blocks.PrefillForward`; None: its Hugging Face forward)."""

    def __init__(self, model: torch.nn.Module, num_layers: int, chunk_tokens: int, logit_dtype: torch.dtype,
                 forward: Callable | None = None, graphs: PrefillGraphs | None = None):
        self.model, self.num_layers, self.chunk_tokens, self.logit_dtype = model, num_layers, chunk_tokens, logit_dtype
        self.forward, self.graphs = forward, graphs

    def __call__(self, seqs: list[list[int]], cached: Sequence[PrefixEntry | None] | None = None,
                 stats: RolloutStats | None = None) -> tuple[SlotCache, torch.Tensor, torch.Tensor]:
        """Left-padded batched prefill of ``seqs`` into a cache of ``C = 1 + L`` slots
        (``L``: the longest sequence); sequence ``i`` in slots ``[C - len_i, C)``. A small
        prefill (one that fits a bucket of ``graphs``) runs in its bucket's layout: ``C`` and
        the window rounded up to powers of two, padding rows after the ``B`` sequences, and
        the cache is the bucket's, rewritten by the next prefill (copy out what is kept).

        ``cached[i]`` (a prefix-cache entry whose tokens start ``seqs[i]``, or None): the
        first ``m_i = len(cached[i])`` tokens' K/V are copied from it, and only the ``n_i =
        len_i - m_i`` new tokens are computed, at their own positions, attending to their
        cached prefix. The queries of a forward are the last ``W = max n_i`` slots (in chunks
        of ``chunk_tokens / B``); a row's slots there that are not its new tokens are
        padding queries: they write their K/V to slot 0 (``SlotCache.write_index``), which no
        real query sees, so a cached prefix inside the window is never overwritten, and see
        only slot 0 (finite outputs, ignored). Each new token sees its sequence's slots up
        to itself: the same attention as a forward of the sequence alone. ``stats``: counters
        to add the forwards and tokens to.

        Returns ``cache`` (its ``length``: ``C``), lengths ``[B]`` and the logits after each
        sequence's last token ``[B, V]`` (the entry's when nothing is new)."""
        stats = RolloutStats() if stats is None else stats
        dev, B = next(self.model.parameters()).device, len(seqs)
        cached = list(cached) if cached is not None else [None] * B
        lens = np.asarray([len(s) for s in seqs], dtype=np.int64)
        m = np.asarray([0 if c is None else len(c) for c in cached], dtype=np.int64)
        C, W, R = 1 + int(lens.max()), int((lens - m).max()), B
        bucket = prefill_bucket(self.graphs, lens, lens - m)
        if bucket is not None:  # a small prefill: the bucket's fixed layout (padding rows and queries)
            R, W, C = bucket.rows, bucket.window, bucket.slots
            cache = self.graphs.cache(bucket)
        else:
            cache = SlotCache(self.num_layers, C)
        first_np = np.full(R, C, dtype=np.int64)  # each row's first slot (padding rows: none)
        first_np[:B] = C - lens
        new_np = np.full(R, C, dtype=np.int64)  # each row's first new token's slot
        new_np[:B] = C - lens + m
        self._load_cached(cache, cached, first_np)
        cache.length = C - W  # the window [C - W, C) is computed
        ids = np.zeros((R, W), dtype=np.int64)  # each row's new tokens, right-aligned in the window
        for i, s in enumerate(seqs):
            if len(s) > m[i]:
                ids[i, W - (len(s) - m[i]) :] = s[m[i] :]
        ids = to_device(ids, dev)
        first = to_device(first_np, dev)[:, None]  # [R, 1]
        window = torch.arange(C - W, C, device=dev)
        position = (window[None, :] - first).clamp(min=0)  # [R, W]
        pad = window[None, :] < to_device(new_np, dev)[:, None]  # [R, W] not a new token
        logits = None
        chunk = W if bucket is not None else max(1, self.chunk_tokens // B)  # a bucket: one forward
        for a in range(0, W, chunk):
            b = min(W, a + chunk)
            mask, index = self.mask(first, pad[:, a:b], C - W + a, C - W + b)
            logits = self._forward(bucket, ids[:, a:b], position[:, a:b], mask, index, cache, stats)[:B]
            stats.prefill_calls += 1
        full = [i for i, c in enumerate(cached) if c is not None and len(c) == len(seqs[i])]
        if logits is None:  # nothing new at all
            logits = torch.stack([c.logits for c in cached]).to(self.logit_dtype)
        elif full:  # nothing new in these rows: the entry's logits
            logits[to_device(np.asarray(full, dtype=np.int64), dev)] = torch.stack([cached[i].logits for i in full]).to(logits.dtype)
        stats.prefill_tokens += int((lens - m).sum())
        stats.prefix_cache_hit_tokens += int(m.sum())
        return cache, to_device(lens, dev), logits

    def _forward(self, bucket, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, index: torch.Tensor,
                 cache: SlotCache, stats: RolloutStats) -> torch.Tensor:
        """One prefill forward of queries ``ids/pos [R, c]`` writing their K/V at slots
        ``index [R, c]`` of ``cache``: the logits after each row's last query ``[R, V]`` in
        ``logit_dtype`` (a tensor of its own). ``bucket``: replayed in it (``graphs``); else
        treerl's own blocks (``forward``) or the model's Hugging Face forward."""
        if bucket is not None:
            stats.prefill_graph_calls += 1
            return self.graphs(bucket, ids, pos, mask, index, stats).to(self.logit_dtype, copy=True)
        cache.write_index = index
        try:
            if self.forward is not None:
                return self.forward(ids, pos, mask, cache).to(self.logit_dtype)
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                             use_cache=True, logits_to_keep=1)
            return out.logits[:, -1].to(self.logit_dtype)
        finally:
            cache.write_index = None

    def mask(self, first: torch.Tensor, pad: torch.Tensor, q0: int, q1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`prefill_mask` in the model's dtype."""
        return prefill_mask(first, pad, q0, q1, next(self.model.parameters()).dtype)

    @staticmethod
    def _load_cached(cache: SlotCache, cached: list[PrefixEntry | None], first: np.ndarray) -> None:
        """Copy each entry's K/V (every layer at once) into its row of ``cache`` from slot ``first[i]``."""
        hits = [i for i, c in enumerate(cached) if c is not None]
        if not hits:
            return
        k, v = cached[hits[0]].keys, cached[hits[0]].values  # [layers, Hkv, m, D]
        cache.allocate(len(cached), k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)
        for i in hits:
            a, b = int(first[i]), int(first[i]) + len(cached[i])
            cache.all_keys[:, i, :, a:b] = cached[i].keys
            cache.all_values[:, i, :, a:b] = cached[i].values
