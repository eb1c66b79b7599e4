"""The streaming decode step's forward for the families treerl runs itself (Qwen2, Qwen3,
Llama, Qwen3-MoE: :data:`treerl.models.FAMILIES`), block by block.

Through Hugging Face's modules one decode step of a 28-layer model launches ~1,900
kernels (norms, RoPE, reshapes and the two-level attention's merge are dozens of small
eager ops per layer); at 64 rows that makes the step launch-bound (8.3 ms on an H100
against a 1.3 ms bandwidth floor). Here each layer runs as

1. ``pre`` — input norm, Q/K/V projections, Q/K norms (Qwen3), RoPE, the new token's K/V
   written into the row store's block pool (at the block and offset the cache computed
   from the block table, device tensors), and the two query layouts of
   :func:`~treerl.rollout.shared.split_queries`;
2. the two attention parts (the group's queries against its prompt, each row against its
   own tokens in the paged row store, read through its block table), each one kernel with
   its log-sum-exp (:func:`~treerl.rollout.shared.attend_with_lse`,
   :meth:`~treerl.rollout.shared.SharedPrefixCache.attend_own`);
3. ``post`` — the LSE merge, output projection, residual, norm, MLP, residual (with the
   split-key kernels, on CUDA: the own part merged with the prompt part's ranges in one kernel,
   :func:`~treerl.rollout.decode_attention.split_attention_merged`, then ``tail``, the rest);

(tree rollouts, eagerly between ``pre`` and ``post``: the token's K/V written into its fork
segment, :meth:`~treerl.rollout.shared.SharedPrefixCache.write_forks`,
and the fork segments attended, their key ranges joining the prompt part's,
:func:`~treerl.rollout.shared.shared_part`; ``post`` merges all ranges as usual);

with ``pre``, ``post`` and ``tail`` compiled (regional ``torch.compile``, dynamic shapes: one graph
each serves every layer and every batch bucket; parameters are graph inputs), so a layer
is ~18 kernels; with the split kernels on CUDA (:meth:`DecodeBlocks._kernel_step`: the Q/K
norms, RoPE and K/V write in one Triton kernel, the merge in another, the residual fused
with the next norm) ~13; at few rows (:mod:`~treerl.rollout.small_products`: the output, gate/up
and down products as Triton kernels split over every SM) ~10. The modules and weights are the model's own (HF checkpoints, in-place
weight updates and a model shared with the trainer all keep working); the math is the
modules' own forward, reordered. Any other causal LM decodes through its HF forward.

LoRA (a PEFT model): the fused copies hold the *merged* weights ``W + scaling x B @ A``
(:func:`treerl.lora.effective_weight`, one ``addmm`` into the copy per projection), and so
do copies of the output and down projections; they are refreshed with the other copies
(every stream, every ``update_weights``: after each optimizer step), so a decode step is
the base model's, kernel for kernel (no adapter product runs in it). The prompts' prefill
runs the same blocks and copies (:mod:`treerl.rollout.prefill_blocks`; a mixture-of-experts
model's prefill runs its Hugging Face forward). Mixture of experts (Qwen3-MoE): the sparse MLP runs through
:func:`treerl.moe.moe_forward` (routing, grouped expert GEMMs; bf16 on CUDA for graph capture).
"""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import torch

import treerl.rollout.small_products as small_products  # (the module: tests and benchmarks patch its settings)
from ..compiled import DECODE_OFF, LazyCompiled
from ..lora import effective_weight
from ..models import causal_lm, decoder_of, runs_own_loop
from ..moe import install as install_moe, is_moe_block
from .kernel_probe import kernel_agrees
from .rope_kernel import rope_write
from .shared import SharedPrefixCache, attend_with_lse, merge_parts, merged_attention_ok, shared_part, split_queries
from .types import raw, stored

# the kernel step's prompt part: its programs at least (key ranges per (group, KV head) chosen to reach it; read at
# each capture, so benchmarks may patch it). Session 30, H200, bench_rollout against 528 (the split kernel's own
# target): 64 rows +3.2% (4 ranges of 256 keys a group and head), 1,024 rows +4.0% (one range of 1,024)
PROMPT_PROGRAMS = 264
# the Q/K/V product's ranges of K as a link of the small-row chain (DecodeBlocks._qkv_link; read at each capture).
# Session 31, H200, 64 rows: see bench/RESULTS.md
QKV_SPLITS = 2
# the prompt part's launch a link after the rope kernel where the Q/K/V product is linked (read at each capture)
PROMPT_LINK = True


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
    o_proj = layer.self_attn.o_proj
    hidden = hidden + (o_proj(attn) if w_o is None else torch.nn.functional.linear(attn, w_o, _bias(o_proj)))
    mlp = layer.mlp
    x = layer.post_attention_layernorm(hidden)
    if w_gate_up is None:
        return hidden + mlp(x)
    gate, up = torch.nn.functional.linear(x, w_gate_up, b_gate_up).chunk(2, dim=-1)
    act = mlp.act_fn(gate) * up
    return hidden + (mlp.down_proj(act) if w_down is None else torch.nn.functional.linear(act, w_down, _bias(mlp.down_proj)))


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


class FusedProjections:
    """Per layer, the Q/K/V projection weights (and biases) concatenated into one matrix, and
    the MLP's gate/up (dense MLPs only): one matrix product each instead of three and two (a
    decode step's small products are latency-bound); with LoRA adapters the weights are the
    merged ones (:func:`treerl.lora.effective_weight`: one ``addmm`` per projection, written
    straight into the copy's rows), and the output and down projections get merged copies
    too. Copies of the model's parameters (memory: those weights once more), written again
    in place at the start of every stream and after ``update_weights``: the only points where
    the parameters can have changed (a shared policy is trained between streams; a fused
    optimizer step bumps no version counter, so a change cannot be detected cheaply and is
    not guessed at). Building and refreshing are one path: the copies are allocated, then
    :meth:`refresh` fills them."""

    def __init__(self, layers):
        self.layers = list(layers)
        self.qkv_w, self.qkv_b, self.gate_up_w, self.gate_up_b, self.o_w, self.down_w = [], [], [], [], [], []
        for layer in self.layers:
            w, bias = self._alloc(self._qkv(layer))
            self.qkv_w.append(w)
            self.qkv_b.append(bias)
            dense = self._gate_up(layer)
            w, bias = self._alloc(dense) if dense else (None, None)
            self.gate_up_w.append(w)
            self.gate_up_b.append(bias)
            self.o_w.append(self._alloc_merged(layer.self_attn.o_proj))
            self.down_w.append(self._alloc_merged(layer.mlp.down_proj) if dense else None)
        self.refresh()

    @staticmethod
    def _qkv(layer) -> list:
        attn = layer.self_attn
        return [attn.q_proj, attn.k_proj, attn.v_proj]

    @staticmethod
    def _gate_up(layer) -> list | None:
        mlp = layer.mlp
        return None if is_moe_block(mlp) else [mlp.gate_proj, mlp.up_proj]

    @staticmethod
    def _alloc_merged(linear) -> torch.Tensor | None:
        """Room for a merged copy of a LoRA layer's weight (None for a plain layer: called as it is)."""
        return torch.empty_like(_base(linear).weight) if hasattr(linear, "base_layer") else None

    @staticmethod
    def _alloc(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Room for the concatenated weights ``[sum out, in]`` and biases (None: no layer has one)."""
        w = _base(linears[0]).weight
        rows = sum(_base(m).weight.shape[0] for m in linears)
        bias = None if all(_bias(m) is None for m in linears) else w.new_empty(rows)
        return w.new_empty(rows, w.shape[1]), bias

    def refresh(self) -> None:
        """Write the (merged) weights into the copies again, in place (captured CUDA graphs keep
        their pointers)."""
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                pairs = [(self.qkv_w[i], self.qkv_b[i], self._qkv(layer))]
                if self.gate_up_w[i] is not None:
                    pairs.append((self.gate_up_w[i], self.gate_up_b[i], self._gate_up(layer)))
                for dst_w, dst_b, linears in pairs:
                    row = 0
                    for m in linears:
                        n = _base(m).weight.shape[0]
                        effective_weight(m, out=dst_w[row:row + n])
                        if dst_b is not None:
                            bias = _bias(m)
                            dst_b[row:row + n].copy_(bias if bias is not None else torch.zeros_like(dst_b[:n]))
                        row += n
                for dst, linear in ((self.o_w[i], layer.self_attn.o_proj), (self.down_w[i], getattr(layer.mlp, "down_proj", None))):
                    if dst is not None:
                        effective_weight(linear, out=dst)


def _base(linear: torch.nn.Module) -> torch.nn.Module:
    """A PEFT LoRA layer's base layer, or the layer itself."""
    return getattr(linear, "base_layer", linear)


_PRE, _POST = LazyCompiled(_pre, "decode blocks", DECODE_OFF), LazyCompiled(_post, "decode blocks", DECODE_OFF)
_TAIL_NORM, _NORM = LazyCompiled(_tail_norm, "decode blocks", DECODE_OFF), LazyCompiled(_norm, "decode blocks", DECODE_OFF)
_RESIDUAL_NORM = LazyCompiled(_residual_norm, "decode blocks", DECODE_OFF)


class DecodeBlocks:
    """One decode step of the running batch through the model's own modules (see the
    module docstring). ``compile``: the ``pre``/``post`` parts through ``torch.compile``.
    Call :meth:`applies` first: other families decode through their HF forward."""

    def __init__(self, model: torch.nn.Module, compile: bool):
        self.model, self.base = causal_lm(model), install_moe(decoder_of(model))
        self.pre, self.post = (_PRE, _POST) if compile else (_pre, _post)
        self.tail_norm, self.norm = (_TAIL_NORM, _NORM) if compile else (_tail_norm, _norm)
        self.residual_norm = _RESIDUAL_NORM if compile else _residual_norm
        self.rope_kernel: bool | None = None  # rope_write serves the steps (probed at the first split-kernel step)
        self.small: bool | None = None  # small_products serve the steps of few rows (probed at the first such step)
        self.chain: bool | None = None  # ... as a chain of dependent launches (sm_90+; probed at the first such step)
        self.qkv_link: bool | None = None  # the Q/K/V product and rope_write join that chain (probed with it)
        self.fused = FusedProjections(self.base.layers)

    @staticmethod
    def applies(model: torch.nn.Module) -> bool:
        return hasattr(model, "base_model") and runs_own_loop(model)

    def refresh(self) -> None:
        """Bring the fused projection copies up to date with the model's parameters."""
        self.fused.refresh()

    @property
    def compiled(self) -> bool:
        """The parts run compiled (False before the first step, or without ``compile``)."""
        done = lambda f: getattr(f, "compiled", False)  # noqa: E731
        return ((done(self.pre) and done(self.post))  # or the kernel step's (its tail: the modules', or the small-row one)
                or ((done(self.tail_norm) or done(self.residual_norm)) and done(self.norm)))

    def _rope_kernel(self, layer, hidden, cos, sin, G, w_qkv, b_qkv, store) -> bool:
        """Whether :func:`~treerl.rollout.rope_kernel.rope_write` serves this model's steps:
        decided at the first step with the split kernels (never inside a capture: a CUDA
        graph's warm-up runs first), by running it beside :func:`_pre` (eager) on that step's
        first layer, into scratch pools, and comparing every output."""
        if self.rope_kernel is None:
            self.rope_kernel = _rope_kernel_agrees(layer, hidden, cos, sin, G, w_qkv, b_qkv, store)
            if not self.rope_kernel and hidden.dtype != torch.float64:
                warnings.warn("the decode step's fused RoPE kernel disagreed with the modules' math or failed; "
                              "its Q/K norms and RoPE run as compiled torch instead (slower)")
        return self.rope_kernel

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, cache: SharedPrefixCache, own_mask: torch.Tensor,
                 prefix_mask: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``ids/pos [B, 1]`` (``B = hg x G`` rows), the cache with its step set (``begin_step``),
        ``own_mask [B, 1, 1, L]``, ``prefix_mask [hg, 1, 1, P]`` -> next-token logits ``[B, V]``
        (written into ``out`` when given: :func:`head_into`). The engine calls :meth:`refresh`
        whenever the parameters may have changed."""
        base, G = self.base, cache.G
        hidden = base.embed_tokens(ids)
        cos, sin = base.rotary_emb(hidden, pos)
        backend = cache.backend(own_mask.shape[-1], prefix_mask.shape[-1])
        f = self.fused
        if (backend == "split" and merged_attention_ok(str(hidden.device), hidden.dtype, cache.layers[0].ok.shape[-1],
                                                       cache.layers[0].ov.shape[-1], cache.kv_dtype)
                and self._rope_kernel(base.layers[0], hidden, cos, sin, G, f.qkv_w[0], f.qkv_b[0], cache.layers[0])):
            return head_into(self.model.lm_head, self._kernel_step(hidden, cos, sin, cache, own_mask, prefix_mask), out)
        for i, layer in enumerate(base.layers):
            store = cache.layers[i]
            q_own, q_pre, k, v = self.pre(layer, hidden, cos, sin, G, f.qkv_w[i], f.qkv_b[i], store.ok, store.ov,
                                          cache.write_block, cache.write_offset)
            parts = self._attention(i, layer, cache, q_own, q_pre, k, v, own_mask, prefix_mask, backend)
            hidden = self.post(layer, hidden, *parts, f.gate_up_w[i], f.gate_up_b[i], f.o_w[i], f.down_w[i])
        return head_into(self.model.lm_head, base.norm(hidden)[:, -1], out)

    def _kernel_step(self, hidden, cos, sin, cache: SharedPrefixCache, own_mask, prefix_mask) -> torch.Tensor:
        """The step with the split-key kernels (CUDA, where the merged attention and rope kernels
        passed their probes): per layer the Q/K/V product, the rope kernel
        (:func:`~treerl.rollout.rope_kernel.rope_write`), the prompt part's key ranges, the rows' own
        part merged with them in one kernel
        (:func:`~treerl.rollout.decode_attention.split_attention_merged`), and the block's compiled
        tail with the next norm (the next layer's input norm, or the final norm) fused after its
        residual: ~12 kernels a layer; at most :data:`~treerl.rollout.small_products.MAX_ROWS` rows the
        tail through the small-row product kernels (:func:`_small_tail`, :meth:`_small_weights`): ~10; on
        sm_90+ and at least :data:`~treerl.rollout.small_products.CHAIN_MIN_ROWS` rows (:meth:`_chain`) the own part and the tail's five kernels a chain of
        dependent launches.
        Where ``cache.overlap``, the own part's launch overlaps the prompt part's (programmatic dependent launch). Returns the final norm's output ``[B, hidden]`` (the head's input)."""
        base, f, G = self.base, self.fused, cache.G
        layers = base.layers
        x = self.norm(layers[0].input_layernorm, hidden)
        small = self._small_weights(hidden)
        chain = (small is not None and hidden.shape[0] >= small_products.CHAIN_MIN_ROWS
                 and self._chain(hidden, small))
        linked = chain and self._qkv_link(x, cos, sin, G, cache.layers[0])
        for i, layer in enumerate(layers):
            store = cache.layers[i]
            q_own, q_pre, k, v = _qkv_rope(layer, x, f.qkv_w[i], f.qkv_b[i], cos, sin, G, store, cache.write_block,
                                           cache.write_offset, linked)
            o_pre, l_pre, merge_g = self._prompt_part(i, layer, cache, q_own, q_pre, k, v, prefix_mask,
                                                      "split", trigger=cache.overlap, linked=linked and PROMPT_LINK)
            attn = cache.attend_own_merged(i, q_own, own_mask, layer.self_attn.scaling, o_pre, l_pre, merge_g,
                                           hidden.dtype, after=cache.overlap, trigger=chain)
            following = _next_norm(base, i)
            if small:
                hidden, x = _small_tail(self.residual_norm, layer, hidden, attn, small[i], following, chain)
            else:
                hidden, x = self.tail_norm(layer, hidden, attn.reshape(*hidden.shape[:-1], -1), f.gate_up_w[i],
                                           f.gate_up_b[i], f.o_w[i], f.down_w[i], following)
        return x[:, -1]

    def _small_weights(self, hidden: torch.Tensor) -> list[tuple] | None:
        """Per layer the weights :func:`_small_tail` multiplies by, where
        :mod:`~treerl.rollout.small_products` serve this step (at most
        :data:`~treerl.rollout.small_products.MAX_ROWS` rows, every layer's products plain, the kernels
        agreeing with the modules' math: probed once, at the first such step, :func:`_small_agrees`);
        else None (cuBLAS and the compiled tail)."""
        if self.small is False or hidden.shape[0] > small_products.MAX_ROWS:
            return None
        layers, f = self.base.layers, self.fused
        weights = [_small_layer(layer, f, i) for i, layer in enumerate(layers)]
        x = hidden.reshape(hidden.shape[0], -1)
        if any(w is None for w in weights) or not all(small_products.runs_here(x, w[0], w[2], w[3]) for w in weights):
            return None
        if self.small is None:
            self.small = kernel_agrees(lambda: _small_agrees(self.residual_norm, layers[0], hidden, f, weights[0],
                                                             _next_norm(self.base, 0)),
                                       what="the decode step's small-row product kernels",
                                       reference="cuBLAS and the modules' math", where=str(hidden.device),
                                       fallback="their products run through cuBLAS (slower at few rows)")
        return weights if self.small else None

    def _chain(self, hidden: torch.Tensor, small: list[tuple]) -> bool:
        """Whether the small tail runs as a chain of dependent launches (:func:`_small_tail` with ``chain``,
        :mod:`~treerl.rollout.small_products`): each of its five kernels lets the next start and then waits for
        the kernel before it, and the own part's attention lets the tail's first product start. At least
        :data:`~treerl.rollout.small_products.CHAIN_MIN_ROWS` rows (the caller's test), on sm_90+ (:func:`~treerl.rollout.small_products.chains_here`) where every
        norm after a residual is a plain RMSNorm, after a probe (:func:`_chain_agrees`, once).
        The layer's Q/K/V product joins the chain too (:meth:`_qkv_link`)."""
        if self.chain is None:
            base = self.base
            norms = [layer.post_attention_layernorm for layer in base.layers] + [_next_norm(base, i)
                                                                                 for i in range(len(base.layers))]
            self.chain = (small_products.chains_here(hidden.device)
                          and all(small_products.plain_rmsnorm(n, hidden) for n in norms)
                          and kernel_agrees(lambda: _chain_agrees(self.residual_norm, base.layers[0], hidden, small[0],
                                                                  _next_norm(base, 0)),
                                            what="the decode step's small-row kernels as a chain of dependent launches",
                                            reference="the same kernels in turn", where=str(hidden.device),
                                            fallback="they run in turn (slower)"))
        return self.chain

    def _qkv_link(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, G: int, store) -> bool:
        """Whether the Q/K/V product and :func:`~treerl.rollout.rope_kernel.rope_write` run as links of the chain
        (:func:`_qkv_rope` with ``linked``): the product as float32 partial sums over :data:`QKV_SPLITS` ranges of
        its inner dimension (:func:`~treerl.rollout.small_products.linear_partials`), added up and rounded in the
        rope kernel, each launch starting beside the kernel before it. Where the chain runs, every layer's Q/K/V
        product is a plain bias-free one the small products take, after a probe (:func:`_qkv_link_agrees`, once)."""
        if self.qkv_link is None:
            f, layer = self.fused, self.base.layers[0]
            x2 = x.reshape(x.shape[0], -1)
            self.qkv_link = (all(w is not None for w in f.qkv_w) and all(b is None for b in f.qkv_b)
                             and small_products.runs_here(x2, *f.qkv_w)
                             and kernel_agrees(lambda: _qkv_link_agrees(layer, x, f.qkv_w[0], cos, sin, G, store),
                                               what="the decode step's Q/K/V product and rope kernel as links of the "
                                                    "chain of dependent launches",
                                               reference="cuBLAS and the rope kernel in turn", where=str(x.device),
                                               fallback="they run in turn (slower)"))
        return self.qkv_link

    @staticmethod
    def _attention(i: int, layer, cache: SharedPrefixCache, q_own, q_pre, k, v, own_mask, prefix_mask, backend: str):
        """Layer ``i``'s two attention parts (and fork levels) in key ranges: ``(o_own, l_own,
        o_pre, l_pre, G of the merge)`` (:func:`~treerl.rollout.shared.merge_parts`)."""
        o_pre, l_pre, merge_g = DecodeBlocks._prompt_part(i, layer, cache, q_own, q_pre, k, v, prefix_mask, backend)
        o_own, l_own = cache.attend_own(i, q_own, own_mask, layer.self_attn.scaling, backend)
        return o_own, l_own, o_pre, l_pre, merge_g

    @staticmethod
    def _prompt_part(i: int, layer, cache: SharedPrefixCache, q_own, q_pre, k, v, prefix_mask, backend: str,
                     trigger: bool = False, linked: bool = False):
        """Layer ``i``'s prompt part (and fork levels) in key ranges: ``(o_pre, l_pre, G of the
        merge)``; writes the token's K/V into its fork segment first (tree rollouts). ``trigger``
        (the split backend, ``cache.overlap``): the own part's launch after it may overlap it; ``linked``: the
        launch is a link of the small-row chain after the rope kernel (:meth:`_qkv_link`; only the split backend
        with overlap, where nothing runs between the rope kernel and this launch)."""
        G = cache.G
        if cache.prompts_in_own_blocks:  # the prompt store is unused: nothing to attend there
            return (*cache.no_prompt_part(q_pre), G)
        cache.write_forks(i, k, v)  # tree rollouts: the token's K/V into its fork segment
        pk, pv = cache.prefix(i, q_pre.shape[0])
        scale = layer.self_attn.scaling
        o_pre, l_pre = attend_with_lse(q_pre, pk, pv, prefix_mask, scale, backend, trigger, PROMPT_PROGRAMS,
                                       linked=linked and not cache.forks)
        merge_g = G
        if cache.forks:  # tree rollouts: the fork segments' key ranges join the prompt part's (own layout)
            forks = cache.fork_levels(i, q_pre.shape[0])
            o_pre, l_pre = shared_part(q_own, o_pre, l_pre, G, forks, scale, backend)
            merge_g = 1
        return o_pre, l_pre, merge_g


def _qkv_rope(layer: torch.nn.Module, x: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None,
              cos: torch.Tensor, sin: torch.Tensor, G: int, store, block: torch.Tensor, offset: torch.Tensor,
              linked: bool) -> tuple:
    """The kernel step's Q/K/V product and :func:`~treerl.rollout.rope_kernel.rope_write` into ``store``'s pools:
    ``(q_own, q_pre, k, v)``. ``linked``: both as links of the small-row chain (:meth:`DecodeBlocks._qkv_link`);
    else the product through cuBLAS, then the rope kernel."""
    if linked:
        qkv = small_products.linear_partials(x.reshape(x.shape[0], -1), w_qkv, splits=QKV_SPLITS, pdl=True)
        link = dict(dtype=x.dtype, pdl=True)
    else:
        qkv, link = torch.nn.functional.linear(x, w_qkv, b_qkv), {}
    return rope_write(qkv, cos, sin, *_qk_norms(layer), *_heads(layer), G, store.ok, store.ov, block, offset, **link)


def _qkv_link_agrees(layer: torch.nn.Module, x: torch.Tensor, w_qkv: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, G: int, store) -> bool:
    """:func:`_qkv_rope` linked against in turn on the first layer's weights, into scratch pools (block 0, row
    ``i`` at slot ``i``; :func:`_agree`): eager, then captured in a CUDA graph and replayed on three other inputs,
    each replay against the launches in turn on that input (as :func:`_chain_agrees`)."""
    B = x.shape[0]
    block = torch.zeros(B, dtype=torch.int64, device=x.device)
    offset = torch.arange(B, device=x.device)

    def run(x_in: torch.Tensor, linked: bool) -> list[torch.Tensor]:
        pools = SimpleNamespace(ok=torch.zeros(1, store.ok.shape[1], B, store.ok.shape[3], dtype=store.ok.dtype,
                                               device=x.device),
                                ov=torch.zeros(1, store.ov.shape[1], B, store.ov.shape[3], dtype=store.ov.dtype,
                                               device=x.device))
        out = _qkv_rope(layer, x_in, w_qkv, None, cos, sin, G, pools, block, offset, linked)
        return [*out, pools.ok, pools.ov]

    if not _agree(run(x, False), run(x, True), x.dtype, x.device):
        return False
    x_in = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = run(x_in, True)
    for scale in (-1.0, 0.5, 2.0):
        x_in.copy_(x.flip(0) * scale)
        graph.replay()
        if not _agree(run(x_in, False), got, x.dtype, x.device):
            return False
    return True


def _next_norm(decoder: torch.nn.Module, i: int) -> torch.nn.Module:
    """The norm after layer ``i``'s residual: the next layer's input norm, or the final norm."""
    layers = decoder.layers
    return layers[i + 1].input_layernorm if i + 1 < len(layers) else decoder.norm


def _small_layer(layer: torch.nn.Module, fused: FusedProjections, i: int) -> tuple | None:
    """Layer ``i``'s ``(w_o, b_o, w_gate_up, w_down, b_down)`` for :func:`_small_tail`, or None where
    it cannot run there: a sparse MLP, a gate/up bias, an activation other than SiLU, an output or
    down projection that runs as its module (hooks, not a plain ``Linear``)."""
    mlp, o_proj = layer.mlp, layer.self_attn.o_proj
    if fused.gate_up_w[i] is None or fused.gate_up_b[i] is not None or not _silu(mlp):
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
    :meth:`DecodeBlocks._chain`). ``hidden [B, 1, H]``, ``attn [B, ..]`` -> ``(hidden, following(hidden))``."""
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


def _agree(want: tuple, got: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    """Two tails' outputs within their dtype's rounding, relative to their largest value (float32: 1e-5, or
    TF32's where cuBLAS runs float32 products in TF32; 16-bit: 4 units of its last place)."""
    if dtype == torch.float32:
        tol = 4 * 2.0 ** -11 if torch.backends.cuda.matmul.allow_tf32 and device.type == "cuda" else 1e-5
    else:
        tol = 4 * torch.finfo(dtype).eps
    return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol,
                                                     atol=tol * a.float().abs().max().item()) for a, b in zip(want, got))


def _probe_attention(layer: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A random attention output ``[B, 1, heads x head size]`` for the tail probes (seeded)."""
    gen = torch.Generator(device=hidden.device).manual_seed(0)
    return torch.randn(hidden.shape[0], 1, layer.self_attn.o_proj.in_features, device=hidden.device,
                       dtype=hidden.dtype, generator=gen)


def _small_agrees(residual_norm, layer: torch.nn.Module, hidden: torch.Tensor, fused: FusedProjections,
                  weights: tuple, following: torch.nn.Module) -> bool:
    """:func:`_small_tail` (with the step's ``residual_norm``: compiled where the step's is) against
    :func:`_tail_norm` (eager) on the first layer, this step's hidden states and a random attention
    output (:func:`_agree`)."""
    attn = _probe_attention(layer, hidden)
    want = _tail_norm(layer, hidden, attn, fused.gate_up_w[0], fused.gate_up_b[0], fused.o_w[0], fused.down_w[0],
                      following)
    return _agree(want, _small_tail(residual_norm, layer, hidden, attn, weights, following), hidden.dtype,
                  hidden.device)


def _chain_agrees(residual_norm, layer: torch.nn.Module, hidden: torch.Tensor, weights: tuple,
                  following: torch.nn.Module) -> bool:
    """:func:`_small_tail` as a chain against its launches in turn (``residual_norm``'s sums and norms) on
    the first layer (:func:`_agree`): eager, then captured in a CUDA graph (as the step runs it) and
    replayed on three other inputs, each replay against the launches in turn on that input (a link
    that read its input before the kernel before it had written it would give the previous replay's
    values)."""
    attn = _probe_attention(layer, hidden)

    def tail(h, a, chain):
        return _small_tail(residual_norm, layer, h, a, weights, following, chain)

    if not _agree(tail(hidden, attn, False), tail(hidden, attn, True), hidden.dtype, hidden.device):
        return False
    h_in, a_in = hidden.clone(), attn.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = tail(h_in, a_in, True)
    for scale in (-1.0, 0.5, 2.0):
        h_in.copy_(hidden * scale)
        a_in.copy_(attn.flip(0) * scale)
        graph.replay()
        if not _agree(tail(h_in, a_in, False), got, hidden.dtype, hidden.device):
            return False
    return True


def head_into(head: torch.nn.Module, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``head(x)`` (``x [B, hidden]`` -> ``[B, V]``), into ``out`` when given: a plain bias-free
    ``Linear`` of ``out``'s dtype writes it in its product (no ``[B, V]`` temporary and copy, ~0.2 ms
    a decode step at 1,024 rows of a 152k vocabulary); any other head, one with hooks (they see the
    call), or another dtype, runs as the module and is copied."""
    if out is None:
        return head(x)
    if (type(head) is torch.nn.Linear and head.bias is None and x.dtype == head.weight.dtype == out.dtype
            and not _hooked(head)):
        return torch.mm(x, head.weight.t(), out=out)
    return out.copy_(head(x))


def _qk_norms(layer: torch.nn.Module) -> tuple:
    attn = layer.self_attn
    return (attn.q_norm, attn.k_norm) if hasattr(attn, "q_norm") else (None, None)


def _heads(layer: torch.nn.Module) -> tuple[int, int]:
    config = layer.self_attn.config
    return config.num_attention_heads, config.num_key_value_heads


def _rope_kernel_agrees(layer, hidden, cos, sin, G, w_qkv, b_qkv, store) -> bool:
    """:func:`~treerl.rollout.rope_kernel.rope_write` against :func:`_pre` (eager) on one
    layer's inputs, each writing a scratch pool (block 0, row ``i`` at slot ``i``): every
    output within its dtype's rounding (float32: 1e-5; half precision and a float8 store's: 2
    units of its last place, relative to the output's largest value)."""
    D = cos.shape[-1]
    Dv = store.ov.shape[-1]
    B = hidden.shape[0]
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16) or D & (D - 1) or Dv & (Dv - 1) or B % G:
        return False  # (float64: the kernel computes in float32)
    try:
        pools = [[torch.zeros(1, p.shape[1], B, p.shape[3], dtype=p.dtype, device=p.device) for p in (store.ok, store.ov)]
                 for _ in range(2)]
        block = torch.zeros(B, dtype=torch.int64, device=hidden.device)
        offset = torch.arange(B, device=hidden.device)
        want = _pre(layer, hidden, cos, sin, G, w_qkv, b_qkv, *pools[0], block, offset)
        got = rope_write(_qkv(layer, hidden, w_qkv, b_qkv), cos, sin, *_qk_norms(layer), *_heads(layer), G,
                         *pools[1], block, offset)
        def tol(dtype: torch.dtype) -> float:  # (a float8 store's values: 2 units of float8's last place)
            return 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps

        pairs = list(zip(want, got)) + list(zip(pools[0], pools[1]))
        return all(a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=tol(b.dtype),
                                                         atol=tol(b.dtype) * b.float().abs().max().item())
                   for a, b in pairs)
    except Exception:  # noqa: BLE001 - any failure: the compiled torch path
        return False
