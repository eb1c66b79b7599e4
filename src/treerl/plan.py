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
when its tokens plus the largest live set below it fit the budget, which keeps the live
activations of a step within the budget (DESIGN.md: memory of one root-to-leaf path).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

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
        return (
            f"{self.mode}: {len(self.segments)} segments ({chains} chains, {recomputed} recomputed), "
            f"{self.num_calls} calls, budget {self.budget} tokens, peak live {self.peak_live_tokens()} tokens"
        )


def make_plan(tree: PrefixTree, mode: str, max_tokens: int, chunk_tokens: int, pack_tokens: int | None = None
              ) -> Plan:
    """Plan ``tree`` for ``mode`` (for ``flat``, pass the unshared tree).

    ``pack_tokens`` (<= ``max_tokens``; default ``max_tokens``): several subtrees or
    sequences share a call only up to this many tokens, while one that is larger, up to
    ``max_tokens``, still runs whole in a call of its own (the engine packs up to the size
    at which a recomputed call keeps every layer's attention)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1 token, got {max_tokens}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1 token, got {chunk_tokens}")
    pack_tokens = max_tokens if pack_tokens is None else max(1, min(pack_tokens, max_tokens))
    planner = _Planner(tree, pack_tokens)
    if mode in ("flat", "packed"):
        planner.whole_trees(mode, max_tokens)
        budget = max_tokens
    else:
        budget = chunk_tokens if mode == "dfs" else max_tokens
        planner.split(group_budget=budget, chunk=min(chunk_tokens, budget))
    segments = planner.finish(budget)
    plan = Plan(mode, segments, planner.children, _targets(tree, segments), budget)
    # auto's choice per tree (packed subtrees vs depth-first chains) is worth seeing
    (log.info if mode == "auto" and any(planner.children) else log.debug)("plan %s", plan.describe())
    return plan


class _Planner:
    def __init__(self, tree: PrefixTree, pack: int):
        self.tree = tree
        self.pack = pack  # most tokens of several subtrees packed into one segment
        self.start = tree.node_start.tolist()
        self.end = tree.node_end.tolist()
        self.sub_end = tree.subtree_end[tree.node_start].tolist()
        self.kids: list[list[int]] = [[] for _ in self.start]
        self.roots: list[int] = []
        for node, parent in enumerate(tree.node_parent.tolist()):
            (self.kids[parent] if parent >= 0 else self.roots).append(node)
        self.raw: list[tuple[int, int, int]] = []  # (start, end, parent segment)

    def _add(self, start: int, end: int, parent: int) -> int:
        self.raw.append((start, end, parent))
        return len(self.raw) - 1

    def whole_trees(self, mode: str, budget: int) -> None:
        if mode == "flat":
            # Sequences that fit are packed several per call; a longer one runs as a chain.
            self._group(self.roots, parent=-1, budget=budget, oversized=self._tail_aligned_chain(budget))
            return
        sizes = [self.sub_end[r] - self.start[r] for r in self.roots]
        for root, size in zip(self.roots, sizes):
            if size > budget:
                # Name the input sequences of this tree (the layout order is not the input order).
                first = self.tree.seq_index[self.tree.seq_offsets[:-1]]
                seqs = ((first >= self.start[root]) & (first < self.sub_end[root])).nonzero()[:, 0].tolist()
                shown = ", ".join(map(str, seqs[:5])) + (", ..." if len(seqs) > 5 else "")
                what = f"sequence {shown}" if len(seqs) == 1 else f"the tree of sequences {shown}"
                raise TreeTooLargeError(
                    f"{what} has {size} tokens, more than max_tokens={budget}, the most tokens one "
                    f"call may hold (given, or derived from the memory budget): mode='{mode}' runs "
                    f"every tree whole in one call; raise max_tokens or the memory budget, or use "
                    f"mode='auto' or 'dfs', which split large trees"
                )
        self._group(self.roots, parent=-1, budget=budget, oversized=None)

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

    def split(self, group_budget: int, chunk: int) -> None:
        def chain(node: int, parent: int) -> None:
            for a in range(self.start[node], self.end[node], chunk):
                parent = self._add(a, min(a + chunk, self.end[node]), parent)
            self._group(self.kids[node], parent, group_budget, oversized=chain)

        self._group(self.roots, -1, group_budget, oversized=chain)

    def _group(self, nodes: list[int], parent: int, budget: int, oversized) -> None:
        """Batch consecutive sibling subtrees into segments: one of at most ``budget``
        tokens alone, several up to ``self.pack`` tokens together."""
        first = last = None
        for node in nodes:
            size = self.sub_end[node] - self.start[node]
            if size > budget:
                if first is not None:
                    self._add(self.start[first], self.sub_end[last], parent)
                    first = None
                oversized(node, parent)
                continue
            if first is not None and self.sub_end[node] - self.start[first] > min(budget, self.pack):
                self._add(self.start[first], self.sub_end[last], parent)
                first = None
            if first is None:
                first = node
            last = node
        if first is not None:
            self._add(self.start[first], self.sub_end[last], parent)

    def finish(self, budget: int) -> list[Segment]:
        n = len(self.raw)
        self.children = [[] for _ in range(n)]
        for i, (_, _, p) in enumerate(self.raw):
            if p >= 0:
                self.children[p].append(i)
        # Bottom-up: retain a chain's graph only if it and the live set below it fit.
        need = [0] * n
        retain = [False] * n
        for i in reversed(range(n)):
            size = self.raw[i][1] - self.raw[i][0]
            below = max((need[c] for c in self.children[i]), default=0)
            retain[i] = bool(self.children[i]) and size + below <= budget
            need[i] = size + below if retain[i] else max(size, below)
        return [Segment(s, e, p, retain[i]) for i, (s, e, p) in enumerate(self.raw)]


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
