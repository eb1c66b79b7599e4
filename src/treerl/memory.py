"""Memory budget -> tokens per call: the engine's memory model.

One engine call (a segment of ``n`` tree tokens) holds, for its backward, activations that
grow linearly in ``n``: ``fixed + n * per_token`` (plus ``n^2 * per_pair`` with the dense
SDPA mask of the CPU backend, whose math kernel materialises the attention scores). With block recompute (activation
checkpointing, :mod:`treerl.decoder`) only each decoder block's input is held, plus one
block's full activations while that block's backward runs; where the budget leaves room
beside that, recomputed blocks keep their attention's output (:mod:`treerl.kept_attention`),
so the recompute skips the attention forward. On CUDA both lines are
*measured* on the engine's own model (two forward calls with grad, no backward, no
gradient touched); elsewhere they are estimated from the config (bf16/float32 HF blocks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

DEFAULT_BUDGET_FRACTION = 0.2  # of the device's total memory, for activations
MIN_BUDGET_BYTES = 1 << 20
BACKWARD_MARGIN = 1.25  # a call's backward peaks above its forward's held activations


def resolve_budget(budget: int | float | None, device: torch.device) -> int:
    """Activation bytes for one step.

    ``None``: :data:`DEFAULT_BUDGET_FRACTION` of the device's total memory (16 GB on an
    80 GB H100): whole trees of tens of thousands of tokens run in one call with block
    recompute, at 0.8-1.1x the peak memory of ``dfs`` (bench/RESULTS.md, the budget sweep:
    2-4 points of peak faster than 10%, and 30% would exceed 1.3x ``dfs`` on GRPO), while
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
    """Total bytes of the device (host RAM for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class MemoryModel:
    """Activation bytes of one call of ``n`` tokens: ``fixed + n * per_token`` (held for
    the backward) or ``fixed + n * recompute_per_token`` with block recompute."""

    fixed: float
    per_token: float
    recompute_per_token: float
    per_pair: float = 0.0
    measured: bool = False
    # what one recomputed layer that keeps its attention holds more (treerl.kept_attention):
    # per query its output and log-sum-exp, per key nothing; where its inputs are copies
    # (concatenated after a prefix, padded, expanded) also the input copies; with the
    # dense SDPA mask the probabilities per (query, key) pair
    attention_per_query: float = 0.0
    attention_copies_per_query: float = 0.0
    attention_copies_per_key: float = 0.0
    attention_per_pair: float = 0.0

    def tokens(self, budget: int, recompute: bool) -> int:
        """Largest call that fits ``budget`` bytes (at least 1 token)."""
        return _largest_call(budget - self.fixed, self.recompute_per_token if recompute else self.per_token,
                             self.per_pair)

    def tokens_keeping_attention(self, budget: int, layers: int, copies: bool) -> int:
        """Largest recomputed call (no prefix) in which all ``layers`` keep their attention
        (:meth:`kept_attention_layers`) within ``budget`` bytes (at least 1 token)."""
        per_query, per_key, per_pair = self._kept_layer_bytes(copies)
        return _largest_call(budget - self.fixed, self.recompute_per_token + layers * (per_query + per_key),
                             self.per_pair + layers * per_pair)

    def kept_attention_layers(self, budget: int, queries: int, keys: int, layers: int, copies: bool) -> int:
        """How many of ``layers`` recomputed blocks of a call (``queries`` tokens after a
        prefix, ``keys`` = prefix + queries) can keep their attention within ``budget``;
        ``copies``: the attention kernel gets copies of its inputs (held too)."""
        held = self.fixed + queries * self.recompute_per_token + queries * keys * self.per_pair
        per_query, per_key, per_pair = self._kept_layer_bytes(copies)
        per_layer = queries * per_query + keys * per_key + queries * keys * per_pair
        if per_layer <= 0:
            return 0
        return int(min(layers, max(0.0, budget - held) // per_layer))

    def _kept_layer_bytes(self, copies: bool) -> tuple[float, float, float]:
        """What one kept attention holds: bytes per query, per key, per (query, key) pair."""
        if not copies:
            return self.attention_per_query, 0.0, self.attention_per_pair
        return (self.attention_per_query + self.attention_copies_per_query, self.attention_copies_per_key,
                self.attention_per_pair)

    @classmethod
    def estimate(cls, config, dtype: torch.dtype, dense_mask: bool = False) -> "MemoryModel":
        """From the shapes: what an eager HF decoder block saves per token (norms in
        float32, q/k/v, RoPE, attention, the SwiGLU intermediates)."""
        size = torch.finfo(dtype).bits // 8
        h, layers = config.hidden_size, config.num_hidden_layers
        head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        block = size * (7 * h + 5 * q + 6 * kv) + mlp_activation_bytes(config, size)
        fixed = 3 * (1 << 27) * 4  # the loss head's float32 logits chunk, ~3 alive
        # dense mask: the bool mask, and scores + probabilities of every head (one layer at a time)
        per_pair = (1 + 2 * size * config.num_attention_heads) if dense_mask else 0.0
        return cls(fixed=fixed, per_token=block * layers * BACKWARD_MARGIN,
                   recompute_per_token=size * h * layers + 2 * block, per_pair=per_pair,
                   **attention_held(config, dtype, dense_mask))

    @classmethod
    def for_engine(cls, engine) -> "MemoryModel":
        """Measured on CUDA (see the module docstring), estimated elsewhere. The decoder
        stack is measured alone; the loss head adds its logits chunks (fixed) and the
        hidden rows it keeps (per token)."""
        model = engine.model
        dtype = engine.head.weight.dtype
        estimate = cls.estimate(model.config, dtype, dense_mask=engine.attention == "sdpa")
        if engine.device.type != "cuda" or engine.attention == "sdpa" or engine.runner.stack.sharded:
            return estimate  # (sharded blocks: a probe forward would run FSDP's collectives)
        small, large = 1024, 3072
        h, inter = model.config.hidden_size, model.config.intermediate_size
        size = engine.head.weight.element_size()
        head_fixed = 3 * engine.runner.chunk_elements * 4  # float32 logits, probabilities, gradients
        head_per_token = h * size
        full = [_stack_forward_peak(engine, n, recompute=False) for n in (small, large)]
        # a frozen model (reference engine) holds nothing: still count a call's transients
        floor = 2 * (h + inter) * size
        per_token = max(floor, (full[1] - full[0]) / (large - small))
        fixed = max(0.0, full[0] - small * per_token) + head_fixed
        recompute_per_token = estimate.recompute_per_token
        if engine.can_recompute:
            ckpt = [_stack_forward_peak(engine, n, recompute=True) for n in (small, large)]
            layers = model.config.num_hidden_layers
            # held block inputs + one block's activations and their gradients while it recomputes
            recompute_per_token = max(floor, (ckpt[1] - ckpt[0]) / (large - small)) + 2 * per_token / layers
        return cls(fixed=fixed, per_token=(per_token + head_per_token) * BACKWARD_MARGIN,
                   recompute_per_token=(recompute_per_token + head_per_token) * BACKWARD_MARGIN, measured=True,
                   **attention_held(model.config, dtype, dense_mask=False))


def _largest_call(room: float, per_token: float, per_pair: float) -> int:
    """Largest n >= 1 with n * per_token + n^2 * per_pair <= room."""
    if room <= 0:
        return 1
    if per_pair > 0:
        return max(1, int((-per_token + (per_token * per_token + 4 * per_pair * room) ** 0.5) / (2 * per_pair)))
    return max(1, int(room // per_token))


def _stack_forward_peak(engine, n: int, recompute: bool) -> float:
    """Peak CUDA bytes above the start of the decoder stack's forward with grad over ``n``
    random tokens (one chain), until its output is freed. No backward: no gradient is
    touched."""
    from .attention import TreeAttention, tree_attention_enabled

    device = engine.device
    gen = torch.Generator(device="cpu").manual_seed(n)
    ids = torch.randint(0, engine.vocab_size, (1, n), generator=gen).to(device)
    index = torch.arange(n, device=device)
    ctx = TreeAttention(engine.attention, index, index, torch.full((n,), n, device=device))
    ctx.mask()
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.enable_grad(), tree_attention_enabled(engine.model, ctx):
        hidden = engine.runner.stack(ids, index[None], checkpoint_blocks=recompute)
    peak = torch.cuda.max_memory_allocated(device) - start
    del hidden
    torch.cuda.synchronize(device)
    return float(peak)


def attention_held(config, dtype: torch.dtype, dense_mask: bool) -> dict[str, float]:
    """Bytes one kept attention holds (:mod:`treerl.kept_attention`): its output and float32
    log-sum-exp per query; input copies: the query and K/V (expanded to every head by
    SDPA's math kernel, which also holds the probabilities per (query, key) pair)."""
    size = torch.finfo(dtype).bits // 8
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = heads if dense_mask else config.num_key_value_heads
    return dict(attention_per_query=(size * head_dim + 4) * heads, attention_copies_per_query=size * heads * head_dim,
                attention_copies_per_key=2 * size * kv_heads * head_dim,
                attention_per_pair=size * heads if dense_mask else 0.0)


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
