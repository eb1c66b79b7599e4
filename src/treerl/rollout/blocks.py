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
and down products as Triton kernels split over every SM) ~10; from 64 rows on sm_90+ those kernels, the Q/K/V
product (float32 partials summed in the rope kernel) and the attention parts a chain of dependent launches; in the
steps those kernels do not serve (above their rows) the tail's SiLU gate through its own kernel between the tail's halves
(:mod:`~treerl.rollout.silu_gate`: inductor's kernel compiled for dynamic shapes ran at a third of the HBM's rate;
session 32, H200, 1,024 rows: the tail 59.1 -> 53.1 us a layer). The modules and weights are the model's own (HF checkpoints, in-place
weight updates and a model shared with the trainer all keep working); the math is the
modules' own forward, reordered (the parts' math: :mod:`~treerl.rollout.layer_math`; the probes that admit each
kernel path: :mod:`~treerl.rollout.block_probes`). Any other causal LM decodes through its HF forward.

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

import warnings

import torch

import treerl.rollout.small_products as small_products  # (the module: tests and benchmarks patch its settings)
from ..compiled import DECODE_OFF, LazyCompiled
from ..lora import effective_weight
from ..models import causal_lm, decoder_of, runs_own_loop
from ..moe import install as install_moe, is_moe_block
from .block_probes import _chain_agrees, _gated_agrees, _qkv_link_agrees, _rope_kernel_agrees, _small_agrees
from .kernel_probe import kernel_agrees
from .layer_math import (_base, _bias, _dense_silu, _gated_tail, _hooked, _next_norm, _norm, _post, _pre, _qkv_rope,
                         _residual_norm, _small_layer, _small_tail, _tail_back, _tail_front, _tail_norm)
from .silu_gate import runs_here as silu_gate_runs_here
from .shared import SharedPrefixCache, attend_with_lse, merged_attention_ok, shared_part

# the kernel step's prompt part: its programs at least (key ranges per (group, KV head) chosen to reach it; read at
# each capture, so benchmarks may patch it). Session 30, H200, bench_rollout against 528 (the split kernel's own
# target): 64 rows +3.2% (4 ranges of 256 keys a group and head), 1,024 rows +4.0% (one range of 1,024)
PROMPT_PROGRAMS = 264
# the Q/K/V product's ranges of K as a link of the small-row chain (DecodeBlocks._qkv_link; read at each capture).
# Session 31, H200, 64 rows, the pair alone: 1 range 7.08 us a layer, 2 ranges 8.49, 4 ranges 11.69, in turn 8.35
QKV_SPLITS = 1
# the prompt part's launch a link after the rope kernel where the Q/K/V product is linked (read at each capture)
PROMPT_LINK = True


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


_PRE, _POST = LazyCompiled(_pre, "decode blocks", DECODE_OFF), LazyCompiled(_post, "decode blocks", DECODE_OFF)
_TAIL_NORM, _NORM = LazyCompiled(_tail_norm, "decode blocks", DECODE_OFF), LazyCompiled(_norm, "decode blocks", DECODE_OFF)
_RESIDUAL_NORM = LazyCompiled(_residual_norm, "decode blocks", DECODE_OFF)
_TAIL_FRONT, _TAIL_BACK = (LazyCompiled(_tail_front, "decode blocks", DECODE_OFF),
                           LazyCompiled(_tail_back, "decode blocks", DECODE_OFF))


class DecodeBlocks:
    """One decode step of the running batch through the model's own modules (see the
    module docstring). ``compile``: the ``pre``/``post`` parts through ``torch.compile``.
    Call :meth:`applies` first: other families decode through their HF forward."""

    def __init__(self, model: torch.nn.Module, compile: bool):
        self.model, self.base = causal_lm(model), install_moe(decoder_of(model))
        self.pre, self.post = (_PRE, _POST) if compile else (_pre, _post)
        self.tail_norm, self.norm = (_TAIL_NORM, _NORM) if compile else (_tail_norm, _norm)
        self.residual_norm = _RESIDUAL_NORM if compile else _residual_norm
        self.tail_front, self.tail_back = (_TAIL_FRONT, _TAIL_BACK) if compile else (_tail_front, _tail_back)
        self.rope_kernel: bool | None = None  # rope_write serves the steps (probed at the first split-kernel step)
        self.small: bool | None = None  # small_products serve the steps of few rows (probed at the first such step)
        self.chain: bool | None = None  # ... as a chain of dependent launches (sm_90+; probed at the first such step)
        self.qkv_link: bool | None = None  # the Q/K/V product and rope_write join that chain (probed with it)
        self.gated: bool | None = None  # steps the small-row kernels do not serve: the SiLU gate through silu_gate (probed once)
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
        return ((done(self.pre) and done(self.post))  # or the kernel step's (its tail: the modules', the small-row or the gated one)
                or ((done(self.tail_norm) or done(self.residual_norm) or done(self.tail_front)) and done(self.norm)))

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
        tail through the small-row product kernels (:func:`~treerl.rollout.layer_math._small_tail`,
        :meth:`_small_weights`): ~10; on sm_90+ and at least :data:`~treerl.rollout.small_products.CHAIN_MIN_ROWS`
        rows (:meth:`_chain`) the own part and the tail's five kernels a chain of dependent launches, and where
        :meth:`_qkv_link` admits it the Q/K/V product, the rope kernel and (with ``cache.overlap``) the prompt
        part links of it too; in the steps the small-row kernels do not serve, where :meth:`_gated` admits it, the
        tail's SiLU gate runs through its own kernel (:func:`~treerl.rollout.layer_math._gated_tail`).
        Where ``cache.overlap``, the own part's launch overlaps the prompt part's (programmatic dependent launch). Returns the final norm's output ``[B, hidden]`` (the head's input)."""
        base, f, G = self.base, self.fused, cache.G
        layers = base.layers
        x = self.norm(layers[0].input_layernorm, hidden)
        small = self._small_weights(hidden)
        chain = (small is not None and hidden.shape[0] >= small_products.CHAIN_MIN_ROWS
                 and self._chain(hidden, small))
        gated = small is None and self._gated(hidden)
        linked = chain and self._qkv_link(x, cos, sin, G, cache.layers[0])
        prompt_linked = linked and PROMPT_LINK and cache.overlap  # (nothing launches between rope and the prompt)
        for i, layer in enumerate(layers):
            store = cache.layers[i]
            q_own, q_pre, k, v = _qkv_rope(layer, x, f.qkv_w[i], f.qkv_b[i], cos, sin, G, store, cache.write_block,
                                           cache.write_offset, linked, splits=QKV_SPLITS)
            o_pre, l_pre, merge_g = self._prompt_part(i, layer, cache, q_own, q_pre, k, v, prefix_mask,
                                                      "split", trigger=cache.overlap, linked=prompt_linked)
            attn = cache.attend_own_merged(i, q_own, own_mask, layer.self_attn.scaling, o_pre, l_pre, merge_g,
                                           hidden.dtype, after=cache.overlap, trigger=chain)
            following = _next_norm(base, i)
            if small:
                hidden, x = _small_tail(self.residual_norm, layer, hidden, attn, small[i], following, chain)
            elif gated:
                hidden, x = _gated_tail(self.tail_front, self.tail_back, layer, hidden,
                                        attn.reshape(*hidden.shape[:-1], -1), f.gate_up_w[i], f.o_w[i], f.down_w[i],
                                        following)
            else:
                hidden, x = self.tail_norm(layer, hidden, attn.reshape(*hidden.shape[:-1], -1), f.gate_up_w[i],
                                           f.gate_up_b[i], f.o_w[i], f.down_w[i], following)
        return x[:, -1]

    def _small_weights(self, hidden: torch.Tensor) -> list[tuple] | None:
        """Per layer the weights :func:`~treerl.rollout.layer_math._small_tail` multiplies by, where
        :mod:`~treerl.rollout.small_products` serve this step (at most
        :data:`~treerl.rollout.small_products.MAX_ROWS` rows, every layer's products plain, the kernels
        agreeing with the modules' math: probed once, at the first such step, :func:`~treerl.rollout.block_probes._small_agrees`);
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

    def _gated(self, hidden: torch.Tensor) -> bool:
        """Whether the tail's SiLU gate runs through :func:`~treerl.rollout.silu_gate.silu_gate` between the tail's
        two halves (compiled with ``compile``; :func:`~treerl.rollout.layer_math._gated_tail`; the steps the small-row
        kernels do not serve): every layer a dense, bias-free SiLU MLP (:func:`~treerl.rollout.layer_math._dense_silu`),
        the kernel running here, after a probe against :func:`~treerl.rollout.layer_math._tail_norm` (eager) on the
        first layer (:func:`~treerl.rollout.block_probes._gated_agrees`, once)."""
        if self.gated is None:
            base, f = self.base, self.fused
            self.gated = (all(_dense_silu(layer, f, i) for i, layer in enumerate(base.layers))
                          and silu_gate_runs_here(hidden.reshape(hidden.shape[0], -1))  # (its device and dtype)
                          and kernel_agrees(lambda: _gated_agrees(self.tail_front, self.tail_back, base.layers[0], hidden,
                                                                  f, _next_norm(base, 0)),
                                            what="the decode step's SiLU gate kernel",
                                            reference="the modules' math", where=str(hidden.device),
                                            fallback="the tail runs in one piece, its SiLU gate as torch's (slower)"))
        return self.gated

    def _chain(self, hidden: torch.Tensor, small: list[tuple]) -> bool:
        """Whether the small tail runs as a chain of dependent launches (:func:`~treerl.rollout.layer_math._small_tail` with ``chain``,
        :mod:`~treerl.rollout.small_products`): each of its five kernels lets the next start and then waits for
        the kernel before it, and the own part's attention lets the tail's first product start. At least
        :data:`~treerl.rollout.small_products.CHAIN_MIN_ROWS` rows (the caller's test), on sm_90+ (:func:`~treerl.rollout.small_products.chains_here`) where every
        norm after a residual is a plain RMSNorm, after a probe (:func:`~treerl.rollout.block_probes._chain_agrees`, once).
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
        (:func:`~treerl.rollout.layer_math._qkv_rope` with ``linked``): the product as float32 partial sums over :data:`QKV_SPLITS` ranges of
        its inner dimension (:func:`~treerl.rollout.small_products.linear_partials`), added up and rounded in the
        rope kernel, each launch starting beside the kernel before it. Where the chain runs, every layer's Q/K/V
        product is a plain bias-free one the small products take, after a probe (:func:`~treerl.rollout.block_probes._qkv_link_agrees`, once)."""
        if self.qkv_link is None:
            f, layer = self.fused, self.base.layers[0]
            x2 = x.reshape(x.shape[0], -1)
            self.qkv_link = (all(b is None for b in f.qkv_b)
                             and small_products.runs_here(x2, *f.qkv_w)
                             and kernel_agrees(lambda: _qkv_link_agrees(layer, x, f.qkv_w[0], cos, sin, G, store, QKV_SPLITS),
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

