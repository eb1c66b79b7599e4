"""Memory budget -> tokens per call: the engine's memory model and policy
(:class:`MemoryPolicy`, one per engine).

One engine call (a segment of ``n`` tree tokens) holds, for its backward, activations that
grow linearly in ``n``: ``fixed + n * per_token`` (plus ``n^2 * per_pair`` with the dense
SDPA mask of the CPU backend, whose math kernel materialises the attention scores). With block recompute (activation
checkpointing, :mod:`treerl.engine.decoder`) only each decoder block's input is held, plus one
block's full activations while that block's backward runs; where the budget leaves room
beside that, recomputed blocks keep their attention's output (:mod:`treerl.engine.kept_attention`),
so the recompute skips the attention forward. On CUDA both lines are
*measured* on the engine's own model (two forward calls with grad, no backward, no
gradient touched); elsewhere they are estimated from the config (bf16/float32 HF blocks).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .attention import TreeAttention, groups_after_prefix, prefix_as_tiles, tree_attention_enabled
from .chain_attention import ALIGN
from .kernel_plans import Layout
from .rooted_trees import RootedTree

if TYPE_CHECKING:
    from .decoder import DecoderStack

DEFAULT_BUDGET_FRACTION = 0.25  # of the device's total memory, for activations
MIN_BUDGET_BYTES = 1 << 20
BACKWARD_MARGIN = 1.25  # a call's backward peaks above its forward's held activations


def resolve_budget(budget: int | float | None, device: torch.device) -> int:
    """Activation bytes for one step.

    ``None``: :data:`DEFAULT_BUDGET_FRACTION` of the device's total memory (20 GB on an
    80 GB H100): whole trees of tens of thousands of tokens run in one call with block
    recompute. Measured on the H100 (bench/RESULTS.md, session 7; Qwen3-1.7B shape): at 25%
    the 32k-token shared prefix runs as one recomputing call (3.4 s, 16.5 GiB) where 20%
    planned 40 calls (4.8 s, 21.6 GiB; ``dfs`` 22.9 GiB); with balanced packs (the planner)
    the medium batches run the 20% plans, at 0.99-1.14x the peak memory of ``dfs``, while
    weights, gradients and optimizer state keep the rest. A value in
    (0, 1] is a fraction of the device's total memory, a larger one is bytes.
    """
    if budget is None:
        budget = DEFAULT_BUDGET_FRACTION
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
        raise ValueError(
            f"memory_budget must be a fraction of the device's memory in (0, 1] or a number of bytes, "
            f"got {budget!r}"
        )
    if budget <= 1:
        return int(budget * device_memory(device))
    if budget < MIN_BUDGET_BYTES:
        raise ValueError(
            f"memory_budget={budget!r} bytes is too small to hold one call; give a fraction in (0, 1] "
            f"(e.g. 0.1) or bytes (e.g. {8 << 30} for 8 GiB)"
        )
    return int(budget)


def device_memory(device: torch.device) -> int:
    """Bytes of the device this process may use (host RAM for the CPU): its total memory,
    times the limit of ``torch.cuda.set_per_process_memory_fraction`` where one is set."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        limit = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        return int(total * (limit(device) if limit is not None else 1.0))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class MemoryModel:
    """Activation bytes of one call of ``n`` query tokens after ``prefix`` tokens of keys
    (:meth:`call_bytes`): ``fixed + n * per_token`` (held for the backward) or
    ``fixed + n * recompute_per_token`` with block recompute, plus what long keys cost a
    call with a prefix (its keys/values concatenated after the prefix's, in every layer
    without recompute) and, for a chain segment, its own keys/values kept as leaves with
    their gradients for the segments below it."""

    fixed: float
    per_token: float
    recompute_per_token: float
    per_pair: float = 0.0
    measured: bool = False
    # what one recomputed layer that keeps its attention holds more (treerl.engine.kept_attention):
    # per query its output and log-sum-exp, per key nothing; where its inputs are copies
    # (concatenated after a prefix, padded, expanded) also the input copies; with the
    # dense SDPA mask the probabilities per (query, key) pair
    attention_per_query: float = 0.0
    attention_copies_per_query: float = 0.0
    attention_copies_per_key: float = 0.0
    attention_per_pair: float = 0.0
    kv_per_token: float = 0.0  # one token's keys and values, all layers (as the model computes them)
    layers: int = 1
    # per key and layer of a call after a prefix whose queries are padded to the keys' length
    # (treerl.engine.attention.PREFIX_AS_TILES): the padded query, output and log-sum-exp
    prefix_pad_per_key: float = 0.0

    @property
    def leaf_per_token(self) -> float:
        """Bytes a chain segment holds per token while the segments below it run: its
        keys/values as leaves and their accumulated gradients."""
        return 2 * self.kv_per_token

    def prefix_bytes(self, prefix: int) -> float:
        """What the ancestors of a call after ``prefix`` tokens hold: their keys/values
        leaves with gradients."""
        return prefix * self.leaf_per_token

    def _coefficients(self, prefix: int, recompute: bool, leaves: bool, kept: int = 0, copies: bool = False
                      ) -> tuple[float, float, float]:
        """(a, b, c): a call of ``n`` queries after ``prefix`` keys holds ``a + b n + c n^2``
        bytes at its peak (forward and backward)."""
        a = self.fixed
        b = self.recompute_per_token if recompute else self.per_token
        c = self.per_pair
        b += prefix * self.per_pair
        if prefix:
            # the concatenated keys/values: saved by every layer without recompute, else one
            # layer's at a time (with its gradient and a padded copy); padded queries likewise
            per_key = self.kv_per_token / self.layers * (3 if recompute else self.layers + 2)
            per_key += self.prefix_pad_per_key * (2 if recompute else self.layers + 1)
            a, b = a + prefix * per_key, b + per_key
        if leaves:
            b += self.leaf_per_token
        if kept:
            per_query, per_key, per_pair = self._kept_layer_bytes(copies or bool(prefix), bool(prefix))
            a += kept * (prefix * per_key)
            b += kept * (per_query + per_key + prefix * per_pair)
            c += kept * per_pair
        return a, b, c

    def call_bytes(self, queries: int, prefix: int = 0, recompute: bool = False, leaves: bool = False) -> float:
        """Peak activation bytes of one call with grad (its forward and backward) of
        ``queries`` tokens after ``prefix`` keys; ``leaves``: a chain segment (its own
        keys/values and their gradients held for the segments below)."""
        a, b, c = self._coefficients(prefix, recompute, leaves)
        return a + b * queries + c * queries * queries

    def largest_call(self, room: float, prefix: int = 0, recompute: bool = False, leaves: bool = False,
                     kept: int = 0, copies: bool = False) -> int:
        """Most queries of a call after ``prefix`` keys within ``room`` bytes (0: none),
        ``kept`` layers keeping their attention (``copies``: the kernel reads input copies)."""
        a, b, c = self._coefficients(prefix, recompute, leaves, kept, copies)
        n = _largest_call(room - a, b, c) if room - a >= b + c else 0
        while n > 0 and a + b * n + c * n * n > room:  # float rounding
            n -= 1
        return n

    def tokens(self, budget: int, recompute: bool) -> int:
        """Largest call without prefix that fits ``budget`` bytes (at least 1 token)."""
        return max(1, self.largest_call(budget, recompute=recompute))

    def tokens_keeping_attention(self, budget: int, layers: int, copies: bool) -> int:
        """Largest recomputed call (no prefix) in which all ``layers`` keep their attention
        (:meth:`kept_attention_layers`) within ``budget`` bytes (at least 1 token)."""
        return max(1, self.largest_call(budget, recompute=True, kept=layers, copies=copies))

    def kept_attention_layers(self, spare: float, queries: int, keys: int, layers: int, copies: bool,
                              roots: tuple[RootedTree, ...] = ()) -> int:
        """How many of ``layers`` recomputed blocks of a call (``queries`` tokens, ``keys``
        = prefix + queries) can keep their attention in ``spare`` bytes (what the budget
        leaves beside the call, :meth:`call_bytes`); ``copies``: the attention kernel gets
        copies of its inputs (held too); ``roots``: the call runs the root split on these trees
        (:attr:`TreeAttention.roots`, :data:`~treerl.engine.attention.ROOT_SPLIT`; empty: it does not)."""
        if roots:  # the root split (no prefix): its outputs, and copies for its own parts' flex only
            per_layer = root_split_layer_bytes(self, queries, roots)
            spare -= root_split_transient(self, queries)
        else:
            per_query, per_key, per_pair = self._kept_layer_bytes(copies, keys > queries)
            per_layer = queries * per_query + keys * per_key + queries * keys * per_pair
        if per_layer <= 0:
            return 0
        return int(min(layers, max(0.0, spare) // per_layer))

    def recompute_margin(self, queries: int) -> float:
        """What the model holds back for a recomputing call of ``queries`` tokens beyond its
        measured needs: the :data:`BACKWARD_MARGIN`'s surplus on its recompute bytes per token.
        Measured on the H100 (bench/RESULTS.md, session 10; Qwen3-1.7B shape, 43,485 tokens, kept
        attentions forced to 0, 8, 16, 28): the call holds 8.69 GiB beside its kept attentions
        (9.02 with the root split) where the model says 11.75; this margin is 3.1-3.4 GiB of those.
        Session 8 also gave away the second block's activations of :meth:`MemoryPolicy._measure`
        (~3 GiB more): the root split's kept attentions took it all and peaked 2.7 GiB over the
        budget, so the recomputed block's activations are held after all. 0 for an estimate."""
        if not self.measured:
            return 0.0
        return queries * self.recompute_per_token * (1 - 1 / BACKWARD_MARGIN)

    def _kept_layer_bytes(self, copies: bool, prefix: bool = False) -> tuple[float, float, float]:
        """What one kept attention holds: bytes per query, per key, per (query, key) pair. After
        a prefix with :data:`~treerl.engine.attention.GROUPS_AFTER_PREFIX` on (anywhere: counted
        on the CPU too, where its default leaves it off), a group's kept attention also holds its
        own part's output and log-sum-exp (:mod:`treerl.engine.group_attention`)."""
        per_query = self.attention_per_query * (2 if prefix and groups_after_prefix() else 1)
        if not copies:
            return per_query, 0.0, self.attention_per_pair
        per_key = self.attention_copies_per_key + (self.prefix_pad_per_key if prefix else 0.0)
        return per_query + self.attention_copies_per_query, per_key, self.attention_per_pair

    @classmethod
    def estimate(cls, config, dtype: torch.dtype, dense_mask: bool = False) -> "MemoryModel":
        """From the shapes: what an eager HF decoder block saves per token (norms in
        float32, q/k/v, RoPE, attention, the SwiGLU intermediates)."""
        size = torch.finfo(dtype).bits // 8
        h, layers = config.hidden_size, config.num_hidden_layers
        heads, kv_heads, head_dim = attention_heads(config)
        q, kv = heads * head_dim, kv_heads * head_dim
        block = size * (7 * h + 5 * q + 6 * kv) + mlp_activation_bytes(config, size)
        # the loss head's float32 logits chunk (~3 alive) and its weight gradient
        fixed = 3 * (1 << 27) * 4 + weight_gradient_transients(config, size)
        # dense mask: the bool mask, and scores + probabilities of every head (one layer at a time)
        per_pair = (1 + 2 * size * config.num_attention_heads) if dense_mask else 0.0
        return cls(fixed=fixed, per_token=block * layers * BACKWARD_MARGIN,
                   recompute_per_token=size * h * layers + 2 * block, per_pair=per_pair,
                   **attention_held(config, dtype, dense_mask), **keys_values(config, dtype))


@dataclass(frozen=True)
class CallBudget:
    """The memory model under a budget, as the planner asks it: how many tokens a call may
    hold after a prefix, whether it recomputes its blocks, what a path needs.

    ``budget``: activation bytes of a step. ``recompute``: calls may recompute their decoder
    blocks in the backward. ``copies``: the attention kernel reads copies of its inputs even
    without a prefix (SDPA), which kept attentions hold. :meth:`tokens_only` is the
    ``max_tokens`` override: one "byte" per token and nothing else, so every decision below
    reads as a token count."""

    model: MemoryModel
    budget: float
    recompute: bool = False
    copies: bool = False
    pack_cap: int | None = None  # most tokens of several subtrees in one call (the override's pack_tokens)
    device_bytes: int | None = None  # for error messages: the budget as a fraction of the device

    @classmethod
    def tokens_only(cls, max_tokens: int, pack_tokens: int | None = None) -> "CallBudget":
        return cls(MemoryModel(fixed=0.0, per_token=1.0, recompute_per_token=1.0), float(max_tokens),
                   pack_cap=pack_tokens)

    def room(self, prefix: int) -> float:
        """Bytes for a call after ``prefix`` tokens: the budget less its ancestors' keys/values."""
        return self.budget - self.model.prefix_bytes(prefix)

    def tokens(self, prefix: int = 0, leaves: bool = False) -> int:
        """Most queries of one call after ``prefix`` tokens (recomputing its blocks where
        allowed; ``leaves``: a chain segment); 0 when not even one fits."""
        return self.model.largest_call(self.room(prefix), prefix, self.recompute, leaves)

    def pack(self, prefix: int = 0) -> int:
        """Most tokens of several subtrees packed into one call after ``prefix``: up to the
        size at which a recomputed call keeps every layer's attention (or needs no recompute)."""
        n = self.tokens(prefix)
        if self.recompute:
            room = self.room(prefix)
            n = max(self.model.largest_call(room, prefix, True, kept=self.model.layers, copies=self.copies),
                    self.model.largest_call(room, prefix, False))
        return min(n, self.pack_cap) if self.pack_cap else n

    def recomputes(self, queries: int, prefix: int = 0, leaves: bool = False) -> bool:
        """Whether a call recomputes its blocks: only where it would not fit otherwise."""
        return self.recompute and self.model.call_bytes(queries, prefix, False, leaves) > self.room(prefix)

    def path_needs(self, length: int) -> tuple[float, float]:
        """(bytes, of which prefix bytes) a root-to-leaf path of ``length`` tokens needs at
        the least: its last token's call after the keys/values (with gradients) of all the
        others, i.e. depth-first in one-token calls."""
        prefix = max(0, length - 1)
        held = self.model.prefix_bytes(prefix)
        return held + self.model.call_bytes(1, prefix, self.recompute), held

    def describe(self, nbytes: float) -> str:
        text = f"{nbytes / 2**30:.2f} GiB"
        if self.device_bytes:
            text += f" ({nbytes / self.device_bytes:.3f} of the device)"
        return text


def root_split_outputs(queries: int, roots: tuple[RootedTree, ...]) -> float:
    """Attention outputs (and log-sum-exps) per query that a kept attention holds in a call of
    ``queries`` tokens that runs the root split on the trees ``roots`` (empty: it does not, 1): the
    call's output (``N`` rows), the root chains' (saved by their kernel), and of the ``n`` others
    (the trees' queries after their root chains) the groups' merged outputs and their own parts':
    ``(2N + n) / N``."""
    return (2 * queries + sum(tree.rest for tree in roots)) / queries if roots else 1.0


def root_split_layer_bytes(model: MemoryModel, queries: int, roots: tuple[RootedTree, ...],
                           align: int = ALIGN["cudnn"]) -> float:
    """Bytes one kept root-split attention holds (a call of ``queries`` tokens, its trees ``roots``):
    :func:`root_split_outputs` outputs per query, and the input copies of its own parts' flex only (per
    tree with a group, its ``n_i`` queries after the root chain over the root keys the fused part leaves
    (:class:`~treerl.engine.kernel_plans.Layout`'s ``front``) and their own; the fused kernels' padded
    copies are rebuilt in the backward, the chain parts save views)."""
    copies = sum(tree.rest * model.attention_copies_per_query
                 + (tree.rest + Layout.of(tree.rest, tree.root, align, causal=False).front)
                 * model.attention_copies_per_key for tree in roots if tree.rest)
    return queries * model.attention_per_query * root_split_outputs(queries, roots) + copies


def root_split_transient(model: MemoryModel, queries: int) -> float:
    """Bytes a root-split call of ``queries`` tokens holds beyond a tree-mask call while one layer's
    attention runs (kept or not): the parts' outputs (the root chains' and the groups', ``N`` rows
    in all whatever the number of trees) beside the concatenated one, ~2 outputs per query (measured on
    the H100 with one tree, session 10: +0.33 GiB at 43,485 tokens)."""
    return 2 * queries * model.attention_per_query


def weight_gradient_transients(config, size: int) -> float:
    """Bytes of the vocabulary-sized gradient a backward materialises beside the held
    activations before adding it to ``.grad``: the LM head's (the loss head's
    ``grad_weight``, at the start of the backward; 622 MB for 152k x 2048 in bf16). The input
    embedding's dense gradient comes at the end, when the blocks' activations are freed."""
    return config.vocab_size * config.hidden_size * size


def keys_values(config, dtype: torch.dtype) -> dict[str, float]:
    """One token's keys and values over all layers (post-RoPE, one per KV head)."""
    size = torch.finfo(dtype).bits // 8
    _, kv_heads, head_dim = attention_heads(config)
    layers = config.num_hidden_layers
    return dict(kv_per_token=2 * size * kv_heads * head_dim * layers, layers=layers)


def attention_heads(config) -> tuple[int, int, int]:
    """A model config's (query heads, KV heads, head dim)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def _largest_call(room: float, per_token: float, per_pair: float) -> int:
    """Largest n >= 1 with n * per_token + n^2 * per_pair <= room."""
    if room <= 0:
        return 1
    if per_pair > 0:
        return max(1, int((-per_token + (per_token * per_token + 4 * per_pair * room) ** 0.5) / (2 * per_pair)))
    return max(1, int(room // per_token))


def attention_held(config, dtype: torch.dtype, dense_mask: bool) -> dict[str, float]:
    """Bytes one kept attention holds (:mod:`treerl.engine.kept_attention`): its output and float32
    log-sum-exp per query; input copies: the query and K/V (expanded to every head by
    SDPA's math kernel, which also holds the probabilities per (query, key) pair)."""
    size = torch.finfo(dtype).bits // 8
    heads, kv_heads, head_dim = attention_heads(config)
    kv_heads = heads if dense_mask else kv_heads
    return dict(attention_per_query=(size * head_dim + 4) * heads, attention_copies_per_query=size * heads * head_dim,
                attention_copies_per_key=2 * size * kv_heads * head_dim,
                attention_per_pair=size * heads if dense_mask else 0.0)


class MemoryPolicy:
    """The engine's memory policy: how many tokens one call may hold, how many trees pack
    into one, which calls recompute their decoder blocks and which layers keep their
    attention. The :class:`MemoryModel` of the engine's model (measured on CUDA at the first
    question, estimated elsewhere) under the budget, or the ``max_tokens`` override (then
    no budget and no recompute).

    Args:
        stack: the engine's decoder stack (it runs the probe forwards on CUDA and says
            whether blocks may be recomputed, :attr:`DecoderStack.can_checkpoint`).
        head: the LM head (the activations' dtype; whether its weight trains).
        attention: the engine's attention backend, ``"sdpa"`` or ``"flex"``.
        device: the engine's device.
        budget: ``memory_budget`` as :func:`resolve_budget` takes it.
        max_tokens: the override: most tree tokens in one call (``None``: from the budget).
        chunk_elements: logits elements per chunk of the loss head.
    """

    def __init__(self, stack: "DecoderStack", head: torch.nn.Module, attention: str, device: torch.device, *,
                 budget: int | float | None, max_tokens: int | None, chunk_elements: int):
        self.stack, self.head, self.attention, self.device = stack, head, attention, device
        self.fixed_tokens, self.chunk_elements = max_tokens, chunk_elements
        self.budget = None if max_tokens is not None else resolve_budget(budget, device)
        self.config = stack.base.config
        self.layers = self.config.num_hidden_layers
        self._model: MemoryModel | None = None

    @property
    def model(self) -> MemoryModel:
        """Activation bytes of a call, with and without block recompute (measured once)."""
        if self._model is None:
            self._model = self._measure()
        return self._model

    @property
    def can_recompute(self) -> bool:
        return self.stack.can_checkpoint

    @property
    def call_budget(self) -> CallBudget | None:
        """The memory model under the budget, as the planner reads it (None with the
        ``max_tokens`` override)."""
        if self.fixed_tokens is not None:
            return None
        model = self.model
        if self.attention == "flex" and prefix_as_tiles():
            pad = model.attention_copies_per_query + model.attention_per_query  # padded query, output, lse
            model = dataclasses.replace(model, prefix_pad_per_key=pad)
        return CallBudget(model, self.budget, recompute=self.can_recompute, copies=self.attention == "sdpa",
                          device_bytes=device_memory(self.device))

    @property
    def max_tokens(self) -> int:
        """Most tree tokens in one call: the override, or what the budget allows (with
        block recompute where the model supports it)."""
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        return max(1, self.call_budget.tokens())

    @property
    def pack_tokens(self) -> int:
        """Most tokens of several trees (or sequences) packed into one call: up to the
        size at which a recomputed call still keeps every layer's attention (or fits
        without recompute). A larger call would recompute attentions, which on long
        sequences costs more than another call; one tree up to :attr:`max_tokens` still
        runs whole. (A packed call has no prefix: its kernel reads copies only with SDPA.)"""
        if self.fixed_tokens is not None:
            return self.fixed_tokens
        return max(1, self.call_budget.pack())

    def recomputes(self, size: int, prefix: int = 0) -> bool:
        """Whether a call of ``size`` tokens after ``prefix`` tokens recomputes its decoder
        blocks in the backward: only under a budget, and only when the call would not fit
        it otherwise (the plan decides it per segment: :attr:`Segment.recompute`)."""
        budget = self.call_budget
        return budget is not None and budget.recomputes(size, prefix)

    def kept_attention_layers(self, queries: int, keys: int, copies: bool, spare: float, alone: bool = False,
                              roots: tuple[RootedTree, ...] = ()) -> frozenset[int]:
        """The layers of a recomputed call whose attention runs once (not again in the
        recompute, :mod:`treerl.engine.kept_attention`): the last ones (their held tensors
        are freed first in the backward), as many as fit the ``spare`` bytes the plan leaves
        beside the call (:attr:`Segment.spare`). ``copies``: :attr:`TreeAttention.input_copies`.

        ``alone``: the call runs its backward right after its forward with no other graph
        held (a single-level plan's call, or a standalone tree's call beside chained trees
        under a separable loss): without a prefix its kept attentions may also take
        the model's margin for the call (:meth:`MemoryModel.recompute_margin`). A call after a
        prefix does not (the model has underestimated such calls: bench/RESULTS.md, the
        half-device memory test), nor one whose graph stays held while others run.

        ``roots``: :attr:`TreeAttention.roots` (the call runs the root split on these trees: its kept
        attentions hold more outputs, :func:`root_split_outputs`)."""
        if alone and keys == queries:
            spare += self.model.recompute_margin(queries)
        count = self.model.kept_attention_layers(spare, queries, keys, self.layers, copies, roots)
        return frozenset(range(self.layers - count, self.layers))

    def _measure(self) -> MemoryModel:
        """Measured on CUDA (see the module docstring), estimated elsewhere. The decoder
        stack is measured alone; the loss head adds its logits chunks (fixed) and the
        hidden rows it keeps (per token)."""
        config, weight = self.config, self.head.weight
        estimate = MemoryModel.estimate(config, weight.dtype, dense_mask=self.attention == "sdpa")
        if self.device.type != "cuda" or self.attention == "sdpa" or self.stack.sharded:
            return estimate  # (sharded blocks: a probe forward would run FSDP's collectives)
        small, large = 1024, 3072
        h, inter = config.hidden_size, config.intermediate_size
        size = weight.element_size()
        head_fixed = 3 * self.chunk_elements * 4  # float32 logits, probabilities, gradients
        head_per_token = h * size
        full = [self._forward_peak(n, recompute=False) for n in (small, large)]
        # a frozen model (reference engine) holds nothing: still count a call's transients
        floor = 2 * (h + inter) * size
        per_token = max(floor, (full[1] - full[0]) / (large - small))
        fixed = max(0.0, full[0] - small * per_token) + head_fixed
        if weight.requires_grad:
            fixed += weight_gradient_transients(config, size)
        recompute_per_token = estimate.recompute_per_token
        if self.can_recompute:
            ckpt = [self._forward_peak(n, recompute=True) for n in (small, large)]
            # held block inputs + one block's activations and their gradients while it recomputes
            recompute_per_token = max(floor, (ckpt[1] - ckpt[0]) / (large - small)) + 2 * per_token / self.layers
        return MemoryModel(fixed=fixed, per_token=(per_token + head_per_token) * BACKWARD_MARGIN,
                           recompute_per_token=(recompute_per_token + head_per_token) * BACKWARD_MARGIN,
                           measured=True, **attention_held(config, weight.dtype, dense_mask=False),
                           **keys_values(config, weight.dtype))

    def _forward_peak(self, n: int, recompute: bool) -> float:
        """Peak CUDA bytes above the start of the decoder stack's forward with grad over
        ``n`` random tokens (one chain), until its output is freed. No backward: no
        gradient is touched."""
        device, base = self.device, self.stack.base
        gen = torch.Generator(device="cpu").manual_seed(n)
        ids = torch.randint(0, base.get_input_embeddings().num_embeddings, (1, n), generator=gen).to(device)
        index = torch.arange(n, device=device)
        ctx = TreeAttention(self.attention, index, index, torch.full((n,), n, device=device))
        ctx.mask()
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.enable_grad(), tree_attention_enabled(base, ctx):
            hidden = self.stack(ids, index[None], checkpoint_blocks=recompute)
        peak = torch.cuda.max_memory_allocated(device) - start
        del hidden
        torch.cuda.synchronize(device)
        return float(peak)


# ------------------------------------------------------------- mixture of experts
def sparse_layers(config) -> int:
    """Decoder layers whose MLP is a sparse MoE block (Qwen3-MoE's rule; 0 for dense models)."""
    experts = getattr(config, "num_experts", 0) or 0
    if not experts:
        return 0
    step, dense = getattr(config, "decoder_sparse_step", 1) or 1, set(getattr(config, "mlp_only_layers", None) or [])
    return sum(1 for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0)


def mlp_activation_bytes(config, size: int) -> float:
    """What one token's MLP saves for the backward, per layer (averaged over the layers):
    a dense SwiGLU its 4 intermediates; a sparse MoE block (:mod:`treerl.moe`) its router
    logits (``size``) and float32 probabilities, and per routed copy (top-k) the gathered
    input, gate/up output, activation and product, down output and weighted output."""
    layers = config.num_hidden_layers
    moe_layers = sparse_layers(config)
    dense = 4 * size * config.intermediate_size
    if not moe_layers:
        return float(dense)
    k, mi, h, e = config.num_experts_per_tok, config.moe_intermediate_size, config.hidden_size, config.num_experts
    routed = size * (k * (4 * mi + 3 * h) + e) + 4 * e
    return (moe_layers * routed + (layers - moe_layers) * dense) / layers


def expert_weight_bytes(config, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of every expert weight, bytes of the experts one token reads: top-k per
    sparse layer) — the weights a decode step reads for a single row, and their total."""
    layers = sparse_layers(config)
    if not layers:
        return 0, 0
    size = torch.finfo(dtype).bits // 8
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * size
    return layers * config.num_experts * per_expert, layers * config.num_experts_per_tok * per_expert
