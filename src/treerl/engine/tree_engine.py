"""TreeEngine: exact forward and backward of a Hugging Face causal LM over a prefix tree.

Every mode is a :mod:`plan <treerl.engine.plan>` of segments run by the one executor below:

- a *single-level* plan (``flat``, ``packed``, or ``auto``/``dfs`` when every tree fits)
  runs each segment's forward and backward once; a loss that is not ``separable`` across
  segments goes through the two-phase path instead, unless there is one segment
  (:mod:`.two_phase`: the general path, which holds the graphs of the calls that fit the
  budget until the loss, so that only the others pay the extra forward);
- a separable loss over trees split into chains runs in one depth-first pass
  (:mod:`.one_pass`): each sequence's loss right after the call holding its last token,
  its gradient injected as below, with no no-grad forward first;
- otherwise, two phases (DESIGN.md, "Loss semantics"): a no-grad forward over the
  segments in depth-first order gives every tree token's logprob (and entropy); the loss
  runs on leaf copies of the per-sequence tensors, giving dL/dlogp per sequence token;
  these are summed per tree token and injected into a backward that recomputes each
  segment with its ancestors' keys/values as detached leaves. A chain segment's backward
  runs after all its descendants, with the key/value gradients they accumulated.

Gradients equal those of running every sequence alone, shared tokens computed once.

One executor: the single-level, one-pass and two-phase paths share the segment call and
the output buffers, and none of them reads on its own. Around it: the batch layout and the
per-sequence maps (:mod:`.batch`), the input checks (:mod:`.checks`), the memory
policy that sizes the calls (:class:`~treerl.engine.memory.MemoryPolicy`), the phases'
order and the general path's held graphs (:mod:`.two_phase`) and the compiled kernels kept
across runs (:mod:`.compile_cache`).
"""

from __future__ import annotations

import collections
import functools
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .attention import (BACKENDS, FLEX_BLOCK, KV, ROOT_SPLIT_KERNELS, TreeAttention, root_split_on,
                        tree_attention_enabled)
from .batch import Batch, outputs_and_grads, prepare_batch, scatter_gather, seq_targets, sequences_by_segment
from .chain_attention import FUSED_DTYPES, Kernel
from .kernel_plans import engine_call, plans_room
from .chain_attention import select as select_kernel
from .checks import check_inputs, check_loss, check_supported
from ..compiled import claim_compiled_code
from .compile_cache import enable as enable_compile_cache, save as save_compile_cache
from .decoder import DecoderStack
from .loss_head import DEFAULT_CHUNK_ELEMENTS, compute_dtype, head_rows, token_logprobs, token_loss_head
from .token_loss import KnownGrad, TokenLossGrad, token_entries
from .memory import MemoryPolicy, attention_heads
from ..models import decoder_of
from .plan import MODES, Plan, make_plan
from .rooted_trees import RootedTree, rooted_trees
from .tree import PrefixTree, TokenSequence
from .one_pass import SegmentLosses, forward_backward as one_pass
from .two_phase import forward_backward as two_phase

LossFn = Callable[..., torch.Tensor]


@dataclass
class TreeOutputs:
    """Per tree token: the logprob of the token given its path, and the entropy of the
    distribution it was drawn from (no grad). Root tokens hold 0."""

    tree: PrefixTree
    logprob: torch.Tensor  # [N]
    entropy: torch.Tensor | None  # [N] or None

    def per_sequence(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Split a [N] tree-token tensor into per-sequence tensors for tokens 1..L-1."""
        index = seq_targets(self.tree).to(values.device)
        return list(values[index].split((self.tree.seq_lengths - 1).tolist()))


@dataclass
class StepStats:
    """What the last engine call did: model calls, tokens, plan, seconds."""

    mode: str = ""
    plan: str = ""
    model_calls: int = 0
    tokens_run: int = 0
    recomputed_calls: int = 0  # calls whose decoder blocks are recomputed in the backward
    kept_attention_layers: int = 0  # summed over those calls: layers whose attention is not recomputed
    kept_graphs: int = 0  # general path: calls whose graph is held until the loss (no extra forward)
    seconds: float = 0.0
    # layer calls of the attention by route (treerl.engine.attention.ROUTES names: "causal",
    # "chain:<kernel>", "group:<kernel>", "root:<kernel>", "mask", "mask:chain-off", "mask:no-kernel",
    # "mask:short-prefix", "mask:group-sdpa", "kept"); block recomputes count again
    attention: collections.Counter = field(default_factory=collections.Counter)


class SegmentRunner(torch.nn.Module):
    """One model call as one module forward: the base model over a segment, then the
    loss head (chunked logprobs/entropies) or a value head on the rows that predict the
    segment's targets. Being a module lets FSDP wrap it as the root, so the LM head's
    weight is unsharded exactly while the head uses it."""

    def __init__(self, model: torch.nn.Module, value_head: torch.nn.Module | None, temperature: float,
                 chunk_elements: int, compile: bool):
        super().__init__()
        self.model = model
        self.value_head = value_head
        self.temperature, self.chunk_elements = temperature, chunk_elements
        self.stack = DecoderStack(decoder_of(model), compile)

    def forward(self, input_ids, position_ids, rows, targets, *, entropy: bool, recompute: bool = False,
                token_grad=None):
        """input_ids/position_ids [1, n]; rows [T] hidden rows to read; targets [T] token ids.
        The tree attention of the call is set by the caller (``tree_attention_enabled``).
        ``recompute``: keep only each decoder block's input for the backward.
        Returns (logprobs or values [T], entropies [T] or None); with ``token_grad`` (the
        loss's derivative per row, :func:`token_loss_head`) (the loss [], entropies or None)."""
        hidden = self.stack(input_ids, position_ids, checkpoint_blocks=recompute)[0]
        picked = hidden[rows]
        if self.value_head is not None:
            if entropy:
                raise ValueError("a critic engine (value_head) has no entropies")
            return self.value_head(picked)[:, 0].to(compute_dtype(picked.dtype)), None
        kw = dict(temperature=self.temperature, with_entropy=entropy, chunk_elements=self.chunk_elements,
                  compiled=self.stack.compile)
        weight = self.model.get_output_embeddings().weight
        if token_grad is not None:
            loss, _, ent = token_loss_head(picked, weight, targets, token_grad, **kw)
            return loss, ent if entropy else None
        return token_logprobs(picked, weight, targets, **kw)


class TreeEngine:
    """Forward/backward of ``model`` over prefix trees.

    Args:
        model: a Hugging Face causal LM (Qwen2, Qwen3, Llama families and alike).
        mode: ``"auto"`` (default), ``"packed"``, ``"dfs"`` or ``"flat"`` (no sharing).
        memory_budget: bytes of activations one step may hold (beside weights, gradients
            and optimizer state): an int, a fraction of the device's total memory (a float
            in (0, 1]), or None for the default (:func:`treerl.engine.memory.resolve_budget`).
            The planner turns it into tokens per call with a memory model of this model
            (measured on CUDA, estimated elsewhere) and recomputes the decoder blocks of a
            call in its backward where that lets a whole tree run in one call.
        max_tokens: advanced override of the budget: most tree tokens in one model call,
            no block recompute (``None``: from ``memory_budget``).
        chunk_tokens: largest piece of a node in one call when nodes are split; also
            the batch budget of ``dfs``.
        compile: compile each decoder block (``None``: on CUDA; the families of :data:`treerl.models.FAMILIES`).
        attention: ``"auto"`` (flex on CUDA, SDPA elsewhere), ``"sdpa"`` or ``"flex"``.
        temperature: logits are divided by it before the softmax (match the sampler's).
        value_head: make this a critic engine: a module mapping hidden states [T, H] to
            values [T, 1]; every method then yields values where it would yield logprobs
            (the value at element t is read at token t: the state before token t + 1).

        compile_cache_dir: with ``compile``, where compiled kernels are kept for later runs
            (:mod:`treerl.engine.compile_cache`; None: ``~/.cache/treerl/compile``, ``""``:
            torch's defaults).

    ``memory`` is the engine's memory policy (:class:`~treerl.engine.memory.MemoryPolicy`:
    tokens per call, packing, recompute, kept attentions).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        mode: str = "auto",
        *,
        memory_budget: int | float | None = None,
        max_tokens: int | None = None,
        chunk_tokens: int = 2048,
        compile: bool | None = None,
        attention: str = "auto",
        temperature: float = 1.0,
        logits_chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
        value_head: torch.nn.Module | None = None,
        compile_cache_dir: str | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(f"max_tokens must be a whole number of at least 1 token, got {max_tokens!r}")
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a whole number of at least 1 token, got {chunk_tokens!r}")
        if not temperature > 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        self.model = model
        self.base = decoder_of(model)
        self.head = model.get_output_embeddings()
        check_supported(model, self.head)
        self.device = self.head.weight.device
        if attention == "auto":
            attention = "flex" if self.device.type == "cuda" else "sdpa"
        if attention not in BACKENDS:
            raise ValueError(f"unknown attention backend {attention!r}: choose auto, {', '.join(BACKENDS)}")
        if attention == "flex" and self.device.type != "cuda":
            raise ValueError("the flex attention backend needs a CUDA model here (CPU flex has no backward)")
        self.mode, self.attention = mode, attention
        self.chunk_tokens = chunk_tokens
        self.num_layers = model.config.num_hidden_layers
        if compile is None:
            compile = self.device.type == "cuda"
        self.runner = SegmentRunner(model, value_head, temperature, logits_chunk_elements, compile)
        if self.runner.stack.compile:
            claim_compiled_code(model)
            enable_compile_cache(compile_cache_dir, self.device)
        self.memory = MemoryPolicy(self.runner.stack, self.head, attention, self.device, budget=memory_budget,
                                   max_tokens=max_tokens, chunk_elements=logits_chunk_elements)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self.stats = StepStats()

    # The two-phase backward takes the K/V of the path phase 1 ends on (the leftmost one,
    # the first that phase 2 opens) instead of running those calls again without grad.
    reuse_forward_kv = True

    # ------------------------------------------------------------------ public API
    def plan(self, tree: PrefixTree | Sequence[TokenSequence]) -> Plan:
        """The segments this engine would run for ``tree``."""
        return self._plan(self._layout(tree))

    @torch.no_grad()
    def forward(self, tree: PrefixTree | Sequence[TokenSequence], entropy: bool = False) -> TreeOutputs:
        """No-grad forward: logprob (and entropy) of every tree token."""
        with engine_call():  # this call's allowance of new cuDNN shapes
            batch = self._prepare(tree)
            t0 = time.perf_counter()
            lp, ent = self._forward_all(batch, entropy)
        self.stats.seconds = time.perf_counter() - t0
        return TreeOutputs(batch.tree, lp, ent)

    def logprobs(
        self, tree: PrefixTree | Sequence[TokenSequence], entropy: bool = False
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per input sequence (input order): log p(token t | tokens < t) for t = 1..L-1.

        With ``entropy=True`` also returns the entropies of those distributions.
        """
        out = self.forward(tree, entropy)
        lps = out.per_sequence(out.logprob)
        return (lps, out.per_sequence(out.entropy)) if entropy else lps

    def values(self, tree: PrefixTree | Sequence[TokenSequence]) -> list[torch.Tensor]:
        """Critic engines: per input sequence, the values at tokens 0..L-2 (no grad)."""
        if self.runner.value_head is None:
            raise ValueError("values() needs an engine built with value_head=...")
        return self.logprobs(tree)

    def forward_backward(
        self,
        tree: PrefixTree | Sequence[TokenSequence],
        loss_fn: LossFn,
        *,
        entropy: bool = False,
        separable: bool = False,
    ) -> float:
        """Accumulate d loss / d parameters into ``.grad`` and return the loss.

        ``loss_fn(logprobs)`` (or ``loss_fn(logprobs, entropies)`` with ``entropy=True``)
        gets the per-sequence tensors of :meth:`logprobs`, with grad, and returns a scalar.
        ``separable=True`` promises the loss is a sum of per-sequence terms (global normalisers fixed in
        advance); it is then called once per micro-batch with the sequences of that micro-batch and
        ``index=`` their input indices, which saves the no-grad forward (single-level plans: per call;
        chained trees: per segment holding sequence ends, in one pass). So under ``separable=True`` an
        error raised by (or a loss refused from) a later call's ``loss_fn`` leaves the earlier calls'
        gradients in ``.grad``: zero them before trying again (the two phases take the whole loss first)."""
        with engine_call():  # this call's allowance of new cuDNN shapes (its backward's recomputes included)
            batch = self._prepare(tree)
            t0 = time.perf_counter()
            plan = batch.plan
            if plan.single_level and (separable or len(plan.segments) == 1):
                loss = self._forward_backward_segments(batch, loss_fn, entropy, separable)
            elif separable:
                # Trees that run as one call go through once; the chained ones in one depth-first pass.
                chained = plan.chained_segments()
                loss = self._forward_backward_segments(batch, loss_fn, entropy, separable, skip=chained)
                loss += one_pass(self, batch, loss_fn, entropy, only=chained)
            else:  # the general path (two_phase: graphs held where the budget has room)
                loss = two_phase(self, batch, loss_fn, entropy, separable)
        self.stats.seconds = time.perf_counter() - t0
        if self.runner.stack.compile:
            save_compile_cache()  # (only when this step compiled something new)
        return loss

    # ------------------------------------------------------------------- preparing
    def _layout(self, tree: PrefixTree | Sequence[TokenSequence]) -> PrefixTree:
        if not isinstance(tree, PrefixTree):
            return PrefixTree.from_sequences(tree, share_prefixes=self.mode != "flat")
        return tree.unshared() if self.mode == "flat" else tree

    def _plan(self, layout: PrefixTree) -> Plan:
        m = self.memory
        return make_plan(layout, self.mode, m.max_tokens, self.chunk_tokens, m.pack_tokens, memory=m.call_budget)

    def _prepare(self, tree: PrefixTree | Sequence[TokenSequence]) -> Batch:
        layout = self._layout(tree)
        check_inputs(layout, self.vocab_size, self.max_positions)
        plan = self._plan(layout)
        self.stats = StepStats(mode=self.mode, plan=plan.describe())
        return prepare_batch(layout, plan, self.device)

    # ------------------------------------------------------------ one model call
    def _split_trees(self, ends: torch.Tensor, start: int) -> tuple[RootedTree, ...]:
        """The trees a call without prefix (subtree ends ``ends`` [N] of its tokens from tree index
        ``start``, on the CPU) runs the root split on (:data:`~treerl.engine.attention.ROOT_SPLIT`;
        :class:`TreeAttention` checks their lengths), or none. On a GPU only with flex attention in half
        precision (float32 there takes the tree mask), one of :data:`~treerl.engine.attention.ROOT_SPLIT_KERNELS`
        chosen by the probe for the model's heads, every part's shape planned by cuDNN or within its allowance
        (:func:`~treerl.engine.kernel_plans.plans_room`; else a part would take the next kernel, slower than the
        padded tree mask: bench/RESULTS.md, session 10). Where none, a GPU call keeps its whole-tile padding."""
        if not root_split_on(self.device):
            return ()
        if self.device.type == "cpu":
            return rooted_trees(ends, start)
        kernel = self._split_kernel()
        if kernel is None:
            return ()
        roots = rooted_trees(ends, start)
        parts = [(t.root, 0, True) for t in roots] + [(t.rest, t.root, False) for t in roots if t.rest]
        return roots if plans_room(kernel, self.device, self.head.weight.dtype, *attention_heads(self.model.config), parts) else ()

    def _split_kernel(self) -> Kernel | None:
        """On a GPU, the probe's fused kernel for the model's heads where the root split pays with it
        (:data:`~treerl.engine.attention.ROOT_SPLIT_KERNELS`), else None."""
        dtype = self.head.weight.dtype
        if self.attention != "flex" or dtype not in FUSED_DTYPES:
            return None
        kernel = select_kernel(self.device, dtype, *attention_heads(self.model.config))
        return kernel if kernel is not None and kernel.name in ROOT_SPLIT_KERNELS else None

    def _call(
        self, b: Batch, i: int, prefix: list[list[KV]], *, capture: bool, grad: bool, entropy: bool,
        head: bool = True, alone: bool = False, token_grad=None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[KV] | None]:
        """Run segment ``i`` after ``prefix`` (per ancestor, per layer K/V).

        Returns the logprobs (and entropies) of the segment's targets (none without
        ``head``: a call for its K/V only skips the LM head), and its own per-layer K/V if
        ``capture``. ``alone``: its backward follows its forward with no other graph held
        (its kept attentions may take the model's margin, :meth:`MemoryPolicy.kept_attention_layers`).
        ``token_grad``: the loss's derivative per target (:func:`token_loss_head`); the
        logprobs are then the loss [], which carries the gradients.
        """
        seg = b.plan.segments[i]
        q_index = torch.arange(seg.start, seg.end, device=self.device)
        if prefix:
            ancestors = b.plan.ancestors(i)
            k_index = torch.cat(
                [torch.arange(b.plan.segments[a].start, b.plan.segments[a].end, device=self.device) for a in ancestors]
                + [q_index]
            )
            per_layer = [[piece[layer] for piece in prefix] for layer in range(self.num_layers)]
        else:
            k_index, per_layer = q_index, None
        # one chain: every token's subtree, the prefix's included, reaches the segment's end
        spans = [b.plan.segments[a] for a in ancestors] if prefix else []
        chain = all(int(b.tree.subtree_end[s.start : s.end].min()) >= seg.end for s in spans + [seg])
        # without prefix, its trees and their root chains (the CPU's tree) where the root split can run them
        roots = () if prefix or chain else self._split_trees(b.tree.subtree_end[seg.start : seg.end], seg.start)
        ctx = TreeAttention(self.attention, q_index, k_index, b.subtree_end[k_index], prefix=per_layer,
                            capture=capture, causal=chain, roots=roots)
        ctx.routes = self.stats.attention
        recompute = grad and seg.recompute
        if recompute:
            ctx.keep_layers = self.memory.kept_attention_layers(seg.size, len(k_index), ctx.input_copies, seg.spare,
                                                                alone=alone, roots=ctx.roots)
        # built once, before the blocks (not inside a block that is recomputed); a group or root-split call
        # builds its masks where it runs (its own part's, or the tree mask where it falls back), cached on ctx
        # for the recompute
        if not (ctx.causal or ctx.group or ctx.roots):
            ctx.additive_mask(self.head.weight.dtype) if self.attention == "sdpa" else ctx.mask()
        self.stats.model_calls += 1
        self.stats.tokens_run += seg.size
        self.stats.recomputed_calls += int(recompute)
        self.stats.kept_attention_layers += len(ctx.keep_layers)
        ids, pos = b.token_ids[seg.start : seg.end], b.position[seg.start : seg.end]
        if self.attention == "flex" and not (prefix or capture or ctx.causal or ctx.roots):
            # Whole flex tiles from the input on: padded queries see nothing and padded keys
            # are seen by nobody (flex_block_mask), no row reads them, so the attention of
            # every layer runs on whole tiles without copying q/k/v to pad them. (The root
            # split slices its queries at the root chains' ends: no padding.)
            pad = -seg.size % FLEX_BLOCK
            ids, pos = torch.nn.functional.pad(ids, (0, pad)), torch.nn.functional.pad(pos, (0, pad))
        with torch.set_grad_enabled(grad), tree_attention_enabled(self.model, ctx):
            targets = b.targets[i] if head else b.targets[i][:0]
            lp, ent = self.runner(
                ids[None], pos[None], b.parent[targets] - seg.start, b.token_ids[targets], entropy=entropy,
                recompute=recompute, token_grad=token_grad,
            )
        kv = [ctx.captured[layer] for layer in range(self.num_layers)] if capture else None
        return lp, ent, kv

    def _buffers(self, b: Batch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        dtype = compute_dtype(self.head.weight.dtype)
        n = b.tree.num_tree_tokens
        lp = torch.zeros(n, dtype=dtype, device=self.device)
        return lp, (torch.zeros(n, dtype=dtype, device=self.device) if entropy else None)

    # ------------------------------------------------------- phase 1: no-grad forward
    def _forward_all(self, b: Batch, entropy: bool, only: set[int] | None = None,
                     reuse: dict[int, list[KV]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Depth-first over segments (or those in ``only``: whole trees), keeping only the
        current path's K/V. With ``reuse``, children are visited last-first, so that the
        path still open at the end is the leftmost one, the path the backward opens first:
        its K/V are left in ``reuse`` for :meth:`_grad_pass` instead of computed again."""
        lp_all, ent_all = self._buffers(b, entropy)
        path: list[tuple[int, list[KV]]] = []
        order = range(len(b.plan.segments)) if reuse is None else _mirrored_preorder(b.plan)
        for i in order:
            seg = b.plan.segments[i]
            if only is not None and i not in only:
                continue
            while path and path[-1][0] != seg.parent:
                path.pop()
            has_children = bool(b.plan.children[i])
            if not has_children and len(b.targets[i]) == 0:
                continue  # nothing predicted from here and nobody attends it
            lp, ent, kv = self._call(
                b, i, [kv for _, kv in path], capture=has_children, grad=False, entropy=entropy
            )
            lp_all[b.targets[i]] = lp
            if entropy:
                ent_all[b.targets[i]] = ent
            if has_children:
                path.append((i, kv))
        if reuse is not None:
            reuse.update(path)
        return lp_all, ent_all

    # ------------------------------------------------- single-level: one pass each
    def _forward_backward_segments(self, b: Batch, loss_fn: LossFn, entropy: bool, separable: bool,
                                   skip: set[int] = frozenset()) -> float:
        """One forward and backward per segment without prefix or children (all but ``skip``)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        token_loss = getattr(loss_fn, "token_loss", None) if separable and self.runner.value_head is None else None
        entries = functools.cache(lambda: token_entries(b, self.device, head_rows(self.runner.chunk_elements,
                                                                                 self.head.weight)))
        groups = sequences_by_segment(b, self.device) if token_loss is None else None  # (a token loss: no gathers)
        for i, seg in enumerate(b.plan.segments):  # (each one not skipped is whole trees: it holds sequences)
            if i in skip:
                continue
            if token_loss is not None:  # the head takes its gradients in its forward (one logits product)
                loss, _, _ = self._call(b, i, [], capture=False, grad=True, entropy=entropy, alone=True,
                                        token_grad=TokenLossGrad(token_loss, lambda i=i: entries()[i]))
            else:
                seqs, flat_index, sizes = groups[i]
                lp, ent, _ = self._call(b, i, [], capture=False, grad=True, entropy=entropy, alone=True)
                local_index = b.targets[i] - seg.start
                outs = [scatter_gather(lp, local_index, seg.size, flat_index, sizes)]
                if entropy:
                    outs.append(scatter_gather(ent, local_index, seg.size, flat_index, sizes))
                loss = loss_fn(*outs, index=seqs) if separable else loss_fn(*outs)
                check_loss(loss)
            if loss.requires_grad:  # (the fused head's, without parameters that train)
                loss.backward()
            total += loss.detach().reshape(()).to(torch.float64)
        return float(total)

    def _grad_pass(self, b: Batch, g_lp: torch.Tensor, g_ent: torch.Tensor | None,
                   only: set[int] | None = None, reuse: dict[int, list[KV]] | None = None,
                   losses: SegmentLosses | None = None) -> None:
        """Run each segment with grad and inject the loss gradients ``g_lp`` (``g_ent``):
        phase 2 of the two phases, or with ``losses`` the one pass of a separable loss
        (:mod:`.one_pass`: the loss of the sequences ending in a segment is taken right after
        its call, adding to ``g_lp``). ``reuse``: K/V of chain segments from phase 1
        (:meth:`_forward_all`), taken instead of a no-grad call (the same call, bit for bit)."""
        reuse = {} if reuse is None else reuse
        entropy = g_ent is not None
        settle = losses.after if losses is not None else (lambda i, lp, ent: None)
        plan = b.plan
        # Stack of open chain segments on the current path: (index, K/V leaves, graph).
        path: list[tuple[int, list[KV], tuple | None]] = []
        fused = self.runner.value_head is None  # (a critic's value head has no logits to fuse)
        known = lambda i: KnownGrad.at(b.targets[i], g_lp, g_ent)  # noqa: E731  (complete before i's call)

        def close(entry) -> None:
            i, leaves, graph = entry
            prefix = [lv for _, lv, _ in path]  # recompute: ancestors' leaves are the rest of the path
            if graph is None and fused:  # the head takes its gradients in its forward
                loss, _, kv = self._call(b, i, prefix, capture=True, grad=True, entropy=entropy,
                                         token_grad=known(i))
                outs, grads = ([loss], [torch.ones_like(loss)]) if loss.requires_grad else ([], [])
            else:
                lp, ent, kv = graph if graph is not None else self._call(b, i, prefix, capture=True, grad=True,
                                                                         entropy=entropy)
                outs, grads = outputs_and_grads(b, i, lp, ent, g_lp, g_ent)
            for (k, v), (leaf_k, leaf_v) in zip(kv, leaves):
                for out, leaf in ((k, leaf_k), (v, leaf_v)):
                    # (frozen parameters, e.g. a LoRA model's: a layer's K/V may depend on none that train)
                    if leaf.grad is not None and out.requires_grad:
                        outs.append(out)
                        grads.append(leaf.grad)
            if outs:
                torch.autograd.backward(outs, grads)

        for i, seg in enumerate(plan.segments):
            if only is not None and i not in only:
                continue
            while path and path[-1][0] != seg.parent:
                close(path.pop())
            prefix = [lv for _, lv, _ in path]
            if plan.children[i]:
                kv = reuse.pop(i, None)
                if seg.retain:
                    kv = None  # its graph comes from a call with grad
                    graph = self._call(b, i, prefix, capture=True, grad=True, entropy=entropy)
                    kv = graph[2]
                    settle(i, graph[0], graph[1])
                else:
                    graph = None
                    if kv is None:
                        head = losses is not None  # (the one pass takes its logprobs from this call)
                        with torch.no_grad():
                            lp, ent, kv = self._call(b, i, prefix, capture=True, grad=False,
                                                     entropy=entropy and head, head=head)
                        settle(i, lp if head else None, ent)
                leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kv]
                path.append((i, leaves, graph))
            elif len(b.targets[i]) and fused and losses is None:  # the gradients known: the fused head
                loss, _, _ = self._call(b, i, prefix, capture=False, grad=True, entropy=entropy,
                                        token_grad=known(i))
                if loss.requires_grad:
                    loss.backward()
            elif len(b.targets[i]):
                lp, ent, _ = self._call(b, i, prefix, capture=False, grad=True, entropy=entropy)
                settle(i, lp, ent)
                torch.autograd.backward(*outputs_and_grads(b, i, lp, ent, g_lp, g_ent))
            else:
                settle(i, None, None)
        while path:
            close(path.pop())


def _mirrored_preorder(plan: Plan) -> list[int]:
    """Segments depth-first with roots and children last-first: the leftmost root-to-leaf
    path (segments 0, its first child, ...) is visited last."""
    order, stack = [], [i for i, s in enumerate(plan.segments) if s.parent < 0]
    while stack:
        i = stack.pop()
        order.append(i)
        stack.extend(plan.children[i])
    return order
