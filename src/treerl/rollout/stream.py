"""Continuous batching: the rollout engine's one generation path.

:meth:`RolloutEngine.generate_stream <treerl.rollout.RolloutEngine.generate_stream>` (and
``generate``, which collects it) keeps a *running batch* of group slots of ``G`` rows each:
``G = params.n`` for plain groups, the complete tree ``params.max_leaves`` for tree rollouts
(rows laid out by :class:`~treerl.rollout.forks.ForkLayout`). Whenever every sample of a
group has finished (stop token, stop string or ``max_new_tokens``) the group is yielded and
its slot freed, and prompt groups waiting in the :class:`~treerl.rollout.prompts.PromptQueue`
are admitted into free slots: each prompt is prefilled once (deduplicated with the other
prompts admitted with it) and its K/V stored once, in the slot's prefix store, for all its
rows. No slot idles through the long tail of generation lengths while prompts are waiting.
The prompts of one admission are prefilled together, in batched forwards (pieces of about
``prefill_chunk_tokens`` prompt tokens); with the engine's prefix cache, a prompt that
extends a cached one joins the same forward with only its new tokens computed (its cached
K/V copied in: :class:`~treerl.rollout.prefill.Prefiller`).

The K/V cache (:class:`~treerl.rollout.shared.SharedPrefixCache`) has a prefix store
``[groups, kv_heads, P, head_dim]`` (prompt K/V, post-RoPE, position ids ``0..P_g-1``), for
tree rollouts one fork-segment store per fork level (each node's tokens between two fork
points, stored once for the rows below it), and a *paged* row store of each row's own tokens
only: a pool of blocks of ``B`` slots and a block table (:mod:`~treerl.rollout.paging`);
a row owns only the blocks its writes reach. Each decode step writes every live row's new
K/V at its own next slot (through the table), or (before the last fork) into the segment of
the node it is generating (device tensors of write indices; rows that are not a segment's
writer write its trash slot, rows without a block there the pool's trash block), feeds
position ``P_g + tokens so far``, and attends to every level, merged by log-sum-exp: the
group's queries against the prompt (read once per group, not once per row), each node's
rows against its segment, each row against its own blocks. Additive masks (device tensors)
hide unwritten slots and what a previous occupant left. Rows of finished samples (and rows
reserved for a tree's later forks) in a group still running are computed along (outputs
ignored) so that steps have fixed shapes: on CUDA each step of a given (group slots, own
slots) bucket is a replayed CUDA graph (:mod:`~treerl.rollout.step`). The step runs over the
first ``hg`` group slots only (covering every live group: with fixed shapes a power of two,
or all) and attends to the own slots written so far rounded up to 64; admissions take the
lowest free slots, and live groups are moved down (compaction: prefix, segments and block
table rows; own K/V stays in its blocks) when they would fit in a smaller bucket.

Forks: when a group's rows have sampled ``t_k`` tokens (a fork point), the batch syncs (rows
that stopped before the fork are not forked), the decode step feeds token ``t_k - 1`` (its
K/V goes into the parent's segment), and each live row's children take their reserved rows:
positions, logits and token history are copied, K/V is not (the children read the parent's
segment; they take own blocks of their own as they write); each child then samples token
``t_k`` on its own.

Capacity: the engine's ``max_batch_tokens`` pays for ``groups x (P + fork segments)`` slots
and a pool of own-token blocks (at most what every row of every group slot could fill; at
least one group's worth). Group slots are overcommitted: there are as many as fit with one
block per row (:func:`group_slots`), and rows take blocks as they grow. Before each decode
step every live row gets the blocks its writes reach until the next host sync; admission is
by free blocks: a waiting group is admitted only if, after the blocks of its first window,
the blocks the running rows need for the next ``sync_every`` steps are still free. When a
live row needs a block and none is free, the batch syncs and preempts whole groups (a tree:
the whole tree), latest-admitted first: their blocks and slot are freed, everything sampled
stays on the host (tokens, logprobs, versions, stop-check state, forks passed) and the group
goes back to the front of the waiting prompts; readmitted, its K/V is recomputed from the
prompt and the tokens fed so far and sampling continues where it stopped (never a crash,
never a lost or repeated sample). A group alone always fits (the pool holds one group's
worst case), so the oldest group always progresses. A prompt longer than ``P`` grows the
prefix store while the budget allows; otherwise it (and the prompts after it) wait until
the batch drains, which is then rebuilt with fewer, larger group slots; a group larger than
the whole budget then runs alone (over the budget, by exactly its own needs). Either way
``P`` at least doubles (as far as the budget allows), so a conversation whose prompts grow
turn by turn costs few growths (each drops the captured decode steps) and few rebuilds.

Sampling settings per group: a prompt may bring its own :class:`~treerl.rollout.params.SamplingParams`
(``PromptQueue.put(params=...)``: temperature, top-p, top-k, min-p, ``max_new_tokens`` and
``n`` up to the stream's, stops, seed, ``top_logprobs``; the tree-rollout fields must be
the stream's). Rows of different settings are sampled in the same call with per-row
tensors (:func:`~treerl.rollout.sampling.sample_rows`, outside the captured decode step);
when every row has the stream's (or one common) setting the single-setting path runs. A
seeded group's rows draw their noise from ``(seed, branch, token index)`` alone. A group's
``listener`` gets each row's new tokens as each read of the log completes (no extra syncs), and
``PromptQueue.cancel`` stops a group at the next sync (yielded with ``finish_reason="abort"``).

Reads of the log: sampled tokens and logprobs are logged on the device and copied to the
host every ``sync_every`` steps and when a row reaches ``max_new_tokens`` (it stops decoding
at once), without waiting: decode steps run on while the copy completes, then stops are
found exactly (later tokens of a row that stopped are discarded). A blocking sync remains
where a row's whole history is needed (preemption, fork points, recomputes, cancels,
compaction) and when nothing decodes. Admissions need no sync (free slots and blocks are known on the host): a slot
freed at a sync is refilled right away, before the next decode step; the admitted rows'
first tokens are sampled from the prefill's logits, and they join the next decode step.
Block tables are copied to the device only when they changed (in place: captured graphs
stay valid), at most once per step and in the steady state about once per sync window.

Weights: ``update_weights`` from another thread takes effect between decode steps; groups
whose K/V was computed under older weights are recomputed (prompt + tokens fed so far)
before the next step; every token records the version of the weights whose logits it was
sampled from (admitted rows: the prefill's; others: the decode step's).

Modules: :class:`RunningBatch` (here) runs the loop and keeps the two sides consistent; the
host side (slots, rows, blocks, admission, preemption, forks, stops: no device tensor) is
:class:`~treerl.rollout.scheduler.Scheduler`, the device side (buffers, K/V cache, loads,
decode step, sampling) :class:`~treerl.rollout.batch.DeviceBatch`, and prefill
:class:`~treerl.rollout.prefill.Prefiller`.
"""

from __future__ import annotations

import time
from typing import Iterator

import numpy as np
import torch

from .batch import DeviceBatch
from .kept_contexts import keep as keep_contexts
from .log_reads import LogReader
from .params import SamplingParams
from .paging import block_size_for
from .prefill import prefill_bucket
from .prefix_cache import PrefixEntry
from .prompts import PromptQueue, Waiting
from .scheduler import Preempted, Scheduler, group_bucket, own_bucket
from .forks import ForkLayout
from .types import Group, round_up

__all__ = ["PromptQueue", "RunningBatch", "group_slots", "own_prompts"]

OWN_PROMPT_STORE = 16  # prompt slots per group slot when prompts live in the rows' own blocks (all masked)


def own_prompts(tree: ForkLayout, max_positions: int | None) -> bool:
    """Whether a stream keeps each prompt in its row's own blocks instead of the prompt
    store: groups of one row (a serving batch: nothing to share, and a prompt store sized
    for the longest prompt would hold that much for every group slot, so growing prompts
    would grow it past the budget and drain the batch) when the model's context bounds a
    row's prompt + completion (``max_positions``)."""
    return tree.rows == 1 and tree.depth == 0 and max_positions is not None


def own_capacity(tree: ForkLayout, max_positions: int | None) -> int:
    """Own slots per row: its completion's, or with :func:`own_prompts` the whole context."""
    return round_up(max_positions) if own_prompts(tree, max_positions) else tree.own_capacity


def group_slots(tree: ForkLayout, prefix_capacity: int, budget: int, block_size: int,
                max_positions: int | None = None) -> int:
    """Group slots a K/V ``budget`` (token slots) affords, overcommitted: each slot's shared
    levels (prompt store, fork segments) and one own block (``block_size`` slots, see
    :func:`~treerl.rollout.paging.block_size_for`) per row; at least one. With
    :func:`own_prompts`, ``prefix_capacity`` prompt tokens in own blocks per slot instead."""
    block = block_size_for(own_capacity(tree, max_positions), block_size)
    return max(1, budget // (tree.shared_tokens(prefix_capacity) + tree.rows * block))


class RunningBatch:
    """State of one ``generate_stream`` call (see the module docstring). Not thread-safe:
    it runs in the consumer's thread; only ``engine.update_weights`` comes from others.

    ``groups`` group slots of ``G = params.max_leaves`` rows; ``prefix_capacity`` prompt
    slots per group; ``budget``: K/V token slots the batch may hold (shared levels of every
    group slot + the own-block pool; over it only when a single group needs more: it then
    runs alone). ``arena``: device buffers an earlier stream kept (:meth:`arena`), reused
    if their shapes match."""

    def __init__(self, engine, queue: PromptQueue, params: SamplingParams, generator: torch.Generator,
                 groups: int, prefix_capacity: int, budget: int, arena: tuple | None = None):
        self.e, self.q, self.p, self.gen = engine, queue, params, generator
        self.tree = tree = ForkLayout.of(params)
        self.G, self.max_new, self.budget = tree.rows, params.max_new_tokens, budget
        # a group of one row keeps its prompt in its own blocks (own_prompts: the prompt store is unused)
        self.own_prompts = own_prompts(tree, engine.max_positions)
        capacity = own_capacity(tree, engine.max_positions)
        self.block = block_size_for(capacity, engine.kv_block_size)  # own slots per block
        self.max_blocks = -(-capacity // self.block)  # own blocks per row at most
        self.exact = not engine.static_kv  # rows computed per step: exactly the live span
        self.host = Scheduler(tree, params, self.block, self.max_blocks, engine.sync_every, self.exact,
                              engine.stats, engine.logit_dtype, self.own_prompts)
        if self.own_prompts:
            prefix_capacity = OWN_PROMPT_STORE
        self.dev = DeviceBatch(engine, tree, self.block, self.max_blocks, engine.stats, self.own_prompts)
        # a row holding its whole context in its own blocks leaves it to the prefix cache as it finishes
        self.host.keep_finished = self.own_prompts and engine.prefix_cache is not None
        self.reads = LogReader(self.host, self.dev, self._keep_finished)
        self._allocate(groups, prefix_capacity, arena)

    def arena(self) -> tuple:
        """The device state (buffers, cache, captured decode steps) for reuse by the
        engine's next stream of the same shapes (``RolloutEngine(keep_stream_buffers=True)``)."""
        return self.dev.arena()

    # views for tests and tools
    @property
    def blocks(self):
        return self.host.blocks

    def _pool_blocks(self, groups: int, prefix_capacity: int) -> int:
        """Own blocks of the pool: what the budget leaves after the shared levels, at most
        what every row could fill, at least one group's worst case (a group alone fits)."""
        worst = self.G * self.max_blocks
        left = (self.budget - groups * self.tree.shared_tokens(prefix_capacity)) // self.block
        return max(worst, min(groups * worst, left))

    def _allocate(self, groups: int, prefix_capacity: int, kept: tuple | None = None) -> None:
        """(Re)build the batch for ``groups`` group slots (nothing may be live, no token unread)."""
        if self.reads.unsynced():  # pragma: no cover - _fit defers a rebuild until every token is read
            raise RuntimeError("the running batch was rebuilt with logged tokens not read")
        num_blocks = self._pool_blocks(groups, prefix_capacity)
        self.dev.allocate(groups, prefix_capacity, num_blocks, kept)
        self.host.reset(groups, num_blocks)
        self.NG, self.S, self.P = groups, groups * self.G, prefix_capacity
        self._count_slots()

    def _count_slots(self) -> None:
        stats = self.e.stats
        stats.kv_slots = max(stats.kv_slots, self._tokens_needed(self.NG, self.P))

    def _tokens_needed(self, groups: int, prefix_capacity: int) -> int:
        """K/V token slots held with ``groups`` group slots of ``prefix_capacity`` prompt
        slots and this batch's block pool."""
        return groups * self.tree.shared_tokens(prefix_capacity) + self.host.blocks.num_blocks * self.block

    # ---------------------------------------------------------------- the loop
    def run(self) -> Iterator[Group]:
        e, q, h = self.e, self.q, self.host
        waited = None  # when the batch became idle (for idle_timeout)
        while True:
            cancelled = q.take_cancelled()
            if cancelled:
                self._cancel(cancelled)
            if not h.live.any() and self.reads.unsynced():
                self.reads.sync()  # nothing decodes: the ending rows' tokens now
            else:
                self.reads.due(e.stats.decode_steps)
            if h.sync_due():
                self.reads.start(e.stats.decode_steps)
            yield from self._flush()
            free = h.free()
            if free and h.room():  # admit waiting prompts into free group slots
                timeout = 0.0
                if not h.live.any():
                    waited = time.monotonic() if waited is None else waited
                    left = 0.1 if q.idle_timeout is None else q.idle_timeout - (time.monotonic() - waited)
                    timeout = max(0.0, min(0.1, left))
                items = self._take(len(free), timeout)
                if items:
                    waited = None
                    with e.generation_turn():
                        items = chunk_admission(self, self._fit(items))
                        if items:
                            rows = self._admit(items, np.asarray(h.free()[: len(items)]))
                            if len(rows):
                                self._sample(rows)
            if not h.live.any():
                if self.reads.unsynced():
                    continue  # rows ending with tokens not read yet: the next turn syncs them
                if not h.deferred and q.closed and not len(q):
                    return
                if (not h.deferred and q.idle_timeout is not None and waited is not None
                        and time.monotonic() - waited >= q.idle_timeout):
                    if q.end_if_empty():
                        return
                continue
            with e.generation_turn():
                stale = h.live & (h.row_version != e.version)
                if stale.any():
                    self.reads.sync()
                    stale = h.live & (h.row_version != e.version)
                    if stale.any():
                        self._recompute(np.flatnonzero(stale))
                if h.live.any():
                    self._compact()
                    self._ensure_blocks()  # may sync, finish rows and preempt groups
                if h.live.any():
                    self._decode()
                    self._fork()
                    self._sample(None)

    def _keep_finished(self) -> None:
        if self.host.kept:
            self.e.stats.contexts_kept += keep_contexts(self.host, self.dev.cache, self.e.prefix_cache, self.e.version)

    def _cancel(self, keys: set) -> None:
        """Stop the cancelled groups the batch holds (synced first: their rows keep every
        token sampled so far); they are yielded with ``finish_reason="abort"``."""
        h = self.host
        if self.reads.unsynced() and any(k in h.gkey for k in keys):
            self.reads.sync()
        if any([h.abort(k) for k in keys]):
            self.dev.set_live(h.live)

    def _flush(self) -> Iterator[Group]:
        out, self.host.out = self.host.out, []
        yield from out

    def _take(self, n: int, timeout: float) -> list:
        """Up to ``n`` waiting groups: deferred ones (preempted, then prompts) first, then
        prompts from the queue."""
        deferred = self.host.deferred
        items = [deferred.popleft() for _ in range(min(n, len(deferred)))]
        if len(items) < n and not deferred:
            items += self.q.take(n - len(items), 0.0 if items else timeout)
        return items

    def _fit(self, items: list) -> list:
        """Admission by capacity: the groups of ``items`` (in order) that fit the prefix
        store and the free blocks now. A longer prompt grows the prefix store in place while
        the budget allows; otherwise it waits (with every item after it, in order) until
        the batch has drained, and the batch is then rebuilt with fewer, larger group slots.
        Never over budget unless a single group needs more (then it runs alone). With
        :func:`own_prompts` the prompts take own blocks: admission by free blocks alone."""
        if self.own_prompts:
            return self.host.fit_blocks(items)
        longest = 0
        for i, item in enumerate(items):
            need = round_up(self._prompt_len(item))
            if need <= self.P:
                continue
            if self._tokens_needed(self.NG, need) <= self.budget:
                longest = max(longest, need)
                continue
            if self.host.live.any() or self.reads.unsynced():  # (rebuilt only once every token is read)
                self.host.deferred.extendleft(reversed(items[i:]))
                items = items[:i]
                break
            capacity = self._capacity_for(need, 1, self.G * self.max_blocks * self.block)  # a group alone fits
            groups = min(self.NG, group_slots(self.tree, capacity, self.budget, self.e.kv_block_size))
            self._allocate(groups, capacity)
            self.e.stats.reallocations += 1
            self.host.deferred.extendleft(reversed(items[groups:]))
            return self._fit(items[:groups])
        if longest > self.P:
            self._grow_prefix(self._capacity_for(longest, self.NG, self._tokens_needed(0, 0)))
        return self.host.fit_blocks(items)

    def _capacity_for(self, need: int, groups: int, pool: int) -> int:
        """Prompt slots per group to grow to for a prompt of ``need`` slots: twice the present
        capacity where ``groups`` group slots of it beside ``pool`` own-block slots fit the
        budget, else as many as fit, and at least ``need``. Geometric, so that a conversation
        growing turn by turn costs few growths (each drops the captured decode steps) and few
        reallocations (each waits for the batch to drain)."""
        most = ((self.budget - pool) // groups - self.tree.shared_tokens(0)) // 16 * 16
        return max(need, min(2 * self.P, most))

    def _prompt_len(self, item) -> int:
        if isinstance(item, Preempted):
            return len(item.prompt)
        return len(self.e.check_prompt(item.key, item.prompt, self._params(item)))

    def _params(self, item: Waiting) -> SamplingParams:
        """The group's sampling settings: its own (checked against the stream's), or the stream's."""
        if item.params is None:
            return self.p
        return item.params.validate(self.e.vocab_size).check_group(self.p)

    def _grow_prefix(self, capacity: int) -> None:
        self.dev.grow_prefix(capacity)
        self.P = capacity
        self.e.stats.prefix_grows += 1
        self._count_slots()

    # ------------------------------------------------------------------ blocks
    def _ensure_blocks(self) -> None:
        """Before a decode step: every live row owns the blocks its writes reach until the
        next sync (at least this step's: else the batch syncs — rows that finished free
        theirs; a preempted group's samples must be on the host — and preempts groups,
        latest-admitted first); the device table is updated if it changed."""
        h = self.host
        if not h.grow_for_step():
            if self.reads.unsynced():
                self.reads.sync()
            h.make_room()
            self.dev.set_live(h.live)
        h.blocks.upload(self.dev.table)

    # ----------------------------------------------------------------- sampling
    def _sample(self, rows: np.ndarray | None) -> None:
        """Sample the next token of the live rows from their pending logits and log it:
        after a decode step (``rows`` None) every row of the step (rows ``[:hi]``, fixed
        shapes); after an admission, the admitted ``rows``."""
        h = self.host
        k = len(h.log_rows)
        live = np.flatnonzero(h.live) if rows is None else rows
        how = h.sampling(live, np.arange(h.hi) if rows is None else rows)
        self.dev.sample(k, rows, h.hi, how, self.gen)
        if h.logged(live):  # rows at max_new stop decoding (they finish when their tokens are read)
            self.dev.set_live(h.live)

    # -------------------------------------------------------------------- forks
    def _fork(self) -> None:
        """After the decode step that fed token ``t_k - 1``: every live row of a group at fork
        point ``t_k`` gets its ``f_k - 1`` further children in its reserved rows (positions,
        pending logits and token history copied; K/V not: they read the parent's segment)."""
        h = self.host
        if not self.tree.depth:
            return
        due = h.due_forks()
        if due and self.reads.unsynced():
            self.reads.sync()  # rows that stopped before the fork are not forked
            due = h.due_forks()
        if not due:
            return
        par, kid = h.fork(due)
        if len(kid):
            self.dev.fork(par, kid)
            self.dev.set_live(h.live)

    # ---------------------------------------------------------------- admission
    def _admit(self, items: list, slots: np.ndarray) -> np.ndarray:
        """Admit ``items`` into group slots ``slots``: preempted groups are readmitted
        (:meth:`_readmit`); each distinct new prompt is prefilled once into the prefix store
        of its group slot. Returns the new prompts' rows (their first samples, whose logits
        are pending)."""
        h = self.host
        fresh = [i for i, item in enumerate(items) if not isinstance(item, Preempted)]
        for i, item in enumerate(items):
            if isinstance(item, Preempted):
                self._readmit(item, int(slots[i]))
        first = self._admit_new([items[i] for i in fresh], slots[fresh]) if fresh else np.zeros(0, np.int64)
        self.dev.set_live(h.live)
        h.hg = max(h.hg, group_bucket(int(slots.max()) + 1, self.NG, self.G, self.exact))
        self.e.stats.admissions += 1
        return first

    def _admit_new(self, items: list, slots: np.ndarray) -> np.ndarray:
        """Prefill each distinct prompt of ``items`` once into the prefix store of its group
        slot (batched: :meth:`_pieces`, :meth:`_load_prompts`); the first rows get their first
        own blocks. Returns those rows (the slots' first samples, whose logits are pending)."""
        e, h = self.e, self.host
        prompts = []
        for item in items:
            if item.key in h.groups:
                raise ValueError(f"prompt key {item.key!r} is already being generated")
            prompts.append(e.check_prompt(item.key, item.prompt, self._params(item)))
        rows = h.slot_rows(slots)
        if self.own_prompts:  # (G = 1) the prompts' K/V goes into their rows' own blocks: taken first
            if not h.blocks.grow(rows, h.cover(np.asarray([len(p) for p in prompts]), h.sync_every)):  # pragma: no cover
                raise RuntimeError("admitted without free blocks")  # (fit_blocks checked them)
        for piece in self._pieces(prompts):
            cached = None
            if e.prefix_cache is not None:  # prompts extending a cached one: their new tokens only
                cached = [e.prefix_cache.lookup(prompts[i], e.version) for i in piece]
            self._load_prompts(piece, slots, prompts, rows, cached)
        return h.admit(items, prompts, slots, e.version)

    def _pieces(self, prompts: list[list[int]]) -> Iterator[list[int]]:
        """The admission's prompts (indices) in prefill pieces of about ``prefill_chunk_tokens``
        prompt tokens each (bounded temporary K/V), shortest first (little padding)."""
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        piece, tokens = [], 0
        for i in order:
            if piece and tokens + len(prompts[i]) > self.e.prefill_chunk_tokens:
                yield piece
                piece, tokens = [], 0
            piece.append(i)
            tokens += len(prompts[i])
        if piece:
            yield piece

    def _readmit(self, item: Preempted, slot: int) -> None:
        """Readmit a preempted group into group slot ``slot``: its rows' host state back,
        blocks for its live rows, its K/V recomputed from the prompt and the tokens fed so
        far; each live row's last sampled token is fed by the next decode step."""
        h = self.host
        live = h.readmit(item, slot)
        self._reload(np.asarray([slot]))
        self.dev.set_last(live, h.host_tok[live, h.steps[live] - 1])

    def _load_prompts(self, items: list[int], slots: np.ndarray, prompts: list[list[int]], rows: np.ndarray,
                      cached: list | None = None) -> None:
        """Prefill prompts ``items`` (indices into the admission; identical ones once, in one
        batched forward; ``cached``: their prefix-cache entries or None, see
        :class:`~treerl.rollout.prefill.Prefiller`), store them in the prefix cache, load
        them into their group slots and set their rows' pending logits."""
        e, G = self.e, self.G
        distinct: dict[tuple[int, ...], int] = {}
        src = [distinct.setdefault(tuple(prompts[i]), len(distinct)) for i in items]
        entries = [None] * len(distinct)
        for j, s in enumerate(src):
            entries[s] = None if cached is None else cached[j]
        seqs = [list(t) for t in distinct]
        prefilled = e.prefiller(seqs, entries, e.stats)
        if e.prefix_cache is not None:
            self._store_prompts(list(distinct), prefilled)
        part = np.concatenate([rows[i * G : (i + 1) * G] for i in items])
        logits = self._load(slots[items], seqs, src, [s for s in src for _ in range(G)],
                            [0 if self.own_prompts else len(prompts[i]) for i in items], prefilled)
        self.dev.set_logits(part, logits.repeat_interleave(G, dim=0))

    def _store_prompts(self, prompts: list[tuple[int, ...]], prefilled) -> None:
        """Keep the K/V (every layer, one copy per prompt) and last logits of the prompts
        just prefilled (rows of the prefill's cache) in the engine's prefix cache."""
        cache, _, logits = prefilled
        C, version = cache.length, self.e.version
        for j, p in enumerate(prompts):
            self.e.prefix_cache.insert(PrefixEntry(p, cache.all_keys[:, j, :, C - len(p) :].clone(),
                                                   cache.all_values[:, j, :, C - len(p) :].clone(),
                                                   logits[j].clone(), version))

    def _load(self, slots: np.ndarray, seqs: list[list[int]], group_src: list[int], row_src: list[int],
              plen: list[int], prefilled=None) -> torch.Tensor:
        """Prefill ``seqs`` (unless ``prefilled``) and load group slots ``slots`` (see
        :meth:`DeviceBatch.load <treerl.rollout.batch.DeviceBatch.load>`); the host gets the
        rows' tokens fed and the slots' prompt lengths. Returns the logits after each slot's
        group sequence ``[len(slots), V]``."""
        h = self.host
        if prefilled is None:
            prefilled = self.e.prefiller(seqs, None, self.e.stats)
        logits, fed = self.dev.load(prefilled, slots, [len(s) for s in seqs], group_src, row_src, plen, h.blocks)
        h.fed_h[h.slot_rows(slots)] = fed
        h.plen[slots] = plen
        return logits

    def _recompute(self, rows: np.ndarray) -> None:
        """After a weight update: rebuild the prompt K/V of the groups of ``rows``, their fork
        segments and the own K/V of their live rows (tokens fed so far)."""
        self._reload(np.unique(rows // self.G))
        self.e.stats.recomputes += 1

    def _reload(self, slots: np.ndarray) -> None:
        """Compute the K/V of group slots ``slots`` under the current weights from the host
        state: prompt store, fork segments and the own K/V of their live rows (tokens fed so
        far, into the blocks they own)."""
        h = self.host
        self._load(slots, *h.reload_plan(slots))
        h.row_version[h.slot_rows(slots)] = self.e.version

    # ------------------------------------------------------------------- decode
    def _compact(self) -> None:
        """Move live groups down into free group slots when they would fit a smaller bucket
        (synced first: no logged token may refer to a row that moves)."""
        if self.host.compaction_due() and self.reads.unsynced():
            self.reads.sync()
            if not self.host.live.any():
                return
        moved = self.host.compact()
        if moved is not None:
            self.dev.move(*moved)
            self.dev.set_live(self.host.live)

    def _decode(self) -> None:
        """Feed every live row its last sampled token; logits of rows ``[:hi]``."""
        e, h = self.e, self.host
        hg = h.hg = h.live_span()
        hi = hg * self.G
        version = e.version
        own_len = own_bucket(max(int(h.fed_h[:hi].max()) - self.tree.own_start, 0) + 1, self.dev.N, self.exact)
        pre_len = max(int(h.plen[:hg].max()), 1) if self.exact else self.P
        self.dev.decode(hg, own_len, pre_len)
        h.fed_h[h.live] += 1
        h.logit_version[h.live] = version
        e.stats.decode_steps += 1
        e.stats.decode_rows += hi
        e.stats.live_rows += int(h.live.sum())


def chunk_admission(batch: RunningBatch, items: list) -> list:
    """Chunked admission: the prefill before a decode step computes at most
    ``prefill_chunk_tokens`` new tokens (after prefix-cache hits; a preempted group: its
    prompt and tokens so far). The first item (the oldest waiting group) is always
    admitted, then the others that fit what is left, fewest new tokens first, so a short
    request passes long prompts that wait (a burst's, or a conversation's whole history);
    the others wait, in order, at the front of the deferred groups. Also when nothing is
    decoding: a burst of long prompts is prefilled a piece per decode step, so a short
    request that came with it starts decoding after the first piece, not after all.

    While rows decode, with captured prefills, the others join only while the prefill fits a
    bucket (:func:`_bucket_fit`): one that does not runs eagerly, ~30-60 ms on an H200 with every
    running row waiting (session 21). (With nothing decoding, a GRPO batch's prompts stay one.)"""
    if len(items) < 2:
        return items
    new = [_new_tokens(batch, item) for item in items]
    fits = _bucket_fit(batch, items, new)
    left, taken = batch.e.prefill_chunk_tokens - new[0], {0}
    for i in sorted(range(1, len(items)), key=lambda i: new[i]):  # (stable: in order among equals)
        if new[i] > left:
            break
        if fits is not None and not fits(taken | {i}):
            continue
        taken.add(i)
        left -= new[i]
    batch.host.deferred.extendleft(reversed([item for i, item in enumerate(items) if i not in taken]))
    return [item for i, item in enumerate(items) if i in taken]


def _bucket_fit(batch: RunningBatch, items: list, new: list[int]):
    """Whether a set of ``items`` (indices) prefills in one captured bucket (:func:`prefill_bucket`),
    or None where no bucket rule applies: no captured prefills, no row decoding, a preempted
    group among the items (its prefill also feeds its tokens), or a first item too large for
    any bucket (it runs eagerly whatever joins it)."""
    graphs = batch.e.prefill_graphs
    if graphs is None or not batch.host.live.any() or any(isinstance(item, Preempted) for item in items):
        return None
    lens = [len(item.prompt) for item in items]

    def fits(taken) -> bool:  # (nothing new at all: no forward, so it fits)
        w = [new[i] for i in taken]
        return max(w) == 0 or prefill_bucket(graphs, [lens[i] for i in taken], w) is not None

    return fits if fits({0}) else None


def _new_tokens(batch: RunningBatch, item) -> int:
    """Tokens admitting ``item`` prefills."""
    if isinstance(item, Preempted):  # (own prompts: the tokens fed count the prompt)
        return int(item.rows["fed_h"].max(initial=0)) + (0 if batch.own_prompts else len(item.prompt))
    cache, prompt = batch.e.prefix_cache, item.prompt
    prompt = prompt.tolist() if isinstance(prompt, (torch.Tensor, np.ndarray)) else prompt
    return len(prompt) - (cache.hit_tokens(prompt, batch.e.version) if cache is not None else 0)
