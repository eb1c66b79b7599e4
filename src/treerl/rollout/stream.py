"""Continuous batching: the rollout engine's streaming path.

:meth:`RolloutEngine.generate_stream <treerl.rollout.RolloutEngine.generate_stream>` keeps
a *running batch* of ``rows`` slots. Whenever rows finish (stop token, stop string or
``max_new_tokens``) their slots are freed, and prompt groups waiting in the
:class:`PromptQueue` are admitted into free slots (``n`` slots per group: the group's
prompt is prefilled once, deduplicated with the other prompts admitted with it, and its KV
copied to its ``n`` rows). A group is yielded as soon as all of its samples have finished.
Compared with waves (every group of a wave waits for the wave's longest row), no slot idles
through the long tail of generation lengths while prompts are waiting.

The slot KV cache (:class:`~treerl.rollout.kv.RowCache`) has a fixed shape
``[rows, kv_heads, capacity, head_dim]``. Each row is filled to its own length: an admitted
prompt's K/V are loaded at slots ``[0, P)`` (left padding of the prefill removed; K/V are
post-RoPE, computed at position ids ``0..P-1``), and each decode step writes every row's
new K/V at that row's own next slot (a device tensor of write indices) and feeds it the
position id ``P + tokens so far``. The additive mask ``[rows, capacity]`` hides each row's
unwritten slots and whatever a previous occupant left there. Free rows are computed along
(their outputs are ignored) so that every decode step has the same shapes: on CUDA each
step of a given row count is a replayed CUDA graph. The step runs over the first ``hi``
rows only (covering every live row: with fixed shapes a power of two >= 8, or all rows); admissions
take the lowest free slots, and live rows are moved down (compaction) when they would fit
in a smaller bucket, so the tail of a stream decodes only what it needs.

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
from .kv import RowCache
from .params import SamplingParams
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


def _bucket(n: int, rows: int, exact: bool = False) -> int:
    """Rows a decode step computes for ``n`` live-row slots: a power of two >= 8, or all
    (fixed shapes: few CUDA graphs); ``exact``: ``n`` (no graphs, e.g. CPU)."""
    if exact:
        return min(n, rows)
    b = 8
    while b < n:
        b *= 2
    return min(b, rows)


@dataclass
class _GroupState:
    prompt_ids: torch.Tensor
    completions: list = field(default_factory=list)


class RunningBatch:
    """State of one ``generate_stream`` call (see the module docstring). Not thread-safe:
    it runs in the consumer's thread; only ``engine.update_weights`` comes from others."""

    def __init__(self, engine, queue: PromptQueue, params: SamplingParams, generator: torch.Generator,
                 rows: int, capacity: int):
        from .engine import Completion, Group, _round_up  # noqa: F401 (circular import)

        self.e, self.q, self.p, self.gen = engine, queue, params, generator
        self.S, self.C = rows, capacity
        self.G, self.max_new = params.n, params.max_new_tokens
        self.exact = not engine.static_kv  # rows computed per step: exactly the live span
        self.stopper = StopChecker(params.stop_token_ids, params.stop_strings, params.decoder())
        dev, S = engine.device, rows
        self.dtype = next(engine.model.parameters()).dtype
        self.neg = torch.finfo(self.dtype).min
        self.cache: RowCache | None = None  # allocated at the first admission (shapes from the prefill)
        self.mask = torch.full((S, capacity), self.neg, dtype=self.dtype, device=dev)
        self.fill = torch.zeros(S, dtype=torch.int64, device=dev)  # next slot of each row
        self.pos = torch.zeros(S, dtype=torch.int64, device=dev)  # next position id
        self.live_d = torch.zeros(S, dtype=torch.int64, device=dev)
        self.last = torch.zeros(S, dtype=torch.int64, device=dev)  # last sampled token (fed next)
        self.logits = torch.zeros(S, engine.vocab_size, dtype=engine.logit_dtype, device=dev)
        K = engine.sync_every + 2  # a sync window logs <= sync_every + 1 sample calls
        self.log_tok = torch.zeros(K, S, dtype=torch.int64, device=dev)
        self.log_lp = torch.zeros(K, S, dtype=engine.logit_dtype, device=dev)
        self.log_rows: list[tuple[np.ndarray, np.ndarray]] = []
        # host state per slot
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
        self.sample_idx = np.zeros(S, dtype=np.int64)
        self.groups: dict[Hashable, _GroupState] = {}
        self.out: list = []
        self.graphs: dict[int, _RowStep] = {}
        self.hi = 0  # rows computed by the last decode / covered by the pending logits
        self._Completion, self._Group, self._round_up = Completion, Group, _round_up

    # ---------------------------------------------------------------- the loop
    def run(self) -> Iterator:
        e, q = self.e, self.q
        waited = None  # when the batch became idle (for idle_timeout)
        while True:
            if self.log_rows and (len(self.log_rows) >= e.sync_every or (self.steps[self.live] >= self.max_new).any()):
                self._sync()
            yield from self._flush()
            free = np.flatnonzero(~self.live)
            if len(free) >= self.G:  # admit waiting prompts into free slots
                timeout = 0.0
                if not self.live.any():
                    waited = time.monotonic() if waited is None else waited
                    left = 0.1 if q.idle_timeout is None else q.idle_timeout - (time.monotonic() - waited)
                    timeout = max(0.0, min(0.1, left))
                items = q.take(len(free) // self.G, timeout)
                if items:
                    waited = None
                    e._yield_to_updates()
                    with e._lock, torch.no_grad():
                        self._admit(items, free)
                        self._sample(free[: len(items) * self.G], prefix=False)
            if not self.live.any():
                if q.closed and not len(q):
                    return
                if q.idle_timeout is not None and waited is not None and time.monotonic() - waited >= q.idle_timeout:
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
            branch=(int(self.sample_idx[r]),),
        ))
        self.e.stats.generated_tokens += length
        self.live[r] = False
        self.key[r] = None
        if len(g.completions) == self.G:
            del self.groups[key]
            g.completions.sort(key=lambda c: c.branch)
            self.out.append(self._Group(key, g.prompt_ids, g.completions))

    # ---------------------------------------------------------------- admission
    def _admit(self, items: list, free: np.ndarray) -> None:
        e, G = self.e, self.G
        prompts = []
        for key, prompt in items:
            if key in self.groups:
                raise ValueError(f"prompt key {key!r} is already being generated")
            prompts.append(e._check_prompt(key, prompt, self.p))
        need = self._round_up(max(len(p) for p in prompts) + self.max_new - 1)
        if need > self.C:
            self._grow(need)
        dst = free[: len(items) * G]
        distinct: dict[tuple[int, ...], int] = {}
        src = []
        for p in prompts:
            s = distinct.setdefault(tuple(p), len(distinct))
            src += [s] * G
        logits = self._load(dst, [list(t) for t in distinct], src)
        version = e.version
        dst_t = torch.as_tensor(dst, device=e.device)
        self.logits[dst_t] = logits
        for i, (key, _) in enumerate(items):
            self.groups[key] = _GroupState(torch.tensor(prompts[i], dtype=torch.int64))
            for j in range(G):
                r = dst[i * G + j]
                self.key[r] = key
                self.sample_idx[r] = j
        self.live[dst] = True
        self.steps[dst] = 0
        self.checked[dst] = 0
        self.row_version[dst] = version
        self.logit_version[dst] = version
        self.live_d.copy_(torch.from_numpy(self.live.astype(np.int64)))
        self.hi = max(self.hi, _bucket(int(dst.max()) + 1, self.S, self.exact))
        e.stats.waves += 1

    def _load(self, dst: np.ndarray, seqs: list[list[int]], src: list[int]) -> torch.Tensor:
        """Prefill ``seqs`` and load row ``dst[i]`` with ``seqs[src[i]]`` (KV, mask, fill,
        position); returns the logits after each row's last token ``[len(dst), V]``."""
        e = self.e
        tmp, _, lens, logits = e._prefill(seqs, capacity=max(len(s) for s in seqs))
        if self.cache is None:
            k, v = tmp.layers[0].keys, tmp.layers[0].values
            self.cache = RowCache(e.num_layers, self.S, self.C, k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)
        L = tmp.length
        src_t = torch.as_tensor(src, device=e.device)
        dst_t = torch.as_tensor(dst, device=e.device)
        P = lens[src_t]
        self.cache.load_rows(dst_t, tmp, src_t, L - P)
        slot = torch.arange(L, device=e.device)
        rows = torch.full((len(dst), self.C), self.neg, dtype=self.dtype, device=e.device)
        rows[:, :L].masked_fill_(slot[None, :] < P[:, None], 0.0)
        self.mask[dst_t] = rows
        self.fill[dst_t] = P
        self.pos[dst_t] = P
        self.fill_h[dst] = [len(seqs[s]) for s in src]
        return logits[src_t]

    def _recompute(self, rows: np.ndarray) -> None:
        """After a weight update: rebuild the KV of ``rows`` (prompt + tokens fed so far)."""
        distinct: dict[tuple[int, ...], int] = {}
        src = []
        for r in rows:
            seq = self.groups[self.key[r]].prompt_ids.tolist() + self.host_tok[r, : self.steps[r] - 1].tolist()
            src.append(distinct.setdefault(tuple(seq), len(distinct)))
        self._load(rows, [list(t) for t in distinct], src)
        self.row_version[rows] = self.e.version
        self.e.stats.recomputes += 1

    def _grow(self, capacity: int) -> None:
        extra = torch.full((self.S, capacity - self.C), self.neg, dtype=self.dtype, device=self.e.device)
        self.mask = torch.cat([self.mask, extra], dim=1)
        if self.cache is not None:
            self.cache.grow(capacity)
        self.C = capacity
        self.graphs.clear()

    def _compact(self) -> None:
        """Move live rows down into free slots when they would fit a smaller bucket
        (only at a sync point: no logged tokens refer to the rows moved)."""
        live = np.flatnonzero(self.live)
        target = _bucket(len(live), self.S, self.exact)
        if self.log_rows or _bucket(int(live.max()) + 1, self.S, self.exact) <= target:
            self.hi = _bucket(int(live.max()) + 1, self.S, self.exact)
            return
        src = live[live >= target]
        dst = np.flatnonzero(~self.live[:target])[: len(src)]
        s_t, d_t = torch.as_tensor(src, device=self.e.device), torch.as_tensor(dst, device=self.e.device)
        self.cache.move_rows(d_t, s_t)
        for t in (self.mask, self.fill, self.pos, self.last, self.logits):
            t[d_t] = t[s_t]
        for a in (self.live, self.steps, self.checked, self.fill_h, self.row_version, self.logit_version,
                  self.host_tok, self.host_lp, self.host_ver, self.sample_idx):
            a[dst] = a[src]
        for d, s in zip(dst, src):
            self.key[d], self.key[s] = self.key[s], None
        self.live[src] = False
        self.live_d.copy_(torch.from_numpy(self.live.astype(np.int64)))
        self.hi = target

    # ------------------------------------------------------------------- decode
    def _decode(self) -> None:
        """Feed every live row its last sampled token; logits of rows ``[:hi]``."""
        e = self.e
        hi = self.hi = _bucket(int(np.flatnonzero(self.live).max()) + 1, self.S, self.exact)
        version = e.version
        self.mask[:hi].scatter_(1, self.fill[:hi, None], 0.0)
        if not e.static_kv:
            n = int(self.fill_h[:hi].max()) + 1
            self.cache.write_index, self.cache.attend = self.fill[:hi], n
            try:
                logits = e.model(
                    input_ids=self.last[:hi, None], position_ids=self.pos[:hi, None],
                    attention_mask=self.mask[:hi, None, None, :n], past_key_values=self.cache, use_cache=True,
                ).logits
            finally:
                self.cache.write_index = self.cache.attend = None
        else:
            step = self.graphs.get(hi)
            if step is None or step.mask_base is not self.mask:
                step = self.graphs[hi] = _RowStep(e, self, hi)
            logits = step.run()
        self.logits[:hi] = logits[:, -1].to(e.logit_dtype)
        self.fill += self.live_d
        self.pos += self.live_d
        self.fill_h[self.live] += 1
        self.logit_version[self.live] = version
        e.stats.decode_steps += 1
        e.stats.decode_rows += hi
        e.stats.live_rows += int(self.live.sum())


class _RowStep:
    """One-token decode step over rows ``[:hi]`` of a running batch with fixed shapes
    (whole-buffer attention, per-row write slots in a device tensor); on CUDA
    (``engine.cuda_graphs``) captured as a graph at its first use and replayed after."""

    def __init__(self, engine, batch: RunningBatch, hi: int):
        self.engine, self.batch, self.hi = engine, batch, hi
        self.mask_base = batch.mask
        self.ids = batch.last[:hi, None]
        self.pos = batch.pos[:hi, None]
        self.index = batch.fill[:hi]
        self.mask = batch.mask[:hi, None, None, :]
        self.step = DecodeStep(engine, self._forward)

    def _forward(self) -> torch.Tensor:
        cache = self.batch.cache
        cache.write_index, cache.attend = self.index, None
        try:
            return self.engine.model(
                input_ids=self.ids, position_ids=self.pos, attention_mask=self.mask,
                past_key_values=cache, use_cache=True, rollout_static=True,
            ).logits
        finally:
            cache.write_index = None

    def run(self) -> torch.Tensor:
        return self.step()
