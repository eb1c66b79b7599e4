"""The tree-aware partitioner: assign the sequences of a batch to data-parallel ranks so
that the *predicted step times* are equal (DESIGN.md, "Distributed"). Every rank runs one
``forward_backward`` over the prefix tree of the sequences it is given and the step waits
for the slowest, so equal token counts are not the goal: a tree's cost depends on its
unique tokens, its attention pairs and its shape (:mod:`treerl.distributed.cost_model`).

Pieces = whole trees; trees too costly for one rank are split at subtree boundaries into
*pieces* (a piece = a set of sibling subtrees plus the prefix path they hang from; the
prefix is recomputed on every rank that holds part of the tree, and counted in each
piece's features). Pieces are assigned by greedy LPT improved by pairwise moves and swaps
(:func:`assign`); further splits are made while they lower the slowest rank.
:func:`equal_token_partition` is the baseline that equalises token counts instead.

Why only LPT + local refinement: on the benchmark batches (``bench/balance_ablation.py``,
160 batches: grpo / agentic / tree / mixed, 2-16 ranks) refinement lowered the slowest
rank in 53 of them (up to 7.2 %); Karmarkar-Karp differencing and an exact branch and
bound, tried on top, changed it by -0.001 % and +0.005 % on average (bench/RESULTS.md).

Pieces, exactly. A split tree's piece holds the subtrees of some children ``c_1..c_m`` of
one node ``v`` and every sequence ending in them, plus (in the piece holding ``c_1``'s
group) the sequences ending on the path above them that no other piece took. The rank
that runs it builds ``PrefixTree.from_sequences`` of those sequences, so the piece's
features are exactly those of that tree:

- tokens = ``P`` + the subtrees' tokens, where ``P`` = depth of the children = the
  tokens of the root-to-``v`` path (``Piece.prefix_tokens``), recomputed on every rank
  holding a piece of the tree;
- attention pairs = ``P (P + 1) / 2`` + the subtrees' pairs (positions are unchanged);
- nodes and leaves: those of the rebuilt tree: the path is cut into nodes only where a
  carried sequence ends, and with a single child (and no carried sequence ending at
  ``v``) its last node merges with the child's first node; leaves are the subtrees';
- sequences: the piece's sequences (each input sequence is in exactly one piece).

Pieces of one tree that land on the same rank share their common path there: a rank's
features (``Partition.features``, from which its predicted cost comes) are those of the
tree of all its sequences. Its tokens, pairs, leaves and sequences never exceed the sum
of its pieces' (the additive weights the assignment uses); nodes may, by one per branch
point the pieces re-join.

Guarantees (for the additive piece costs the partitioner optimises, see :func:`assign`):
every input sequence is on exactly one rank (duplicates and strict prefixes keep their
identity); the result is deterministic (ties broken by index); the makespan is at most
``(4/3 - 1/(3k))`` times the optimum over assignments of the same pieces (Graham's LPT
bound: refinement never makes LPT's result worse).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..engine.tree import PrefixTree, TokenSequence
from .cost_model import DEFAULT_COST_MODEL, CostModel
from .features import Forest, TreeFeatures

__all__ = ["Assignment", "assign", "Piece", "Partition", "partition", "equal_token_partition"]

_EPS = 1e-12  # relative tolerance of cost comparisons


@dataclass(frozen=True)
class Assignment:
    """Items (pieces) assigned to ranks: ``rank_of[i]`` and the summed weight per rank."""

    rank_of: np.ndarray  # [items] int64
    loads: np.ndarray  # [ranks] float64
    method: str
    optimal: bool = False  # proven optimal (the lower bound is met)

    @property
    def makespan(self) -> float:
        return float(self.loads.max()) if len(self.loads) else 0.0


def _loads(weights: np.ndarray, rank_of: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(rank_of, weights=weights, minlength=k).astype(np.float64)


def _lpt(w: np.ndarray, k: int) -> np.ndarray:
    """Longest processing time first: heaviest item to the least-loaded rank."""
    order = np.lexsort((np.arange(len(w)), -w))
    heap = [(0.0, r) for r in range(k)]
    rank_of = np.zeros(len(w), dtype=np.int64)
    for i in order.tolist():
        load, r = heapq.heappop(heap)
        rank_of[i] = r
        heapq.heappush(heap, (load + float(w[i]), r))
    return rank_of


def _refine(w: np.ndarray, rank_of: np.ndarray, k: int, max_rounds: int | None = None) -> np.ndarray:
    """Local search: move one item off the most loaded rank, or swap one of its items with
    a lighter one elsewhere, taking the change that lowers that pair's maximum the most.

    Each accepted change strictly lowers ``max(load_M, load_r)`` with ``load_M + load_r``
    fixed, so the sum of squared loads strictly falls: it terminates."""
    rank_of = rank_of.copy()
    loads = _loads(w, rank_of, k)
    max_rounds = max_rounds or 4 * len(w) + 16
    for _ in range(max_rounds):
        m = int(np.argmax(loads))
        lm = loads[m]
        items_m = np.flatnonzero(rank_of == m)
        best = (lm - _EPS * max(lm, 1e-30), None)  # must beat lm strictly
        if len(items_m) == 0:
            break
        wm = w[items_m]
        for r in range(k):
            if r == m:
                continue
            items_r = np.flatnonzero(rank_of == r)
            deltas = [wm[:, None]]
            if len(items_r):
                deltas.append(wm[:, None] - w[items_r][None, :])
            for kind, d in enumerate(deltas):
                new_max = np.where(d > 0, np.maximum(lm - d, loads[r] + d), np.inf)
                j = int(np.argmin(new_max))
                if new_max.flat[j] < best[0]:
                    a, b = np.unravel_index(j, new_max.shape)
                    best = (float(new_max.flat[j]), (r, int(items_m[a]), None if kind == 0 else int(items_r[b])))
        if best[1] is None:
            break
        r, a, b = best[1]
        rank_of[a] = r
        if b is not None:
            rank_of[b] = m
        loads = _loads(w, rank_of, k)
    return rank_of


def assign(weights: Sequence[float] | np.ndarray, num_ranks: int, *, refine: bool = True) -> Assignment:
    """Assign items of non-negative ``weights`` (seconds) to ``num_ranks`` ranks,
    minimising the largest per-rank sum (multiway number partitioning, NP-hard).

    LPT, then (with ``refine``) :func:`_refine`. Bound: makespan <= (4/3 - 1/(3
    num_ranks)) x optimum. ``optimal`` is True when the result meets the lower bound
    ``max(largest item, total / num_ranks)`` (or there is at most one item per rank).
    Deterministic: ties go to the lower index.
    """
    w = np.asarray(weights, dtype=np.float64)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError("weights must be finite and non-negative")
    k = num_ranks
    if len(w) == 0:
        return Assignment(np.zeros(0, dtype=np.int64), np.zeros(k), "empty", True)
    method, rank_of = "lpt", _lpt(w, k)
    if refine:
        refined = _refine(w, rank_of, k)
        if _loads(w, refined, k).max() < _loads(w, rank_of, k).max():
            method, rank_of = "lpt+refine", refined
    loads = _loads(w, rank_of, k)
    lower = max(float(w.max()), float(w.sum()) / k)
    optimal = len(w) <= k or float(loads.max()) <= lower * (1 + 1e-9)
    return Assignment(rank_of, loads, method, optimal)


@dataclass(frozen=True)
class _Piece:
    """The subtrees of the child nodes ``kids(anchor)[j] for j in kids`` (anchor -1: root
    nodes), with the path above them, plus ``carry``: sequences ending on that path that
    are assigned to this piece. Its sequences: ``carry`` and those ending in the subtrees."""

    anchor: int
    kids: tuple[int, ...]
    carry: tuple[int, ...] = ()


@dataclass(frozen=True)
class Piece:
    """One unit of work placed on a rank: a whole tree, or part of one.

    A part of a tree is a set of sibling subtrees plus the prefix path they hang from; the
    path's ``prefix_tokens`` are recomputed on every rank that holds a part of the tree
    and are included in ``features`` (exactly the features of the tree of ``sequences``).
    """

    rank: int
    tree: int  # root tree number (layout order) it comes from
    sequences: tuple[int, ...]  # input sequence indices, ascending
    prefix_tokens: int  # tokens of the shared path above the piece (0 for a whole tree)
    features: TreeFeatures
    cost: float  # marginal predicted seconds (CostModel.marginal)
    whole: bool  # the whole root tree


@dataclass
class Partition:
    """Sequences of a batch per data-parallel rank, with predicted seconds.

    ``ranks[r]``: input sequence indices of rank ``r`` (ascending); every input sequence
    appears on exactly one rank. ``features[r]``: exact features of the tree that rank
    builds from its sequences (prefixes of split trees included; pieces of one tree on the
    same rank share their prefix there). ``costs[r] = cost_model.predict(features[r])``.
    """

    ranks: list[list[int]]
    costs: list[float]
    features: list[TreeFeatures]
    pieces: list[Piece]
    method: str
    optimal: bool = False  # the piece assignment is proven optimal (for additive piece costs)
    total_tokens: int = 0  # unique tokens of the whole batch's tree (one rank)

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def makespan(self) -> float:
        """Predicted seconds of the slowest rank."""
        return max(self.costs)

    @property
    def imbalance(self) -> float:
        """max / mean predicted seconds over ranks (1.0 = perfectly balanced)."""
        mean = sum(self.costs) / len(self.costs)
        return self.makespan / mean if mean > 0 else 1.0

    @property
    def rank_tokens(self) -> list[int]:
        return [f.tokens for f in self.features]

    @property
    def extra_tokens(self) -> int:
        """Tokens computed more than once across ranks (prefixes of split trees)."""
        return sum(self.rank_tokens) - self.total_tokens

    @property
    def split_trees(self) -> int:
        return len({p.tree for p in self.pieces if not p.whole})

    def describe(self) -> str:
        return (
            f"{self.method}: {self.num_ranks} ranks, max {self.makespan:.3f} s, imbalance "
            f"{self.imbalance:.3f}, {len(self.pieces)} pieces ({self.split_trees} trees split, "
            f"{self.extra_tokens} extra tokens)"
        )


def _as_tree(tree_or_sequences: PrefixTree | Sequence[TokenSequence]) -> PrefixTree:
    if isinstance(tree_or_sequences, PrefixTree):
        return tree_or_sequences
    return PrefixTree.from_sequences(tree_or_sequences)


class _Splitter:
    """Pieces of a forest: their sequences, exact features and how to bisect them."""

    def __init__(self, forest: Forest, cost_model: CostModel):
        self.f = forest
        self.cm = cost_model
        self.sub_cost = forest.subtree_vectors() @ cost_model.coefficients[:4]

    def nodes(self, p: _Piece) -> np.ndarray:
        return self.f.kids(p.anchor)[list(p.kids)]

    def tree_no(self, p: _Piece) -> int:
        return int(self.f.root_of_node[self.nodes(p)[0]])

    def prefix_tokens(self, p: _Piece) -> int:
        """Tokens of the path above the piece's subtrees (recomputed with it)."""
        return int(self.f.pos[self.f.node_start[self.nodes(p)[0]]])

    def sequences(self, p: _Piece) -> np.ndarray:
        nodes = self.nodes(p)
        parts = [self.f.seqs_in(int(self.f.node_start[v]), int(self.f.node_sub_end[v])) for v in nodes.tolist()]
        return np.concatenate([np.array(p.carry, dtype=np.int64), *parts])

    def features(self, p: _Piece) -> TreeFeatures:
        r0, r1 = self.f.root_range(self.tree_no(p))
        return self.f.features(self.sequences(p), r0, r1)

    def bisect(self, p: _Piece) -> list[_Piece] | None:
        """Two pieces covering ``p``'s sequences, or None if ``p`` is one chain.

        A single subtree is first descended along single-child nodes (sequences ending on
        the way are carried down); at the first node with several children, the children
        are split into two groups of as equal subtree cost as possible (:func:`assign` with
        two ranks; the path above is in both); the carried sequences go with the group
        holding the first child."""
        anchor, kids, carry = p.anchor, p.kids, p.carry
        while len(kids) == 1:
            node = int(self.f.kids(anchor)[kids[0]])
            below = self.f.kids(node)
            if len(below) == 0:
                return None
            ending = self.f.seqs_in(int(self.f.node_start[node]), int(self.f.node_end[node]))
            carry = carry + tuple(ending.tolist())
            anchor, kids = node, tuple(range(len(below)))
        costs = self.sub_cost[self.f.kids(anchor)[list(kids)]]
        side = assign(costs, 2).rank_of
        side = side if side[0] == 0 else 1 - side
        first = tuple(j for j, s in zip(kids, side) if s == 0)
        second = tuple(j for j, s in zip(kids, side) if s == 1)
        return [_Piece(anchor, first, carry), _Piece(anchor, second)]


def partition(
    tree_or_sequences: PrefixTree | Sequence[TokenSequence],
    num_ranks: int,
    cost_model: CostModel | None = None,
    max_rank_tokens: int | None = None,
    split: bool = True,
    *,
    margin: float = 0.05,
    tolerance: float = 0.01,
    max_splits: int | None = None,
) -> Partition:
    """Assign the sequences of a batch to ``num_ranks`` ranks for equal predicted time.

    1. Pieces = the root trees of the forest, weighted by ``cost_model`` marginal costs
       (default :data:`DEFAULT_COST_MODEL`).
    2. With ``split`` and ``max_rank_tokens``: pieces with more tokens are bisected at
       subtree boundaries until they fit or are single chains. Bisecting a piece: descend
       its single-child nodes to the first node with several children, and split those
       children into two groups of as equal subtree cost as possible (2-way
       :func:`assign`); both halves keep the path above (see the module docstring).
    3. :func:`assign` the pieces. Then, with ``split``, while the imbalance of the additive
       loads exceeds ``1 + tolerance`` (at most ``max_splits`` times, default 4 x
       num_ranks): try bisecting (up to 4 per round, costliest first) the pieces costing
       more than ``(1 + margin)`` x the ideal share (total / num_ranks), then the pieces of
       the slowest rank; keep the first split whose re-assignment improves the loads
       (sorted descending, compared lexicographically: the slowest rank first). A split
       duplicates its prefix, so it is kept only when it pays for that.

    Returns a :class:`Partition`; deterministic for given inputs. ``max_rank_tokens``
    bounds the tokens of a piece (what one rank runs of one tree), not a rank's total
    (ranks run their pieces in micro-batches); a single chain longer than it stays whole.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    if max_rank_tokens is not None and max_rank_tokens < 1:
        raise ValueError(f"max_rank_tokens must be at least 1 token, got {max_rank_tokens}")
    tree = _as_tree(tree_or_sequences)
    cm = cost_model or DEFAULT_COST_MODEL
    forest = Forest(tree)
    sp = _Splitter(forest, cm)
    k = num_ranks
    max_splits = 4 * k if max_splits is None else max_splits

    pieces = [_Piece(-1, (r,)) for r in range(len(forest.roots))]
    table = forest.root_table()
    feats = [TreeFeatures(*row) for row in table.tolist()]
    costs = [cm.marginal(f) for f in feats]

    def replace(i: int, halves: list[_Piece]) -> tuple[list, list, list]:
        hf = [sp.features(h) for h in halves]
        return (pieces[:i] + halves + pieces[i + 1:], feats[:i] + hf + feats[i + 1:],
                costs[:i] + [cm.marginal(f) for f in hf] + costs[i + 1:])

    chains: set[_Piece] = set()  # pieces that cannot be bisected (single chains)

    if split and max_rank_tokens is not None:  # a hard limit: bisect until pieces fit
        while True:
            over = [i for i, f in enumerate(feats) if f.tokens > max_rank_tokens and pieces[i] not in chains]
            if not over:
                break
            i = max(over, key=lambda j: (feats[j].tokens, -j))
            halves = sp.bisect(pieces[i])
            if halves is None:
                chains.add(pieces[i])
            else:
                pieces, feats, costs = replace(i, halves)

    best = assign(costs, k)
    splits = 0
    while split and splits < max_splits:
        loads = best.loads
        if loads.max() <= loads.mean() * (1 + tolerance):
            break
        # Candidates: pieces over the ideal share (they alone exceed it), then the pieces of
        # the slowest rank; costliest first, at most 4 tried per round.
        share = sum(costs) / k * (1 + margin)
        slow = int(np.argmax(loads))
        by_cost = sorted(range(len(pieces)), key=lambda j: (-costs[j], j))
        candidates = [j for j in by_cost if costs[j] > share] + [j for j in by_cost if best.rank_of[j] == slow]
        candidates = [j for j in dict.fromkeys(candidates) if pieces[j] not in chains][:4]
        accepted = False
        for i in candidates:
            halves = sp.bisect(pieces[i])
            if halves is None:
                chains.add(pieces[i])
                continue
            trial_pieces, trial_feats, trial_costs = replace(i, halves)
            trial = assign(trial_costs, k)
            if _lex_better(trial.loads, best.loads):
                pieces, feats, costs, best = trial_pieces, trial_feats, trial_costs, trial
                accepted = True
                break
        if not accepted:
            break
        splits += 1

    return _finish(tree, forest, sp, pieces, feats, costs, best, cm)


def _lex_better(a: np.ndarray, b: np.ndarray) -> bool:
    """Loads ``a`` beat ``b``: sorted descending, the first clear difference is lower."""
    sa, sb = np.sort(a)[::-1], np.sort(b)[::-1]
    scale = max(float(sb[0]), 1e-30)
    for x, y in zip(sa, sb):
        if abs(x - y) > 1e-9 * scale:
            return x < y
    return False


def _finish(tree, forest, sp, pieces, feats, costs, final: Assignment, cm) -> Partition:
    k = len(final.loads)
    seqs = [np.sort(sp.sequences(p)) for p in pieces]
    per_rank = [np.sort(np.concatenate([seqs[i] for i in np.flatnonzero(final.rank_of == r)] or
                                       [np.zeros(0, np.int64)])) for r in range(k)]
    # Canonical rank order: by smallest sequence held, empty ranks last.
    order = sorted(range(k), key=lambda r: (len(per_rank[r]) == 0, per_rank[r][0] if len(per_rank[r]) else 0))
    new_rank = np.empty(k, dtype=np.int64)
    new_rank[order] = np.arange(k)
    ranks = [per_rank[r].tolist() for r in order]
    rank_feats = [forest.set_features(np.asarray(s, dtype=np.int64)) for s in ranks]
    out_pieces = [
        Piece(
            rank=int(new_rank[final.rank_of[i]]),
            tree=sp.tree_no(p),
            sequences=tuple(seqs[i].tolist()),
            prefix_tokens=sp.prefix_tokens(p),
            features=feats[i],
            cost=costs[i],
            whole=p.anchor < 0,
        )
        for i, p in enumerate(pieces)
    ]
    return Partition(
        ranks=ranks,
        costs=[cm.predict(f) for f in rank_feats],
        features=rank_feats,
        pieces=out_pieces,
        method="tree-aware",
        optimal=final.optimal,
        total_tokens=tree.num_tree_tokens,
    )


# =========================================================================== baseline
def equal_token_partition(
    tree_or_sequences: PrefixTree | Sequence[TokenSequence],
    num_ranks: int,
    cost_model: CostModel | None = None,
    how: str = "greedy",
) -> Partition:
    """Baselines that equalise token counts, with the same predicted costs as
    :func:`partition` (each rank builds the prefix tree of the sequences it gets).

    ``how``:
    - ``"greedy"``: sequences longest first, each to the rank with the fewest flat tokens
      (what balancing by sequence length does; groups get scattered across ranks);
    - ``"contiguous"``: input order cut into ``num_ranks`` runs of ~equal flat tokens;
    - ``"trees"``: whole trees, largest first, to the rank with the fewest unique tokens.
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    tree = _as_tree(tree_or_sequences)
    cm = cost_model or DEFAULT_COST_MODEL
    forest = Forest(tree)
    lengths = forest.seq_len.astype(np.float64)
    k = num_ranks
    if how == "greedy":
        rank_of = _lpt(lengths, k)
    elif how == "contiguous":
        cum = np.cumsum(lengths) - lengths / 2  # midpoint of each sequence
        rank_of = np.minimum((cum * k / lengths.sum()).astype(np.int64), k - 1)
    elif how == "trees":
        tree_rank = _lpt(forest.root_table()[:, 0].astype(np.float64), k)
        rank_of = tree_rank[forest.root_of_seq]
    else:
        raise ValueError(f"unknown equal-token baseline {how!r}: choose greedy, contiguous or trees")
    ranks = [np.flatnonzero(rank_of == r).tolist() for r in range(k)]
    feats = [forest.set_features(np.asarray(s, dtype=np.int64)) for s in ranks]
    return Partition(
        ranks=ranks,
        costs=[cm.predict(f) for f in feats],
        features=feats,
        pieces=[],
        method=f"equal-tokens ({how})",
        total_tokens=tree.num_tree_tokens,
    )
