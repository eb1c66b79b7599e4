"""Tree attention for Hugging Face models.

One model call runs a *segment*: a contiguous range of tree tokens (the queries), after
an optional prefix of ancestor keys/values computed by earlier calls. Every key and query
carries its global tree index, and one rule decides visibility everywhere (DESIGN.md):

    query q sees key k  iff  k <= q < subtree_end[k]

The function registered with ``transformers.AttentionInterface`` reads a
:class:`TreeAttention` from the keyword ``tree_attention`` (HF forwards it to every
attention call); it refuses to run without one, because a custom attention function
receives ``attention_mask=None`` and would otherwise silently attend everything.
It also records each layer's keys/values (post-RoPE, one per KV head) when asked, so
later segments can use them as their prefix, and it can keep a layer's attention out of a
block recompute (:attr:`TreeAttention.keep_layers`).

The engine hands the :class:`TreeAttention` over through :func:`tree_attention_enabled`
(a thread-local, not a keyword argument) so that compiled decoder blocks
(:mod:`treerl.engine.decoder`) never see it as an input to guard on; the attention call itself is
excluded from compilation (it runs its own compiled flex kernel).

Routes (:data:`ROUTES`): one chain without prefix runs SDPA's causal kernel; after a prefix, a chain
piece or a group of leaves runs its prefix through a fused kernel (:mod:`treerl.engine.chain_attention`,
:mod:`treerl.engine.group_attention`); a call without prefix whose trees (at most
:data:`ROOT_SPLIT_MAX_TREES`) each start with a long root chain (:data:`ROOT_SPLIT`, on for CUDA
tensors by default) runs, per tree, that chain causally and the rest as a group after it ("root
split"); everything else runs the tree mask.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from typing import Iterator

import torch
import torch.nn.functional as F

from ..compiled import FLEX_OFF, LazyCompiled
from ..hf_attention import attention_routed, register
from .chain_attention import MATH, chain_attention, kernel_for
from .group_attention import OwnPart, group_attention
from .kept_attention import KeptAttention
from .rooted_trees import RootedTree

ATTN_NAME = "treerl"
KWARG = "tree_attention"
BACKENDS = ("sdpa", "flex")

KV = tuple[torch.Tensor, torch.Tensor]  # ([1, kv_heads, n, head_dim], same)


class TreeAttention:
    """Everything one model call needs to attend over a tree segment.

    ``q_index`` [Nq] and ``k_index`` [Nk] are global tree indices (keys = prefix tokens
    then the queries themselves), ``k_end`` [Nk] the keys' subtree ends. ``causal``: the
    caller knows the segment is one chain (every key visible to every later query, the
    prefix's to all queries): without prefix plain causal attention is exact, after one the
    chain attention of :mod:`treerl.engine.chain_attention` (with :data:`CHAIN_AFTER_PREFIX`);
    either needs no mask. ``group``: not one chain, after a prefix whose every key every query
    sees (with :data:`GROUPS_AFTER_PREFIX`): the prefix through a fused kernel, the own keys
    under the tree mask (:mod:`treerl.engine.group_attention`). ``roots``: the call's trees in
    call order (rows of its queries, without prefix; from the CPU's tree), each with its root chain:
    where :meth:`_splits` holds (:data:`ROOT_SPLIT` on, at most :data:`ROOT_SPLIT_MAX_TREES` trees,
    each with a root chain of at least :data:`ROOT_SPLIT_MIN_TOKENS`, not all of them one chain, the
    flex backend or CPU tensors), :attr:`roots` keeps them and the call runs the root split
    (:func:`_root`); else :attr:`roots` is empty. ``prefix[l]`` is
    the list of (K, V) pieces of layer ``l`` that precede this call's own keys. With
    ``capture``, each layer's own (K, V) lands in ``captured[layer]``.

    ``keep_layers``: layers whose decoder block is recomputed in the backward (activation
    checkpointing) but whose attention runs once (:mod:`treerl.engine.kept_attention`): it holds
    its output for the recompute and its backward, at the memory of
    ``MemoryModel.kept_attention_layers``, and the recompute skips the attention forward
    (the most expensive part of it on long trees).

    A plain class, not a dataclass: module wrappers (FSDP) copy dataclass arguments,
    and the engine must read ``captured`` from this very object.
    """

    def __init__(self, backend: str, q_index: torch.Tensor, k_index: torch.Tensor, k_end: torch.Tensor,
                 prefix: list[list[KV]] | None = None, capture: bool = False, causal: bool = False,
                 roots: tuple[RootedTree, ...] = ()):
        self.backend, self.q_index, self.k_index, self.k_end = backend, q_index, k_index, k_end
        self.prefix, self.capture = prefix, capture
        # one chain, no prefix: the tree mask is the causal mask, and SDPA's causal kernels
        # (flash attention on CUDA) run it without any mask tensor; one chain after a prefix:
        # full attention to the prefix merged with causal attention to its own keys
        self.chain = causal
        device = q_index.device
        self.causal = causal and (not prefix or path_on(CHAIN_AFTER_PREFIX, device))
        # every plan's prefix is seen by all its queries (its segments are chains of ancestors):
        # checked on the CPU (the tests), trusted on a GPU (the check is a device sync per call)
        self.group = (bool(prefix) and not causal and path_on(GROUPS_AFTER_PREFIX, device)
                      and (device.type != "cpu" or self._seen_by_all(range(len(k_index) - len(q_index)),
                                                                      range(len(q_index)))))
        roots = tuple(roots)
        self.roots = roots if not (prefix or causal) and self._splits(roots) else ()
        self.routes: collections.Counter | None = None  # layer calls by route (the engine's StepStats.attention)
        self.captured: dict[int, KV] = {}
        self.keep_layers: frozenset[int] = frozenset()
        self.kept: dict[int, KeptAttention] = {}
        self._mask = None
        self._own_masks: dict[tuple[int, int, int | None], object] = {}

    def _seen_by_all(self, keys: range, rows: range) -> bool:
        """Whether the queries of ``rows`` see the ``keys`` (true of every plan's prefix: its segments
        are chains of ancestors, and of a root chain; a device sync where the tensors are on a GPU):
        each key precedes the first query and its subtree reaches past the last (the queries are one
        range)."""
        k = slice(keys.start, keys.stop)
        first, last = self.q_index[rows.start], self.q_index[rows.stop - 1]
        return bool((self.k_index[k].max() <= first) & (self.k_end[k].min() > last))

    def _splits(self, roots: tuple[RootedTree, ...]) -> bool:
        """Whether the root split runs a call without prefix, not one chain, of trees ``roots``:
        :data:`ROOT_SPLIT` on for the device, the flex backend (or CPU tensors: the SDPA backend on
        CUDA has no own part for a group), 1 to :data:`ROOT_SPLIT_MAX_TREES` trees covering the call,
        each with a root chain of at least :data:`ROOT_SPLIT_MIN_TOKENS`, some with a group after it;
        on the CPU also each tree checked as one block (:meth:`_one_block`)."""
        device = self.q_index.device
        starts = [0] + [tree.end for tree in roots[:-1]]
        return (0 < len(roots) <= ROOT_SPLIT_MAX_TREES and [tree.start for tree in roots] == starts
                and roots[-1].end == len(self.q_index) and any(tree.rest for tree in roots)
                and all(tree.root >= max(ROOT_SPLIT_MIN_TOKENS, 1) for tree in roots)
                and path_on(ROOT_SPLIT, device) and (self.backend == "flex" or device.type == "cpu")
                and (device.type != "cpu" or all(self._one_block(tree) for tree in roots)))

    def _one_block(self, tree: RootedTree) -> bool:
        """Whether ``tree``'s root keys are seen by its root chain's last query and every later one of
        the tree, and its keys by no query after the tree (a call without prefix)."""
        last = tree.start + tree.root - 1
        alone = tree.end == len(self.q_index) or bool(self.k_end[tree.start:tree.end].max() <= self.q_index[tree.end])
        return alone and self._seen_by_all(range(tree.start, last + 1), range(last, tree.end))

    @property
    def input_copies(self) -> bool:
        """Whether the attention kernel reads copies of q/k/v rather than the tensors
        themselves (held by a kept attention): K/V concatenated after a prefix, SDPA's
        kernels (the math kernel expands K/V to every head), the root split's slices and copies.
        Flex on a call without prefix reads them as they are."""
        return bool(self.prefix) or self.causal or bool(self.roots) or self.backend == "sdpa"

    def mask(self) -> object:
        """The visibility mask, built once per call and shared by all layers."""
        if self._mask is None:
            if self.backend == "sdpa":
                self._mask = dense_tree_mask(self.q_index, self.k_index, self.k_end)[None, None]
            else:
                square = PREFIX_AS_TILES and len(self.k_index) > len(self.q_index)
                self._mask = flex_block_mask(self.q_index, self.k_index, self.k_end, square=square)
        return self._mask

    def own_mask(self, first: int, rows: int = 0, stop: int | None = None) -> object:
        """The visibility of the queries from row ``rows`` over the keys from ``first``, both up to
        ``stop`` (None: the call's end; a bounded block is one tree of a call without prefix, whose
        rows are both queries and keys) (a group's own part: the prefix keys its fused part leaves,
        then its own; the root split's: those of a tree's root chain, then the rest of the tree),
        built once per call, ``first``, ``rows`` and ``stop``: dense [Nq - rows, Nk - first] (or
        [stop - rows, stop - first]) for the SDPA backend, flex's block mask otherwise."""
        key = (rows, first, stop)
        if key not in self._own_masks:
            build = dense_tree_mask if self.backend == "sdpa" else flex_block_mask
            self._own_masks[key] = build(self.q_index[rows:stop], self.k_index[first:stop], self.k_end[first:stop])
        return self._own_masks[key]

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The SDPA mask as 0 / -inf of ``dtype``, built once per call. SDPA would convert
        a boolean mask itself, in every layer, and differently when a block is recomputed
        in the backward than in its forward (which activation checkpointing refuses)."""
        if getattr(self, "_additive", None) is None or self._additive.dtype != dtype:
            mask = self.mask()
            self._additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return self._additive


def dense_tree_mask(q_index: torch.Tensor, k_index: torch.Tensor, k_end: torch.Tensor) -> torch.Tensor:
    """[Nq, Nk] boolean visibility. O(Nq * Nk): for the SDPA backend and small segments."""
    q = q_index[:, None]
    return (k_index[None, :] <= q) & (q < k_end[None, :])


# ----------------------------------------------------------------------------- flex
FLEX_BLOCK = 128
# The main Triton kernel always: with dynamic shapes, segments under 128 queries would
# otherwise be routed to the decoding kernel, which has no valid config for them.
FLEX_KERNEL = {"BACKEND": "TRITON"}
# Calls after a prefix as whole tiles too (issue 24, an A/B switch of bench/long_trees.py,
# off by default until measured): the queries are padded at the front to the keys' length
# (the padded rows see nothing, so flex skips their tiles) and the call takes the
# whole-tile kernel of equal lengths. Costs a padded query and output per key in every layer.
PREFIX_AS_TILES = False
# Calls after a prefix through fused SDPA kernels (issue 24), each switch True (on), False (off:
# the tree mask, as any call after a prefix) or "cuda" (the default: on for CUDA tensors, where the
# fused kernels run in half precision; float32/float64 there find no kernel and take the tree mask;
# on the CPU the paths would run their plain-torch parts, which the exactness tests turn on with True).
# A chain piece after a prefix (treerl.engine.chain_attention): full attention to the prefix merged
# with causal attention to its own keys, by log-sum-exp.
CHAIN_AFTER_PREFIX: bool | str = "cuda"
# A call of several leaves after a prefix (not one chain; every query sees every prefix key),
# treerl.engine.group_attention: the prefix's full attention
# through a fused kernel merged by log-sum-exp with the tree mask over its own keys (flex).
# On the H100 (2026-11-25, bench/RESULTS.md): long_prefix 5.66 -> 4.73 s with both, episodes
# 8.44 -> 7.20 s (peak 19.7 -> 15.3 GiB), the medium shapes unchanged (no calls after a prefix).
GROUPS_AFTER_PREFIX: bool | str = "cuda"
# A call without prefix that is not one chain, of at most ROOT_SPLIT_MAX_TREES trees each starting with
# a root chain of at least ROOT_SPLIT_MIN_TOKENS tokens (e.g. a long prompt and its responses): per
# tree, the root chain's causal attention through the probed fused kernel (chain_attention without
# prefix) and the rest's queries as a group after it (the root chain its prefix,
# treerl.engine.group_attention), concatenated ("root split"). On for CUDA tensors ("cuda", half
# precision: the fused kernels) by default: long_prefix on the H100 3.02 -> 2.70 s (bench/RESULTS.md,
# session 10; bench/long_trees.py's auto-noroot is the A/B). True/False to force.
ROOT_SPLIT: bool | str = "cuda"
ROOT_SPLIT_MIN_TOKENS = 4096
# The most trees of a call the root split runs: 1 (one tree, as measured on the H100); calls of
# several trees (the workload `long`: two in one call) take the tree mask until measured
# (bench/long_trees.py's auto-roots).
ROOT_SPLIT_MAX_TREES = 1
# The fused kernels the root split pays with on a GPU (H100: cuDNN's split runs at 97% of cuDNN's causal
# rate; flash's causal kernel runs below flex's padded tree mask): with another, the engine keeps the mask.
ROOT_SPLIT_KERNELS = ("cudnn",)


def path_on(switch: bool | str, device: torch.device) -> bool:
    """Whether a path switch (:data:`CHAIN_AFTER_PREFIX`, :data:`GROUPS_AFTER_PREFIX`,
    :data:`ROOT_SPLIT`) is on for tensors on ``device``."""
    return switch is True or (switch == "cuda" and device.type == "cuda")


def root_split_on(device: torch.device) -> bool:
    """Whether :data:`ROOT_SPLIT` is on for tensors on ``device`` (as it is now: the engine reads it per call)."""
    return path_on(ROOT_SPLIT, device)


def groups_after_prefix() -> bool:
    """Whether :data:`GROUPS_AFTER_PREFIX` is on anywhere (True or "cuda"): the memory model counts
    what a kept group attention holds more."""
    return bool(GROUPS_AFTER_PREFIX)


def prefix_as_tiles() -> bool:
    """:data:`PREFIX_AS_TILES` as it is now (the memory model counts its padding)."""
    return PREFIX_AS_TILES


def _flex(query, key, value, lse: bool = False, **kwargs):
    """flex_attention -> out, or with ``lse`` (out, log-sum-exp [B, H, N], natural log, differentiable)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if not lse:
        return flex_attention(query, key, value, **kwargs)
    out, aux = flex_attention(query, key, value, return_aux=AuxRequest(lse=True), **kwargs)
    return out, aux.lse


def _flex_whole_tiles(query, key, value, block_mask, scale, enable_gqa, lse=False):
    """[1, H, T, FLEX_BLOCK, D] tensors: the sequence axis as whole tiles, so that the
    compiled kernel knows its lengths are multiples of the tile (see flex_tree_attention)."""
    q, k, v = (x.flatten(2, 3) for x in (query, key, value))
    return _flex(q, k, v, lse, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, kernel_options=FLEX_KERNEL)


def whole_tile_views(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """[1, H, N, D] (N a multiple of FLEX_BLOCK) -> [1, H, N / FLEX_BLOCK, FLEX_BLOCK, D]
    views with every axis but the tile count marked static for dynamo."""
    tiles = [x.unflatten(2, (-1, FLEX_BLOCK)) for x in tensors]
    for x in tiles:
        for dim in (0, 1, 3, 4):  # only the number of tiles varies
            torch._dynamo.mark_static(x, dim)
    return tiles


def _flex_any(*args, **kwargs):
    return _flex(*args, **kwargs)


_FLEX_TILES = LazyCompiled(_flex_whole_tiles, "flex tree attention (whole tiles)", FLEX_OFF)
_FLEX_ANY = LazyCompiled(_flex_any, "flex tree attention", FLEX_OFF)


def flex_tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask,
                        scale: float | None, lse: bool = False):
    """query [1, H, Nq, D], key/value [1, H_kv, Nk, D], ``block_mask`` from
    :func:`flex_block_mask` (whole tiles of :data:`FLEX_BLOCK`) -> [1, H, Nq, D]; with ``lse``
    (out, its differentiable log-sum-exp [1, H, Nq]).

    A call without prefix arrives on whole tiles (the engine pads its tokens; padded
    queries see nothing, padded keys are seen by nobody) and is handed over with the tile
    as an axis of its own: compiled with dynamic shapes, flex's kernels then know the
    lengths divide their tiles (``IS_DIVISIBLE``) and skip the bounds checks, index
    wrapping and masking that an unknown length costs every tile (1.3-1.4x faster
    forward+backward on an H100, bench/RESULTS.md), with one compiled kernel for every
    length. Calls with a prefix (keys longer than queries, lengths in every relation) are
    padded here and run with lengths unknown: the tile view would recompile per relation
    of the two lengths until dynamo gives up and runs flex eagerly.
    """
    nq, gqa = query.shape[2], query.shape[1] != key.shape[1]
    if nq == key.shape[2] and nq % FLEX_BLOCK == 0:
        return _FLEX_TILES(*whole_tile_views(query, key, value), block_mask, scale, gqa, lse)
    q_len, kv_len = block_mask.seq_lengths
    if q_len == kv_len and nq < key.shape[2]:  # a square mask (PREFIX_AS_TILES): queries last, padded in front
        front = q_len - -(-nq // FLEX_BLOCK) * FLEX_BLOCK
        q = F.pad(query, (0, 0, front, q_len - front - nq))
        k, v = (F.pad(x, (0, 0, 0, kv_len - x.shape[2])) if x.shape[2] != kv_len else x for x in (key, value))
        return _rows(_FLEX_TILES(*whole_tile_views(q, k, v), block_mask, scale, gqa, lse), front, nq)
    q, k, v = (F.pad(x, (0, 0, 0, -x.shape[2] % FLEX_BLOCK)) if x.shape[2] % FLEX_BLOCK else x
               for x in (query, key, value))
    out = _FLEX_ANY(q, k, v, lse, block_mask=block_mask, scale=scale, enable_gqa=gqa, kernel_options=FLEX_KERNEL)
    return _rows(out, 0, nq)


def _rows(out, start: int, n: int):
    """Rows ``start`` to ``start + n`` of flex's output (and log-sum-exp, when it is a pair)."""
    if isinstance(out, tuple):
        return tuple(x.narrow(2, start, n) for x in out)
    return out.narrow(2, start, n)


def flex_block_mask(q_index: torch.Tensor, k_index: torch.Tensor, k_end: torch.Tensor, block: int = FLEX_BLOCK,
                    square: bool = False):
    """Block-sparse tree mask for flex attention, built in O(N + blocks), never N x N.

    ``square``: as many query tiles as key tiles, the queries' tiles last and empty tiles
    (rows that see nothing) before them (:data:`PREFIX_AS_TILES`).

    A segment's queries are one contiguous range of tree indices, so the queries that key
    ``k`` is visible to form one interval of rows ``[k - q0, k_end - q0)``. A (query
    block, key block) tile is skipped when no key's interval meets its rows, runs without
    the mask function when every key's interval covers all of them, and is masked
    elementwise otherwise.
    """
    from torch.nn.attention.flex_attention import BlockMask

    device = q_index.device
    nq_tok, nk_tok = len(q_index), len(k_index)
    nq, nk = -(-nq_tok // block), -(-nk_tok // block)
    q0 = q_index[0]
    lo = (k_index - q0).clamp(0, nq_tok)  # first query row that sees key k
    hi = (k_end - q0).clamp(0, nq_tok)  # one past the last
    seen = hi > lo
    key_block = torch.arange(nk_tok, device=device) // block
    # Tiles touched by some key: +1/-1 at each key's first/past-last query block, cumsum.
    touch = torch.zeros(nq + 1, nk, dtype=torch.int32, device=device)
    ones = seen.to(torch.int32)
    touch.index_put_((lo // block, key_block), ones, accumulate=True)
    touch.index_put_((-(-hi // block), key_block), -ones, accumulate=True)
    touched = touch.cumsum(0)[:nq] > 0
    # Tiles where every key sees every row (partial edge tiles never count as full).
    pad = nk * block - nk_tok
    lo_p = F.pad(torch.where(seen, lo, nq_tok), (0, pad), value=nq_tok).view(nk, block)
    hi_p = F.pad(torch.where(seen, hi, 0), (0, pad), value=0).view(nk, block)
    row_start = torch.arange(nq, device=device) * block
    row_end = row_start + block
    full = (lo_p.amax(1)[None, :] <= row_start[:, None]) & (hi_p.amin(1)[None, :] >= row_end[:, None])
    partial = touched & ~full

    def blocks(which: torch.Tensor):
        count = which.sum(-1, dtype=torch.int32)
        order = torch.argsort((~which).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[None, None], order[None, None]

    # Index tensors padded to whole blocks so the mask function never reads past them:
    # padded queries see nothing, padded keys are seen by nobody.
    q_pad = F.pad(q_index, (0, nq * block - nq_tok), value=-1)
    k_pad = F.pad(k_index, (0, pad), value=torch.iinfo(k_index.dtype).max)
    end_pad = F.pad(k_end, (0, pad), value=0)

    def tree_mask_mod(b, h, q, kv):
        qi = q_pad[q]
        return (k_pad[kv] <= qi) & (qi < end_pad[kv])

    if square and nk > nq:  # empty query tiles in front: no key tile at all
        empty = nk - nq
        partial = F.pad(partial, (0, 0, empty, 0), value=False)
        full = F.pad(full, (0, 0, empty, 0), value=False)
        q_pad = F.pad(q_pad, (empty * block, 0), value=-1)
        nq = nk
    kv_num, kv_idx = blocks(partial)
    full_num, full_idx = blocks(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=tree_mask_mod,
        seq_lengths=(nq * block, nk * block),
    )


# ------------------------------------------------------------------- the HF function
_active = threading.local()  # .ctx: the TreeAttention of the model call in progress


@torch.compiler.disable
def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, Nq, D], key/value [1, H_kv, Nq, D] -> ([1, Nq, H, D], None)."""
    ctx: TreeAttention | None = kwargs.get(KWARG) or getattr(_active, "ctx", None)
    if ctx is None:
        raise RuntimeError(
            "treerl attention was called without a tree mask: run the model through "
            "treerl.TreeEngine (it passes tree_attention=...), or switch the model back "
            "to its own attention implementation"
        )
    if attention_mask is not None:
        raise RuntimeError("treerl attention got an HF attention_mask too; pass only the tree mask")
    if kwargs.get("sliding_window"):
        raise NotImplementedError("sliding-window attention is not supported by treerl")
    layer = module.layer_idx
    kept = ctx.kept.get(layer)
    if kept is not None and torch.is_grad_enabled():  # the block's recompute in the backward
        _route(ctx, "kept")
        out = kept.recompute(*_inputs(ctx, layer, query, key, value))
        return out.transpose(1, 2).contiguous().requires_grad_(), None  # saves what the forward's saved
    if ctx.capture:
        ctx.captured[layer] = (key, value)
    inputs = _inputs(ctx, layer, query, key, value)
    if layer in ctx.keep_layers and torch.is_grad_enabled():
        ctx.kept[layer] = KeptAttention(inputs)
        out = ctx.kept[layer].run(functools.partial(_attend, ctx, scaling=scaling), *inputs)
    else:
        out = _attend(ctx, *inputs, scaling=scaling)
    return out.transpose(1, 2).contiguous(), None


def _inputs(ctx: TreeAttention, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's query, and its keys/values after the prefix's."""
    if ctx.prefix:
        pieces = ctx.prefix[layer]
        key = torch.cat([k for k, _ in pieces] + [key], dim=2)
        value = torch.cat([v for _, v in pieces] + [value], dim=2)
    return query, key, value


# Layer calls by route since the process started (or since the caller cleared it), beside the
# engine's per-step StepStats.attention: "causal" (one chain, no prefix: SDPA's causal kernel),
# "chain:<kernel>" (one chain after a prefix: treerl.engine.chain_attention), "mask" (the tree
# mask: not one chain), "mask:chain-off" (one chain after a prefix, CHAIN_AFTER_PREFIX off),
# "mask:no-kernel" (one chain or group after a prefix that no fused kernel takes), "group:<kernel>"
# (several leaves after a prefix: treerl.engine.group_attention, GROUPS_AFTER_PREFIX on;
# "mask:group-sdpa": such a call under the SDPA backend on CUDA, which takes the tree mask),
# "mask:short-prefix" (a group whose prefix is shorter than its kernel's grid), "root:<kernel>" (per
# tree a root chain and the rest as a group after it: ROOT_SPLIT on; "root:<chain's>+<group's>" where the
# kernels differ, e.g. one past cuDNN's shape bound, each named once in order of first use;
# "mask:no-kernel" / "mask:short-prefix" as a part's), "kept" (a block's recompute of a kept attention:
# the held output, no attention run).
ROUTES: collections.Counter = collections.Counter()


def _route(ctx: TreeAttention, name: str) -> None:
    ROUTES[name] += 1
    if ctx.routes is not None:
        ctx.routes[name] += 1


def _attend(ctx: TreeAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            scaling: float | None) -> torch.Tensor:
    """query [1, H, Nq, D], key/value [1, H_kv, Nk, D] -> [1, H, Nq, D] by ``ctx``'s backend."""
    gqa = query.shape[1] != key.shape[1]
    if ctx.causal and key.shape[2] == query.shape[2]:
        _route(ctx, "causal")
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    if ctx.causal:  # one chain after a prefix
        kernel = kernel_for(query, key)
        if kernel is not None:
            _route(ctx, f"chain:{kernel.label}")
            return chain_attention(query, key, value, scaling, kernel)
        # no fused kernel takes these inputs (the probe says why, once): the tree mask
        _route(ctx, "mask:no-kernel")
    elif ctx.group:  # several leaves after a prefix
        out = _group(ctx, query, key, value, scaling)
        if out is not None:
            return out
    elif ctx.roots:  # long root chains, each then the rest of its tree
        out = _root(ctx, query, key, value, scaling)
        if out is not None:
            return out
    else:
        _route(ctx, "mask:chain-off" if ctx.chain and ctx.prefix else "mask")
    if ctx.backend == "sdpa":
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=ctx.additive_mask(query.dtype), scale=scaling, enable_gqa=gqa
        )
    return flex_tree_attention(query, key, value, ctx.mask(), scaling)


def _group(ctx: TreeAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           scaling: float | None) -> torch.Tensor | None:
    """A group's attention after a prefix (:func:`_fused_group`), its route counted as ``group:<kernel>``;
    None where it does not run (the tree mask instead). Its own part: flex with the tree mask, or on the
    CPU the plain-torch math (the SDPA backend on CUDA has no own part that returns a log-sum-exp without
    the whole score matrix)."""
    if ctx.backend != "flex" and query.device.type != "cpu":
        _route(ctx, "mask:group-sdpa")  # no own part with its log-sum-exp short of the whole score matrix
        return None
    out, label = _fused_group(query, key, value, scaling, functools.partial(_own, ctx))
    _route(ctx, label if out is None else f"group:{label}")
    return out


def _fused_group(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                 own: OwnPart) -> tuple[torch.Tensor | None, str]:
    """A group (query [1, H, n, D] after the prefix keys of key/value [1, Hk, P + n, D]) through
    :mod:`treerl.engine.group_attention` and ``own`` -> (out [1, H, n, D], its kernel's label), or
    (None, the route of why not: ``mask:no-kernel``, ``mask:short-prefix``)."""
    kernel = kernel_for(query, key, causal=False)
    out = None if kernel is None else group_attention(query, key, value, scaling, own, kernel)
    return out, "mask:no-kernel" if kernel is None else "mask:short-prefix" if out is None else kernel.label


def _root(ctx: TreeAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          scaling: float | None) -> torch.Tensor | None:
    """The root split of a call without prefix (query [1, H, N, D], key/value [1, Hk, N, D], its trees
    ``ctx.roots``) -> [1, H, N, D]: each tree's parts (:func:`_root_tree`) in call order, counted once as
    ``root:<kernels>`` (those its parts ran, in order of first use: ``root:<chain's>+<group's>`` where
    they differ, e.g. one past cuDNN's shape bound); None where a part does not run (the tree mask
    instead; counted as the part's reason)."""
    outs: list[torch.Tensor] = []
    labels: dict[str, None] = {}  # (ordered, unique)
    for tree in ctx.roots:  # (the engine pads no such call to whole flex tiles: its queries are its tokens)
        parts = _root_tree(ctx, query, key, value, scaling, tree)
        if isinstance(parts, str):
            _route(ctx, parts)
            return None
        outs += parts[0]
        labels.update(dict.fromkeys(parts[1]))
    _route(ctx, "root:" + "+".join(labels))
    return torch.cat(outs, dim=2)


def _root_tree(ctx: TreeAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None, tree: RootedTree) -> tuple[list[torch.Tensor], list[str]] | str:
    """One tree of the root split (the call's query/key/value as in :func:`_root`) -> its outputs in
    order ([1, H, r, D] of the root chain, then [1, H, n, D] of the rest; none for a tree that is one
    chain) and the labels of their kernels; or the route of why not (the group first: a part that
    does not run costs no kernel call). The root chain's causal attention runs through the probed fused
    kernel (:func:`~treerl.engine.chain_attention.chain_attention` without prefix: cuDNN's where it
    passes the probe; SDPA's own choice may be flash, slower than flex on long chains: bench/RESULTS.md,
    session 4), the rest as a group whose prefix is the root chain (every one of them sees it), its own
    part over the tree's block (:func:`_own`)."""
    root = slice(tree.start, tree.start + tree.root)
    q_root, k_root, v_root = query[:, :, root], key[:, :, root], value[:, :, root]
    kernel = kernel_for(q_root, k_root)
    if kernel is None:
        return "mask:no-kernel"
    rest, labels = [], [kernel.label]
    if tree.rest:
        block = slice(tree.start, tree.end)
        own = functools.partial(_own, ctx, rows=root.stop, start=tree.start, stop=tree.end)
        out, label = _fused_group(query[:, :, root.stop:tree.end], key[:, :, block], value[:, :, block], scaling, own)
        if out is None:
            return label
        rest, labels = [out], labels + [label]
    return [chain_attention(q_root, k_root, v_root, scaling, kernel), *rest], labels


def _own(ctx: TreeAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, first: int,
         scale: float, rows: int = 0, start: int = 0, stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's own part: the queries (the call's from row ``rows`` on, up to ``stop``) over the keys
    from ``first`` on of the group's keys (the call's from key ``start`` on, up to ``stop``: one tree's
    block of a call without prefix; None: the call's end) under the tree mask -> (out [1, H, n, D],
    differentiable log-sum-exp [1, H, n]), n the queries."""
    mask = ctx.own_mask(start + first, rows, stop)
    if ctx.backend == "flex":
        return flex_tree_attention(query, key, value, mask, scale, lse=True)
    out, lse, _ = MATH.forward(query, key, value, mask, scale)
    return out, lse


register(ATTN_NAME, tree_attention_forward)


def active_tree_attention() -> TreeAttention | None:
    """The tree attention set by the innermost :func:`tree_attention_enabled` of this thread."""
    return getattr(_active, "ctx", None)


@contextlib.contextmanager
def tree_attention_enabled(model: torch.nn.Module, ctx: TreeAttention | None = None) -> Iterator[None]:
    """Route the model's attention through treerl for the duration of the block, with
    ``ctx`` as the tree attention of every call in it (or pass ``tree_attention=ctx`` to
    the model)."""
    previous_ctx = getattr(_active, "ctx", None)
    _active.ctx = ctx
    try:
        with attention_routed(model, ATTN_NAME):
            yield
    finally:
        _active.ctx = previous_ctx
