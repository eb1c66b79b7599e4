"""Continuous batching: the rollout engine's streaming path.

:meth:`RolloutEngine.generate_stream <treerl.rollout.RolloutEngine.generate_stream>` keeps
a *running batch* of group slots, ``G = params.n`` rows each. Whenever every sample of a
group has finished (stop token, stop string or ``max_new_tokens``) the group is yielded and
its slot freed, and prompt groups waiting in the :class:`PromptQueue` are admitted into free
slots: each prompt is prefilled once (deduplicated with the other prompts admitted with it)
and its K/V stored once, in the slot's prefix store, for all ``G`` rows. Compared with waves
(every group of a wave waits for the wave's longest row), no slot idles through the long
tail of generation lengths while prompts are waiting.

The K/V cache (:class:`~treerl.rollout.shared.SharedPrefixCache`) has a prefix store
``[groups, kv_heads, P, head_dim]`` (prompt K/V, post-RoPE, position ids ``0..P_g-1``) and a
row store ``[rows, kv_heads, N, head_dim]`` of each row's generated tokens only
(``N = max_new_tokens`` rounded up). Each decode step writes every row's new K/V at that
row's own next slot (a device tensor of write indices), feeds it position ``P_g + tokens
so far``, and attends in two parts merged by their log-sum-exp: the group's queries
against the prompt (read once per group, not once per row) and each row against its own
slots (:func:`~treerl.rollout.shared.two_level_attention`). Additive masks (device tensors)
hide each row's unwritten slots and what a previous occupant left. Rows of finished
samples in a group still running are computed along (outputs ignored) so that steps have
fixed shapes: on CUDA each step of a given (group slots, own slots) bucket is a replayed
CUDA graph. The step runs over the first ``hg`` group slots only (covering every live
group: with fixed shapes a power of two, or all) and attends to the own slots written so
far rounded up to 64; admissions take the lowest free slots, and live groups are moved
down (compaction) when they would fit in a smaller bucket.

Capacity: the batch holds ``groups x (P + G x N)`` K/V slots, within the engine's
``max_batch_tokens``; every admitted row has its ``N`` slots, so a running batch never
runs out. A prompt longer than ``P`` grows the prefix store while the budget allows;
otherwise it (and the prompts after it) wait until the batch drains, which is then
rebuilt with fewer, larger group slots: no crash, no lost sample.

Host syncs: sampled tokens and logprobs are logged on the device and copied to the host
every ``sync_every`` steps (and when a row reaches ``max_new_tokens``), where stops are
found exactly (tokens a row sampled after its stop are discarded). Admissions need no
sync (free slots are known on the host): a slot freed at a sync is refilled right away,
before the next decode step; the admitted rows' first tokens are sampled from the
prefill's logits, and they join the next decode step.

Weights: ``update_weights`` from another thread takes effect between decode steps; rows
whose KV was computed under older weights are recomputed (prompt + tokens fed so far) before
the next step; every token records the version of the weights whose logits it was sampled
from (admitted rows: the prefill's; others: the decode step's).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Iterator

import numpy as np
import torch

from .graphs import DecodeStep
from .shared import SharedPrefixCache
from .params import SamplingParams
from .prefix_cache import PrefixEntry
from .sampling import sample
from .stops import StopChecker


class PromptQueue:
    """A thread-safe source of prompt groups for ``generate_stream``.

    ``put(prompt, key)`` adds a prompt (token ids; ``key`` names its group in the output,
    default 0, 1, 2, ... in order of ``put``); ``close()`` says no more will come: the
    stream ends once every admitted group is done. While the stream has nothing to
    generate it waits for prompts; with ``idle_timeout`` (seconds) it ends after waiting
    that long (0: as soon as it is idle), atomically with respect to ``put``: a prompt is
    either taken by this stream or refused (``put`` returns False; start a new stream).
    """

    def __init__(self, prompts: Iterable[Any] = (), *, close: bool = False, idle_timeout: float | None = None):
        self._cond = threading.Condition()
        self._items: deque = deque()
        self._closed = False
        self._ended = False
        self._next_key = 0
        self.idle_timeout = idle_timeout
        for p in prompts:
            self.put(p)
        if close:
            self.close()

    def put(self, prompt: Any, key: Hashable | None = None) -> bool:
        """Queue one prompt; False if the queue is closed or its stream has ended."""
        with self._cond:
            if self._closed or self._ended:
                return False
            if key is None:
                key = self._next_key
            if isinstance(key, int):
                self._next_key = max(self._next_key, key + 1)
            self._items.append((key, prompt))
            self._cond.notify_all()
            return True

    def put_many(self, items: Iterable[tuple[Hashable, Any]]) -> bool:
        """Queue ``(key, prompt)`` pairs all together or none (False: closed or ended)."""
        items = list(items)
        with self._cond:
            if self._closed or self._ended:
                return False
            for key, prompt in items:
                if isinstance(key, int):
                    self._next_key = max(self._next_key, key + 1)
                self._items.append((key, prompt))
            self._cond.notify_all()
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed or self._ended

    def items(self) -> list[tuple[Hashable, Any]]:
        """The prompts waiting (a snapshot)."""
        with self._cond:
            return list(self._items)

    def take(self, n: int, timeout: float = 0.0) -> list[tuple[Hashable, Any]]:
        """Up to ``n`` waiting prompts; waits up to ``timeout`` s if none is waiting."""
        with self._cond:
            if not self._items and timeout > 0 and not self.closed:
                self._cond.wait_for(lambda: self._items or self.closed, timeout)
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def end_if_empty(self) -> bool:
        """End the stream (refuse further prompts) unless prompts are waiting."""
        with self._cond:
            if self._items:
                return False
            self._ended = True
            return True


def _group_bucket(n: int, groups: int, G: int, exact: bool = False) -> int:
    """Group slots a decode step computes to cover slots ``[:n]``: a power of two with at
    least 8 rows, or all (fixed shapes: few CUDA graphs); ``exact``: ``n`` (no graphs)."""
    if exact:
        return min(max(n, 1), groups)
    b = 1
    while b < n or b * G < 8:
        b *= 2
    return min(b, groups)


def _own_bucket(n: int, capacity: int, exact: bool = False, step: int = 64) -> int:
    """Own slots a decode step attends to cover ``[:n]``: ``n`` rounded up to ``step``
    (fixed shapes), at most ``capacity``; ``exact``: ``n``."""
    return min(n if exact else -(-n // step) * step, capacity)


@dataclass
class _GroupState:
    prompt_ids: torch.Tensor
    completions: list = field(default_factory=list)


class RunningBatch:
    """State of one ``generate_stream`` call (see the module docstring). Not thread-safe:
    it runs in the consumer's thread; only ``engine.update_weights`` comes from others.

    ``groups`` group slots of ``G = params.n`` rows; ``prefix_capacity`` prompt slots per
    group, ``own_capacity`` generated-token slots per row; ``budget``: K/V token slots
    (prefix + own) the batch may hold (``groups x (prefix_capacity + G x own_capacity)``
    stays within it unless a single group needs more: it then runs alone)."""

    def __init__(self, engine, queue: PromptQueue, params: SamplingParams, generator: torch.Generator,
                 groups: int, prefix_capacity: int, own_capacity: int, budget: int):
        from .engine import Completion, Group, _round_up  # noqa: F401 (circular import)

        self.e, self.q, self.p, self.gen = engine, queue, params, generator
        self.G, self.max_new = params.n, params.max_new_tokens
        self.N, self.budget = own_capacity, budget
        self.exact = not engine.static_kv  # rows computed per step: exactly the live span
        self.stopper = StopChecker(params.stop_token_ids, params.stop_strings, params.decoder())
        self.dtype = next(engine.model.parameters()).dtype
        self.neg = torch.finfo(self.dtype).min
        self.groups: dict[Hashable, _GroupState] = {}
        self.deferred: deque = deque()  # prompts taken from the queue that did not fit yet
        self.out: list = []
        self.log_rows: list[tuple[np.ndarray, np.ndarray]] = []
        self._Completion, self._Group, self._round_up = Completion, Group, _round_up
        self._allocate(groups, prefix_capacity)

    _DEVICE_STATE = ("cache", "prefix_mask", "own_mask", "fill", "pos", "live_d", "last", "logits", "log_tok",
                     "log_lp", "steps_cache", "graph_pool")

    def _arena_key(self, groups: int, prefix_capacity: int) -> tuple:
        e = self.e
        return (groups, self.G, prefix_capacity, self.N, e.sync_every, self.dtype, e.logit_dtype, e.vocab_size)

    def arena(self) -> tuple:
        """The device state (buffers, cache, captured decode steps) for reuse by the
        engine's next stream of the same shapes (``RolloutEngine(keep_stream_buffers=True)``)."""
        return self._arena_key(self.NG, self.P), {k: getattr(self, k) for k in self._DEVICE_STATE}

    def _allocate(self, groups: int, prefix_capacity: int) -> None:
        """(Re)build the batch's state for ``groups`` group slots (nothing may be live).
        Device buffers (and CUDA graphs) kept by the engine from an earlier stream of the
        same shapes are reused."""
        e, dev, G = self.e, self.e.device, self.G
        S = groups * G
        self.NG, self.S, self.P = groups, S, prefix_capacity
        kept = getattr(e, "_stream_arena", None)
        e._stream_arena = None
        if kept is not None and kept[0] == self._arena_key(groups, prefix_capacity):
            for k, v in kept[1].items():
                setattr(self, k, v)
            self.prefix_mask.fill_(self.neg)
            self.own_mask.fill_(self.neg)
            for t in (self.fill, self.pos, self.live_d, self.last):
                t.zero_()
        else:
            del kept
            self.cache = None  # SharedPrefixCache, allocated at the first load (shapes from the prefill)
            self.steps_cache: dict[tuple[int, int], _TwoLevelStep] = {}
            self.graph_pool = None  # the CUDA graphs' memory pool (graphs.capture_decode_step)
            self.prefix_mask = torch.full((groups, prefix_capacity), self.neg, dtype=self.dtype, device=dev)
            self.own_mask = torch.full((S, self.N), self.neg, dtype=self.dtype, device=dev)
            self.fill = torch.zeros(S, dtype=torch.int64, device=dev)  # next own slot of each row
            self.pos = torch.zeros(S, dtype=torch.int64, device=dev)  # next position id
            self.live_d = torch.zeros(S, dtype=torch.int64, device=dev)
            self.last = torch.zeros(S, dtype=torch.int64, device=dev)  # last sampled token (fed next)
            self.logits = torch.zeros(S, e.vocab_size, dtype=e.logit_dtype, device=dev)
            K = e.sync_every + 2  # a sync window logs <= sync_every + 1 sample calls
            self.log_tok = torch.zeros(K, S, dtype=torch.int64, device=dev)
            self.log_lp = torch.zeros(K, S, dtype=e.logit_dtype, device=dev)
        # host state per row
        self.live = np.zeros(S, dtype=bool)
        self.steps = np.zeros(S, dtype=np.int64)  # tokens sampled
        self.checked = np.zeros(S, dtype=np.int64)  # tokens synced and checked for stops
        self.fill_h = np.zeros(S, dtype=np.int64)
        self.row_version = np.zeros(S, dtype=np.int64)  # weights of the row's KV
        self.logit_version = np.zeros(S, dtype=np.int64)  # weights of the row's pending logits
        self.host_tok = np.zeros((S, self.max_new), dtype=np.int64)
        self.host_lp = np.zeros((S, self.max_new), dtype=np.float64)
        self.host_ver = np.zeros((S, self.max_new), dtype=np.int64)
        self.key: list[Hashable | None] = [None] * S
        # host state per group slot
        self.gkey: list[Hashable | None] = [None] * groups
        self.plen = np.zeros(groups, dtype=np.int64)
        self._count_slots()
        self.hg = 0  # group slots computed by the last decode / covered by the pending logits

    @property
    def hi(self) -> int:
        return self.hg * self.G

    def _count_slots(self) -> None:
        stats = self.e.stats
        stats.kv_slots = max(stats.kv_slots, self._tokens_needed(self.NG, self.P))

    def _tokens_needed(self, groups: int, prefix_capacity: int) -> int:
        return groups * (prefix_capacity + self.G * self.N)

    # ---------------------------------------------------------------- the loop
    def run(self) -> Iterator:
        e, q = self.e, self.q
        waited = None  # when the batch became idle (for idle_timeout)
        while True:
            if self.log_rows and (len(self.log_rows) >= e.sync_every or (self.steps[self.live] >= self.max_new).any()):
                self._sync()
            yield from self._flush()
            free = [g for g in range(self.NG) if self.gkey[g] is None]
            if free:  # admit waiting prompts into free group slots
                timeout = 0.0
                if not self.live.any():
                    waited = time.monotonic() if waited is None else waited
                    left = 0.1 if q.idle_timeout is None else q.idle_timeout - (time.monotonic() - waited)
                    timeout = max(0.0, min(0.1, left))
                items = self._take(len(free), timeout)
                if items:
                    waited = None
                    e._yield_to_updates()
                    with e._lock, torch.no_grad():
                        items = self._fit(items)
                        if items:
                            free = [g for g in range(self.NG) if self.gkey[g] is None]
                            rows = self._admit(items, np.asarray(free[: len(items)]))
                            self._sample(rows, prefix=False)
            if not self.live.any():
                if not self.deferred and q.closed and not len(q):
                    return
                if (not self.deferred and q.idle_timeout is not None and waited is not None
                        and time.monotonic() - waited >= q.idle_timeout):
                    if q.end_if_empty():
                        return
                continue
            if (self.steps[self.live] >= self.max_new).any():
                continue  # finish those rows (sync) before the next step
            e._yield_to_updates()
            with e._lock, torch.no_grad():
                stale = self.live & (self.row_version != e.version)
                if stale.any():
                    self._sync()
                    stale = self.live & (self.row_version != e.version)
                    if stale.any():
                        self._recompute(np.flatnonzero(stale))
                if self.live.any():
                    self._compact()
                    self._decode()
                    self._sample(np.flatnonzero(self.live), prefix=True)

    def _flush(self) -> Iterator:
        out, self.out = self.out, []
        yield from out

    def _take(self, n: int, timeout: float) -> list:
        """Up to ``n`` prompts: deferred ones first, then from the queue."""
        items = [self.deferred.popleft() for _ in range(min(n, len(self.deferred)))]
        if len(items) < n and not self.deferred:
            items += self.q.take(n - len(items), 0.0 if items else timeout)
        return items

    def _fit(self, items: list) -> list:
        """Admission by capacity: the prompts of ``items`` that fit the prefix store now.
        A longer prompt grows it in place while the budget allows; otherwise it waits
        (with every prompt after it, in order) until the batch has drained, and the batch
        is then rebuilt with fewer, larger group slots. Never over budget unless a single
        group needs more (then it runs alone)."""
        longest = 0
        for i, (key, prompt) in enumerate(items):
            ids = self.e._check_prompt(key, prompt, self.p)
            need = self._round_up(len(ids))
            if need <= self.P:
                continue
            if self._tokens_needed(self.NG, need) <= self.budget:
                longest = max(longest, need)
                continue
            if self.live.any():
                self.deferred.extendleft(reversed(items[i:]))
                items = items[:i]
                break
            groups = max(1, min(self.NG, self.budget // (need + self.G * self.N)))
            self._allocate(groups, need)
            self.e.stats.reallocations += 1
            self.deferred.extendleft(reversed(items[groups:]))
            return self._fit(items[:groups])
        if longest > self.P:
            self._grow_prefix(longest)
        return items

    # ----------------------------------------------------------------- sampling
    def _sample(self, rows: np.ndarray, prefix: bool) -> None:
        """Sample the next token of ``rows`` (live) from their pending logits and log it:
        after a decode step, every row of the step (``prefix``: rows ``[:hi]``, fixed
        shapes); after an admission, the admitted rows."""
        k = len(self.log_rows)
        if prefix:
            hi = self.hi
            tokens, logp = sample(self.logits[:hi], self.p, self.gen)
            self.last[:hi] = tokens
            self.log_tok[k, :hi] = tokens
            self.log_lp[k, :hi] = logp
        else:
            idx = torch.as_tensor(rows, device=self.e.device)
            tokens, logp = sample(self.logits[idx], self.p, self.gen)
            self.last[idx] = tokens
            self.log_tok[k, idx] = tokens
            self.log_lp[k, idx] = logp
        self.log_rows.append((rows, self.steps[rows].copy()))
        self.host_ver[rows, self.steps[rows]] = self.logit_version[rows]
        self.steps[rows] += 1

    def _sync(self) -> None:
        """Bring the logged tokens to the host; finish rows that stopped."""
        k = len(self.log_rows)
        if k:
            tok = self.log_tok[:k].cpu().numpy()
            lp = self.log_lp[:k].double().cpu().numpy()
            for j, (rows, idx) in enumerate(self.log_rows):
                self.host_tok[rows, idx] = tok[j, rows]
                self.host_lp[rows, idx] = lp[j, rows]
            self.log_rows = []
        finished = False
        for r in np.flatnonzero(self.live):
            n = int(self.steps[r])
            found = self.stopper.find(self.host_tok[r, :n], int(self.checked[r]))
            if found is not None:
                self._finish(r, found[0], "stop", found[1])
                finished = True
            elif n >= self.max_new:
                self._finish(r, n, "length", None)
                finished = True
            else:
                self.checked[r] = n
        if finished:
            self.live_d.copy_(torch.from_numpy(self.live.astype(np.int64)))

    def _finish(self, r: int, length: int, reason: str, stop) -> None:
        key = self.key[r]
        g = self.groups[key]
        g.completions.append(self._Completion(
            prompt_index=key,
            prompt_ids=g.prompt_ids,
            completion_ids=torch.from_numpy(self.host_tok[r, :length].copy()),
            logprobs=torch.from_numpy(self.host_lp[r, :length].copy()).to(self.e.logit_dtype),
            versions=torch.from_numpy(self.host_ver[r, :length].copy()),
            finish_reason=reason,
            stop=stop,
            branch=(int(r % self.G),),
        ))
        self.e.stats.generated_tokens += length
        self.live[r] = False
        self.key[r] = None
        if len(g.completions) == self.G:  # the group's slot is free
            del self.groups[key]
            self.gkey[r // self.G] = None
            g.completions.sort(key=lambda c: c.branch)
            self.out.append(self._Group(key, g.prompt_ids, g.completions))

    # ---------------------------------------------------------------- admission
    def _admit(self, items: list, slots: np.ndarray) -> np.ndarray:
        """Prefill each distinct prompt of ``items`` once into the prefix store of its group
        slot; returns the rows admitted (whose logits are pending)."""
        e, G = self.e, self.G
        prompts = []
        for key, prompt in items:
            if key in self.groups:
                raise ValueError(f"prompt key {key!r} is already being generated")
            prompts.append(e._check_prompt(key, prompt, self.p))
        rows = (slots[:, None] * G + np.arange(G)).reshape(-1)
        # prefill in pieces of about prefill_chunk_tokens prompt tokens (bounded temporary K/V)
        start = 0
        while start < len(prompts):
            end, tokens = start + 1, len(prompts[start])
            while end < len(prompts) and tokens + len(prompts[end]) <= e.prefill_chunk_tokens:
                tokens += len(prompts[end])
                end += 1
            todo = list(range(start, end))
            if e.prefix_cache is not None:  # prompts extending a cached one: their new tokens only
                hits = [(i, e.prefix_cache.lookup(prompts[i], e.version)) for i in todo]
                for i, entry in hits:
                    if entry is not None:
                        self._load_rows_of([i], slots, prompts, rows, prefilled=e._extend(prompts[i], entry))
                todo = [i for i, entry in hits if entry is None]
            if todo:
                self._load_rows_of(todo, slots, prompts, rows)
            start = end
        version = e.version
        if e.prefix_cache is not None:
            for i, p in enumerate(prompts):
                e.prefix_cache.insert(PrefixEntry(
                    tuple(p), [layer.pk[slots[i], :, : len(p)].clone() for layer in self.cache.layers],
                    [layer.pv[slots[i], :, : len(p)].clone() for layer in self.cache.layers],
                    self.logits[rows[i * G]].clone(), version))
        for i, (key, _) in enumerate(items):
            self.groups[key] = _GroupState(torch.tensor(prompts[i], dtype=torch.int64))
            self.gkey[slots[i]] = key
            for r in rows[i * G : (i + 1) * G]:
                self.key[r] = key
        self.live[rows] = True
        self.steps[rows] = 0
        self.checked[rows] = 0
        self.row_version[rows] = version
        self.logit_version[rows] = version
        self.live_d.copy_(torch.from_numpy(self.live.astype(np.int64)))
        self.hg = max(self.hg, _group_bucket(int(slots.max()) + 1, self.NG, G, self.exact))
        e.stats.waves += 1
        return rows

    def _load_rows_of(self, items: list[int], slots: np.ndarray, prompts: list[list[int]], rows: np.ndarray,
                      prefilled=None) -> None:
        """Load prompts ``items`` (indices into the admission) into their group slots and
        set their rows' pending logits."""
        G = self.G
        distinct: dict[tuple[int, ...], int] = {}
        src = [distinct.setdefault(tuple(prompts[i]), len(distinct)) for i in items]
        part = np.concatenate([rows[i * G : (i + 1) * G] for i in items])
        logits = self._load(slots[items], [list(t) for t in distinct], src, part, [s for s in src for _ in range(G)],
                            [len(prompts[i]) for i in items], prefilled)
        self.logits[torch.as_tensor(part, device=self.e.device)] = logits.repeat_interleave(G, dim=0)

    def _load(self, slots: np.ndarray, seqs: list[list[int]], group_src: list[int], rows: np.ndarray,
              row_src: list[int], plen: list[int], prefilled=None) -> torch.Tensor:
        """Prefill ``seqs`` (each a prompt followed by tokens a row fed); group slot
        ``slots[i]`` gets the prompt (its first ``plen[i]`` tokens) of ``seqs[group_src[i]]``,
        row ``rows[j]`` the rest of ``seqs[row_src[j]]`` as its own tokens (K/V, masks,
        fill, positions). Returns the logits after the last token of each group's sequence
        ``[len(slots), V]``. ``prefilled``: ``(cache, lengths, logits)`` of ``seqs`` already
        computed (a prefix-cache hit), instead of a prefill."""
        e, dev, G = self.e, self.e.device, self.G
        if prefilled is None:
            tmp, _, lens, logits = e._prefill(seqs, capacity=max(len(s) for s in seqs))
        else:
            tmp, lens, logits = prefilled
        if self.cache is None:
            k, v = tmp.layers[0].keys, tmp.layers[0].values
            self.cache = SharedPrefixCache(e.num_layers, self.NG, G, self.P, self.N, k.shape[1], k.shape[3],
                                           v.shape[3], k.dtype, k.device)
        L = tmp.length
        slots_t = torch.as_tensor(slots, device=dev)
        gsrc_t = torch.as_tensor(group_src, device=dev)
        plen_t = torch.as_tensor(plen, dtype=torch.int64, device=dev)
        rows_t = torch.as_tensor(rows, device=dev)
        rsrc_t = torch.as_tensor(row_src, device=dev)
        row_plen = plen_t.repeat_interleave(G)
        own = lens[rsrc_t] - row_plen  # [R] own tokens of each row
        own_max = max(len(seqs[s]) - plen[i // G] for i, s in enumerate(row_src))
        self.cache.load(tmp, slots_t, gsrc_t, L - lens[gsrc_t], max(plen), rows_t, rsrc_t, L - own, max(own_max, 0))
        zero = torch.zeros((), dtype=self.dtype, device=dev)
        hide = torch.full((), self.neg, dtype=self.dtype, device=dev)
        slot = torch.arange(self.P, device=dev)
        self.prefix_mask[slots_t] = torch.where(slot[None, :] < plen_t[:, None], zero, hide)
        slot = torch.arange(self.N, device=dev)
        self.own_mask[rows_t] = torch.where(slot[None, :] < own[:, None], zero, hide)
        self.fill[rows_t] = own
        self.pos[rows_t] = lens[rsrc_t]
        self.fill_h[rows] = [len(seqs[s]) - plen[i // G] for i, s in enumerate(row_src)]
        self.plen[slots] = plen
        return logits[gsrc_t]

    def _recompute(self, rows: np.ndarray) -> None:
        """After a weight update: rebuild the prompt K/V of the groups of ``rows`` and the
        own K/V of their live rows (tokens fed so far)."""
        G = self.G
        slots = np.unique(rows // G)
        distinct: dict[tuple[int, ...], int] = {}
        live_rows, row_src, group_src, plen = [], [], [], []
        for g in slots:
            prompt = self.groups[self.gkey[g]].prompt_ids.tolist()
            plen.append(len(prompt))
            first = None
            for r in range(g * G, (g + 1) * G):
                if not self.live[r]:
                    continue
                seq = prompt + self.host_tok[r, : self.steps[r] - 1].tolist()
                s = distinct.setdefault(tuple(seq), len(distinct))
                first = s if first is None else first
                live_rows.append(r)
                row_src.append(s)
            group_src.append(first)
        # rows of a group slot are loaded together: dead rows copy a live one's (ignored)
        all_rows = (slots[:, None] * G + np.arange(G)).reshape(-1)
        by_row = dict(zip(live_rows, row_src))
        src_all = [by_row.get(r, group_src[i // G]) for i, r in enumerate(all_rows)]
        self._load(slots, [list(t) for t in distinct], group_src, all_rows, src_all, plen)
        self.row_version[all_rows] = self.e.version
        self.e.stats.recomputes += 1

    def _grow_prefix(self, capacity: int) -> None:
        extra = torch.full((self.NG, capacity - self.P), self.neg, dtype=self.dtype, device=self.e.device)
        self.prefix_mask = torch.cat([self.prefix_mask, extra], dim=1)
        if self.cache is not None:
            self.cache.grow_prefix(capacity)
        self.P = capacity
        self.steps_cache.clear()
        self.graph_pool = None  # its graphs are gone, and with them the pool
        self._count_slots()

    def _compact(self) -> None:
        """Move live groups down into free group slots when they would fit a smaller bucket
        (only at a sync point: no logged tokens refer to the rows moved)."""
        G = self.G
        used = np.asarray([g for g in range(self.NG) if self.gkey[g] is not None])
        top = _group_bucket(int(used.max()) + 1, self.NG, G, self.exact)
        target = _group_bucket(len(used), self.NG, G, self.exact)
        if self.log_rows or top <= target:
            self.hg = top
            return
        src = used[used >= target]
        dst = np.asarray([g for g in range(target) if self.gkey[g] is None][: len(src)])
        dev = self.e.device
        s_t, d_t = torch.as_tensor(src, device=dev), torch.as_tensor(dst, device=dev)
        self.cache.move_groups(d_t, s_t)
        self.prefix_mask[d_t] = self.prefix_mask[s_t]
        rsrc = (src[:, None] * G + np.arange(G)).reshape(-1)
        rdst = (dst[:, None] * G + np.arange(G)).reshape(-1)
        rs_t, rd_t = torch.as_tensor(rsrc, device=dev), torch.as_tensor(rdst, device=dev)
        for t in (self.own_mask, self.fill, self.pos, self.last, self.logits):
            t[rd_t] = t[rs_t]
        for a in (self.live, self.steps, self.checked, self.fill_h, self.row_version, self.logit_version,
                  self.host_tok, self.host_lp, self.host_ver):
            a[rdst] = a[rsrc]
        for d, s in zip(rdst, rsrc):
            self.key[d], self.key[s] = self.key[s], None
        self.live[rsrc] = False
        self.plen[dst] = self.plen[src]
        for d, s in zip(dst, src):
            self.gkey[d], self.gkey[s] = self.gkey[s], None
        self.live_d.copy_(torch.from_numpy(self.live.astype(np.int64)))
        self.hg = target

    # ------------------------------------------------------------------- decode
    def _decode(self) -> None:
        """Feed every live row its last sampled token; logits of rows ``[:hi]``."""
        e, G = self.e, self.G
        used = [g for g in range(self.NG) if self.gkey[g] is not None]
        hg = self.hg = _group_bucket(max(used) + 1, self.NG, G, self.exact)
        hi = hg * G
        version = e.version
        self.own_mask[:hi].scatter_(1, self.fill[:hi, None], 0.0)
        own_len = _own_bucket(int(self.fill_h[:hi].max()) + 1, self.N, self.exact)
        pre_len = int(self.plen[:hg].max()) if self.exact else self.P
        step = self.steps_cache.get((hg, own_len))
        if step is None or step.cache is not self.cache:
            step = self.steps_cache[(hg, own_len)] = _TwoLevelStep(e, self, hg, own_len, pre_len)
        elif self.exact:
            step.prefix_mask = self.prefix_mask[:hg, None, None, :pre_len]
        if e.decode_forward is not None:
            e.decode_forward.refresh()  # fused projection copies, if the parameters changed
        step()  # writes the logits of rows [:hi] into self.logits
        self.fill += self.live_d
        self.pos += self.live_d
        self.fill_h[self.live] += 1
        self.logit_version[self.live] = version
        e.stats.decode_steps += 1
        e.stats.decode_rows += hi
        e.stats.live_rows += int(self.live.sum())


class _TwoLevelStep:
    """One-token decode step over group slots ``[:hg]`` (rows ``[:hg*G]``) attending to
    ``own_len`` own slots per row and the prefix store, writing the next-token logits into
    the batch's ``logits[:hi]``: inputs and output are views of the batch's
    persistent tensors, so with ``engine.cuda_graphs`` it is captured as a graph at its
    first use and replayed after (:class:`~treerl.rollout.graphs.DecodeStep`)."""

    def __init__(self, engine, batch: RunningBatch, hg: int, own_len: int, pre_len: int):
        hi = hg * batch.G
        self.engine, self.cache, self.own_len = engine, batch.cache, own_len
        self.ids = batch.last[:hi, None]
        self.pos = batch.pos[:hi, None]
        self.index = batch.fill[:hi]
        self.own_mask = batch.own_mask[:hi, None, None, :own_len]
        self.prefix_mask = batch.prefix_mask[:hg, None, None, :pre_len]
        self.out = batch.logits[:hi]
        self.step = DecodeStep(engine, self._forward, owner=batch)

    def _forward(self) -> torch.Tensor:
        cache = self.cache
        # own_len from a shape (not a Python int attribute): compiled steps stay shape-generic
        cache.write_index, cache.own_len, cache.prefix_mask = self.index, self.own_mask.shape[-1], self.prefix_mask
        try:
            if self.engine.decode_forward is not None:  # treerl's own blocks (Qwen2/Qwen3/Llama)
                logits = self.engine.decode_forward(self.ids, self.pos, cache, self.own_mask, self.prefix_mask)
            else:
                logits = self.engine.model(
                    input_ids=self.ids, position_ids=self.pos, attention_mask=self.own_mask,
                    past_key_values=cache, use_cache=True, rollout_static=True, rollout_prefix=cache,
                ).logits[:, -1]
            # into the batch's logits buffer (in the graph: the model's logits are a temporary
            # of the shared pool, not an output kept alive per graph)
            return self.out.copy_(logits)
        finally:
            cache.write_index = cache.prefix_mask = None

    def __call__(self) -> torch.Tensor:
        return self.step()
