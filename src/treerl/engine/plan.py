"""Planning: which tree tokens run together in one model call.

A plan is a forest of *segments*. A segment is a contiguous range of tree tokens (in the
DFS layout) run in one call, after the keys/values of its ancestor segments. Only
*chains* (a node, or a chunk of a long node) have child segments, so a segment's prefix
is exactly the tokens of its ancestor segments, all of which it may attend.

Every engine mode is a plan; the executor is shared:
- ``packed``: whole trees, several per call up to ``max_tokens``; no prefixes.
- ``flat``: ``packed`` over the unshared layout (one chain per sequence); a sequence
  longer than ``max_tokens`` runs as a chain of pieces of ``max_tokens`` (the first piece
  takes the remainder), each piece after the earlier pieces' keys/values, so any length runs.
- ``dfs``: depth-first (AReaL-DTA): a node per call (split into ``chunk_tokens`` pieces),
  consecutive small sibling subtrees batched into one call up to ``chunk_tokens``.
- ``auto``: whole subtrees packed up to ``max_tokens``; nodes of a tree too large for the
  budget run as chains, with the subtrees below them packed again.

A chain segment either *retains* its autograd graph while its descendants run (one
forward) or *recomputes* it afterwards (a second, no-grad forward first); it retains
when what it holds plus the largest live set below it fit the budget, which keeps the live
activations of a step within the budget (DESIGN.md: memory of one root-to-leaf path).

Every decision is in bytes of a :class:`~treerl.engine.memory.CallBudget` (the ``max_tokens``
override is one "byte" per token): a call after a prefix has less room than one without
(the prefix's keys/values and their gradients stay alive, and the call concatenates
them), a chain segment holds its own keys/values for the segments below it, a retained
one holds its activations, and a call recomputes its decoder blocks only where it would
not fit otherwise (:attr:`Segment.recompute`). Nodes split into pieces no larger than the
room left on their path; a path that leaves no room for even one token is refused with
the bytes it needs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from .memory import CallBudget
from .tree import PrefixTree

log = logging.getLogger("treerl")

MODES = ("flat", "packed", "dfs", "auto")


class TreeTooLargeError(ValueError):
    """A whole tree does not fit the token budget of a mode that cannot split it."""


@dataclass(frozen=True)
class Segment:
    start: int  # first tree token
    end: int  # exclusive end
    parent: int  # index of the parent segment, -1 if none (no prefix)
    retain: bool = False  # chain segments: keep the graph while children run
    recompute: bool = False  # its call with grad recomputes the decoder blocks in the backward
    spare: float = 0.0  # bytes the budget leaves beside its call with grad (for kept attentions)

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class Plan:
    """Segments in execution (preorder) order, with per-segment loss-head targets."""

    mode: str
    segments: list[Segment]
    children: list[list[int]]
    targets: list[torch.Tensor]  # tree tokens whose logit is produced inside the segment
    budget: int
    peak_bytes: float = 0.0  # the memory model's peak of the step's backward (budget units)

    @property
    def single_level(self) -> bool:
        """No segment has a prefix: every call is independent (packed / flat)."""
        return all(s.parent < 0 for s in self.segments)

    def ancestors(self, i: int) -> list[int]:
        """Ancestor segments of ``i``, root first."""
        chain = []
        p = self.segments[i].parent
        while p >= 0:
            chain.append(p)
            p = self.segments[p].parent
        return chain[::-1]

    def chained_segments(self) -> set[int]:
        """Segments of the trees that do not run as one call: every segment with a parent
        or children (a chain and all below it)."""
        return {i for i, s in enumerate(self.segments) if s.parent >= 0 or self.children[i]}

    def prefix_tokens(self, i: int) -> int:
        return sum(self.segments[a].size for a in self.ancestors(i))

    @property
    def num_calls(self) -> int:
        """Model calls of one forward+backward (a recomputed chain runs twice)."""
        return len(self.segments) + sum(
            1 for i, s in enumerate(self.segments) if self.children[i] and not s.retain
        )

    def peak_live_tokens(self) -> int:
        """Largest number of tokens whose activations are alive at once in the backward."""
        need = [0] * len(self.segments)
        for i in reversed(range(len(self.segments))):
            below = max((need[c] for c in self.children[i]), default=0)
            s = self.segments[i]
            need[i] = s.size + below if s.retain else max(s.size, below)
        return max((need[i] for i, s in enumerate(self.segments) if s.parent < 0), default=0)

    def describe(self) -> str:
        chains = sum(1 for c in self.children if c)
        recomputed = sum(1 for i, s in enumerate(self.segments) if self.children[i] and not s.retain)
        blocks = sum(1 for s in self.segments if s.recompute)
        return (
            f"{self.mode}: {len(self.segments)} segments ({chains} chains, {recomputed} recomputed, "
            f"{blocks} recomputing blocks), {self.num_calls} calls, budget {self.budget} tokens, "
            f"peak live {self.peak_live_tokens()} tokens, modelled peak {self.peak_bytes / 2**30:.2f} GiB"
        )


def make_plan(tree: PrefixTree, mode: str, max_tokens: int, chunk_tokens: int, pack_tokens: int | None = None,
              memory: CallBudget | None = None) -> Plan:
    """Plan ``tree`` for ``mode`` (for ``flat``, pass the unshared tree).

    ``pack_tokens`` (<= ``max_tokens``; default ``max_tokens``): several subtrees or
    sequences share a call only up to this many tokens, while one that is larger, up to
    ``max_tokens``, still runs whole in a call of its own (the engine packs up to the size
    at which a recomputed call keeps every layer's attention).

    ``memory``: the engine's memory model under its budget; calls after a prefix are then
    sized by the room the prefix leaves, and chains retain, and calls recompute their
    blocks, by bytes. Without it, the token counts above are the budget (``dfs``:
    ``chunk_tokens``). Raises :class:`TreeTooLargeError` for a tree that a mode cannot
    run within the budget."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1 token, got {max_tokens}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1 token, got {chunk_tokens}")
    pack_tokens = max_tokens if pack_tokens is None else max(1, min(pack_tokens, max_tokens))
    budget = chunk_tokens if mode == "dfs" else max_tokens
    if memory is None:
        memory = CallBudget.tokens_only(budget, pack_tokens)
    planner = _Planner(tree, memory, pack_tokens)
    if mode in ("flat", "packed"):
        planner.whole_trees(mode, max_tokens)
    else:
        # dfs: calls of at most chunk_tokens; auto: as large as the room on the path allows
        planner.split(cap=chunk_tokens if mode == "dfs" else max_tokens, chunk=min(chunk_tokens, budget))
    segments, peak = planner.finish(retain_tokens=chunk_tokens if mode == "dfs" else None)
    plan = Plan(mode, segments, planner.children, _targets(tree, segments), budget, peak)
    # auto's choice per tree (packed subtrees vs depth-first chains) is worth seeing
    (log.info if mode == "auto" and any(planner.children) else log.debug)("plan %s", plan.describe())
    return plan


class _Planner:
    def __init__(self, tree: PrefixTree, memory: CallBudget, pack: int):
        self.tree = tree
        self.memory = memory
        self.pack_cap = pack  # most tokens of several subtrees packed into one segment
        self.start = tree.node_start.tolist()
        self.end = tree.node_end.tolist()
        self.sub_end = tree.subtree_end[tree.node_start].tolist()
        self.kids: list[list[int]] = [[] for _ in self.start]
        self.roots: list[int] = []
        for node, parent in enumerate(tree.node_parent.tolist()):
            (self.kids[parent] if parent >= 0 else self.roots).append(node)
        self.raw: list[tuple[int, int, int]] = []  # (start, end, parent segment)
        self.prefix: list[int] = []  # per segment: tokens of its ancestor segments

    def _add(self, start: int, end: int, parent: int) -> int:
        self.raw.append((start, end, parent))
        self.prefix.append(self._below(parent))
        return len(self.raw) - 1

    def _below(self, parent: int) -> int:
        """Prefix tokens of a segment under ``parent``."""
        if parent < 0:
            return 0
        start, end, _ = self.raw[parent]
        return self.prefix[parent] + end - start

    def whole_trees(self, mode: str, budget: int) -> None:
        if mode == "flat":
            # Sequences that fit are packed several per call; a longer one runs as a chain.
            self._group(self.roots, parent=-1, budget=budget, oversized=self._tail_aligned_chain(budget))
            return
        sizes = [self.sub_end[r] - self.start[r] for r in self.roots]
        for root, size in zip(self.roots, sizes):
            if size > budget:
                what = self._sequences_of(root)
                raise TreeTooLargeError(
                    f"{what} has {size} tokens, more than max_tokens={budget}, the most tokens one "
                    f"call may hold (given, or derived from the memory budget): mode='{mode}' runs "
                    f"every tree whole in one call; raise max_tokens or the memory budget, or use "
                    f"mode='auto' or 'dfs', which split large trees"
                )
        self._group(self.roots, parent=-1, budget=budget, oversized=None)

    def _sequences_of(self, node: int) -> str:
        """'sequence i' / 'the tree of sequences i, j, ...' whose first token lies in the
        subtree of ``node`` (input order; the layout order is not the input order)."""
        first = self.tree.seq_index[self.tree.seq_offsets[:-1]]
        seqs = ((first >= self.start[node]) & (first < self.sub_end[node])).nonzero()[:, 0].tolist()
        shown = ", ".join(map(str, seqs[:5])) + (", ..." if len(seqs) > 5 else "")
        return f"sequence {shown}" if len(seqs) == 1 else f"the tree of sequences {shown}"

    def _tail_aligned_chain(self, budget: int):
        """``oversized`` for ``flat``: a node as pieces of ``budget`` tokens aligned to its
        end (the first piece is the remainder), then its children grouped again.

        The last piece is a leaf and holds a full budget; every earlier piece is
        recomputed (``finish``: it plus the live set below exceeds the budget), so this
        alignment recomputes the fewest tokens (length - budget) with the fewest calls."""

        def chain(node: int, parent: int) -> None:
            start, end = self.start[node], self.end[node]
            first = (end - start) % budget or budget
            bounds = [start, *range(start + first, end + 1, budget)]
            for a, b in zip(bounds, bounds[1:]):
                parent = self._add(a, b, parent)
            self._group(self.kids[node], parent, budget, oversized=chain)

        return chain

    def split(self, cap: int, chunk: int) -> None:
        """Subtrees that fit the room under their prefix run whole (up to ``cap`` tokens);
        a larger one runs its top node as a chain of pieces of at most ``chunk`` tokens,
        each no larger than the room left after the pieces above it."""
        memory = self.memory

        def chain(node: int, parent: int) -> None:
            a, end, leaf = self.start[node], self.end[node], not self.kids[node]
            while a < end:
                prefix = self._below(parent)
                n = min(chunk, end - a, memory.tokens(prefix, leaves=True))
                if leaf and end - a <= min(chunk, memory.tokens(prefix)):
                    n = end - a  # the node's last piece holds no keys/values for others
                if n < 1:
                    raise self._path_too_long(node, prefix)
                parent = self._add(a, a + n, parent)
                a += n
            self._group(self.kids[node], parent, self._room(parent, cap), oversized=chain)

        self._group(self.roots, -1, self._room(-1, cap), oversized=chain)

    def _room(self, parent: int, cap: int) -> int:
        return min(cap, self.memory.tokens(self._below(parent)))

    def _path_too_long(self, node: int, prefix: int) -> TreeTooLargeError:
        tree, memory = self.tree, self.memory
        lo, hi = self.start[node], self.sub_end[node]
        deepest = lo + int(tree.position[lo:hi].argmax())
        length = int(tree.position[deepest]) + 1
        ends = tree.seq_index[tree.seq_offsets[1:] - 1]
        seq = int((ends == deepest).nonzero()[0, 0]) if bool((ends == deepest).any()) else -1
        need, held = memory.path_needs(length)
        return TreeTooLargeError(
            f"sequence {seq} has a root-to-leaf path of {length} tokens that does not fit the memory budget "
            f"even depth-first: it needs at least {memory.describe(need)} of activation memory "
            f"({memory.describe(held)} of it the keys/values of its first {length - 1} tokens with their "
            f"gradients), the budget is {memory.describe(memory.budget)} (no room left after {prefix} "
            f"tokens); raise memory_budget or shorten the sequence"
        )

    def _group(self, nodes: list[int], parent: int, budget: int, oversized) -> None:
        """Batch consecutive sibling subtrees into segments: one of at most ``budget``
        tokens alone, several up to the pack limit together. Each run of siblings between
        oversized ones takes as few segments as packing greedily to the limit would, with
        their sizes balanced (:func:`_balanced_groups`): the same calls, the largest (which
        sets the step's memory peak) as small as the run allows."""
        pack = min(budget, self.pack_cap, self.memory.pack(self._below(parent)))
        run: list[int] = []
        for node in [*nodes, None]:
            if node is not None and self.sub_end[node] - self.start[node] <= budget:
                run.append(node)
                continue
            sizes = [self.sub_end[n] - self.start[n] for n in run]
            for a, b in _balanced_groups(sizes, pack):
                self._add(self.start[run[a]], self.sub_end[run[b - 1]], parent)
            run = []
            if node is not None:
                oversized(node, parent)

    def finish(self, retain_tokens: int | None) -> tuple[list[Segment], float]:
        """Segments with their memory decisions, and the modelled peak of the backward.

        Bottom-up: a call recomputes its blocks if it would not fit the room its ancestors'
        keys/values leave; a chain retains its graph only if it needs no recompute and what
        it holds plus the largest live set below fit that room (and, for ``dfs``, its tokens
        plus those below fit ``retain_tokens``). Top-down: what is left beside each call once
        its ancestors' retained graphs are counted (``spare``, for kept attentions)."""
        n = len(self.raw)
        memory, model = self.memory, self.memory.model
        self.children = [[] for _ in range(n)]
        for i, (_, _, p) in enumerate(self.raw):
            if p >= 0:
                self.children[p].append(i)
        need = [0.0] * n  # bytes alive at once at and below segment i (its ancestors' not counted)
        need_tokens = [0] * n
        retain, recompute, peak, held = [False] * n, [False] * n, [0.0] * n, [0.0] * n
        for i in reversed(range(n)):
            start, end, _ = self.raw[i]
            size, prefix, chain = end - start, self.prefix[i], bool(self.children[i])
            room = memory.room(prefix)
            recompute[i] = memory.recomputes(size, prefix, leaves=chain)
            peak[i] = model.call_bytes(size, prefix, recompute[i], leaves=chain)
            below = max((need[c] for c in self.children[i]), default=0.0)
            below_tokens = max((need_tokens[c] for c in self.children[i]), default=0)
            if chain:
                leaves = size * model.leaf_per_token
                held[i] = model.call_bytes(size, prefix) - model.fixed
                retain[i] = (not recompute[i] and leaves + held[i] + below <= room
                             and (retain_tokens is None or size + below_tokens <= retain_tokens))
                need[i] = max(peak[i], leaves + below + (held[i] if retain[i] else 0.0))
            else:
                need[i] = peak[i]
            need_tokens[i] = size + below_tokens if retain[i] else max(size, below_tokens)
        above = [0.0] * n  # bytes held by the ancestors while segment i runs with grad
        for i, (start, end, p) in enumerate(self.raw):
            if p >= 0:
                ps, pe, _ = self.raw[p]
                above[i] = above[p] + (pe - ps) * model.leaf_per_token + (held[p] if retain[p] else 0.0)
        segments = [Segment(s, e, p, retain[i], recompute[i], memory.budget - above[i] - peak[i])
                    for i, (s, e, p) in enumerate(self.raw)]
        top = max((need[i] for i, (_, _, p) in enumerate(self.raw) if p < 0), default=0.0)
        return segments, top


def _targets(tree: PrefixTree, segments: list[Segment]) -> list[torch.Tensor]:
    """Per segment: the tree tokens predicted from a token inside it (parent in range)."""
    starts = np.array([s.start for s in segments], dtype=np.int64)
    assert np.all(np.diff(starts) > 0), "segments must be in layout order"
    seg_of_token = np.searchsorted(starts, np.arange(tree.num_tree_tokens), side="right") - 1
    parent = tree.parent.numpy()
    child = np.flatnonzero(parent >= 0)
    owner = seg_of_token[parent[child]]
    by_owner = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=len(segments))
    return list(torch.from_numpy(child[by_owner]).split(counts.tolist()))


def _greedy_groups(sizes: list[int], cap: int) -> list[tuple[int, int]]:
    """Consecutive items as ``[a, b)`` ranges, each filled greedily up to ``cap`` in total
    (an item larger than ``cap`` alone)."""
    groups, a, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > a and total + size > cap:
            groups.append((a, i))
            a, total = i, 0
        total += size
    if sizes:
        groups.append((a, len(sizes)))
    return groups


def _balanced_groups(sizes: list[int], cap: int) -> list[tuple[int, int]]:
    """As few consecutive groups as greedy packing to ``cap`` makes, with the largest group
    as small as possible: greedy packing to the smallest limit (binary search) that needs
    no more groups. Every group of several items stays within ``cap``."""
    want = len(_greedy_groups(sizes, cap))
    lo, hi = max(1, min(cap, max(sizes, default=1))), cap
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_greedy_groups(sizes, mid)) <= want:
            hi = mid
        else:
            lo = mid + 1
    return _greedy_groups(sizes, lo)
