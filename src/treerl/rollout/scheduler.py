"""The running batch's host side: which group holds which slot, what each row has sampled,
which blocks each row owns, admission, preemption, forks, stops and compaction plans.

:class:`Scheduler` holds no device tensor and calls no model: the running batch
(:class:`~treerl.rollout.stream.RunningBatch`) asks it what to do and applies the device side
(:class:`~treerl.rollout.batch.DeviceBatch`). Testable alone (``tests/rollout/test_rollout_scheduler.py``).

Rows: ``groups`` group slots of ``G = tree.rows`` rows (:class:`~treerl.rollout.forks.ForkLayout`).
Per row (:data:`ROW_STATE`): live, ending (sampled its last token, not yet on the host:
it decodes no more and finishes when its tokens arrive), tokens sampled (``steps``),
tokens on the host (``recorded``), tokens checked for stops,
tokens fed (``fed_h``: the host copy of the device's ``fed``), the weight versions of its
K/V and of its pending logits, and its sampled tokens, logprobs and versions. Per group
slot: the group's key, prompt length, forks applied (``level``), admission order
(``arrival``) and sampling settings (temperature, top-p, top-k, min-p, ``max_new``, seed:
a group's own :class:`~treerl.rollout.params.SamplingParams`, or the stream's). Own K/V
blocks: a :class:`~treerl.rollout.paging.BlockTable`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np
import torch

from .kept_contexts import note as note_finished
from .paging import BlockTable
from .params import SamplingParams
from .prompts import Waiting
from .requests import RowSampling, abort, emit, plan_sampling, row_completion
from .stops import StopChecker
from .forks import ForkLayout
from .types import Group, RolloutStats

# host state per row: what a row carries through forks, compaction and preemption
ROW_STATE = ("live", "ending", "steps", "recorded", "checked", "emitted", "fed_h", "row_version", "logit_version",
             "host_tok", "host_lp", "host_ver", "top_id", "top_lp")


def group_bucket(n: int, groups: int, G: int, exact: bool = False) -> int:
    """Group slots a decode step computes to cover slots ``[:n]``: a power of two with at
    least 8 rows, or all (fixed shapes: few CUDA graphs); ``exact``: ``n`` (no graphs)."""
    if exact:
        return min(max(n, 1), groups)
    b = 1
    while b < n or b * G < 8:
        b *= 2
    return min(b, groups)


def own_bucket(n: int, capacity: int, exact: bool = False, step: int = 64) -> int:
    """Own slots a decode step attends to cover ``[:n]`` (fixed shapes), at most ``capacity``:
    ``n`` rounded up to ``step`` up to ``16 x step``, then to a grain that doubles with each
    doubling of ``n`` (at most 12.5% over ``n``); ``exact``: ``n``. Each bucket is a decode
    graph captured at its first use while every row waits (~0.2-0.4 s on an H200: 2-3 a served
    run's timed part in session 16); the spans past ``16 x step`` (served conversations of a few
    thousand tokens) need half as many of them as in steps of ``step`` up to 4,096, a quarter up
    to 8,192. The extra slots are masked, and the kernels read K/V only up to each row's last
    visible key (a slot more of mask read, ~1/128 of a K/V slot's bytes)."""
    if exact:
        return min(n, capacity)
    grain = step
    while grain * 16 < n:
        grain *= 2
    return min(-(-n // grain) * grain, capacity)


@dataclass
class GroupState:
    """An admitted group (running or preempted): its prompt, its sampling settings (own:
    ``custom``), stop checker and listener, and its finished completions."""

    prompt_ids: torch.Tensor
    params: SamplingParams
    stopper: StopChecker
    custom: bool = False
    listener: object = None
    completions: list = field(default_factory=list)


@dataclass
class Preempted:
    """A group taken out of the batch (its own blocks ran out), waiting to be readmitted:
    its prompt, when it was first admitted (``arrival``), forks applied (``level``), and
    its ``G`` rows' host state (``rows``: :data:`ROW_STATE` arrays, ``keys``)."""

    key: Hashable
    prompt: list[int]
    arrival: int
    level: int
    rows: dict[str, np.ndarray]
    keys: list


def _without(r: int, calls: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Logged sample calls ``(rows, step index)`` without row ``r``'s entries."""
    return [(rows[rows != r], idx[rows != r]) for rows, idx in calls]


class Scheduler:
    """Host state of a running batch (see the module docstring). ``params``: the stream's
    sampling settings (``max_new_tokens``: tokens per completion at most; groups may bring
    their own, :meth:`SamplingParams.check_group
    <treerl.rollout.params.SamplingParams.check_group>`); ``block`` own slots per block,
    ``max_blocks`` per row; ``sync_every``: decode steps between host syncs (the window
    blocks are taken for); ``exact``: decode steps cover exactly the live span (no
    fixed-shape buckets); ``stats``: counters to add to."""

    def __init__(self, tree: ForkLayout, params: SamplingParams, block: int, max_blocks: int,
                 sync_every: int, exact: bool, stats: RolloutStats, logit_dtype: torch.dtype = torch.float32,
                 own_prompts: bool = False):
        self.tree, self.G, self.p, self.max_new = tree, tree.rows, params, params.max_new_tokens
        self.stopper = StopChecker(params.stop_token_ids, params.stop_strings, params.decoder())
        self.block, self.max_blocks, self.N = block, max_blocks, max_blocks * block
        self.sync_every, self.exact, self.stats, self.logit_dtype = sync_every, exact, stats, logit_dtype
        self.own_prompts = own_prompts  # prompts live in their rows' own blocks (fed_h counts them)
        self.groups: dict[Hashable, GroupState] = {}  # admitted groups (preempted ones too) by key
        # taken from the queue, not admitted yet: prompts (key, prompt) and preempted groups first
        self.deferred: deque = deque()
        self.arrivals = 0  # groups admitted so far (preemption takes the latest first)
        self.out: list[Group] = []  # groups finished, to be yielded
        self.log_rows: list[tuple[np.ndarray, np.ndarray]] = []  # per logged sample call: (rows, step index)
        self.in_flight: list[list[tuple[np.ndarray, np.ndarray]]] = []  # the log reads in flight' calls, oldest first
        self.ending_new = False  # rows began ending since the last read of the log was started
        self.keep_finished = False  # finished rows' contexts noted for the prefix cache (kept_contexts)
        self.kept: list = []  # those noted and not kept yet (kept_contexts.KeptContext)

    def reset(self, groups: int, num_blocks: int) -> None:
        """Empty state for ``groups`` group slots and a pool of ``num_blocks`` blocks."""
        S = groups * self.G
        self.NG, self.S = groups, S
        self.blocks = BlockTable(S, self.max_blocks, num_blocks, self.block)
        self.blocks.dirty = False  # the device table starts all trash
        self.live = np.zeros(S, dtype=bool)
        self.ending = np.zeros(S, dtype=bool)  # at max_new: not decoding, finishing when its tokens are read
        self.steps = np.zeros(S, dtype=np.int64)  # tokens sampled
        self.recorded = np.zeros(S, dtype=np.int64)  # tokens on the host (read from the device's log)
        self.checked = np.zeros(S, dtype=np.int64)  # tokens synced and checked for stops
        self.emitted = np.zeros(S, dtype=np.int64)  # tokens given to the group's listener
        self.fed_h = np.zeros(S, dtype=np.int64)  # tokens fed (host copy of the device's ``fed``)
        self.row_version = np.zeros(S, dtype=np.int64)  # weights of the row's KV
        self.logit_version = np.zeros(S, dtype=np.int64)  # weights of the row's pending logits
        width = min(self.max_new, 256)  # grows with the longest row (max_new may be a whole context)
        self.host_tok = np.zeros((S, width), dtype=np.int64)
        self.host_lp = np.zeros((S, width), dtype=np.float64)
        self.host_ver = np.zeros((S, width), dtype=np.int64)
        # the k most likely tokens per sampled token, for groups that ask (k = 0 until one does)
        self.top_id = np.zeros((S, width, 0), dtype=np.int64)
        self.top_lp = np.zeros((S, width, 0), dtype=np.float64)
        self.key: list[Hashable | None] = [None] * S
        self.gkey: list[Hashable | None] = [None] * groups
        self.plen = np.zeros(groups, dtype=np.int64)
        self.level = np.zeros(groups, dtype=np.int64)  # forks applied
        self.arrival = np.zeros(groups, dtype=np.int64)  # admission order of the slot's group
        # sampling settings per group slot (custom: the group's own, else the stream's)
        t, tp, tk, mp = self.p.sampling_fields()
        self.temperature = np.full(groups, t)
        self.top_p = np.full(groups, tp)
        self.top_k = np.full(groups, tk, dtype=np.int64)
        self.min_p = np.full(groups, mp)
        self.max_new_g = np.full(groups, self.max_new, dtype=np.int64)
        self.seed = np.full(groups, -1, dtype=np.int64)  # the group's own seed, -1: the stream's generator
        self.top_n = np.full(groups, self.p.top_logprobs, dtype=np.int64)  # top tokens logged per token
        self.custom = np.zeros(groups, dtype=bool)
        self.hg = 0  # group slots computed by the last decode / covered by the pending logits

    @property
    def hi(self) -> int:
        return self.hg * self.G

    def used(self) -> list[int]:
        return [g for g in range(self.NG) if self.gkey[g] is not None]

    def free(self) -> list[int]:
        return [g for g in range(self.NG) if self.gkey[g] is None]

    def slot_rows(self, slots) -> np.ndarray:
        """The rows of group slots ``slots``, in order."""
        return (np.asarray(slots, dtype=np.int64)[:, None] * self.G + np.arange(self.G)).reshape(-1)

    def sync_due(self) -> bool:
        """A read of the log is due: a full window logged, or a row began ending."""
        return bool(self.log_rows) and (len(self.log_rows) >= self.sync_every or self.ending_new)

    def take_log(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The logged calls' ``(rows, step index)``, as their read starts (the log restarts)."""
        out, self.log_rows, self.ending_new = self.log_rows, [], False
        return out

    def live_span(self) -> int:
        """Group slots a decode step covers now (every used slot)."""
        return group_bucket(max(self.used()) + 1, self.NG, self.G, self.exact)

    # ------------------------------------------------------------------ blocks
    def cover(self, fed: np.ndarray, steps: int) -> np.ndarray:
        """Own slots that rows having fed ``fed`` tokens write within ``steps`` decode steps
        (the slots to own blocks for)."""
        return np.clip(fed + steps - self.tree.own_start, 0, self.N)

    def blocks_needed(self, item) -> int:
        """Blocks a waiting group (``item``; None or ``(key, prompt)``: a new prompt) takes at
        admission: its live rows' writes for the next ``sync_every`` steps (a preempted group:
        past ones too)."""
        W = self.sync_every
        if isinstance(item, Preempted):
            live = item.rows["live"]
            return int(self.blocks.blocks_for(self.cover(item.rows["fed_h"][live], W)).sum())
        n = item.params.n if isinstance(item, Waiting) and item.params is not None else self.tree.n
        fed = len(item.prompt) if self.own_prompts and isinstance(item, Waiting) else 0
        return n * int(self.blocks.blocks_for(self.cover(np.full(1, fed, np.int64), W))[0])

    def reserve(self) -> int:
        """Blocks the live rows still need for their writes of the next ``sync_every`` steps."""
        rows = np.flatnonzero(self.live)
        return int(self.blocks.missing(rows, self.cover(self.fed_h[rows], self.sync_every)).sum())

    def room(self) -> bool:
        """Whether the first waiting group would get its blocks now (checked before taking
        prompts, so a full pool costs no prompt checks per step)."""
        first = self.deferred[0] if self.deferred else None
        return self.blocks_needed(first) + self.reserve() <= self.blocks.free

    def fit_blocks(self, items: list) -> list:
        """Admission by free blocks: the leading ``items`` whose blocks (:meth:`blocks_needed`)
        are free beyond what the live rows need for the next sync window; the rest wait,
        in order, at the front of the deferred groups."""
        free = self.blocks.free - self.reserve()
        for i, item in enumerate(items):
            need = self.blocks_needed(item)
            if need > free:
                self.deferred.extendleft(reversed(items[i:]))
                return items[:i]
            free -= need
        return items

    def grow_for_step(self) -> bool:
        """Before a decode step: give every live row the blocks its writes reach until the
        next sync (at least this step's). False if even this step's do not fit."""
        rows = np.flatnonzero(self.live)
        ahead = max(1, self.sync_every - len(self.log_rows))
        return self.blocks.grow(rows, self.cover(self.fed_h[rows], ahead)) or \
            self.blocks.grow(rows, self.cover(self.fed_h[rows], 1))

    def make_room(self) -> None:
        """(Synced.) Preempt whole groups, latest-admitted first, until every live row gets
        this step's block."""
        while True:
            rows = np.flatnonzero(self.live)
            if self.blocks.grow(rows, self.cover(self.fed_h[rows], 1)):
                return
            used = self.used()
            if len(used) < 2:  # pragma: no cover - the pool holds one group's worst case
                raise RuntimeError(f"the own-block pool ({self.blocks.num_blocks} blocks) does not hold one group")
            self.preempt(max(used, key=lambda g: self.arrival[g]))

    def preempt(self, g: int) -> None:
        """Take group slot ``g``'s group out of the batch (synced: no logged samples): its
        blocks and slot are freed, its host state goes to the front of the deferred groups."""
        key = self.gkey[g]
        rows = self.slot_rows([g])
        self.deferred.appendleft(Preempted(
            key, self.groups[key].prompt_ids.tolist(), int(self.arrival[g]), int(self.level[g]),
            {name: getattr(self, name)[rows].copy() for name in ROW_STATE}, [self.key[r] for r in rows]))
        self.blocks.release(rows)
        self.live[rows] = False
        for r in rows:
            self.key[r] = None
        self.gkey[g] = None
        self.stats.preemptions += 1

    # --------------------------------------------------------------- admission
    def admit(self, items: list[Waiting], prompts: list[list[int]], slots: np.ndarray, version: int) -> np.ndarray:
        """New groups ``items`` (prompts ``prompts``, loaded) into group slots ``slots``: their
        first rows (``tree.first_rows``, the group's ``n``) go live and take their first
        blocks. Returns those rows (their first samples' logits are pending)."""
        G = self.G
        rows = self.slot_rows(slots)
        first = []
        for i, item in enumerate(items):
            params = self.p if item.params is None else item.params
            custom = item.params is not None
            stopper = StopChecker(params.stop_token_ids, params.stop_strings, params.decoder()) if custom \
                else self.stopper
            g = self.groups[item.key] = GroupState(torch.tensor(prompts[i], dtype=torch.int64), params, stopper,
                                                   custom, item.listener)
            self.gkey[slots[i]] = item.key
            self.arrival[slots[i]] = self.arrivals
            self.arrivals += 1
            self._set_settings(int(slots[i]), g)
            for r in rows[i * G : (i + 1) * G]:
                self.key[r] = item.key
            first += [slots[i] * G + r for r in self.tree.first_rows()[: params.n]]
        first = np.asarray(first, dtype=np.int64)
        self.level[slots] = 0
        self.live[first] = True
        self.ending[rows] = False
        self.steps[first] = 0
        self.recorded[first] = 0
        self.checked[first] = 0
        self.emitted[first] = 0
        self.row_version[rows] = version
        self.logit_version[rows] = version
        if not self.blocks.grow(first, self.cover(self.fed_h[first], self.sync_every)):  # pragma: no cover
            raise RuntimeError("admitted without free blocks")  # (fit_blocks checked them)
        self.stats.admitted += len(items)
        return first

    def _set_settings(self, slot: int, g: GroupState) -> None:
        p = g.params
        self.temperature[slot], self.top_p[slot], self.top_k[slot], self.min_p[slot] = p.sampling_fields()
        self.max_new_g[slot] = p.max_new_tokens
        self.seed[slot] = p.seed if g.custom and p.seed is not None else -1
        self.custom[slot] = g.custom
        self.top_n[slot] = p.top_logprobs
        if p.top_logprobs > self.top_id.shape[2]:
            self._widen(self.host_tok.shape[1], 20)

    def readmit(self, item: Preempted, slot: int) -> np.ndarray:
        """A preempted group's host state back into group slot ``slot``, with blocks for its
        live rows (its K/V is to be recomputed). Returns its live rows."""
        rows = self.slot_rows([slot])
        width, k = item.rows["host_tok"].shape[1], item.rows["top_id"].shape[2]
        if width > self.host_tok.shape[1] or k > self.top_id.shape[2]:  # (a rebuilt batch's arrays start narrow)
            self._widen(max(width, self.host_tok.shape[1]), max(k, self.top_id.shape[2]))
        for name in ROW_STATE:
            a, saved = getattr(self, name), item.rows[name]
            if a.ndim >= 2:  # (host arrays may have grown since)
                a[rows] = 0
                a[(rows,) + tuple(slice(0, n) for n in saved.shape[1:])] = saved
            else:
                a[rows] = saved
        for r, key in zip(rows, item.keys):
            self.key[r] = key
        self.gkey[slot] = item.key
        self.level[slot] = item.level
        self.arrival[slot] = item.arrival
        self._set_settings(slot, self.groups[item.key])
        live = rows[self.live[rows]]
        if not self.blocks.grow(live, self.cover(self.fed_h[live], self.sync_every)):  # pragma: no cover
            raise RuntimeError("readmitted without free blocks")  # (fit_blocks checked them)
        return live

    def reload_plan(self, slots: np.ndarray) -> tuple[list[list[int]], list[int], list[int], list[int]]:
        """What recomputing group slots ``slots`` prefills: the distinct sequences (a prompt
        followed by the tokens a live row fed), each slot's group sequence (its first live
        row's), each row's sequence (-1: not live) and each slot's prompt length."""
        distinct: dict[tuple[int, ...], int] = {}
        row_src, group_src, plen = [], [], []
        for g in slots:
            prompt = self.groups[self.gkey[g]].prompt_ids.tolist()
            plen.append(0 if self.own_prompts else len(prompt))
            first = None
            for r in range(g * self.G, (g + 1) * self.G):
                if not self.live[r]:
                    row_src.append(-1)
                    continue
                seq = prompt + self.host_tok[r, : self.steps[r] - 1].tolist()
                s = distinct.setdefault(tuple(seq), len(distinct))
                first = s if first is None else first
                row_src.append(s)
            group_src.append(first)
        return [list(t) for t in distinct], group_src, row_src, plen

    # ------------------------------------------------------------ samples, stops
    def logged(self, rows: np.ndarray) -> bool:
        """``rows`` sampled their next token (logged on the device at the next index); those
        at their group's ``max_new`` stop decoding and end (finished when their tokens are
        read). Whether any row ended (the device's live rows change)."""
        if len(rows) and self.steps[rows].max() >= self.host_tok.shape[1]:
            self._widen(min(2 * self.host_tok.shape[1], self.max_new))
        self.log_rows.append((rows, self.steps[rows].copy()))
        self.host_ver[rows, self.steps[rows]] = self.logit_version[rows]
        self.steps[rows] += 1
        done = rows[self.steps[rows] >= self.max_new_g[rows // self.G]]
        if len(done):
            self.live[done] = False
            self.ending[done] = True
            self.ending_new = True
        return bool(len(done))

    def _widen(self, width: int, k: int | None = None) -> None:
        """Room for ``width`` tokens per row (and ``k`` top tokens each)."""
        for name in ("host_tok", "host_lp", "host_ver", "top_id", "top_lp"):
            a = getattr(self, name)
            top = () if a.ndim == 2 else (a.shape[2] if k is None else k,)  # top_id/top_lp: [S, width, k]
            wide = np.zeros((a.shape[0], width) + top, dtype=a.dtype)
            wide[(slice(None), slice(0, a.shape[1])) + (slice(0, a.shape[-1]),) * (a.ndim - 2)] = a
            setattr(self, name, wide)

    def sampling(self, rows: np.ndarray, span: np.ndarray) -> RowSampling:
        """How to sample ``span`` (rows, in order) of which ``rows`` are live
        (:func:`~treerl.rollout.requests.plan_sampling`)."""
        return plan_sampling(self, rows, span)

    def finish(self, r: int, length: int, reason: str, stop) -> None:
        """Row ``r`` ends with its first ``length`` tokens; its blocks are freed, and its
        group is done (queued in ``out``) when it was the group's last live row."""
        key = self.key[r]
        g = self.groups[key]
        if g.listener is not None:
            emit(self, r, length, reason)
        slot = int(r) // self.G
        g.completions.append(row_completion(self, r, length, reason, stop))
        self.stats.generated_tokens += length
        if self.keep_finished:
            note_finished(self, r, length, reason)
        self.live[r] = False
        self.ending[r] = False
        self.key[r] = None
        self.blocks.release([r])
        # a row still logged after the read (it decoded past its stop): those tokens are not its own any more
        self.log_rows, self.in_flight = _without(r, self.log_rows), [_without(r, c) for c in self.in_flight]
        rows = slice(slot * self.G, (slot + 1) * self.G)
        if not (self.live[rows] | self.ending[rows]).any():  # the group's slot is free
            del self.groups[key]
            self.gkey[slot] = None
            g.completions.sort(key=lambda c: c.branch)
            self.out.append(Group(key, g.prompt_ids, g.completions))

    def abort(self, key: Hashable) -> bool:
        """(Synced.) Stop group ``key`` (cancelled; :func:`~treerl.rollout.requests.abort`)."""
        return abort(self, key)

    # -------------------------------------------------------------------- forks
    def due_forks(self) -> list[int]:
        """Group slots whose live rows have sampled exactly their next fork point's tokens."""
        tree, G, due = self.tree, self.G, []
        for g in range(self.NG):
            if self.gkey[g] is None or self.level[g] >= tree.depth:
                continue
            live = np.flatnonzero(self.live[g * G : (g + 1) * G])
            if len(live) and self.steps[g * G + live[0]] == tree.points[self.level[g]]:
                due.append(g)
        return due

    def fork(self, due: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Fork group slots ``due``: every live row's further children (its reserved rows)
        take a copy of its host state and go live. Returns ``(parents, children)`` rows (the
        device copies theirs the same way; children own no blocks yet)."""
        G, tree = self.G, self.tree
        parents, kids = [], []
        for g in due:
            k = int(self.level[g]) + 1
            for r in np.flatnonzero(self.live[g * G : (g + 1) * G]) + g * G:
                for c in tree.children(int(r - g * G), k):
                    parents.append(r)
                    kids.append(g * G + c)
            self.level[g] = k
        par, kid = np.asarray(parents, dtype=np.int64), np.asarray(kids, dtype=np.int64)
        if len(kid):
            for name in ROW_STATE:
                a = getattr(self, name)
                a[kid] = a[par]
            for c, p in zip(kid, par):
                self.key[c] = self.key[p]
            self.live[kid] = True
            self.stats.forks += len(kid)
        return par, kid

    # --------------------------------------------------------------- compaction
    def _buckets(self, used) -> tuple[int, int]:
        """The group-slot buckets the ``used`` slots span now and would after compaction."""
        return (group_bucket(int(max(used)) + 1, self.NG, self.G, self.exact),
                group_bucket(len(used), self.NG, self.G, self.exact))

    def compaction_due(self) -> bool:
        """Whether the used group slots would fit a smaller bucket if moved down."""
        used = self.used()
        if not used:
            return False
        top, target = self._buckets(used)
        return top > target

    def compact(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Plan and apply (host side) moving live groups down into free group slots when they
        would fit a smaller bucket (only at a sync point: no logged tokens refer to the rows
        moved). Sets ``hg``. Returns ``(src, dst)`` group slots moved, or None."""
        used = np.asarray(self.used())
        top, target = self._buckets(used)
        if self.log_rows or self.in_flight or top <= target:  # (the running batch finishes reads first: LogReader.sync)
            self.hg = top
            return None
        src = used[used >= target]
        dst = np.asarray([g for g in range(target) if self.gkey[g] is None][: len(src)])
        rsrc, rdst = self.slot_rows(src), self.slot_rows(dst)
        for name in ROW_STATE:
            a = getattr(self, name)
            a[rdst] = a[rsrc]
        self.blocks.move(rdst, rsrc)
        for d, s in zip(rdst, rsrc):
            self.key[d], self.key[s] = self.key[s], None
        self.live[rsrc] = False
        for a in (self.plen, self.level, self.arrival, self.temperature, self.top_p, self.top_k, self.min_p,
                  self.max_new_g, self.seed, self.custom, self.top_n):
            a[dst] = a[src]
        for d, s in zip(dst, src):
            self.gkey[d], self.gkey[s] = self.gkey[s], None
        self.hg = target
        return src, dst
