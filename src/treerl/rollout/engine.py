"""RolloutEngine: batched sampling from a Hugging Face causal LM with a shared-prefix KV cache.

One generation path, continuous batching (:mod:`treerl.rollout.stream`):
:meth:`RolloutEngine.generate_stream` keeps a running batch of fixed-shape group slots;
finished groups free their slots and waiting prompt groups are admitted into them; each
group is yielded as soon as all its samples finish. :meth:`RolloutEngine.generate` collects
that stream for a list of prompts. Plain groups (``n`` samples), tree rollouts (forks at
chosen completion lengths, :mod:`treerl.rollout.forks`) and the turns of multi-turn
episodes (with ``prefix_cache_tokens``, a turn prefills only its new tokens) all go through
it. A group's prompt is prefilled once and its K/V stored once; a fork point's tokens are
stored once for the rows below it; decode attention reads each shared level once per step
for all its rows and merges the levels by log-sum-exp (:mod:`treerl.rollout.shared`).

Weights: :meth:`RolloutEngine.update_weights` copies new parameters in place (thread-safe;
another thread may call it during generation). A running stream notices at its next step,
recomputes the KV of its unfinished rows under the new weights and continues; every token
records the version of the weights whose logits it was sampled from.

Prefill goes through :func:`~treerl.rollout.kv.rollout_attention` (SDPA) into a
:class:`~treerl.rollout.kv.SlotCache`; decode steps through treerl's own blocks
(:mod:`treerl.rollout.blocks`, Qwen2/Qwen3/Llama) or the model's HF forward. Models with
sliding-window or non-attention (linear/recurrent) layers are refused. The engine sets the
model's attention implementation for the duration of a generation: give it its own copy
of the model if the trainer runs the same module object concurrently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..compiled import claim_compiled_code
from .blocks import DecodeBlocks
from .kv import rollout_attention_enabled
from .params import SamplingParams
from .prefill import Prefiller
from .prefill_blocks import PrefillForward
from .prefill_graphs import DEFAULT_TOKENS as PREFILL_GRAPH_TOKENS, PrefillGraphs
from .prefix_cache import PrefixCache
from .prompts import PromptQueue
from .stream import RunningBatch, group_slots
from .forks import ForkLayout
from .types import KV_CACHE_DTYPES, Completion, Group, PromptLike, RolloutStats, round_up

__all__ = ["RolloutEngine", "Completion", "Group", "RolloutStats", "PromptLike"]


class RolloutEngine:
    """Generates groups of completions from ``model`` (any HF causal LM of full-attention
    layers, on CPU or GPU), embedded in the trainer's process.

    ``max_batch_tokens`` bounds the KV-cache slots of the running batch: group slots x
    (prompt + fork segments), stored once per group, and a pool of blocks of
    ``kv_block_size`` slots (default 64, a multiple of 16; smaller when ``max_new_tokens`` is)
    from which rows take the blocks their own tokens fill as they grow. Group slots are
    overcommitted (as many as fit with one block per row); admission is by free blocks, and
    when blocks run out groups are preempted and re-queued (their K/V recomputed when
    readmitted; ``stats.preemptions``): never a crash, never a lost sample. A single group
    larger than the budget runs alone. ``prefill_chunk_tokens`` bounds the (padded) query
    tokens of one prefill forward and the prompt tokens prefilled together (the prompts
    admitted together are prefilled in batched pieces of about that many tokens,
    prefix-cache hits included: their cached K/V is part of the piece) and, while rows are
    decoding, the new tokens prefilled between two decode steps (chunked admission: the
    oldest waiting prompt always, others while they fit; a longer wait for the rest instead
    of a long stall for every running row). Groups of one row (``n = 1``: a serving batch)
    keep their prompts in their own blocks, not in a prompt store. ``sync_every``:
    decode steps between host syncs (stop checks); stops are exact whatever its value.

    ``cuda_graphs`` (default: on for CUDA devices) replays each decode step as a CUDA graph,
    captured once per (group slots, own slots) bucket. It needs ``static_kv`` (default: same
    as ``cuda_graphs``): decode steps cover bucketed row and slot counts (fixed shapes, write
    slots in device tensors); without it, steps cover exactly the live span.

    ``compile_decode`` (default: on for CUDA devices): the streaming decode step of the
    families treerl runs itself (:data:`treerl.models.FAMILIES`) goes block by block through the model's
    own modules (:mod:`~treerl.rollout.blocks`: ~18 kernels per layer instead of ~70), and
    with ``compile_decode`` each block's parts are compiled (regional ``torch.compile``,
    dynamic shapes: compiled once, in seconds, for every layer and batch bucket), then
    captured in the step's CUDA graph. A compiler failure is a
    :class:`~treerl.compiled.CompileError` naming this switch (no eager fallback). In float64 the fused kernels differ from eager by ~1e-8 (float32: within 1e-5).

    ``prefill_graph_tokens`` (default: 2048 with ``cuda_graphs``, else 0: off): a prefill of
    at most this many (padded) query tokens (an admission of a prompt or two, a
    conversation's next turn) runs in a fixed bucket of rows, queries and slots, replayed
    as a CUDA graph captured at the bucket's first use (:mod:`~treerl.rollout.prefill_graphs`:
    its host time, not its GPU time, stalled the decode steps); the families treerl
    decodes itself only. Without ``cuda_graphs`` a value > 0 runs the same layout eagerly.

    ``prefix_cache_tokens`` (default 0: off): the engine keeps the K/V of prompts it
    prefilled and of finished rows of one (prompt + completion,
    :mod:`~treerl.rollout.kept_contexts`), up to this many tokens (LRU,
    :mod:`~treerl.rollout.prefix_cache`); a prompt that extends a kept one (the next turn of
    a conversation) prefills only its new tokens, batched with the other prompts admitted
    with it, and one that shares a prefix with a kept one reuses that prefix.

    ``kv_cache_dtype`` (default ``"auto"``: the model's dtype, exact): ``"fp8"`` keeps the running
    batch's K/V (prompts, fork segments, the rows' own blocks) in float8 e4m3 without scales, as
    vLLM's and SGLang's ``--kv-cache-dtype fp8`` do: half the bytes a decode step reads and holds,
    **not exact**: a decode step attends to keys and values rounded to 3 mantissa bits (each value
    rounded to the model's dtype first, then to float8, saturated at +-448); prefills attend in the
    model's dtype. The trainer recomputes the logprobs it trains on; its rollout mismatch metric
    and truncated importance sampling (``algorithm.behaviour_weight_cap``) see the difference.

    ``keep_stream_buffers`` (default False): keep a finished stream's device buffers, K/V
    cache and captured CUDA graphs, and reuse them in the next stream with the same group
    slots whose prompts fit the kept prompt store (no new captures: a trainer's rollouts of
    varying prompt lengths reuse one arena); the memory stays held until
    :meth:`release_stream_buffers`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        version: int = 0,
        device: str | torch.device | None = None,
        max_batch_tokens: int = 1 << 17,
        prefill_chunk_tokens: int = 8192,
        prefill_graph_tokens: int | None = None,
        sync_every: int = 8,
        cuda_graphs: bool | None = None,
        static_kv: bool | None = None,
        keep_stream_buffers: bool = False,
        compile_decode: bool | None = None,
        prefix_cache_tokens: int = 0,
        kv_block_size: int = 64,
        kv_cache_dtype: str = "auto",
    ):
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.version = int(version)
        if max_batch_tokens < 1 or prefill_chunk_tokens < 1 or sync_every < 1:
            raise ValueError("max_batch_tokens, prefill_chunk_tokens and sync_every must be >= 1")
        if kv_block_size < 16 or kv_block_size % 16:
            raise ValueError(f"kv_block_size must be a positive multiple of 16, got {kv_block_size}")
        self.kv_block_size = int(kv_block_size)
        self.max_batch_tokens = int(max_batch_tokens)
        self.prefill_chunk_tokens = int(prefill_chunk_tokens)
        self.sync_every = int(sync_every)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        if any(t != "full_attention" for t in layer_types):
            raise NotImplementedError(
                f"RolloutEngine supports full-attention layers only; this model has {sorted(set(layer_types))}"
            )
        self.num_layers = int(config.num_hidden_layers)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        dtype = next(model.parameters()).dtype
        self.logit_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_dtype = KV_CACHE_DTYPES[kv_cache_dtype] or dtype  # the running batch's K/V stores
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, the model is on {self.device}")
        self.static_kv = self.cuda_graphs if static_kv is None else bool(static_kv)
        if self.cuda_graphs and not self.static_kv:
            raise ValueError("cuda_graphs needs static_kv")
        self.keep_stream_buffers = bool(keep_stream_buffers)
        self.compile_decode = self.device.type == "cuda" if compile_decode is None else bool(compile_decode)
        if self.compile_decode:
            claim_compiled_code(model)
        self.decode_blocks = DecodeBlocks(model, self.compile_decode) if DecodeBlocks.applies(model) else None
        # the running batch's pending logits: the lm_head's own 16-bit values where treerl runs the blocks (it writes
        # them there itself: no float32 copy of [rows, vocab] a step; every sampling path widens what it reads to
        # float32 first, so the samples and logprobs are the same as from a float32 copy), else logit_dtype
        self.pending_logit_dtype = dtype if self.decode_blocks is not None and dtype in (
            torch.bfloat16, torch.float16) else self.logit_dtype
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        own_prefill = PrefillForward(self.decode_blocks, self.compile_decode) \
            if PrefillForward.applies(self.decode_blocks) else None
        if prefill_graph_tokens is None:
            prefill_graph_tokens = PREFILL_GRAPH_TOKENS if self.cuda_graphs else 0
        if prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {prefill_graph_tokens}")
        self.prefill_graph_tokens = min(int(prefill_graph_tokens), self.prefill_chunk_tokens) if own_prefill else 0
        graphs = None
        if self.prefill_graph_tokens:
            attn = self.decode_blocks.base.layers[0].self_attn
            heads, head_dim = attn.config.num_key_value_heads, attn.head_dim
            graphs = PrefillGraphs(self, own_prefill, self.num_layers, (heads, head_dim, head_dim), dtype, self.device,
                                   self.prefill_graph_tokens, self.cuda_graphs)
        self.prefill_graphs = graphs
        self.prefiller = Prefiller(model, self.num_layers, self.prefill_chunk_tokens, self.pending_logit_dtype, own_prefill,
                                   graphs)
        self._stream_arena = None  # (shapes, device state) of the last stream, kept for the next
        self.stats = RolloutStats()
        self._lock = threading.RLock()
        self._pending_updates = 0  # update_weights calls waiting for the lock (other threads)
        self._pending_lock = threading.Lock()
        self._device_lock = _PriorityLock(self)

    def release_stream_buffers(self) -> None:
        """Free the buffers kept between streams: the running batch's (``keep_stream_buffers``)
        and the small prefills' CUDA graphs and K/V buffers (``prefill_graph_tokens``; made
        again at the next small prefill)."""
        with self._device_lock:  # (between a running stream's steps)
            self._stream_arena = None
            if self.prefill_graphs is not None:
                self.prefill_graphs.release()

    def warm_prefill(self) -> int:
        """Compile treerl's prefill forward for every class of shapes a prefill can take
        (:meth:`PrefillForward.warm <treerl.rollout.prefill_blocks.PrefillForward.warm>`), so that none
        compiles while rows decode: a server calls it before its first request. Returns the warm-up
        forwards run (0: the prefill is not compiled, or not treerl's)."""
        forward = self.prefiller.forward
        if forward is None or not forward.compiled:
            return 0
        with self._lock, self._device_lock, torch.no_grad(), rollout_attention_enabled(self.model):
            return forward.warm()  # (on the fused copies as they are: only the shapes matter)

    @property
    def device_lock(self) -> "_PriorityLock":
        """Held while the engine changes its weights or captures a CUDA graph. Another
        thread doing device work on the engine's device (e.g. receiving weights) holds it
        too, so that work never overlaps a capture; a running ``generate`` yields it to
        such a thread between decode steps."""
        return self._device_lock

    # ------------------------------------------------------------------ weights
    def update_weights(self, source: torch.nn.Module | Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Copy ``source``'s parameters and buffers (a model or a state dict; dtype and
        device are converted) into the engine's model and set the weight version
        (default: current + 1). Safe to call from another thread during ``generate``.
        Returns the new version."""
        with self._device_lock:
            return self._update_weights(source, version)

    def _update_weights(self, source, version: int | None) -> int:
        with self._lock, torch.no_grad():
            if source is not self.model:
                state = source.state_dict() if isinstance(source, torch.nn.Module) else dict(source)
                own = self.model.state_dict()
                unexpected = [k for k in state if k not in own]
                provided = {own[k].data_ptr() for k in state if k in own}
                missing = [k for k in own if k not in state and own[k].data_ptr() not in provided]
                if unexpected or missing:
                    raise KeyError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
                for k, t in state.items():
                    t = t.full_tensor() if hasattr(t, "full_tensor") else t
                    if own[k].shape != t.shape:
                        raise ValueError(f"{k}: shape {tuple(t.shape)} does not match the model's {tuple(own[k].shape)}")
                    own[k].copy_(t)
            if self.decode_blocks is not None:
                self.decode_blocks.refresh()
            self.version = self.version + 1 if version is None else int(version)
            return self.version

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[PromptLike],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Group]:
        """Sample ``params.n`` completions (or trees of them) per prompt.

        ``prompts``: token-id sequences (no special tokens are added; stop tokens such as
        EOS must be named in ``params.stop_token_ids``). ``params``: one setting for all, or
        one per prompt (each group sampled with its own, in one running batch; their
        tree-rollout fields must be equal; when every one has the same ``seed`` it seeds the
        stream, else each seeded group draws from its own seed). Returns one :class:`Group`
        per prompt, in order: :meth:`generate_stream` over the list, collected.
        """
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams):
            params.validate(self.vocab_size)
            prompts = self._check_prompts(prompts, params)
            source, stream = prompts, params
        else:
            if len(params) != len(prompts):
                raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts (one per prompt)")
            for p in params:
                p.validate(self.vocab_size)
            seeds = {p.seed for p in params}
            shared = seeds.pop() if len(seeds) == 1 else None
            own = [p if shared is None else dataclasses.replace(p, seed=None) for p in params]
            stream = dataclasses.replace(params[0], n=max(p.n for p in params), seed=shared,
                                         max_new_tokens=max(p.max_new_tokens for p in params))
            for p in own:
                p.check_group(stream)
            prompts = [self.check_prompt(i, x, p) for i, (x, p) in enumerate(zip(prompts, own))]
            source = PromptQueue(close=False)
            source.put_many([(i, x, p) for i, (x, p) in enumerate(zip(prompts, own))])
            source.close()
        groups: dict[int, Group] = {}
        for g in self.generate_stream(source, stream):
            groups[g.prompt_index] = g
        if sorted(groups) != list(range(len(prompts))):  # pragma: no cover - a bug, never an input error
            raise RuntimeError(f"generate_stream returned groups {sorted(groups)} for {len(prompts)} prompts")
        return [groups[i] for i in range(len(prompts))]

    def _check_prompts(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor) and prompts.ndim == 1 or (
            len(prompts) and isinstance(prompts[0], (int, np.integer))
        ):
            raise ValueError("prompts must be a list of token-id sequences (got a single sequence)")
        return [self.check_prompt(i, p, params) for i, p in enumerate(prompts)]

    def check_prompt(self, i, p: PromptLike, params: SamplingParams) -> list[int]:
        """Prompt ``i`` (its index or key, for messages) as a list of token ids; a clear
        ``ValueError`` if it is not a non-empty sequence of the model's token ids that fits
        the context with ``params.max_new_tokens``."""
        if isinstance(p, (int, np.integer)):
            raise ValueError(f"prompt {i} must be a sequence of token ids, got the single id {p!r}")
        ids = [int(t) for t in (p.tolist() if isinstance(p, (torch.Tensor, np.ndarray)) else p)]
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {self.vocab_size})")
        limit = None if self.max_positions is None else self.max_positions - params.max_new_tokens
        if limit is not None and len(ids) > limit:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={params.max_new_tokens} the model's "
                f"context of {self.max_positions} tokens (max_position_embeddings) allows at most {limit}"
            )
        return ids

    # ------------------------------------------------------- continuous batching
    def generate_stream(
        self,
        prompts: "PromptQueue | Iterable[PromptLike]",
        params: SamplingParams | None = None,
        *,
        max_rows: int | None = None,
    ) -> Iterator[Group]:
        """Continuous batching: yield each prompt's :class:`Group` as soon as all of its
        samples (``params.n``, or the leaves of its tree rollout) have finished, admitting
        waiting prompts into the slots that finished groups free (see :mod:`treerl.rollout.stream`).

        ``prompts``: a :class:`~treerl.rollout.prompts.PromptQueue` (other threads may add
        prompts while the stream runs; a group's ``prompt_index`` is its key) or a finite
        iterable of token-id sequences (keys 0, 1, ...). The running batch has group
        slots of ``G = params.max_leaves`` rows (``n``, or a tree rollout's leaves); each
        group's prompt K/V is stored once, each fork point's once, and each row stores only
        its own tokens, in blocks it takes as it grows (:mod:`treerl.rollout.paging`), so a
        group slot costs ``P + fork segments`` K/V slots (:meth:`ForkLayout.shared_tokens
        <treerl.rollout.forks.ForkLayout.shared_tokens>`; ``P``: the longest prompt waiting at
        the start, rounded up to 16) and its rows' blocks. Group slots: as many as
        ``max_batch_tokens`` allows with one block per row (:func:`~treerl.rollout.stream.group_slots`),
        at most ``max_rows // G``, no more than a finite input needs, at least one; the
        block pool gets the rest of the budget (at most what all rows could fill). When
        blocks run out, the latest-admitted groups are preempted and readmitted later. A
        longer prompt arriving later grows the prompt store (to at least twice its size) while ``max_batch_tokens``
        allows, else waits until the batch drains. ``self.stats`` describes the stream so far.
        """
        params = SamplingParams() if params is None else params
        params.validate(self.vocab_size)
        queue = prompts if isinstance(prompts, PromptQueue) else PromptQueue(prompts, close=True)
        waiting = [len(self.check_prompt(w.key, w.prompt, params if w.params is None else w.params))
                   for w in queue.items()]
        tree = ForkLayout.of(params)
        G = tree.rows
        prefix_capacity = round_up(max(waiting, default=1))
        groups = group_slots(tree, prefix_capacity, self.max_batch_tokens, self.kv_block_size, self.max_positions)
        if max_rows is not None:
            groups = min(groups, max(1, max_rows // G))
        if queue.closed:
            groups = min(groups, max(1, len(waiting)))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.stats = RolloutStats()
        start = time.perf_counter()
        if self.decode_blocks is not None:  # the model may have changed in place since the last stream
            with self._device_lock, torch.no_grad():
                self.decode_blocks.refresh()
        if self.prefill_graphs is not None:  # captured prefills read the parameters where they were
            self.prefill_graphs.follow(self.model)
        kept, self._stream_arena = self._stream_arena, None
        if kept is not None:  # a kept arena with room for these prompts is reused, captured decode steps and all
            kept_groups, kept_tree, kept_capacity = kept[0][:3]
            if kept_groups == groups and kept_tree == tree and prefix_capacity <= kept_capacity:
                prefix_capacity = kept_capacity
        batch = RunningBatch(self, queue, params, generator, groups, prefix_capacity, self.max_batch_tokens, kept)
        del kept
        with rollout_attention_enabled(self.model):
            for group in batch.run():
                self.stats.seconds = time.perf_counter() - start
                yield group
        if self.keep_stream_buffers:
            self._stream_arena = batch.arena()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.seconds = time.perf_counter() - start

    @contextlib.contextmanager
    def generation_turn(self, timeout: float = 60.0) -> Iterator[None]:
        """One turn of the running batch's device work (an admission, or a decode step with
        its recomputes): first lets a weight update waiting in another thread (up to
        ``timeout`` s) take the engine's lock, then holds it, without autograd."""
        deadline = time.monotonic() + timeout
        while self._pending_updates and time.monotonic() < deadline:
            time.sleep(1e-4)
        with self._lock, torch.no_grad():
            yield


class _PriorityLock:
    """The engine's (re-entrant) lock, taken with priority over the generating thread:
    while a thread waits for it or holds it, ``generate`` pauses between decode steps."""

    def __init__(self, engine: RolloutEngine):
        self.engine = engine

    def __enter__(self) -> "_PriorityLock":
        e = self.engine
        with e._pending_lock:
            e._pending_updates += 1
        e._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        e = self.engine
        e._lock.release()
        with e._pending_lock:
            e._pending_updates -= 1
