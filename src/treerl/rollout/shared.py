"""Shared-prefix KV cache and two-level decode attention (continuous-batching path).

A running batch of ``S = NG x G`` rows is organised in ``NG`` *group slots* of ``G`` rows:
rows ``[g*G, (g+1)*G)`` are the samples of the prompt held by group slot ``g``. Per layer:

- the **prefix store** ``[NG, Hkv, Pcap, D]`` holds each group's prompt K/V once (slots
  ``[0, P_g)``; post-RoPE, position ids ``0..P_g-1``);
- the **row store** holds only the tokens each row generated, *paged*: a pool of blocks
  ``[num_blocks + 1, Hkv, B, D]`` and a block table ``[S, max_blocks]`` (device tensor,
  updated in place; host side and allocation in :mod:`~treerl.rollout.paging`). Own slot
  ``j`` of row ``r`` (the token at position ``P_g + j``; tree rollouts ``P_g + t_m + j``)
  is slot ``j % B`` of block ``table[r, j // B]``; a row owns only the blocks it has
  reached, the rest of its entries name the trash block (the pool's last);
- tree rollouts (:mod:`~treerl.rollout.forks`) add one **fork-segment store** per fork
  level ``k < m``, ``[NG x c_k, Hkv, cap_k, D]``: the tokens ``[t_k, t_{k+1})`` of each
  node, stored once and read by the ``r_k`` consecutive rows below it.

A one-token decode step of rows ``[:hg*G]`` (``hg`` group slots) writes each row's new K/V
at its own slot ``write_index[r]`` (through the table: rows that own no block there write
the trash block) and attends in two parts merged by their log-sum-exp
(:func:`two_level_attention`): the ``G x (Hq/Hkv)`` queries of a group that share a KV head
against the group's prefix, in one pass (so the prefix is read once per step, not once per
row), and each row's queries against its own slots ``[:own_len]`` (the split-key kernel
reads them through the block table; the other backends gather them into a dense view
first); with fork levels, the queries of each node's ``r_k`` rows against its segment
(:func:`shared_part`), all parts' key ranges merged by their LSEs (:func:`merge_parts`:
exact, whatever their number). Masks are additive device tensors (``0`` visible, dtype
minimum hidden), so shapes are fixed per ``(hg, own_len)`` bucket and the step can be
captured in a CUDA graph.

Every store holds ``kv_dtype``: the model's dtype by default (exact), or float8 (e4m3, no
scale: ``RolloutEngine(kv_cache_dtype="fp8")``), written from K/V rounded to the model's dtype
first and widened to the queries' dtype where read; the prefill's own cache stays in the
model's dtype.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .decode_attention import (MERGED_MIN_PROGRAMS, TARGET_PROGRAMS, merge_ranges, overlap_ok, split_attention,
                               split_attention_merged, split_attention_ok, splits_for)
from .kernel_probe import kernel_agrees
from .kv_copy import copy_slots, copy_slots_ok
from .types import raw, stored

LOAD_TEMP_BYTES = 64 << 20  # a load's gathered keys (or values) of several layers at once: at most this (bytes)


class _TwoLevelLayer(CacheLayerMixin):
    """One layer: prefix keys/values ``[NG, Hkv, Pcap, D]``, the own store's block pools
    ``ok/ov [num_blocks + 1, Hkv, B, D]`` (``own_capacity`` slots per row through the block
    table), fork-segment keys/values ``fk[k]/fv[k]`` ``[NG x c_k, Hkv, cap_k, D]`` (tree rollouts)."""

    is_sliding = False

    def __init__(self, pk: torch.Tensor, pv: torch.Tensor, ok: torch.Tensor, ov: torch.Tensor, own_capacity: int,
                 fk: list[torch.Tensor] | None = None, fv: list[torch.Tensor] | None = None):
        super().__init__()
        self.pk, self.pv, self.ok, self.ov = pk, pv, ok, ov
        self.own_capacity = own_capacity
        self.fk, self.fv = fk or [], fv or []
        self.dtype, self.device = ok.dtype, ok.device
        self.is_initialized = True

    def lazy_initialization(self, *args) -> None:  # pragma: no cover
        raise RuntimeError("SharedPrefixCache layers are allocated up front")

    def update(self, *args, **kwargs):  # pragma: no cover - written through SharedPrefixCache.update
        raise RuntimeError("SharedPrefixCache layers are written through SharedPrefixCache.update")

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return self.own_capacity, 0

    def get_seq_length(self) -> int:
        return self.own_capacity

    def get_max_length(self) -> int:
        return self.own_capacity


class SharedPrefixCache(Cache):
    """Prefix store + paged row store of a running batch (see the module docstring).

    ``table``: the batch's block table ``[S, max_blocks]`` (int64 device tensor, entries
    ``< num_blocks``, or ``num_blocks``: the trash block), read here, written by the batch
    in place; ``block_size`` slots per block, so ``own_capacity = max_blocks x block_size``.

    Set for one decode step by :meth:`begin_step` (views of the batch's persistent device
    tensors): ``write_index [s]`` (own slot of each row's new token), ``own_len`` (own slots
    attended), ``prefix_mask [hg, 1, 1, Pa]`` (additive; ``Pa`` prefix slots attended); with
    fork levels, ``fork_index``: per level ``(node [s], slot [s])`` where each row writes its
    new token (its node's trash slot unless it is the node's writer), and ``fork_masks``:
    per level ``[hg x c_k, 1, 1, cap_k]``.

    ``forks``: per fork level ``(c_k, cap_k, r_k)``: nodes per group slot, slots per node,
    rows per node (empty: plain groups, two levels). ``prompts_in_own_blocks``: the rows keep
    their prompts in their own blocks and the prompt store is unused (all masked): a decode
    step's prompt part is then one empty key range (:meth:`no_prompt_part`), not a kernel.

    ``overlap`` (probed here): the kernel step's prompt part and merged own part run as one
    overlapped pair (:func:`~treerl.rollout.decode_attention.split_attention_merged`'s ``after``)."""

    def __init__(self, num_layers: int, groups: int, G: int, prefix_capacity: int, table: torch.Tensor,
                 num_blocks: int, block_size: int, kv_heads: int, head_dim: int, value_dim: int, dtype: torch.dtype,
                 device: torch.device, forks: Sequence[tuple[int, int, int]] = (),
                 prompts_in_own_blocks: bool = False, kv_dtype: torch.dtype | None = None):
        S = groups * G
        own_capacity = table.shape[1] * block_size
        self.compute_dtype, self.kv_dtype = dtype, kv_dtype or dtype

        def z(n, c, d):  # one buffer for all layers (each layer's store is a view): loads move every layer at once
            return torch.zeros(num_layers, n, kv_heads, c, d, dtype=self.kv_dtype, device=device)

        self.all_pk, self.all_pv = z(groups, prefix_capacity, head_dim), z(groups, prefix_capacity, value_dim)
        self.all_ok, self.all_ov = z(num_blocks + 1, block_size, head_dim), z(num_blocks + 1, block_size, value_dim)
        self.all_fk = [z(groups * c, cap, head_dim) for c, cap, _ in forks]
        self.all_fv = [z(groups * c, cap, value_dim) for c, cap, _ in forks]
        layers = [_TwoLevelLayer(self.all_pk[i], self.all_pv[i], self.all_ok[i], self.all_ov[i], own_capacity,
                                 [f[i] for f in self.all_fk], [f[i] for f in self.all_fv])
                  for i in range(num_layers)]
        super().__init__(layers=layers)
        self.groups, self.G, self.rows = groups, G, S
        self.prefix_capacity, self.own_capacity = prefix_capacity, own_capacity
        self.table, self.num_blocks, self.block_size = table, num_blocks, block_size
        self.forks = tuple(forks)
        self.prompts_in_own_blocks = prompts_in_own_blocks  # (groups of one row: no fork levels)
        self._no_prompt: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fork_index: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.fork_masks: list[torch.Tensor] = []
        # the CUDA kernels with LSE that run here (probed now: never inside a capture or a compile)
        self.split = device.type == "cuda" and split_attention_ok(str(device), dtype, head_dim, value_dim, block_size,
                                                                  self.kv_dtype)
        # the prompt part's launch and the merged own part's overlap: the own part's launch must follow the prompt
        # part's directly (fork levels run kernels between them; prompts in own blocks run no prompt-part kernel, so
        # the rope kernel, which writes the own part's queries and keys, would come before it)
        self.overlap = (self.split and not self.forks and not prompts_in_own_blocks
                        and merged_attention_ok(str(device), dtype, head_dim, value_dim, self.kv_dtype)
                        and overlap_ok(str(device), dtype, head_dim, value_dim, self.kv_dtype))
        self.efficient = device.type == "cuda" and _efficient_ok(str(device), dtype, head_dim, value_dim)
        self.efficient_unaligned = self.efficient and _efficient_ok(str(device), dtype, head_dim, value_dim, True)
        self.write_index: torch.Tensor | None = None
        self.write_block: torch.Tensor | None = None
        self.write_offset: torch.Tensor | None = None
        self.own_len: int = own_capacity
        self.prefix_mask: torch.Tensor | None = None

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, value_dim: int, itemsize: int) -> int:
        """Bytes of one token's K/V over all layers."""
        return num_layers * kv_heads * (head_dim + value_dim) * itemsize

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.own_len - 1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.own_len, 0

    # ------------------------------------------------------------ one decode step
    def begin_step(self, write_index: torch.Tensor, own_len: int, prefix_mask: torch.Tensor,
                   fork_index: list[tuple[torch.Tensor, torch.Tensor]], fork_masks: list[torch.Tensor]) -> None:
        """Set the step's inputs (see the class docstring) and where each row's new token
        goes in the pool: ``write_block [s]`` (through the table) and ``write_offset [s]``
        (device ops only: captured with the step)."""
        s = write_index.shape[0]
        self.write_index, self.own_len, self.prefix_mask = write_index, own_len, prefix_mask
        self.fork_index, self.fork_masks = fork_index, fork_masks
        self.write_block = self.table[:s].gather(1, (write_index // self.block_size)[:, None])[:, 0]
        self.write_offset = write_index % self.block_size

    def end_step(self) -> None:
        self.write_index = self.write_block = self.write_offset = self.prefix_mask = None
        self.fork_index, self.fork_masks = [], []

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """(HF forward path.) Write one token per row (``[s, Hkv, 1, D]``) at its own slot;
        return the rows' own keys/values ``[s, Hkv, own_len, D]`` (a dense gathered copy)."""
        layer = self.layers[layer_idx]
        s, h, q, d = key_states.shape
        if q != 1 or self.write_index is None:
            raise RuntimeError("SharedPrefixCache takes one-token decode steps only (prefill goes through SlotCache)")
        k, v = stored(key_states[:, :, 0], self.kv_dtype), stored(value_states[:, :, 0], self.kv_dtype)
        raw(layer.ok)[self.write_block, :, self.write_offset] = raw(k)
        raw(layer.ov)[self.write_block, :, self.write_offset] = raw(v)
        self.write_forks(layer_idx, k, v)
        return self.own(layer_idx, s)

    def write_forks(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tree rollouts: write the step's new keys/values ``k/v [s, Hkv, D]`` (rows ``[:s]``)
        into each fork level at ``fork_index`` (a node's segment slot for its writer, the
        node's trash slot for every other row). No-op without fork levels."""
        if not self.forks:
            return
        layer = self.layers[layer_idx]
        for fk, fv, (node, slot) in zip(layer.fk, layer.fv, self.fork_index):
            raw(fk)[node, :, slot] = raw(stored(k, fk.dtype))
            raw(fv)[node, :, slot] = raw(stored(v, fv.dtype))

    def own(self, layer_idx: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Own keys/values of rows ``[:s]`` over the attended slots, gathered from their
        blocks into dense ``[s, Hkv, own_len, D]`` copies (fallback attention backends)."""
        layer, n = self.layers[layer_idx], self.own_len
        idx = self.table[:s, : -(-n // self.block_size)]

        def dense(pool: torch.Tensor) -> torch.Tensor:
            x = raw(pool)[idx].view(pool.dtype)  # [s, blocks, Hkv, B, D]
            return x.transpose(1, 2).reshape(s, x.shape[2], -1, x.shape[-1])[:, :, :n]

        return dense(layer.ok), dense(layer.ov)

    def attend_own_merged(self, layer_idx: int, q_own: torch.Tensor, own_mask: torch.Tensor, scale: float,
                          o_pre: torch.Tensor, l_pre: torch.Tensor, G: int, dtype: torch.dtype,
                          after: bool = False, trigger: bool = False) -> torch.Tensor:
        """:meth:`attend_own` through the split-key kernel in one key range per row, merged in the
        kernel with the prompt part's ranges ``o_pre``/``l_pre`` (groups of ``G`` rows; 1: the rows'
        layout) -> the layer's attention ``[s, 1, Hkv x gq, Dv]`` in ``dtype``
        (:func:`~treerl.rollout.decode_attention.split_attention_merged`). Where rows x KV heads
        would not give every SM a program and the own keys span several tiles (a few served
        conversations, each its whole context in its own blocks), one range per row would leave the
        GPU idle: the own part runs in key ranges, merged with the prompt part's in one kernel
        (:func:`~treerl.rollout.decode_attention.merge_ranges`, :func:`merge_parts`' ~7 kernels).
        (Session 15 also ran own spans past 512 keys in ranges up to ``TARGET_PROGRAMS``: faster in
        the kernel's bench, slower served: session 16 call 3, H200, 64 agents in process, 8,962
        against 9,593 tokens/s on one machine; reverted.) ``after``: the launch that wrote
        ``o_pre``/``l_pre`` came directly before, with ``trigger`` (:attr:`overlap`): the one range
        per row overlaps it (:func:`~treerl.rollout.decode_attention.split_attention_merged`). ``trigger``:
        the one range per row lets the next launch start beside it (the small tail's chain of dependent
        launches, :meth:`~treerl.rollout.blocks.DecodeBlocks._chain`)."""
        s, layer, N = q_own.shape[0], self.layers[layer_idx], own_mask.shape[-1]
        if splits_for(s, q_own.shape[1], N, MERGED_MIN_PROGRAMS) > 1:
            o_own, l_own = split_attention(q_own, layer.ok, layer.ov, own_mask, scale, table=self.table[:s])
            return merge_ranges(o_own, l_own, o_pre, l_pre, G, dtype)
        return split_attention_merged(q_own, layer.ok, layer.ov, own_mask, scale, o_pre, l_pre, G, dtype,
                                      table=self.table[:s], after=after, trigger=trigger)

    def attend_own(self, layer_idx: int, q_own: torch.Tensor, own_mask: torch.Tensor, scale: float,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's queries ``q_own [s, Hkv, gq, D]`` against its own slots ``[:own_len]``
        (``own_mask [s, 1, 1, own_len]``), in key ranges (:func:`attend_with_lse`): the
        split-key kernel reads the blocks through the table; the other backends attend a
        gathered copy (:meth:`own`)."""
        s = q_own.shape[0]
        if backend == "split":
            layer = self.layers[layer_idx]
            return split_attention(q_own, layer.ok, layer.ov, own_mask, scale, table=self.table[:s])
        k, v = self.own(layer_idx, s)
        return attend_with_lse(q_own, k, v, own_mask, scale, backend)

    def backend(self, own_len: int, prefix_len: int) -> str:
        """This step's attention kernel (see :func:`attend_with_lse`): ``"split"`` (treerl's
        split-key Triton kernel), ``"efficient"`` (CUDA's memory-efficient kernel, on key
        lengths it handles here) or ``"math"``."""
        if self.split:
            return "split"
        if self.efficient and (self.efficient_unaligned or (own_len % 16 == 0 and prefix_len % 16 == 0)):
            return "efficient"
        return "math"

    def no_prompt_part(self, q_pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt part of a step whose prompts are in the rows' own blocks: one key range
        with no key (output 0, LSE ``-inf``: it adds nothing to the merge), ``[groups, Hkv, 1,
        queries, Dv]`` / ``[groups, Hkv, 1, queries]`` (float32) for ``q_pre [groups, Hkv,
        queries, D]``: views of one pair for every group slot, made at the first step's eager
        warm-up (``graphs.capture_graph``), never inside a capture."""
        key = tuple(q_pre.shape[1:3])
        if key not in self._no_prompt:
            if q_pre.device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # pragma: no cover
                raise RuntimeError("the empty prompt part must be made before a capture (its warm-up)")
            heads, queries = key
            self._no_prompt[key] = (
                torch.zeros(self.groups, heads, 1, queries, self.all_ov.shape[-1], device=q_pre.device),
                torch.full((self.groups, heads, 1, queries), float("-inf"), device=q_pre.device))
        o, lse = self._no_prompt[key]
        return o[: q_pre.shape[0]], lse[: q_pre.shape[0]]

    def prefix(self, layer_idx: int, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefix keys/values of group slots ``[:groups]`` over the attended slots."""
        layer = self.layers[layer_idx]
        pa = self.prefix_mask.shape[-1]
        return layer.pk[:groups, :, :pa], layer.pv[:groups, :, :pa]

    def fork_levels(self, layer_idx: int, groups: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        """Fork segments of group slots ``[:groups]``: per level ``(keys, values, mask, r_k)``."""
        layer = self.layers[layer_idx]
        return [(fk[: groups * c], fv[: groups * c], mask, r)
                for fk, fv, mask, (c, _, r) in zip(layer.fk, layer.fv, self.fork_masks, self.forks)]

    # ------------------------------------------------------------ loading / moving
    def load(self, src_cache, store: str | int, dst: torch.Tensor, src: torch.Tensor, start: torch.Tensor,
             n: int) -> None:
        """Copy from a left-padded prefill ``src_cache`` (a ``SlotCache`` of ``L`` filled slots)
        into ``store`` (``"prefix"``, ``"own"`` or a fork level ``k``): entry ``dst[i]``
        (group slot, row or node) gets ``n`` slots of row ``src[i]`` from slot ``start[i]``
        on (clamped at the end: copies of the last slot, to be masked). ``"own"``: into the
        blocks the table gives the rows (slots past their blocks go to the trash block). Where
        :func:`~treerl.rollout.kv_copy.copy_slots` runs (CUDA), one launch per keys and values,
        and a row's slots past the prefill's end are left as they were (masked as well)."""
        if len(dst) == 0 or n == 0:
            return
        L = src_cache.length
        if store == "prefix":
            targets = (self.all_pk, self.all_pv)
        elif store == "own":
            targets = (self.all_ok, self.all_ov)
        else:
            targets = (self.all_fk[store], self.all_fv[store])
        sources = (src_cache.all_keys, src_cache.all_values)  # every layer's [layers, B, Hkv, slots, D]
        if copy_slots_ok(str(start.device), sources[0].dtype, targets[0].shape[-1], targets[0].dtype):
            count, zero = (L - start).clamp(max=n), torch.zeros_like(start)
            for target, x_all in zip(targets, sources):
                copy_slots(x_all, target, src, start, dst, zero, count, n,
                           dst_table=self.table if store == "own" else None)
            return
        j = torch.arange(n, device=start.device)
        idx = (j[None, :] + start[:, None]).clamp(max=L - 1)
        if store == "own":
            blk = self.table[dst][:, j // self.block_size]  # [len(dst), n]
            off = (j % self.block_size)[None, :].expand_as(blk)
        # every layer in one gather and one write (in groups of layers that bound the temporary), indexed
        # [len(dst), n, layers, Hkv, D]: the advanced indices are apart, so their dims lead
        _, _, kv_heads, _, dim = sources[0].shape
        per = max(1, LOAD_TEMP_BYTES // (len(dst) * n * kv_heads * dim * sources[0].element_size()))
        rows = src[:, None]
        for target, x_all in zip(targets, sources):
            for a in range(0, x_all.shape[0], per):
                x = raw(stored(x_all[a : a + per][:, rows, :, idx], target.dtype))
                if store == "own":
                    raw(target)[a : a + per, blk, :, off] = x
                else:
                    raw(target)[a : a + per, dst, :, :n] = x.permute(2, 0, 3, 1, 4)

    def move_groups(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Move group slots ``src`` (prefix, fork segments, and their ``G`` rows' block
        table entries: own K/V stays in its blocks) to group slots ``dst``; the rows of
        ``src`` are left owning no block."""

        def expand(slots: torch.Tensor, width: int) -> torch.Tensor:
            return (slots[:, None] * width + torch.arange(width, device=slots.device)).reshape(-1)

        rdst, rsrc = expand(dst, self.G), expand(src, self.G)
        self.table[rdst] = self.table[rsrc]
        self.table[rsrc] = self.num_blocks
        for store in (self.all_pk, self.all_pv):
            raw(store)[:, dst] = raw(store)[:, src]
        for fk, fv, (c, _, _) in zip(self.all_fk, self.all_fv, self.forks):
            ndst, nsrc = expand(dst, c), expand(src, c)
            raw(fk)[:, ndst], raw(fv)[:, ndst] = raw(fk)[:, nsrc], raw(fv)[:, nsrc]

    def grow_prefix(self, capacity: int) -> None:
        """More prefix slots per group (keeps the contents)."""
        for name in ("all_pk", "all_pv"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:3], capacity, old.shape[4])
            new[:, :, :, : old.shape[3]] = old
            setattr(self, name, new)
        for i, layer in enumerate(self.layers):
            layer.pk, layer.pv = self.all_pk[i], self.all_pv[i]
        self.prefix_capacity = capacity


# ---------------------------------------------------------------------- attention
def _attend_math(q, k, v, mask, scale):
    """Reference attention with LSE: ``q [B, H, M, D]``, ``k/v [B, H, N, D]``, additive
    ``mask`` broadcastable to ``[B, H, M, N]``; scores in float32 (float64 for float64).
    Returns ``out [B, H, M, Dv]`` (float32/64) and ``lse [B, H, M]``."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale + mask.to(acc)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return torch.matmul(p, v.to(acc)), lse


def _attend_efficient(q, k, v, mask, scale):
    """CUDA memory-efficient attention kernel with its LSE (fp32 accumulation; float8 K/V widened to
    the queries' dtype first)."""
    B, H, M, _ = q.shape
    k, v = k.to(q.dtype), v.to(q.dtype)
    bias = mask.expand(B, H, M, k.shape[2])
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), k, v, bias, True, 0.0, False, scale=scale)[:2]
    return out, lse[..., :M]


@functools.lru_cache(maxsize=None)
def _efficient_ok(device: str, dtype: torch.dtype, head_dim: int, value_dim: int, unaligned: bool = False) -> bool:
    """Whether the CUDA kernel runs here and agrees with the reference (probed once per
    device, dtype and head sizes) on key lengths that are multiples of 16 (the
    fixed-shape steps), or with ``unaligned`` also on views of other lengths (eager steps)."""
    if not device.startswith("cuda") or dtype == torch.float64:
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(3, 2, 32, head_dim, device=device, dtype=dtype, generator=g)
        k = torch.randn(3, 2, 48, head_dim, device=device, dtype=dtype, generator=g)
        v = torch.randn(3, 2, 48, value_dim, device=device, dtype=dtype, generator=g)
        mask = torch.zeros(3, 1, 1, 48, device=device, dtype=dtype)
        mask[1, ..., 20:] = torch.finfo(dtype).min
        for n in (48, 37) if unaligned else (48,):  # views of 37 of the 48 slots: eager steps
            o1, l1 = _attend_efficient(q, k[:, :, :n], v[:, :, :n], mask[..., :n], 0.125)
            o2, l2 = _attend_math(q, k[:, :, :n], v[:, :, :n], mask[..., :n], 0.125)
            if not (torch.allclose(o1.float(), o2, atol=2e-2) and torch.allclose(l1, l2, atol=1e-3)):
                return False
        return True
    except Exception:  # noqa: BLE001 - any failure: use the reference
        return False


def attend_with_lse(q, k, v, mask, scale, backend: str = "math", trigger: bool = False,
                    target: int = TARGET_PROGRAMS, linked: bool = False):
    """Attention of ``q [B, H, M, D]`` to ``k/v [B, H, N, D]`` under an additive ``mask``
    (``[B, 1, 1, N]``), in key ranges: returns ``out [B, H, S, M, Dv]`` and ``lse [B, H, S, M]``
    of each range (float32, or float64 for math on float64), merged by :func:`merge_parts`.
    ``backend``: ``"split"`` (:mod:`~treerl.rollout.decode_attention`: several ranges, to
    fill the GPU), ``"efficient"`` (CUDA's memory-efficient kernel, see :func:`_efficient_ok`)
    or ``"math"`` (exact); the last two return one range. ``trigger`` (``"split"`` only): the
    next launch may overlap this one (:func:`~treerl.rollout.decode_attention.split_attention`); ``target``
    (``"split"`` only): its programs at least (the key ranges are chosen to reach it); ``linked`` (``"split"``
    only): a link of the small-row chain, waiting for the kernel before it (the rope kernel) at its start."""
    assert not (trigger or linked) or backend == "split", "only the split-key kernel overlaps its neighbours"
    if backend == "split":
        return split_attention(q, k, v, mask, scale, trigger=trigger, target=target, linked=linked)
    out, lse = _attend_efficient(q, k, v, mask, scale) if backend == "efficient" else _attend_math(q, k, v, mask, scale)
    return out.unsqueeze(2), lse.unsqueeze(2)


def group_queries(q_own: torch.Tensor, r: int) -> torch.Tensor:
    """``q_own [B, Hkv, gq, D]`` -> ``[B/r, Hkv, r x gq, D]``: the queries of ``r``
    consecutive rows that share a KV head, together (one pass over keys they share)."""
    B, Hkv, gq, D = q_own.shape
    return q_own.reshape(B // r, r, Hkv, gq, D).transpose(1, 2).reshape(B // r, Hkv, r * gq, D)


def ungroup(o: torch.Tensor, lse: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`group_queries` for an attention output in key ranges
    (:func:`attend_with_lse`) ``o [B/r, Hkv, S, r x gq, Dv]``, ``lse [B/r, Hkv, S, r x gq]``:
    ``[B, Hkv, S, gq, Dv]`` and ``[B, Hkv, S, gq]``."""
    Bn, Hkv, S, rgq, Dv = o.shape
    gq = rgq // r
    o = o.reshape(Bn, Hkv, S, r, gq, Dv).permute(0, 3, 1, 2, 4, 5).reshape(Bn * r, Hkv, S, gq, Dv)
    return o, lse.reshape(Bn, Hkv, S, r, gq).permute(0, 3, 1, 2, 4).reshape(Bn * r, Hkv, S, gq)


def split_queries(query: torch.Tensor, kv_heads: int, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two query layouts of a decode step of ``B = NGb x G`` rows, ``query [B, Hq, 1, D]``:
    ``q_own [B, Hkv, Hq/Hkv, D]`` (each row against its own keys) and
    ``q_pre [NGb, Hkv, G x Hq/Hkv, D]`` (a group's queries that share a KV head, together)."""
    B, Hq, _, D = query.shape
    q_own = query.reshape(B, kv_heads, Hq // kv_heads, D)
    return q_own, group_queries(q_own, G)


def shared_part(q_own: torch.Tensor, o_pre: torch.Tensor, l_pre: torch.Tensor, G: int, forks, scale: float,
                backend: str = "math") -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt part (``o_pre/l_pre`` in group layout, ``G`` rows per group) and the fork
    levels (:meth:`SharedPrefixCache.fork_levels`: ``(keys [B/r, Hkv, N, D], values, mask
    [B/r, 1, 1, N], r)``, each attended by the queries of its ``r`` consecutive rows
    together, one pass over a node's keys) as one part in own layout, their key ranges
    side by side: ``o [B, Hkv, S, gq, Dv]``, ``lse [B, Hkv, S, gq]``, for
    :func:`merge_parts` with ``G = 1`` (which merges all ranges by their LSEs: exact)."""
    parts = [ungroup(o_pre, l_pre, G)]
    for k, v, mask, r in forks:
        o, lse = attend_with_lse(group_queries(q_own, r), k, v, mask, scale, backend)
        parts.append(ungroup(o, lse, r))
    acc = parts[0][1].dtype
    return torch.cat([o.to(acc) for o, _ in parts], dim=2), torch.cat([lse.to(acc) for _, lse in parts], dim=2)


def merge_parts(o_own: torch.Tensor, l_own: torch.Tensor, o_pre: torch.Tensor, l_pre: torch.Tensor, G: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Softmax over the union of prefix and own keys from the key ranges' outputs and LSEs
    (:func:`attend_with_lse`): ``o_own [B, Hkv, S1, gq, Dv]``, ``l_own [B, Hkv, S1, gq]``,
    ``o_pre [NGb, Hkv, S2, G x gq, Dv]``, ``l_pre [NGb, Hkv, S2, G x gq]``. Each range's
    weight is ``exp(lse_range - lse_all)``. Returns ``[B, 1, Hq, Dv]`` in ``dtype``."""
    B, Hkv, _, gq, Dv = o_own.shape
    NGb, _, S2, _, _ = o_pre.shape
    o_pre = o_pre.reshape(NGb, Hkv, S2, G, gq, Dv).permute(0, 3, 1, 2, 4, 5).reshape(B, Hkv, S2, gq, Dv)
    l_pre = l_pre.reshape(NGb, Hkv, S2, G, gq).permute(0, 3, 1, 2, 4).reshape(B, Hkv, S2, gq)
    acc = l_own.dtype
    lse = torch.cat([l_own, l_pre.to(acc)], dim=2)
    w = torch.softmax(lse, dim=2)[..., None]  # [B, Hkv, S1 + S2, gq, 1]
    out = (w * torch.cat([o_own.to(acc), o_pre.to(acc)], dim=2)).sum(2)
    return out.to(dtype).reshape(B, 1, Hkv * gq, Dv)


@functools.lru_cache(maxsize=None)
def merged_attention_ok(device: str, dtype: torch.dtype, head_dim: int, value_dim: int,
                        kv_dtype: torch.dtype | None = None) -> bool:
    """Whether :func:`~treerl.rollout.decode_attention.split_attention_merged` runs here and agrees
    with the own part in float64 merged by :func:`merge_parts` (probed once per device, dtype and
    head sizes, on two groups of 3 rows, 2 KV heads of 2 query heads, a row with fewer keys, the
    prompt part in 2 ranges, one of them empty), and so does the own part in 3 key ranges (the
    short row's last two hidden) merged by :func:`~treerl.rollout.decode_attention.merge_ranges`
    (``kv_dtype``: K/V stored in float8). A failure warns with its reason
    (:func:`~treerl.rollout.kernel_probe.kernel_agrees`)."""
    kv_dtype = kv_dtype or dtype
    if not split_attention_ok(device, dtype, head_dim, value_dim, 0, kv_dtype) or value_dim & (value_dim - 1):
        return False

    def check() -> bool:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(6, 2, 2, head_dim, device=device, dtype=dtype, generator=g)
        k = stored(torch.randn(6, 2, 160, head_dim, device=device, dtype=dtype, generator=g), kv_dtype)  # (3 ranges)
        v = stored(torch.randn(6, 2, 160, value_dim, device=device, dtype=dtype, generator=g), kv_dtype)
        mask = torch.zeros(6, 1, 1, 160, device=device, dtype=dtype)
        mask[4, ..., 17:] = torch.finfo(dtype).min
        o2 = torch.randn(2, 2, 2, 6, value_dim, device=device, generator=g)
        l2 = torch.randn(2, 2, 2, 6, device=device, generator=g)
        l2[0, 0, 1] = float("-inf")
        o1, l1 = _attend_math(q.double(), k.double(), v.double(), mask.double(), 0.125)
        want = merge_parts(o1.unsqueeze(2), l1.unsqueeze(2), o2.double(), l2.double(), 3, torch.float64)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        got = split_attention_merged(q, k, v, mask, 0.125, o2, l2, 3, dtype)
        if not torch.allclose(got.double(), want, atol=tol):
            return False
        got = merge_ranges(*split_attention(q, k, v, mask, 0.125, splits=3), o2, l2, 3, dtype)
        return torch.allclose(got.double(), want, atol=tol)

    return kernel_agrees(check, what="the decode step's merged attention kernels", reference="merge_parts",
                         where=f"{device} ({dtype}, K/V {kv_dtype})",
                         fallback="the decode step runs without its split-key kernel step (slower)")


def two_level_attention(query, own_k, own_v, own_mask, prefix_k, prefix_v, prefix_mask, scale, G,
                        backend: str = "math"):
    """Decode attention of ``B = NGb x G`` rows, one query token each.

    ``query [B, Hq, 1, D]``; ``own_k/v [B, Hkv, L, D]``, ``own_mask [B, 1, 1, L]``;
    ``prefix_k/v [NGb, Hkv, P, D]``, ``prefix_mask [NGb, 1, 1, P]`` (group slot ``g`` is
    the prefix of rows ``[g*G, (g+1)*G)``). Returns ``[B, 1, Hq, Dv]`` in the query dtype:
    softmax over the union of prefix and own keys, from the two parts' LSEs."""
    q_own, q_pre = split_queries(query, own_k.shape[1], G)
    o_pre, l_pre = attend_with_lse(q_pre, prefix_k, prefix_v, prefix_mask, scale, backend)
    o_own, l_own = attend_with_lse(q_own, own_k, own_v, own_mask, scale, backend)
    return merge_parts(o_own, l_own, o_pre, l_pre, G, query.dtype)


def fork_attention(query, own_k, own_v, own_mask, prefix_k, prefix_v, prefix_mask, forks, scale, G,
                   backend: str = "math"):
    """:func:`two_level_attention` with fork levels between the prompt and the rows' own
    tokens (``forks``: ``(keys, values, mask, r_k)`` per level, see
    :meth:`SharedPrefixCache.fork_levels`); without fork levels, exactly it."""
    if not forks:
        return two_level_attention(query, own_k, own_v, own_mask, prefix_k, prefix_v, prefix_mask, scale, G,
                                   backend)
    q_own, q_pre = split_queries(query, own_k.shape[1], G)
    o_pre, l_pre = attend_with_lse(q_pre, prefix_k, prefix_v, prefix_mask, scale, backend)
    o_sh, l_sh = shared_part(q_own, o_pre, l_pre, G, forks, scale, backend)
    o_own, l_own = attend_with_lse(q_own, own_k, own_v, own_mask, scale, backend)
    return merge_parts(o_own, l_own, o_sh, l_sh, 1, query.dtype)
