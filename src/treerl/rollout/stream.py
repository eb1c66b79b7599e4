"""Continuous batching: the rollout engine's one generation path.

:meth:`RolloutEngine.generate_stream <treerl.rollout.RolloutEngine.generate_stream>` (and
``generate``, which collects it) keeps a *running batch* of group slots of ``G`` rows each:
``G = params.n`` for plain groups, the complete tree ``params.max_leaves`` for tree rollouts
(rows laid out by :class:`~treerl.rollout.tree.TreeLayout`). Whenever every sample of a
group has finished (stop token, stop string or ``max_new_tokens``) the group is yielded and
its slot freed, and prompt groups waiting in the :class:`~treerl.rollout.prompts.PromptQueue`
are admitted into free slots: each prompt is prefilled once (deduplicated with the other
prompts admitted with it) and its K/V stored once, in the slot's prefix store, for all its
rows. No slot idles through the long tail of generation lengths while prompts are waiting.
The prompts of one admission are prefilled together, in batched forwards (pieces of about
``prefill_chunk_tokens`` prompt tokens); with the engine's prefix cache, a prompt that
extends a cached one joins the same forward with only its new tokens computed (its cached
K/V copied in: :meth:`RolloutEngine._prefill <treerl.rollout.RolloutEngine._prefill>`).

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

Host syncs: sampled tokens and logprobs are logged on the device and copied to the host
every ``sync_every`` steps (and when a row reaches ``max_new_tokens`` or a fork point, or
before a preemption), where stops are found exactly (tokens a row sampled after its stop are
discarded). Admissions need no sync (free slots and blocks are known on the host): a slot
freed at a sync is refilled right away, before the next decode step; the admitted rows'
first tokens are sampled from the prefill's logits, and they join the next decode step.
Block tables are copied to the device only when they changed (in place: captured graphs
stay valid), at most once per step and in the steady state about once per sync window.

Weights: ``update_weights`` from another thread takes effect between decode steps; groups
whose K/V was computed under older weights are recomputed (prompt + tokens fed so far)
before the next step; every token records the version of the weights whose logits it was
sampled from (admitted rows: the prefill's; others: the decode step's).

(One module over 500 lines: every method of :class:`RunningBatch` keeps the same host and
device row state consistent — admission, syncs, forks, recomputes, preemption, compaction,
decode — so it reads as one piece; the decode step, tree layout, block allocator, prompt
queue and cache live apart.)
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterator

import numpy as np
import torch

from .params import SamplingParams
from .paging import BlockTable, block_size_for
from .prefix_cache import PrefixEntry
from .prompts import PromptQueue
from .sampling import sample
from .shared import SharedPrefixCache
from .step import BatchStep
from .stops import StopChecker
from .tree import TreeLayout
from .types import Completion, Group, round_up

__all__ = ["PromptQueue", "RunningBatch", "group_slots"]

# host state per row: what a row carries through forks, compaction and preemption
_ROW_STATE = ("live", "steps", "checked", "fed_h", "row_version", "logit_version", "host_tok", "host_lp", "host_ver")


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


def group_slots(tree: TreeLayout, prefix_capacity: int, budget: int, block_size: int) -> int:
    """Group slots a K/V ``budget`` (token slots) affords, overcommitted: each slot's shared
    levels (prompt store, fork segments) and one own block (``block_size`` slots, see
    :func:`~treerl.rollout.paging.block_size_for`) per row; at least one."""
    block = block_size_for(tree.own_capacity, block_size)
    return max(1, budget // (tree.shared_tokens(prefix_capacity) + tree.rows * block))


@dataclass
class _GroupState:
    prompt_ids: torch.Tensor
    completions: list = field(default_factory=list)


@dataclass
class _Preempted:
    """A group taken out of the batch (its own blocks ran out), waiting to be readmitted:
    its prompt, when it was first admitted (``arrival``), forks applied (``level``), and
    its ``G`` rows' host state (``rows``: :data:`_ROW_STATE` arrays, ``keys``)."""

    key: Hashable
    prompt: list[int]
    arrival: int
    level: int
    rows: dict[str, np.ndarray]
    keys: list


class RunningBatch:
    """State of one ``generate_stream`` call (see the module docstring). Not thread-safe:
    it runs in the consumer's thread; only ``engine.update_weights`` comes from others.

    ``groups`` group slots of ``G = params.max_leaves`` rows; ``prefix_capacity`` prompt
    slots per group; ``budget``: K/V token slots the batch may hold (shared levels of every
    group slot + the own-block pool; over it only when a single group needs more: it then
    runs alone)."""

    def __init__(self, engine, queue: PromptQueue, params: SamplingParams, generator: torch.Generator,
                 groups: int, prefix_capacity: int, budget: int):
        self.e, self.q, self.p, self.gen = engine, queue, params, generator
        self.tree = TreeLayout.of(params)
        self.G, self.max_new = self.tree.rows, params.max_new_tokens
        self.budget = budget
        self.block = block_size_for(self.tree.own_capacity, engine.kv_block_size)  # own slots per block
        self.max_blocks = -(-self.tree.own_capacity // self.block)  # own blocks per row at most
        self.N = self.max_blocks * self.block  # own slots per row
        self.exact = not engine.static_kv  # rows computed per step: exactly the live span
        self.stopper = StopChecker(params.stop_token_ids, params.stop_strings, params.decoder())
        self.dtype = next(engine.model.parameters()).dtype
        self.neg = torch.finfo(self.dtype).min
        self.zero = torch.zeros((), dtype=self.dtype, device=engine.device)
        self.hide = torch.full((), self.neg, dtype=self.dtype, device=engine.device)
        self.groups: dict[Hashable, _GroupState] = {}  # admitted groups (preempted ones too) by key
        # taken from the queue, not admitted yet: prompts (key, prompt) and preempted groups first
        self.deferred: deque = deque()
        self.arrivals = 0  # groups admitted so far (preemption takes the latest first)
        self.out: list[Group] = []
        self.log_rows: list[tuple[np.ndarray, np.ndarray]] = []
        self._allocate(groups, prefix_capacity)

    _DEVICE_STATE = ("cache", "prefix_mask", "own_mask", "table", "fill", "fed", "pos", "live_d", "last", "logits",
                     "log_tok", "log_lp", "fork_mask", "fork_node", "fork_slot", "steps_cache", "graph_pool")

    def _arena_key(self, groups: int, prefix_capacity: int, num_blocks: int) -> tuple:
        e = self.e
        return (groups, self.tree, prefix_capacity, num_blocks, self.block, e.sync_every, self.dtype, e.logit_dtype,
                e.vocab_size)

    def arena(self) -> tuple:
        """The device state (buffers, cache, captured decode steps) for reuse by the
        engine's next stream of the same shapes (``RolloutEngine(keep_stream_buffers=True)``)."""
        state = {k: getattr(self, k) for k in self._DEVICE_STATE}
        return self._arena_key(self.NG, self.P, self.blocks.num_blocks), state

    def _pool_blocks(self, groups: int, prefix_capacity: int) -> int:
        """Own blocks of the pool: what the budget leaves after the shared levels, at most
        what every row could fill, at least one group's worst case (a group alone fits)."""
        worst = self.G * self.max_blocks
        left = (self.budget - groups * self.tree.shared_tokens(prefix_capacity)) // self.block
        return max(worst, min(groups * worst, left))

    def _allocate(self, groups: int, prefix_capacity: int) -> None:
        """(Re)build the batch's state for ``groups`` group slots (nothing may be live).
        Device buffers (and CUDA graphs) kept by the engine from an earlier stream of the
        same shapes are reused."""
        e, dev, G, tree = self.e, self.e.device, self.G, self.tree
        S = groups * G
        self.NG, self.S, self.P = groups, S, prefix_capacity
        num_blocks = self._pool_blocks(groups, prefix_capacity)
        kept = getattr(e, "_stream_arena", None)
        e._stream_arena = None
        if kept is not None and kept[0] == self._arena_key(groups, prefix_capacity, num_blocks):
            for k, v in kept[1].items():
                setattr(self, k, v)
            for mask in [self.prefix_mask, self.own_mask] + self.fork_mask:
                mask.fill_(self.neg)
            for t in (self.fill, self.fed, self.pos, self.live_d, self.last):
                t.zero_()
            self.table.fill_(num_blocks)
        else:
            del kept
            self.cache = None  # SharedPrefixCache, allocated at the first load (shapes from the prefill)
            self.steps_cache: dict[tuple[int, int], BatchStep] = {}
            self.graph_pool = None  # the CUDA graphs' memory pool (graphs.capture_decode_step)
            self.prefix_mask = torch.full((groups, prefix_capacity), self.neg, dtype=self.dtype, device=dev)
            self.own_mask = torch.full((S, self.N), self.neg, dtype=self.dtype, device=dev)
            # each row's own blocks (the trash block past them); updated in place from ``self.blocks``
            self.table = torch.full((S, self.max_blocks), num_blocks, dtype=torch.int64, device=dev)
            self.fill = torch.zeros(S, dtype=torch.int64, device=dev)  # next own slot of each row
            # completion tokens fed (K/V written) per row; plain groups: the own slot, one tensor
            self.fed = torch.zeros(S, dtype=torch.int64, device=dev) if tree.depth else self.fill
            self.pos = torch.zeros(S, dtype=torch.int64, device=dev)  # next position id
            self.live_d = torch.zeros(S, dtype=torch.int64, device=dev)
            self.last = torch.zeros(S, dtype=torch.int64, device=dev)  # last sampled token (fed next)
            self.logits = torch.zeros(S, e.vocab_size, dtype=e.logit_dtype, device=dev)
            K = e.sync_every + 2  # a sync window logs <= sync_every + 1 sample calls
            self.log_tok = torch.zeros(K, S, dtype=torch.int64, device=dev)
            self.log_lp = torch.zeros(K, S, dtype=e.logit_dtype, device=dev)
            # fork levels: segment masks [groups x c_k, cap_k]; each row's node and write slot per level
            self.fork_mask = [torch.full((groups * tree.nodes(k), tree.segment_capacity(k)), self.neg,
                                         dtype=self.dtype, device=dev) for k in range(tree.depth)]
            self.fork_node = [torch.arange(S, device=dev) // tree.rows_per_node(k) for k in range(tree.depth)]
            self.fork_slot = [torch.zeros(S, dtype=torch.int64, device=dev) for _ in range(tree.depth)]
        self.blocks = BlockTable(S, self.max_blocks, num_blocks, self.block)
        self.blocks.dirty = False  # the device table is all trash already
        # host state per row
        self.live = np.zeros(S, dtype=bool)
        self.steps = np.zeros(S, dtype=np.int64)  # tokens sampled
        self.checked = np.zeros(S, dtype=np.int64)  # tokens synced and checked for stops
        self.fed_h = np.zeros(S, dtype=np.int64)  # tokens fed (host copy of ``fed``)
        self.row_version = np.zeros(S, dtype=np.int64)  # weights of the row's KV
        self.logit_version = np.zeros(S, dtype=np.int64)  # weights of the row's pending logits
        self.host_tok = np.zeros((S, self.max_new), dtype=np.int64)
        self.host_lp = np.zeros((S, self.max_new), dtype=np.float64)
        self.host_ver = np.zeros((S, self.max_new), dtype=np.int64)
        self.key: list[Hashable | None] = [None] * S
        # host state per group slot
        self.gkey: list[Hashable | None] = [None] * groups
        self.plen = np.zeros(groups, dtype=np.int64)
        self.level = np.zeros(groups, dtype=np.int64)  # forks applied
        self.arrival = np.zeros(groups, dtype=np.int64)  # admission order of the slot's group
        self._count_slots()
        self.hg = 0  # group slots computed by the last decode / covered by the pending logits

    @property
    def hi(self) -> int:
        return self.hg * self.G

    def _count_slots(self) -> None:
        stats = self.e.stats
        stats.kv_slots = max(stats.kv_slots, self._tokens_needed(self.NG, self.P))

    def _tokens_needed(self, groups: int, prefix_capacity: int) -> int:
        """K/V token slots held with ``groups`` group slots of ``prefix_capacity`` prompt
        slots and this batch's block pool."""
        return groups * self.tree.shared_tokens(prefix_capacity) + self.blocks.num_blocks * self.block

    # ---------------------------------------------------------------- the loop
    def run(self) -> Iterator[Group]:
        e, q = self.e, self.q
        waited = None  # when the batch became idle (for idle_timeout)
        while True:
            if self.log_rows and (len(self.log_rows) >= e.sync_every or (self.steps[self.live] >= self.max_new).any()):
                self._sync()
            yield from self._flush()
            free = [g for g in range(self.NG) if self.gkey[g] is None]
            if free and self._room():  # admit waiting prompts into free group slots
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
                            if len(rows):
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
                    self._ensure_blocks()  # may sync, finish rows and preempt groups
                if self.live.any():
                    self._decode()
                    self._fork()
                    self._sample(np.flatnonzero(self.live), prefix=True)

    def _flush(self) -> Iterator[Group]:
        out, self.out = self.out, []
        yield from out

    def _take(self, n: int, timeout: float) -> list:
        """Up to ``n`` waiting groups: deferred ones (preempted, then prompts) first, then
        prompts from the queue."""
        items = [self.deferred.popleft() for _ in range(min(n, len(self.deferred)))]
        if len(items) < n and not self.deferred:
            items += self.q.take(n - len(items), 0.0 if items else timeout)
        return items

    def _fit(self, items: list) -> list:
        """Admission by capacity: the groups of ``items`` (in order) that fit the prefix
        store and the free blocks now. A longer prompt grows the prefix store in place while
        the budget allows; otherwise it waits (with every item after it, in order) until
        the batch has drained, and the batch is then rebuilt with fewer, larger group slots.
        Never over budget unless a single group needs more (then it runs alone)."""
        longest = 0
        for i, item in enumerate(items):
            need = round_up(self._prompt_len(item))
            if need <= self.P:
                continue
            if self._tokens_needed(self.NG, need) <= self.budget:
                longest = max(longest, need)
                continue
            if self.live.any():
                self.deferred.extendleft(reversed(items[i:]))
                items = items[:i]
                break
            capacity = self._capacity_for(need, 1, self.G * self.max_blocks * self.block)  # a group alone fits
            groups = min(self.NG, group_slots(self.tree, capacity, self.budget, self.e.kv_block_size))
            self._allocate(groups, capacity)
            self.e.stats.reallocations += 1
            self.deferred.extendleft(reversed(items[groups:]))
            return self._fit(items[:groups])
        if longest > self.P:
            self._grow_prefix(self._capacity_for(longest, self.NG, self._tokens_needed(0, 0)))
        return self._fit_blocks(items)

    def _capacity_for(self, need: int, groups: int, pool: int) -> int:
        """Prompt slots per group to grow to for a prompt of ``need`` slots: twice the present
        capacity where ``groups`` group slots of it beside ``pool`` own-block slots fit the
        budget, else as many as fit, and at least ``need``. Geometric, so that a conversation
        growing turn by turn costs few growths (each drops the captured decode steps) and few
        reallocations (each waits for the batch to drain)."""
        most = ((self.budget - pool) // groups - self.tree.shared_tokens(0)) // 16 * 16
        return max(need, min(2 * self.P, most))

    def _prompt_len(self, item) -> int:
        if isinstance(item, _Preempted):
            return len(item.prompt)
        key, prompt = item
        return len(self.e._check_prompt(key, prompt, self.p))

    # ------------------------------------------------------------------ blocks
    def _cover(self, fed: np.ndarray, steps: int) -> np.ndarray:
        """Own slots that rows having fed ``fed`` tokens write within ``steps`` decode steps
        (the slots to own blocks for)."""
        return np.clip(fed + steps - self.tree.own_start, 0, self.N)

    def _blocks_needed(self, item) -> int:
        """Blocks a waiting group (``item``; None: a new prompt) takes at admission: its live
        rows' writes for the next ``sync_every`` steps (a preempted group: past ones too)."""
        W = self.e.sync_every
        if isinstance(item, _Preempted):
            live = item.rows["live"]
            return int(self.blocks.blocks_for(self._cover(item.rows["fed_h"][live], W)).sum())
        return self.tree.n * int(self.blocks.blocks_for(self._cover(np.zeros(1, np.int64), W))[0])

    def _reserve(self) -> int:
        """Blocks the live rows still need for their writes of the next ``sync_every`` steps."""
        rows = np.flatnonzero(self.live)
        return int(self.blocks.missing(rows, self._cover(self.fed_h[rows], self.e.sync_every)).sum())

    def _room(self) -> bool:
        """Whether the first waiting group would get its blocks now (checked before taking
        prompts, so a full pool costs no prompt checks per step)."""
        first = self.deferred[0] if self.deferred else None
        return self._blocks_needed(first) + self._reserve() <= self.blocks.free

    def _fit_blocks(self, items: list) -> list:
        """Admission by free blocks: the leading ``items`` whose blocks (:meth:`_blocks_needed`)
        are free beyond what the live rows need for the next sync window; the rest wait,
        in order, at the front of the deferred groups."""
        free = self.blocks.free - self._reserve()
        for i, item in enumerate(items):
            need = self._blocks_needed(item)
            if need > free:
                self.deferred.extendleft(reversed(items[i:]))
                return items[:i]
            free -= need
        return items

    def _ensure_blocks(self) -> None:
        """Before a decode step: every live row owns the blocks its writes reach until the
        next sync (at least this step's: else the batch syncs and preempts groups, see
        :meth:`_make_room`); the device table is updated if it changed."""
        rows = np.flatnonzero(self.live)
        ahead = max(1, self.e.sync_every - len(self.log_rows))
        if not self.blocks.grow(rows, self._cover(self.fed_h[rows], ahead)):
            if not self.blocks.grow(rows, self._cover(self.fed_h[rows], 1)):
                self._make_room()
        self.blocks.upload(self.table)

    def _make_room(self) -> None:
        """The pool cannot give every live row this step's block: sync (rows that finished
        free theirs; a preempted group's samples must be on the host), then preempt whole
        groups, latest-admitted first, until it can."""
        if self.log_rows:
            self._sync()
        while True:
            rows = np.flatnonzero(self.live)
            if self.blocks.grow(rows, self._cover(self.fed_h[rows], 1)):
                break
            used = [g for g in range(self.NG) if self.gkey[g] is not None]
            if len(used) < 2:  # pragma: no cover - the pool holds one group's worst case
                raise RuntimeError(f"the own-block pool ({self.blocks.num_blocks} blocks) does not hold one group")
            self._preempt(max(used, key=lambda g: self.arrival[g]))
        self.live_d.copy_(torch.from_numpy(self.live.astype(np.int64)))

    def _preempt(self, g: int) -> None:
        """Take group slot ``g``'s group out of the batch (synced: no logged samples): its
        blocks and slot are freed, its host state goes to the front of the deferred groups."""
        G, key = self.G, self.gkey[g]
        rows = np.arange(g * G, (g + 1) * G)
        self.deferred.appendleft(_Preempted(
            key, self.groups[key].prompt_ids.tolist(), int(self.arrival[g]), int(self.level[g]),
            {name: getattr(self, name)[rows].copy() for name in _ROW_STATE}, [self.key[r] for r in rows]))
        self.blocks.release(rows)
        self.live[rows] = False
        for r in rows:
            self.key[r] = None
        self.gkey[g] = None
        self.e.stats.preemptions += 1

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
        slot, p = divmod(int(r), self.G)
        g.completions.append(Completion(
            prompt_index=key,
            prompt_ids=g.prompt_ids,
            completion_ids=torch.from_numpy(self.host_tok[r, :length].copy()),
            logprobs=torch.from_numpy(self.host_lp[r, :length].copy()).to(self.e.logit_dtype),
            versions=torch.from_numpy(self.host_ver[r, :length].copy()),
            finish_reason=reason,
            stop=stop,
            branch=self.tree.branch(p, self.tree.depth_of(length)),
        ))
        self.e.stats.generated_tokens += length
        self.live[r] = False
        self.key[r] = None
        self.blocks.release([r])
        if not self.live[slot * self.G : (slot + 1) * self.G].any():  # the group's slot is free
            del self.groups[key]
            self.gkey[slot] = None
            g.completions.sort(key=lambda c: c.branch)
            self.out.append(Group(key, g.prompt_ids, g.completions))

    # -------------------------------------------------------------------- forks
    def _due_forks(self) -> list[int]:
        """Group slots whose live rows have sampled exactly their next fork point's tokens."""
        tree, G, due = self.tree, self.G, []
        for g in range(self.NG):
            if self.gkey[g] is None or self.level[g] >= tree.depth:
                continue
            live = np.flatnonzero(self.live[g * G : (g + 1) * G])
            if len(live) and self.steps[g * G + live[0]] == tree.points[self.level[g]]:
                due.append(g)
        return due

    def _fork(self) -> None:
        """After the decode step that fed token ``t_k - 1``: every live row of a group at fork
        point ``t_k`` gets its ``f_k - 1`` further children in its reserved rows (positions,
        pending logits and token history copied; K/V not: they read the parent's segment)."""
        if not self.tree.depth:
            return
        due = self._due_forks()
        if due and self.log_rows:
            self._sync()  # rows that stopped before the fork are not forked
            due = self._due_forks()
        if not due:
            return
        G, tree = self.G, self.tree
        parents, kids = [], []
        for g in due:
            k = int(self.level[g]) + 1
            for r in np.flatnonzero(self.live[g * G : (g + 1) * G]) + g * G:
                for c in tree.children(int(r - g * G), k):
                    parents.append(r)
                    kids.append(g * G + c)
            self.level[g] = k
        if not kids:
            return
        par, kid = np.asarray(parents), np.asarray(kids)
        for name in _ROW_STATE:  # (the children own no blocks: they take their own as they write)
            a = getattr(self, name)
            a[kid] = a[par]
        for c, p in zip(kid, par):
            self.key[c] = self.key[p]
        self.live[kid] = True
        dev = self.e.device
        par_t, kid_t = torch.as_tensor(par, device=dev), torch.as_tensor(kid, device=dev)
        for t in (self.fed, self.pos, self.logits):
            t[kid_t] = t[par_t]
        self.live_d.copy_(torch.from_numpy(self.live.astype(np.int64)))
        self.e.stats.forks += len(kid)

    # ---------------------------------------------------------------- admission
    def _admit(self, items: list, slots: np.ndarray) -> np.ndarray:
        """Admit ``items`` into group slots ``slots``: preempted groups are readmitted
        (:meth:`_readmit`); each distinct new prompt is prefilled once into the prefix store
        of its group slot. Returns the new prompts' rows (their first samples, whose logits
        are pending)."""
        fresh = [i for i, item in enumerate(items) if not isinstance(item, _Preempted)]
        for i, item in enumerate(items):
            if isinstance(item, _Preempted):
                self._readmit(item, int(slots[i]))
        first = self._admit_new([items[i] for i in fresh], slots[fresh]) if fresh else np.zeros(0, np.int64)
        self.live_d.copy_(torch.from_numpy(self.live.astype(np.int64)))
        self.hg = max(self.hg, _group_bucket(int(slots.max()) + 1, self.NG, self.G, self.exact))
        self.e.stats.admissions += 1
        return first

    def _admit_new(self, items: list, slots: np.ndarray) -> np.ndarray:
        """Prefill each distinct prompt of ``items`` once into the prefix store of its group
        slot (batched: :meth:`_pieces`, :meth:`_load_prompts`); the first rows get their first
        own blocks. Returns those rows (the slots' first samples, whose logits are pending)."""
        e, G = self.e, self.G
        prompts = []
        for key, prompt in items:
            if key in self.groups:
                raise ValueError(f"prompt key {key!r} is already being generated")
            prompts.append(e._check_prompt(key, prompt, self.p))
        rows = (slots[:, None] * G + np.arange(G)).reshape(-1)
        first = (slots[:, None] * G + np.asarray(self.tree.first_rows())).reshape(-1)
        for piece in self._pieces(prompts):
            cached = None
            if e.prefix_cache is not None:  # prompts extending a cached one: their new tokens only
                cached = [e.prefix_cache.lookup(prompts[i], e.version) for i in piece]
            self._load_prompts(piece, slots, prompts, rows, cached)
        version = e.version
        for i, (key, _) in enumerate(items):
            self.groups[key] = _GroupState(torch.tensor(prompts[i], dtype=torch.int64))
            self.gkey[slots[i]] = key
            self.arrival[slots[i]] = self.arrivals
            self.arrivals += 1
            for r in rows[i * G : (i + 1) * G]:
                self.key[r] = key
        self.level[slots] = 0
        self.live[first] = True
        self.steps[first] = 0
        self.checked[first] = 0
        self.row_version[rows] = version
        self.logit_version[rows] = version
        if not self.blocks.grow(first, self._cover(self.fed_h[first], self.e.sync_every)):  # pragma: no cover
            raise RuntimeError("admitted without free blocks")  # (_fit_blocks checked them)
        e.stats.admitted += len(items)
        return first

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

    def _readmit(self, item: _Preempted, slot: int) -> None:
        """Readmit a preempted group into group slot ``slot``: its rows' host state back,
        blocks for its live rows, its K/V recomputed from the prompt and the tokens fed so
        far; each live row's last sampled token is fed by the next decode step."""
        G = self.G
        rows = np.arange(slot * G, (slot + 1) * G)
        for name in _ROW_STATE:
            getattr(self, name)[rows] = item.rows[name]
        for r, key in zip(rows, item.keys):
            self.key[r] = key
        self.gkey[slot] = item.key
        self.level[slot] = item.level
        self.arrival[slot] = item.arrival
        live = rows[self.live[rows]]
        if not self.blocks.grow(live, self._cover(self.fed_h[live], self.e.sync_every)):  # pragma: no cover
            raise RuntimeError("readmitted without free blocks")  # (_fit_blocks checked them)
        self._reload(np.asarray([slot]))
        last = self.host_tok[live, self.steps[live] - 1]
        self.last[torch.as_tensor(live, device=self.e.device)] = torch.as_tensor(last, device=self.e.device)

    def _load_prompts(self, items: list[int], slots: np.ndarray, prompts: list[list[int]], rows: np.ndarray,
                      cached: list | None = None) -> None:
        """Prefill prompts ``items`` (indices into the admission; identical ones once, in one
        batched forward; ``cached``: their prefix-cache entries or None, see
        :meth:`RolloutEngine._prefill <treerl.rollout.RolloutEngine._prefill>`), store them
        in the prefix cache, load them into their group slots and set their rows' pending logits."""
        e, G = self.e, self.G
        distinct: dict[tuple[int, ...], int] = {}
        src = [distinct.setdefault(tuple(prompts[i]), len(distinct)) for i in items]
        entries = [None] * len(distinct)
        for j, s in enumerate(src):
            entries[s] = None if cached is None else cached[j]
        prefilled = e._prefill([list(t) for t in distinct], entries)
        if e.prefix_cache is not None:
            self._store_prompts(list(distinct), prefilled)
        part = np.concatenate([rows[i * G : (i + 1) * G] for i in items])
        logits = self._load(slots[items], [list(t) for t in distinct], src, [s for s in src for _ in range(G)],
                            [len(prompts[i]) for i in items], prefilled)
        self.logits[torch.as_tensor(part, device=e.device)] = logits.repeat_interleave(G, dim=0)

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
        """Prefill ``seqs`` (each a prompt followed by tokens a row fed) and load group slots
        ``slots``: slot ``slots[i]`` gets the prompt (the first ``plen[i]`` tokens) of
        ``seqs[group_src[i]]``; the ``j``-th row of the slots (``len(slots) x G`` in order)
        continues ``seqs[row_src[j]]`` (-1: a row not live, nothing of its own); each fork
        segment gets its tokens from the first live row below it. Sets stores, masks and the
        rows' ``fed``/``pos``/``fill``. Returns the logits after each slot's group sequence
        ``[len(slots), V]``. ``prefilled``: ``(cache, lengths, logits)`` of ``seqs`` already
        computed (a prefix-cache hit), instead of a prefill."""
        e, dev, G, tree = self.e, self.e.device, self.G, self.tree
        if prefilled is None:
            tmp, _, logits = e._prefill(seqs)
        else:
            tmp, _, logits = prefilled
        if self.cache is None:
            k, v = tmp.layers[0].keys, tmp.layers[0].values
            forks = [(tree.nodes(j), tree.segment_capacity(j), tree.rows_per_node(j)) for j in range(tree.depth)]
            self.cache = SharedPrefixCache(e.num_layers, self.NG, G, self.P, self.table, self.blocks.num_blocks,
                                           self.block, k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device, forks)
        t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int64), device=dev)  # noqa: E731
        pad = tmp.length - np.asarray([len(s) for s in seqs])  # slot of each sequence's first token
        lens = np.asarray([len(s) for s in seqs])
        plen_a = np.asarray(plen, dtype=np.int64)
        rows = (slots[:, None] * G + np.arange(G)).reshape(-1)
        src = np.asarray(row_src, dtype=np.int64)
        row_plen = np.repeat(plen_a, G)
        fed = np.where(src >= 0, lens[np.maximum(src, 0)] - row_plen, 0)
        # the prompts
        gsrc = np.asarray(group_src)
        self.cache.load(tmp, "prefix", t(slots), t(gsrc), t(pad[gsrc]), int(plen_a.max()))
        slot = torch.arange(self.P, device=dev)
        self.prefix_mask[t(slots)] = torch.where(slot[None, :] < t(plen_a)[:, None], self.zero, self.hide)
        # fork segments: node j of level k (slot i) from the first live row below it
        for k in range(tree.depth):
            c, r, t0, t1 = tree.nodes(k), tree.rows_per_node(k), tree.start(k), tree.end(k)
            nodes = (slots[:, None] * c + np.arange(c)).reshape(-1)
            filled = np.zeros(len(nodes), dtype=np.int64)
            copy = []  # (node index into nodes, row index into rows)
            for n in range(len(nodes)):
                below = np.flatnonzero(src[n * r : (n + 1) * r] >= 0)
                if len(below):
                    j = n * r + below[0]
                    filled[n] = min(max(fed[j] - t0, 0), t1 - t0)
                    if filled[n]:
                        copy.append((n, j))
            if copy:
                ni, ri = np.asarray(copy).T
                self.cache.load(tmp, k, t(nodes[ni]), t(src[ri]), t(pad[src[ri]] + row_plen[ri] + t0),
                                int(filled[ni].max()))
            slot = torch.arange(tree.segment_capacity(k), device=dev)
            self.fork_mask[k][t(nodes)] = torch.where(slot[None, :] < t(filled)[:, None], self.zero, self.hide)
        # each row's own tokens, into its blocks
        own = np.maximum(fed - tree.own_start, 0)
        mine = np.flatnonzero(own > 0)
        assert (self.blocks.missing(rows, own) == 0).all(), "rows load own K/V into blocks they do not own"
        self.blocks.upload(self.table)
        if len(mine):
            self.cache.load(tmp, "own", t(rows[mine]), t(src[mine]),
                            t(pad[src[mine]] + row_plen[mine] + tree.own_start), int(own.max()))
        slot = torch.arange(self.N, device=dev)
        rows_t = t(rows)
        self.own_mask[rows_t] = torch.where(slot[None, :] < t(own)[:, None], self.zero, self.hide)
        self.fill[rows_t] = t(own)
        self.fed[rows_t] = t(fed)
        self.pos[rows_t] = t(row_plen + fed)
        self.fed_h[rows] = fed
        self.plen[slots] = plen_a
        return logits[t(gsrc)]

    def _recompute(self, rows: np.ndarray) -> None:
        """After a weight update: rebuild the prompt K/V of the groups of ``rows``, their fork
        segments and the own K/V of their live rows (tokens fed so far)."""
        self._reload(np.unique(rows // self.G))
        self.e.stats.recomputes += 1

    def _reload(self, slots: np.ndarray) -> None:
        """Compute the K/V of group slots ``slots`` under the current weights from the host
        state: prompt store, fork segments and the own K/V of their live rows (tokens fed so
        far, into the blocks they own)."""
        G = self.G
        distinct: dict[tuple[int, ...], int] = {}
        row_src, group_src, plen = [], [], []
        for g in slots:
            prompt = self.groups[self.gkey[g]].prompt_ids.tolist()
            plen.append(len(prompt))
            first = None
            for r in range(g * G, (g + 1) * G):
                if not self.live[r]:
                    row_src.append(-1)
                    continue
                seq = prompt + self.host_tok[r, : self.steps[r] - 1].tolist()
                s = distinct.setdefault(tuple(seq), len(distinct))
                first = s if first is None else first
                row_src.append(s)
            group_src.append(first)
        self._load(slots, [list(t) for t in distinct], group_src, row_src, plen)
        self.row_version[(slots[:, None] * G + np.arange(G)).reshape(-1)] = self.e.version

    def _grow_prefix(self, capacity: int) -> None:
        extra = torch.full((self.NG, capacity - self.P), self.neg, dtype=self.dtype, device=self.e.device)
        self.prefix_mask = torch.cat([self.prefix_mask, extra], dim=1)
        if self.cache is not None:
            self.cache.grow_prefix(capacity)
        self.P = capacity
        self.e.stats.prefix_grows += 1
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
        self.cache.move_groups(d_t, s_t)  # (and the device block table's rows)
        self.prefix_mask[d_t] = self.prefix_mask[s_t]
        for k, mask in enumerate(self.fork_mask):
            c = self.tree.nodes(k)
            nd = torch.as_tensor((dst[:, None] * c + np.arange(c)).reshape(-1), device=dev)
            ns = torch.as_tensor((src[:, None] * c + np.arange(c)).reshape(-1), device=dev)
            mask[nd] = mask[ns]
        rsrc = (src[:, None] * G + np.arange(G)).reshape(-1)
        rdst = (dst[:, None] * G + np.arange(G)).reshape(-1)
        rs_t, rd_t = torch.as_tensor(rsrc, device=dev), torch.as_tensor(rdst, device=dev)
        for t in {id(t): t for t in (self.own_mask, self.fill, self.fed, self.pos, self.last, self.logits)}.values():
            t[rd_t] = t[rs_t]
        for name in _ROW_STATE:
            a = getattr(self, name)
            a[rdst] = a[rsrc]
        self.blocks.move(rdst, rsrc)
        for d, s in zip(rdst, rsrc):
            self.key[d], self.key[s] = self.key[s], None
        self.live[rsrc] = False
        self.plen[dst] = self.plen[src]
        self.level[dst] = self.level[src]
        self.arrival[dst] = self.arrival[src]
        for d, s in zip(dst, src):
            self.gkey[d], self.gkey[s] = self.gkey[s], None
        self.live_d.copy_(torch.from_numpy(self.live.astype(np.int64)))
        self.hg = target

    # ------------------------------------------------------------------- decode
    def _write_slots(self, hi: int) -> None:
        """Tree rollouts, before a step: where each row of ``[:hi]`` writes its new K/V (own
        slot, or its node's segment slot at a fork level; non-writers: the trash slot) and
        the slots revealed, from ``fed`` (device tensors only: no host values)."""
        tree = self.tree
        fed, live = self.fed[:hi], self.live_d[:hi].bool()
        at_own = live & (fed >= tree.own_start)
        torch.clamp(fed - tree.own_start, min=0, out=self.fill[:hi])
        self.own_mask[:hi].scatter_(1, self.fill[:hi, None], torch.where(at_own, self.zero, self.hide)[:, None])
        for k in range(tree.depth):
            writer = live & (fed >= tree.start(k)) & (fed < tree.end(k))
            self.fork_slot[k][:hi] = torch.where(writer, fed - tree.start(k), tree.trash(k))
            self.fork_mask[k].index_put_((self.fork_node[k][:hi], self.fork_slot[k][:hi]),
                                         torch.where(writer, self.zero, self.hide))

    def _decode(self) -> None:
        """Feed every live row its last sampled token; logits of rows ``[:hi]``."""
        e, G = self.e, self.G
        used = [g for g in range(self.NG) if self.gkey[g] is not None]
        hg = self.hg = _group_bucket(max(used) + 1, self.NG, G, self.exact)
        hi = hg * G
        version = e.version
        if self.tree.depth:
            self._write_slots(hi)
        else:
            self.own_mask[:hi].scatter_(1, self.fill[:hi, None], 0.0)
        own_len = _own_bucket(max(int(self.fed_h[:hi].max()) - self.tree.own_start, 0) + 1, self.N, self.exact)
        pre_len = int(self.plen[:hg].max()) if self.exact else self.P
        step = self.steps_cache.get((hg, own_len))
        if step is None or step.cache is not self.cache:
            step = self.steps_cache[(hg, own_len)] = BatchStep(e, self, hg, own_len, pre_len)
            e.stats.step_builds += 1
        elif self.exact:
            step.prefix_mask = self.prefix_mask[:hg, None, None, :pre_len]
        step()  # writes the logits of rows [:hi] into self.logits
        self.fed += self.live_d  # plain groups: ``fed`` is ``fill``
        self.pos += self.live_d
        self.fed_h[self.live] += 1
        self.logit_version[self.live] = version
        e.stats.decode_steps += 1
        e.stats.decode_rows += hi
        e.stats.live_rows += int(self.live.sum())
