"""RolloutEngine: batched sampling from a Hugging Face causal LM with a shared-prefix KV cache.

Two paths:

- **continuous batching** (:meth:`RolloutEngine.generate_stream`, and ``generate`` for
  plain groups without tree branching): a running batch of fixed-shape slots; finished
  rows free their slots and waiting prompt groups are admitted into them; each group is
  yielded as soon as all its samples finish. See :mod:`treerl.rollout.stream`.
- **waves** (``generate`` with branch points, i.e. tree rollouts, or with
  ``continuous=False``), described below.

One wave-path :meth:`RolloutEngine.generate` call:

1. Validates the prompts and packs the groups (prompt x G samples, or tree leaves) into
   *waves* whose KV cache fits ``max_batch_tokens`` slots (longest prompts first).
2. Per wave, prefills every *distinct* prompt once (left-padded, additive attention mask,
   position ids = offsets from each prompt's first real token; long batches in chunks of
   ``prefill_chunk_tokens``), then repeats each prompt's KV rows to its samples.
3. Decodes all unfinished samples of the wave together, one token per step, with the
   preallocated :class:`~treerl.rollout.kv.SlotCache`. Sampled tokens and behaviour
   logprobs stay on the device; every ``sync_every`` steps (and at branch points and the
   end) one copy brings the new block to the host, where stop tokens and stop strings are
   found exactly (tokens a row sampled after its stop are discarded). Finished rows are
   dropped from the batch when keeping them would cost more than copying the cache.
   On CUDA each decode step is a replayed CUDA graph (fixed shapes: the step attends to
   the whole masked cache; captured again when rows are forked or dropped).
4. At a branch point every unfinished row is copied ``factor`` times (KV included), and
   the copies sample independently from there: tree rollouts.

Weights: :meth:`RolloutEngine.update_weights` copies new parameters in place (thread-safe;
another thread may call it during ``generate``). A running ``generate`` notices at its next
step, recomputes the KV of its unfinished rows under the new weights and continues; every
token records the version of the weights whose logits it was sampled from.

Attention goes through :func:`~treerl.rollout.kv.rollout_attention` (SDPA); models with
sliding-window or non-attention (linear/recurrent) layers are refused. The engine sets the
model's attention implementation for the duration of ``generate``: give it its own copy
of the model if the trainer runs the same module object concurrently.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from .blocks import DecodeForward
from .graphs import DecodeStep
from .kv import SlotCache, rollout_attention_enabled
from .params import SamplingParams
from .prefix_cache import PrefixCache, PrefixEntry
from .sampling import sample
from .stops import StopChecker

if TYPE_CHECKING:
    from .stream import PromptQueue

PromptLike = Sequence[int] | torch.Tensor | np.ndarray


@dataclass
class Completion:
    """One sampled sequence. ``completion_ids``, ``logprobs`` and ``versions`` have one
    entry per generated token ``[T]``; ``logprobs`` are behaviour logprobs
    (log-softmax of the temperature-scaled logits before top-k/top-p; float64 for a
    float64 model, float32 otherwise)."""

    prompt_index: int
    prompt_ids: torch.Tensor  # [P] int64
    completion_ids: torch.Tensor  # [T] int64
    logprobs: torch.Tensor  # [T]
    versions: torch.Tensor  # [T] int64: weight version that produced each token
    finish_reason: str  # "stop" or "length"
    stop: int | str | None  # the stop token id or stop string that ended it, else None
    branch: tuple[int, ...]  # sample index in the group, then child index at each fork passed

    @property
    def token_ids(self) -> torch.Tensor:
        """``[P + T]`` prompt followed by completion."""
        return torch.cat([self.prompt_ids, self.completion_ids])

    @property
    def min_version(self) -> int:
        """Oldest weight version among the completion's tokens (for staleness control)."""
        return int(self.versions.min()) if len(self.versions) else -1

    def __len__(self) -> int:
        return len(self.completion_ids)


@dataclass
class Group:
    """The completions of one prompt, ordered by ``branch``."""

    prompt_index: int
    prompt_ids: torch.Tensor  # [P]
    completions: list[Completion]

    def sequences(self) -> list[torch.Tensor]:
        """Prompt + completion of every completion (e.g. for ``PrefixTree.from_sequences``)."""
        return [c.token_ids for c in self.completions]

    def __len__(self) -> int:
        return len(self.completions)

    def __iter__(self) -> Iterator[Completion]:
        return iter(self.completions)

    def __getitem__(self, i: int) -> Completion:
        return self.completions[i]


@dataclass
class RolloutStats:
    """What the last ``generate`` call did."""

    waves: int = 0  # waves (wave path) or admission rounds (continuous batching)
    prefill_calls: int = 0
    prefill_tokens: int = 0  # real (unpadded) tokens prefilled, recomputes included
    decode_steps: int = 0  # batched one-token forwards
    decode_rows: int = 0  # sum of the batch sizes of those forwards
    live_rows: int = 0  # continuous batching: sum of the unfinished rows of those forwards
    generated_tokens: int = 0  # tokens in the returned completions
    recomputes: int = 0  # KV recomputations after a weight update
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    reallocations: int = 0  # continuous batching: running batch rebuilt for a longer prompt
    kv_slots: int = 0  # continuous batching: most K/V token slots held (prompt stores + row stores)
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Row:
    group: int  # index into the wave's groups
    branch: tuple[int, ...]
    done: bool = False


@dataclass
class _Batch:
    """Decoding state of one wave: R rows, ``cache`` with ``capacity`` slots."""

    cache: SlotCache
    mask: torch.Tensor  # [R, capacity] additive attention mask
    pos: torch.Tensor  # [R] position id of the next token fed
    tokens: torch.Tensor  # [R, max_new] sampled tokens (device)
    logp: torch.Tensor  # [R, max_new] behaviour logprobs (device)
    host_tokens: np.ndarray  # [R, max_new] the synced part
    host_logp: np.ndarray
    rows: list[_Row]
    cache_version: int
    checked: int = 0  # tokens [0, checked) of every row are synced and checked
    versions: list[int] = field(default_factory=list)  # version of the token at each step
    graph: "_StaticStep | None" = None  # the static decode step of the current rows/cache

    @property
    def active(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if not r.done]


class RolloutEngine:
    """Generates groups of completions from ``model`` (any HF causal LM of full-attention
    layers, on CPU or GPU), embedded in the trainer's process.

    ``max_batch_tokens`` bounds the KV-cache slots of one wave (rows x (longest prompt +
    max_new_tokens)) or of the continuous-batching running batch (group slots x (prompt
    + n x max_new_tokens): prompts are stored once); a single group larger than it runs alone. ``prefill_chunk_tokens``
    bounds the (padded) tokens of one prefill forward. ``sync_every``: decode steps between
    host syncs (stop checks); stops are exact whatever its value.

    ``cuda_graphs`` (default: on for CUDA devices) replays each decode step as a CUDA graph,
    captured once per batch shape (again after rows are forked or dropped). It needs
    ``static_kv`` (default: same as ``cuda_graphs``): decode steps attend to the whole
    preallocated cache under the mask, with the write slot in a device tensor, so every
    step has the same shapes.

    ``continuous`` (default True): ``generate`` of plain groups (no branch points) runs on
    the continuous-batching path (:meth:`generate_stream`); False: waves, as tree
    rollouts always do.

    ``compile_decode`` (default: on for CUDA devices): the streaming decode step of the
    families treerl runs itself (Qwen2, Qwen3, Llama) goes block by block through the model's
    own modules (:mod:`~treerl.rollout.blocks`: ~18 kernels per layer instead of ~70), and
    with ``compile_decode`` each block's parts are compiled (regional ``torch.compile``,
    dynamic shapes: compiled once, in seconds, for every layer and batch bucket), then
    captured in the step's CUDA graph. Falls back to eager (with a warning) if compilation
    fails. In float64 the fused kernels differ from eager by ~1e-8 (float32: within 1e-5).

    ``prefix_cache_tokens`` (default 0: off): the streaming path keeps the K/V of prompts it
    prefilled, up to this many tokens (LRU, :mod:`~treerl.rollout.prefix_cache`); a prompt
    that extends a kept one (the next turn of a conversation) prefills only its new tokens.

    ``keep_stream_buffers`` (default False): keep a finished stream's device buffers, K/V
    cache and captured CUDA graphs, and reuse them in the next stream of the same shapes
    (no new captures); the memory stays held until :meth:`release_stream_buffers`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        version: int = 0,
        device: str | torch.device | None = None,
        max_batch_tokens: int = 1 << 17,
        prefill_chunk_tokens: int = 8192,
        sync_every: int = 8,
        cuda_graphs: bool | None = None,
        static_kv: bool | None = None,
        continuous: bool = True,
        keep_stream_buffers: bool = False,
        compile_decode: bool | None = None,
        prefix_cache_tokens: int = 0,
    ):
        if device is not None:
            model = model.to(device)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.version = int(version)
        if max_batch_tokens < 1 or prefill_chunk_tokens < 1 or sync_every < 1:
            raise ValueError("max_batch_tokens, prefill_chunk_tokens and sync_every must be >= 1")
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
        self.cuda_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, the model is on {self.device}")
        self.static_kv = self.cuda_graphs if static_kv is None else bool(static_kv)
        if self.cuda_graphs and not self.static_kv:
            raise ValueError("cuda_graphs needs static_kv")
        self.continuous = bool(continuous)
        self.keep_stream_buffers = bool(keep_stream_buffers)
        self.compile_decode = self.device.type == "cuda" if compile_decode is None else bool(compile_decode)
        self.decode_forward = DecodeForward(model, self.compile_decode) if DecodeForward.applies(model) else None
        self.prefix_cache = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self._stream_arena = None  # (shapes, device state) of the last stream, kept for the next
        self.stats = RolloutStats()
        self._lock = threading.RLock()
        self._pending_updates = 0  # update_weights calls waiting for the lock (other threads)
        self._pending_lock = threading.Lock()
        self._device_lock = _PriorityLock(self)

    def release_stream_buffers(self) -> None:
        """Free the buffers kept by ``keep_stream_buffers``."""
        self._stream_arena = None

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
            if self.decode_forward is not None:
                self.decode_forward.refresh(force=True)
            self.version = self.version + 1 if version is None else int(version)
            return self.version

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[PromptLike], params: SamplingParams | None = None) -> list[Group]:
        """Sample ``params.n`` completions (or trees of them) per prompt.

        ``prompts``: token-id sequences (no special tokens are added; stop tokens such as
        EOS must be named in ``params.stop_token_ids``). Returns one :class:`Group` per
        prompt, in order.
        """
        params = SamplingParams() if params is None else params
        params.validate(self.vocab_size)
        prompts = self._check_prompts(prompts, params)
        schedule = params.branch_schedule()
        if self.continuous and not schedule:
            return self._generate_continuous(prompts, params)
        stopper = StopChecker(params.stop_token_ids, params.stop_strings, params.decoder())
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.stats = RolloutStats()
        start = time.perf_counter()
        results: list[list[Completion]] = [[] for _ in prompts]
        prompt_tensors = [torch.tensor(p, dtype=torch.int64) for p in prompts]
        with torch.no_grad(), rollout_attention_enabled(self.model):
            for wave in self._waves(prompts, params):
                self.stats.waves += 1
                for group, completion in self._run_wave(wave, prompts, prompt_tensors, params, schedule, stopper, generator):
                    results[group].append(completion)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.seconds = time.perf_counter() - start
        groups = []
        for i, completions in enumerate(results):
            completions.sort(key=lambda c: c.branch)
            self.stats.generated_tokens += sum(len(c) for c in completions)
            groups.append(Group(i, prompt_tensors[i], completions))
        return groups

    def _check_prompts(self, prompts: Sequence[PromptLike], params: SamplingParams) -> list[list[int]]:
        if isinstance(prompts, torch.Tensor) and prompts.ndim == 1 or (
            len(prompts) and isinstance(prompts[0], (int, np.integer))
        ):
            raise ValueError("prompts must be a list of token-id sequences (got a single sequence)")
        return [self._check_prompt(i, p, params) for i, p in enumerate(prompts)]

    def _check_prompt(self, i, p: PromptLike, params: SamplingParams) -> list[int]:
        """Prompt ``i`` (its index or key, for messages) as a list of token ids."""
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
        ``params.n`` samples have finished, admitting waiting prompts into the slots that
        finished rows free (see :mod:`treerl.rollout.stream`).

        ``prompts``: a :class:`~treerl.rollout.stream.PromptQueue` (other threads may add
        prompts while the stream runs; a group's ``prompt_index`` is its key) or a finite
        iterable of token-id sequences (keys 0, 1, ...). The running batch has group
        slots of ``n`` rows; each group's prompt K/V is stored once and each row stores
        only its own tokens, so a group slot costs ``P + n x max_new_tokens`` K/V slots
        (``P``: the longest prompt waiting at the start, rounded up to 16). Group slots: as
        many as ``max_batch_tokens`` allows, at most ``max_rows // n``, no more than a
        finite input needs, at least one. A longer prompt arriving later grows the prompt
        store while ``max_batch_tokens`` allows, else waits until the batch drains. Branch points (tree rollouts) are not supported here:
        use :meth:`generate`. ``self.stats`` describes the stream so far.
        """
        from .stream import PromptQueue, RunningBatch

        params = SamplingParams() if params is None else params
        params.validate(self.vocab_size)
        if params.branch_schedule():
            raise ValueError("generate_stream does not do tree rollouts (branch points): use generate")
        queue = prompts if isinstance(prompts, PromptQueue) else PromptQueue(prompts, close=True)
        waiting = [len(self._check_prompt(k, p, params)) for k, p in queue.items()]
        G, max_new = params.n, params.max_new_tokens
        prefix_capacity = _round_up(max(waiting, default=1))
        own_capacity = _round_up(max_new)
        groups = max(1, self.max_batch_tokens // (prefix_capacity + G * own_capacity))
        if max_rows is not None:
            groups = min(groups, max(1, max_rows // G))
        if queue.closed:
            groups = min(groups, max(1, len(waiting)))
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.stats = RolloutStats()
        start = time.perf_counter()
        if self.decode_forward is not None:  # the model may have changed in place since the last stream
            with self._device_lock, torch.no_grad():
                self.decode_forward.refresh(force=True)
        batch = RunningBatch(self, queue, params, generator, groups, prefix_capacity, own_capacity,
                             self.max_batch_tokens)
        with rollout_attention_enabled(self.model):
            for group in batch.run():
                self.stats.seconds = time.perf_counter() - start
                yield group
        if self.keep_stream_buffers:
            self._stream_arena = batch.arena()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.seconds = time.perf_counter() - start

    def _generate_continuous(self, prompts: list[list[int]], params: SamplingParams) -> list[Group]:
        groups: dict[int, Group] = {}
        for g in self.generate_stream(prompts, params):
            groups[g.prompt_index] = g
        if sorted(groups) != list(range(len(prompts))):  # pragma: no cover - a bug, never an input error
            raise RuntimeError(f"generate_stream returned groups {sorted(groups)} for {len(prompts)} prompts")
        return [groups[i] for i in range(len(prompts))]

    def _waves(self, prompts: list[list[int]], params: SamplingParams) -> Iterator[list[int]]:
        """Groups (prompt indices) per wave, longest prompts first, each wave's KV slots
        (rows x (longest prompt + max_new_tokens)) within ``max_batch_tokens``."""
        rows = params.max_leaves
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        wave: list[int] = []
        for i in order:
            width = (len(prompts[wave[0]]) if wave else len(prompts[i])) + params.max_new_tokens
            if wave and (len(wave) + 1) * rows * width > self.max_batch_tokens:
                yield wave
                wave = []
            wave.append(i)
        if wave:
            yield wave

    # ------------------------------------------------------------------ model calls
    def _prefill(self, seqs: list[list[int]], capacity: int) -> tuple[SlotCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prefill of ``seqs`` into a new cache of ``capacity`` slots.

        Returns ``cache``, the additive mask ``[B, capacity]``, next position ids ``[B]``
        and the logits after each sequence's last token ``[B, V]``."""
        dev = self.device
        dtype = next(self.model.parameters()).dtype
        neg = torch.finfo(dtype).min
        zero, ninf = torch.zeros((), dtype=dtype, device=dev), torch.full((), neg, dtype=dtype, device=dev)
        lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
        B, L = len(seqs), int(lens.max())
        ids = torch.zeros(B, L, dtype=torch.int64)
        for i, s in enumerate(seqs):
            ids[i, L - len(s) :] = torch.tensor(s, dtype=torch.int64)
        ids, lens = ids.to(dev), lens.to(dev)
        slot = torch.arange(L, device=dev)
        pad = (L - lens)[:, None]  # [B, 1]
        real = slot[None, :] >= pad  # [B, L]
        position = (slot[None, :] - pad).clamp(min=0)
        mask = torch.full((B, capacity), neg, dtype=dtype, device=dev)
        mask[:, :L] = torch.where(real, zero, ninf)
        cache = SlotCache(self.num_layers, capacity)
        chunk = max(1, self.prefill_chunk_tokens // B)
        logits = None
        for c0 in range(0, L, chunk):
            c1 = min(L, c0 + chunk)
            q = slot[c0:c1]
            # query i sees key j <= i that is a real token; a pad query sees itself only
            allowed = ((slot[None, :c1] <= q[:, None])[None] & real[:, None, :c1]) | (slot[None, :c1] == q[:, None])[None]
            mask4 = torch.where(allowed, zero, ninf)[:, None]  # [B, 1, c, c1]
            out = self.model(
                input_ids=ids[:, c0:c1],
                position_ids=position[:, c0:c1],
                attention_mask=mask4,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            logits = out.logits[:, -1]
            self.stats.prefill_calls += 1
        self.stats.prefill_tokens += int(lens.sum())
        return cache, mask, lens.clone(), logits.to(self.logit_dtype)

    def _extend(self, seq: list[int], entry: PrefixEntry) -> tuple[SlotCache, torch.Tensor, torch.Tensor]:
        """Prefill ``seq`` whose first ``len(entry)`` tokens are ``entry``'s (their K/V and
        logits reused): only the rest is computed. Returns ``cache`` (``len(seq)`` slots, no
        padding), lengths ``[1]`` and the logits after the last token ``[1, V]``."""
        dev, m = self.device, len(entry)
        dtype = next(self.model.parameters()).dtype
        neg = torch.finfo(dtype).min
        cache = SlotCache(self.num_layers, len(seq))
        for layer, k, v in zip(cache.layers, entry.keys, entry.values):
            layer.lazy_initialization(k[None], v[None])
            layer.keys[0, :, :m] = k
            layer.values[0, :, :m] = v
            layer.length = m
        logits = entry.logits[None]
        new = seq[m:]
        for c0 in range(0, len(new), self.prefill_chunk_tokens):
            c1 = min(len(new), c0 + self.prefill_chunk_tokens)
            start = m + c0
            position = torch.arange(start, m + c1, device=dev)
            allowed = torch.arange(m + c1, device=dev)[None, :] <= position[:, None]  # [q, m + c1]
            mask4 = torch.where(allowed, torch.zeros((), dtype=dtype, device=dev),
                                torch.full((), neg, dtype=dtype, device=dev))[None, None]
            out = self.model(
                input_ids=torch.tensor([new[c0:c1]], dtype=torch.int64, device=dev), position_ids=position[None],
                attention_mask=mask4, past_key_values=cache, use_cache=True, logits_to_keep=1,
            )
            logits = out.logits[:, -1].to(self.logit_dtype)
            self.stats.prefill_calls += 1
        self.stats.prefill_tokens += len(new)
        self.stats.prefix_cache_hit_tokens += m
        return cache, torch.tensor([len(seq)], device=dev), logits

    def _decode(self, b: _Batch, step: int) -> torch.Tensor:
        """Feed every row's token ``step - 1``; returns the next logits ``[R, V]``."""
        n = b.cache.length
        b.mask[:, n] = 0
        if not self.static_kv:
            logits = self.model(
                input_ids=b.tokens[:, step - 1 : step],
                position_ids=b.pos[:, None],
                attention_mask=b.mask[:, None, None, : n + 1],
                past_key_values=b.cache,
                use_cache=True,
            ).logits
        else:
            if b.graph is None:
                b.graph = _StaticStep(self, b)
            logits = b.graph.run(b, step, n)
            b.cache.advance(1)
        b.pos += 1
        self.stats.decode_steps += 1
        self.stats.decode_rows += len(b.rows)
        return logits[:, -1].to(self.logit_dtype)

    # ------------------------------------------------------------------ one wave
    def _run_wave(self, wave, prompts, prompt_tensors, params, schedule, stopper, generator):
        """Generate every group of ``wave``; yields ``(prompt index, Completion)``."""
        max_new = params.max_new_tokens
        distinct: dict[tuple[int, ...], int] = {}
        for g in wave:
            distinct.setdefault(tuple(prompts[g]), len(distinct))
        seqs = [list(k) for k in distinct]
        capacity = _round_up(max(len(s) for s in seqs) + max_new - 1)
        with self._lock:
            version = self.version
            cache, mask, pos, logits = self._prefill(seqs, capacity)
            src = torch.tensor(
                [distinct[tuple(prompts[g])] for g in wave for _ in range(params.n)],
                device=self.device,
            )
            cache.select(src)
            R = len(src)
            b = _Batch(
                cache=cache, mask=mask[src], pos=pos[src],
                tokens=torch.zeros(R, max_new, dtype=torch.int64, device=self.device),
                logp=torch.zeros(R, max_new, dtype=self.logit_dtype, device=self.device),
                host_tokens=np.zeros((R, max_new), dtype=np.int64),
                host_logp=np.zeros((R, max_new), dtype=np.float64),
                rows=[_Row(gi, (j,)) for gi in range(len(wave)) for j in range(params.n)],
                cache_version=version,
            )
            logits = logits[src]

        finished: list[tuple[int, Completion]] = []

        def finish(r: int, length: int, reason: str, stop) -> None:
            row = b.rows[r]
            row.done = True
            g = wave[row.group]
            finished.append((g, Completion(
                prompt_index=g,
                prompt_ids=prompt_tensors[g],
                completion_ids=torch.from_numpy(b.host_tokens[r, :length].copy()),
                logprobs=torch.from_numpy(b.host_logp[r, :length].copy()).to(self.logit_dtype),
                versions=torch.tensor(b.versions[:length], dtype=torch.int64),
                finish_reason=reason,
                stop=stop,
                branch=row.branch,
            )))

        def sync(step: int) -> None:
            """Bring tokens [checked, step) to the host; finish rows that stopped."""
            if step > b.checked:
                b.host_tokens[:, b.checked : step] = b.tokens[:, b.checked : step].cpu().numpy()
                b.host_logp[:, b.checked : step] = b.logp[:, b.checked : step].double().cpu().numpy()
            for r in b.active:
                found = stopper.find(b.host_tokens[r, :step], b.checked)
                if found is not None:
                    finish(r, found[0], "stop", found[1])
                elif step == max_new:
                    finish(r, step, "length", None)
            b.checked = step

        step = 0
        while True:
            self._yield_to_updates()
            with self._lock:
                if step > 0:
                    if self.version != b.cache_version:
                        sync(step)
                        self._select(b, b.active)
                        if not b.rows:
                            break
                        self._recompute(b, step, prompts, wave, max_new)
                    version = self.version
                    logits = self._decode(b, step)
                tokens, logp = sample(logits, params, generator)
                b.tokens[:, step] = tokens
                b.logp[:, step] = logp
                b.versions.append(version)
            step += 1
            if step == max_new or step in schedule or step - b.checked >= self.sync_every:
                sync(step)
                if step == max_new:
                    break
                active = b.active
                if not active:
                    break
                if step in schedule:
                    f = schedule[step]
                    index = [r for r in active for _ in range(f)]
                    new_rows = [_Row(b.rows[r].group, b.rows[r].branch + (c,)) for r in active for c in range(f)]
                    self._select(b, index)
                    b.rows = new_rows
                elif len(active) < len(b.rows) and self._worth_compacting(b, len(active), max_new - step):
                    self._select(b, active)
            yield from finished
            finished.clear()
        yield from finished

    def _yield_to_updates(self, timeout: float = 60.0) -> None:
        """Let a weight update waiting in another thread take the lock before the next step."""
        deadline = time.monotonic() + timeout
        while self._pending_updates and time.monotonic() < deadline:
            time.sleep(1e-4)

    def _worth_compacting(self, b: _Batch, active: int, steps_left: int) -> bool:
        """Drop finished rows when computing them for the steps left would cost more
        than copying the cache (~2 decode steps of the whole batch; ~8 with a CUDA graph
        to capture again)."""
        price = 8 if self.cuda_graphs else 2
        return (len(b.rows) - active) * steps_left >= price * len(b.rows)

    def _select(self, b: _Batch, index: list[int]) -> None:
        """Keep (or repeat) rows ``index`` of the batch."""
        if index == list(range(len(b.rows))):
            return
        rows = [_Row(b.rows[i].group, b.rows[i].branch, b.rows[i].done) for i in index]
        idx = torch.tensor(index, dtype=torch.int64, device=self.device)
        b.cache.select(idx)
        b.mask, b.pos, b.tokens, b.logp = b.mask[idx], b.pos[idx], b.tokens[idx], b.logp[idx]
        b.host_tokens, b.host_logp = b.host_tokens[index], b.host_logp[index]
        b.rows = rows
        b.graph = None

    def _recompute(self, b: _Batch, step: int, prompts, wave, max_new: int) -> None:
        """After a weight update: rebuild the KV of every row (prompt + tokens fed so far,
        i.e. ``[0, step - 1)``) under the new weights."""
        seqs = [prompts[wave[row.group]] + b.host_tokens[r, : step - 1].tolist() for r, row in enumerate(b.rows)]
        capacity = _round_up(max(len(s) for s in seqs) + max_new - step)
        b.cache, b.mask, b.pos, _ = self._prefill(seqs, capacity)
        b.graph = None
        b.cache_version = self.version
        self.stats.recomputes += 1


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


def _round_up(n: int, multiple: int = 16) -> int:
    """Cache capacities are multiples of 16 (aligned rows for SDPA's masked kernels)."""
    return -(-n // multiple) * multiple


class _StaticStep:
    """One-token decode step with fixed shapes for the current rows and cache: static
    inputs, the write slot in a device tensor; on CUDA (``engine.cuda_graphs``) captured
    as a graph at its first use and replayed after that."""

    def __init__(self, engine: RolloutEngine, b: _Batch):
        R, dev = len(b.rows), engine.device
        self.model = engine.model
        self.ids = torch.zeros(R, 1, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(R, 1, dtype=torch.int64, device=dev)
        self.index = torch.zeros(1, dtype=torch.int64, device=dev)
        self.mask = b.mask[:, None, None, :]
        self.cache = b.cache
        self.step = DecodeStep(engine, self._forward)

    def _forward(self) -> torch.Tensor:
        self.cache.static_index = self.index
        try:
            return self.model(
                input_ids=self.ids, position_ids=self.pos, attention_mask=self.mask,
                past_key_values=self.cache, use_cache=True, rollout_static=True,
            ).logits
        finally:
            self.cache.static_index = None

    def run(self, b: _Batch, step: int, n: int) -> torch.Tensor:
        self.ids.copy_(b.tokens[:, step - 1 : step])
        self.pos.copy_(b.pos[:, None])
        self.index.fill_(n)
        return self.step()
