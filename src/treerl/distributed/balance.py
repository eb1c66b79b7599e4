"""Tree-aware load balancing for data-parallel training (DESIGN.md, "Distributed").

Every data-parallel rank runs one ``forward_backward`` over the prefix tree of the
sequences it is given; the step waits for the slowest rank. This module assigns the
sequences of a batch to ranks so that the *predicted step times* are equal (not the token
counts: a tree's cost depends on its unique tokens, its attention pairs and its shape).

Three parts:

1. **Features** (:class:`TreeFeatures`): unique tokens, attention pairs (sum over tokens of
   the keys each sees, ``position + 1``), nodes, leaves and sequences of a tree, of each
   root tree of a forest, or of any subset of the sequences -- always exactly the features
   of ``PrefixTree.from_sequences(subset)``, computed with vectorised numpy on the
   existing tree (no rebuild).
2. **Cost model** (:class:`CostModel`): seconds of one ``forward_backward`` call =
   ``per_call + per_token * tokens + per_pair * attention_pairs + per_node * nodes +
   per_leaf * leaves``, fitted by non-negative least squares (:func:`nnls`) to measured
   step times (``bench/bench_balance.py --fit``). Shipped: :data:`ESTIMATED_COST_MODEL`
   (from FLOPs, Qwen3-1.7B bf16) and :data:`DEFAULT_COST_MODEL` = :data:`FITTED_COST_MODEL`
   (the same shape fitted on an H200; valid for that setting only).
3. **Partitioner** (:func:`partition`): pieces = whole trees; trees too costly for one
   rank are split at subtree boundaries into *pieces* (a piece = a set of sibling subtrees
   plus the prefix path they hang from; the prefix is recomputed on every rank that holds
   part of the tree, and counted in each piece's features). Pieces are assigned by the
   better of greedy LPT and Karmarkar-Karp differencing, improved by pairwise moves and
   swaps, and solved exactly (branch and bound) when there are few pieces. Further splits
   are made while they lower the slowest rank. :func:`equal_token_partition` is the
   baseline that equalises token counts instead.

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
bound: the result is never worse than LPT's), and optimal when there are at most
``exact_max_pieces`` pieces and the search finishes within its node budget
(``Partition.optimal`` says so).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from ..tree import PrefixTree, TokenSequence

__all__ = [
    "TreeFeatures",
    "CostModel",
    "DEFAULT_COST_MODEL",
    "ESTIMATED_COST_MODEL",
    "FITTED_COST_MODEL",
    "default_cost_model",
    "nnls",
    "tree_features",
    "root_features",
    "sequence_set_features",
    "Assignment",
    "assign",
    "Piece",
    "Partition",
    "partition",
    "equal_token_partition",
]

_EPS = 1e-12  # relative tolerance of cost comparisons


# =========================================================================== features
@dataclass(frozen=True)
class TreeFeatures:
    """What one tree (or the tree of a set of sequences) costs the engine.

    tokens: unique tree tokens (the tokens the tree engine computes).
    attention_pairs: query-key pairs of tree attention, ``sum(position + 1)`` over tokens.
    nodes: maximal runs of tokens shared by the same sequences (``PrefixTree.num_nodes``).
    leaves: nodes without children.
    sequences: input sequences (flat sequences; duplicates counted).
    """

    tokens: int = 0
    attention_pairs: int = 0
    nodes: int = 0
    leaves: int = 0
    sequences: int = 0

    def __add__(self, other: "TreeFeatures") -> "TreeFeatures":
        return TreeFeatures(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int, int]:
        return (self.tokens, self.attention_pairs, self.nodes, self.leaves, self.sequences)

    def vector(self) -> np.ndarray:
        """[tokens, attention_pairs, nodes, leaves] as float64 (the cost model's inputs)."""
        return np.array([self.tokens, self.attention_pairs, self.nodes, self.leaves], dtype=np.float64)


def tree_features(tree: PrefixTree) -> TreeFeatures:
    """Features of the whole forest ``tree``."""
    return TreeFeatures(
        tokens=tree.num_tree_tokens,
        attention_pairs=tree.attention_pairs,
        nodes=tree.num_nodes,
        leaves=tree.num_leaves,
        sequences=tree.num_sequences,
    )


def root_features(tree: PrefixTree) -> list[TreeFeatures]:
    """Features of each root tree of the forest, in layout order (vectorised).

    Root trees are contiguous in the DFS layout: the root of tree ``r`` is the ``r``-th
    token with ``parent < 0``; its sequences are those whose last token lies in it.
    """
    f = _Forest(tree)
    return [TreeFeatures(*row) for row in f.root_table().tolist()]


def sequence_set_features(tree: PrefixTree, seq_ids: Sequence[int] | np.ndarray) -> TreeFeatures:
    """Exact features of ``PrefixTree.from_sequences([tree.sequence(i) for i in seq_ids])``
    (without building it); ``seq_ids`` are distinct input sequence indices. O(tree tokens)."""
    return _Forest(tree).set_features(np.asarray(seq_ids, dtype=np.int64))


class _Forest:
    """Numpy views of a PrefixTree and the per-node tables the partitioner needs."""

    def __init__(self, tree: PrefixTree):
        self.tree = tree
        self.pos = tree.position.numpy()
        self.parent = tree.parent.numpy()
        self.sub_end = tree.subtree_end.numpy()
        self.n = len(self.pos)
        self.node_start = tree.node_start.numpy()
        self.node_end = tree.node_end.numpy()
        self.node_parent = tree.node_parent.numpy()
        self.node_sub_end = self.sub_end[self.node_start]
        offsets = tree.seq_offsets.numpy()
        self.seq_len = np.diff(offsets)
        self.last = tree.seq_index.numpy()[offsets[1:] - 1]  # tree token where each sequence ends
        self.by_last = np.argsort(self.last, kind="stable")
        self.last_sorted = self.last[self.by_last]
        self.pairs_cum = np.concatenate([[0], np.cumsum(self.pos + 1)])
        m = len(self.node_start)
        # Children of each node (CSR, layout order); "node -1" holds the roots.
        self._child_order = np.argsort(self.node_parent, kind="stable")
        self._child_offsets = np.concatenate([[0], np.cumsum(np.bincount(self.node_parent + 1, minlength=m + 1))])
        self.roots = self.kids(-1)
        self.root_of_node = np.cumsum(self.node_parent < 0) - 1
        self.root_of_seq = np.searchsorted(self.node_start[self.roots], self.last, side="right") - 1
        self._table: np.ndarray | None = None  # root_table(), computed on first use

    # ---------------------------------------------------------------- tables
    def kids(self, anchor: int) -> np.ndarray:
        """Child nodes of node ``anchor`` in layout order (``anchor=-1``: the root nodes)."""
        return self._child_order[self._child_offsets[anchor + 1] : self._child_offsets[anchor + 2]]

    def seqs_in(self, a: int, b: int) -> np.ndarray:
        """Sequences whose last token is in ``[a, b)``, ordered by that token (stable)."""
        i, j = np.searchsorted(self.last_sorted, [a, b])
        return self.by_last[i:j]

    def root_range(self, root_no: int) -> tuple[int, int]:
        r = self.roots[root_no]
        return int(self.node_start[r]), int(self.node_sub_end[r])

    def root_table(self) -> np.ndarray:
        """[roots, 5] int64: tokens, pairs, nodes, leaves, sequences of each root tree."""
        if self._table is None:
            self._table = self._root_table()
        return self._table

    def _root_table(self) -> np.ndarray:
        starts = self.node_start[self.roots]
        ends = self.node_sub_end[self.roots]
        tokens = ends - starts
        pairs = self.pairs_cum[ends] - self.pairs_cum[starts]
        node_root = self.root_of_node
        nroots = len(self.roots)
        nodes = np.bincount(node_root, minlength=nroots)
        has_child = np.zeros(len(self.node_start), dtype=bool)
        has_child[self.node_parent[self.node_parent >= 0]] = True
        leaves = np.bincount(node_root[~has_child], minlength=nroots)
        seqs = np.bincount(self.root_of_seq, minlength=nroots)
        return np.stack([tokens, pairs, nodes, leaves, seqs], axis=1).astype(np.int64)

    def subtree_vectors(self) -> np.ndarray:
        """[nodes, 4] float64 features (tokens, pairs, nodes, leaves) of each node's subtree,
        without the path above it (used to balance a bisection)."""
        start, end = self.node_start, self.node_sub_end
        m = len(start)
        has_child = np.zeros(m, dtype=bool)
        has_child[self.node_parent[self.node_parent >= 0]] = True
        leaf_cum = np.concatenate([[0], np.cumsum(~has_child)])
        node_stop = np.searchsorted(start, end)  # first node outside the subtree
        idx = np.arange(m)
        return np.stack([
            end - start,
            self.pairs_cum[end] - self.pairs_cum[start],
            node_stop - idx,
            leaf_cum[node_stop] - leaf_cum[idx],
        ], axis=1).astype(np.float64)

    # --------------------------------------------------------------- features
    def set_features(self, seqs: np.ndarray) -> TreeFeatures:
        """Exact features of the tree of sequences ``seqs`` (distinct), root tree by root
        tree: the table row where a root tree's sequences are all there, else the
        features over that root tree's token range (root trees share nothing)."""
        table = self.root_table()
        seqs = np.asarray(seqs, dtype=np.int64)
        roots = self.root_of_seq[seqs]
        order = np.argsort(roots, kind="stable")
        present, first, counts = np.unique(roots[order], return_index=True, return_counts=True)
        complete = counts == table[present, 4]
        total = TreeFeatures(*table[present[complete]].sum(axis=0).tolist()) if complete.any() else TreeFeatures()
        for r, f, c in zip(present[~complete], first[~complete], counts[~complete]):
            lo, hi = self.root_range(int(r))
            total = total + self.features(seqs[order[f:f + c]], lo, hi)
        return total

    def features(self, seqs: np.ndarray, lo: int, hi: int) -> TreeFeatures:
        """Exact features of the tree of sequences ``seqs``, all of whose paths lie in the
        token range ``[lo, hi)`` (a root tree's range, or the whole forest).

        The tokens of that tree are the ancestors-or-self of the sequences' last tokens;
        a token starts a node iff it is a root, its parent has a number of kept children
        other than one, or a kept sequence ends at its parent (PrefixTree's rule).
        """
        if len(seqs) == 0:
            return TreeFeatures()
        n = hi - lo
        ends = np.bincount(self.last[seqs] - lo, minlength=n)
        marked = np.concatenate([[0], np.cumsum(ends > 0)])
        sub_end = self.sub_end[lo:hi] - lo
        keep = marked[sub_end] > marked[:-1]  # some kept sequence ends in [t, subtree_end[t])
        parent = self.parent[lo:hi][keep] - lo  # a root's parent stays negative
        has_parent = parent >= 0
        kids = np.bincount(parent[has_parent], minlength=n)
        safe = np.where(has_parent, parent, 0)
        starts = ~has_parent | (kids[safe] != 1) | (ends[safe] > 0)
        return TreeFeatures(
            tokens=int(keep.sum()),
            attention_pairs=int((self.pos[lo:hi][keep] + 1).sum()),
            nodes=int(starts.sum()),
            leaves=int((kids[keep] == 0).sum()),
            sequences=int(len(seqs)),
        )


# ========================================================================= cost model
def _nnls_active_set(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Lawson-Hanson active-set NNLS: argmin ||a x - b|| subject to x >= 0."""
    m, n = a.shape
    max_iter = max_iter or 30 * max(n, 1)
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(np.abs(a).sum(axis=0).max(initial=0.0), 1.0)
    w = a.T @ (b - a @ x)
    it = 0
    while (~passive).any() and np.max(np.where(passive, -np.inf, w)) > tol and it < max_iter:
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while it < max_iter:
            it += 1
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > tol):
                x = z
                break
            blocking = passive & (z <= tol)
            alpha = np.min(x[blocking] / (x[blocking] - z[blocking]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def nnls(a: np.ndarray, b: np.ndarray, *, use_scipy: bool = True) -> np.ndarray:
    """Non-negative least squares: ``argmin_x ||a @ x - b||_2`` with ``x >= 0``.

    Columns are scaled to unit norm first (features differ by ~10 orders of magnitude).
    Uses ``scipy.optimize.nnls`` when scipy is importable (and ``use_scipy``), otherwise a
    Lawson-Hanson active-set solver (scipy is not a dependency of treerl).
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls: need a [m, n] matrix and an [m] vector, got {a.shape} and {b.shape}")
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    scaled = a / scale
    x = None
    if use_scipy:
        try:
            from scipy.optimize import nnls as scipy_nnls
        except ImportError:
            scipy_nnls = None
        if scipy_nnls is not None:
            x = scipy_nnls(scaled, b)[0]
    if x is None:
        x = _nnls_active_set(scaled, b)
    return np.maximum(x, 0.0) / scale


@dataclass(frozen=True)
class CostModel:
    """Seconds of one ``TreeEngine.forward_backward`` call over a tree with given features:

    ``per_call + per_token * tokens + per_pair * attention_pairs + per_node * nodes
    + per_leaf * leaves`` (0 for an empty tree). All coefficients are seconds per unit and
    non-negative. Linear, so a rank's cost is ``per_call`` plus the sum of its pieces'
    :meth:`marginal` costs (the partitioner's additive weights).
    """

    per_token: float = 0.0  # s per unique tree token
    per_pair: float = 0.0  # s per attention query-key pair
    per_node: float = 0.0  # s per node
    per_leaf: float = 0.0  # s per leaf node
    per_call: float = 0.0  # s per forward_backward call (fixed overhead)
    name: str = ""
    source: str = "estimate"  # "estimate" or a description of the measurements it was fitted to
    fit_stats: dict = field(default_factory=dict, compare=False)

    COLUMNS = ("tokens", "attention_pairs", "nodes", "leaves", "calls")

    @property
    def coefficients(self) -> np.ndarray:
        """[per_token, per_pair, per_node, per_leaf, per_call]."""
        return np.array([self.per_token, self.per_pair, self.per_node, self.per_leaf, self.per_call])

    def marginal(self, features: TreeFeatures) -> float:
        """Seconds the features add to a call (everything but ``per_call``)."""
        return float(self.coefficients[:4] @ features.vector())

    def predict(self, features: TreeFeatures) -> float:
        """Predicted seconds of one forward_backward over a tree with ``features``."""
        return 0.0 if features.tokens == 0 else self.per_call + self.marginal(features)

    def predict_many(self, features: Sequence[TreeFeatures]) -> np.ndarray:
        return np.array([self.predict(f) for f in features])

    @staticmethod
    def design_matrix(features: Sequence[TreeFeatures]) -> np.ndarray:
        """[len(features), 5]: tokens, pairs, nodes, leaves, 1 (one call each)."""
        return np.array([[*f.vector(), 1.0] for f in features], dtype=np.float64).reshape(-1, 5)

    @staticmethod
    def fit(
        features: Sequence[TreeFeatures],
        seconds: Sequence[float],
        *,
        relative: bool = True,
        name: str = "",
        source: str = "fitted",
    ) -> "CostModel":
        """Fit all five coefficients (>= 0) to measured seconds of one call per tree.

        ``relative=True`` minimises squared *relative* errors (rows divided by the measured
        time), so small and large trees weigh alike; else absolute seconds.
        """
        x_mat = CostModel.design_matrix(features)
        y = np.asarray(seconds, dtype=np.float64)
        if len(y) != len(x_mat) or len(y) == 0:
            raise ValueError(f"fit: {len(x_mat)} feature rows and {len(y)} timings")
        if np.any(y <= 0) or not np.all(np.isfinite(y)):
            raise ValueError("fit: timings must be positive, finite seconds")
        w = 1.0 / y if relative else np.ones_like(y)
        coef = nnls(x_mat * w[:, None], y * w).tolist()
        stats = CostModel(*coef).quality(features, y)
        return CostModel(*coef, name=name, source=source, fit_stats=stats)

    def quality(self, features: Sequence[TreeFeatures], seconds: Sequence[float]) -> dict:
        """R^2, max and mean relative error of the predictions against measured seconds."""
        y = np.asarray(seconds, dtype=np.float64)
        pred = self.predict_many(features)
        ss_res = float(((y - pred) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum())
        rel = np.abs(pred - y) / y
        return {
            "n": int(len(y)),
            "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float("nan"),
            "max_rel_err": float(rel.max()),
            "mean_rel_err": float(rel.mean()),
        }

    @staticmethod
    def from_flops(
        params: float,
        layers: int,
        heads: int,
        head_dim: int,
        *,
        achieved_tflops: float = 275.0,
        per_call_s: float = 0.12,
        name: str = "",
    ) -> "CostModel":
        """An *estimate* from FLOPs: forward+backward matmuls ``6 * params`` per token and
        attention ``12 * layers * heads * head_dim`` per query-key pair, at
        ``achieved_tflops``; ``per_call_s`` of fixed overhead per call; nodes and leaves
        free. Replace by a fit (``bench/bench_balance.py --fit``) on the target GPU."""
        rate = achieved_tflops * 1e12
        return CostModel(
            per_token=6.0 * params / rate,
            per_pair=12.0 * layers * heads * head_dim / rate,
            per_call=per_call_s,
            name=name,
            source=f"estimate: {achieved_tflops:g} TFLOP/s on 6*params*tokens + attention FLOPs, "
            f"{per_call_s:g} s per call; not fitted",
        )

    # ------------------------------------------------------------------- files
    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path) -> "CostModel":
        data = json.loads(Path(path).read_text())
        known = {f for f in CostModel.__dataclass_fields__}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"{path}: unknown cost model fields {sorted(unknown)}")
        return CostModel(**data)

    def describe(self) -> str:
        return (
            f"CostModel({self.name or 'unnamed'}: {self.per_call * 1e3:.1f} ms/call + "
            f"{self.per_token * 1e6:.2f} us/token + {self.per_pair * 1e9:.3f} ns/pair + "
            f"{self.per_node * 1e6:.1f} us/node + {self.per_leaf * 1e6:.1f} us/leaf; {self.source})"
        )


# An ESTIMATE, not a measurement: Qwen3-1.7B shape (28 layers, 16 heads of 128), bf16 on
# one H100/H200, at the ~275 TFLOP/s that the packed tree engine reached on unique tokens
# (bench/RESULTS.md) and ~0.12 s per forward_backward call of fixed overhead.
ESTIMATED_COST_MODEL = CostModel.from_flops(
    1.7e9, layers=28, heads=16, head_dim=128, achieved_tflops=275.0, per_call_s=0.12,
    name="qwen3-1.7b bf16 H100/H200 (FLOP estimate)",
)

# FITTED on one NVIDIA H200 (2026-11-22, torch 2.11.0+cu130, code of commit 4fe9cd3 plus
# this module): ``bench/bench_balance.py --fit --device cuda`` with the Qwen3-1.7B shape,
# bf16, TreeEngine mode "auto", max_tokens 16384; the 78 measured random batches of
# 2,048-32,768 unique tokens (of 132; smaller ones are launch-bound, and rank shares are
# larger). Held-out (every 4th): R^2 0.971, max relative error 0.137, mean 0.049. Checked
# on 116 independently measured rank shares of the grpo/agentic/mixed workloads split over
# 2-8 ranks (``--measure``): R^2 0.994, mean relative error 0.033 (max 0.35, one share).
# Only valid for that shape, dtype, engine mode and budget: refit for anything else.
FITTED_COST_MODEL = CostModel(
    per_token=3.2009e-05,
    per_pair=3.7189e-09,
    per_node=0.0,
    per_leaf=1.5510e-04,
    per_call=4.9404e-02,
    name="qwen3-1.7b bf16 H200 auto/16384 (fitted)",
    source="fitted: bench/bench_balance.py --fit on NVIDIA H200, qwen3-1.7b bfloat16, TreeEngine auto "
    "max_tokens 16384, 78 batches of 2048-32768 tokens, 2026-11-22; held-out R^2 0.971",
)

# The default: the H200 fit. For another GPU, model shape or engine setting, fit one with
# bench/bench_balance.py --fit and pass it (or its JSON through default_cost_model(path)).
DEFAULT_COST_MODEL = FITTED_COST_MODEL


def default_cost_model(path: str | Path | None = None) -> CostModel:
    """The cost model in ``path`` (JSON written by :meth:`CostModel.save`), else the
    shipped :data:`DEFAULT_COST_MODEL` (:data:`FITTED_COST_MODEL`)."""
    return CostModel.load(path) if path is not None else DEFAULT_COST_MODEL


# ========================================================================= assignment
@dataclass(frozen=True)
class Assignment:
    """Items (pieces) assigned to ranks: ``rank_of[i]`` and the summed weight per rank."""

    rank_of: np.ndarray  # [items] int64
    loads: np.ndarray  # [ranks] float64
    method: str
    optimal: bool = False  # proven optimal (exact search finished or lower bound met)

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


def _karmarkar_karp(w: np.ndarray, k: int) -> np.ndarray:
    """Largest differencing method for k-way partitioning (Karmarkar & Karp, 1982).

    Each item starts as a k-tuple of subsets (the item, then empties); the two tuples with
    the largest spread (max - min load) are merged, largest subset with smallest, until
    one tuple remains. A tuple is (loads, representatives) sorted by load, descending;
    the items of a subset are a union-find class (-1: empty), so a merge costs O(k log k).
    """
    n = len(w)
    parent = list(range(n))
    heap = [(-float(w[i]), i, [float(w[i])] + [0.0] * (k - 1), [i] + [-1] * (k - 1)) for i in range(n)]
    heapq.heapify(heap)
    tie = n
    while len(heap) > 1:
        _, _, load_a, rep_a = heapq.heappop(heap)
        _, _, load_b, rep_b = heapq.heappop(heap)
        loads, reps = [], []
        for j in range(k):
            a, b = rep_a[j], rep_b[k - 1 - j]
            if a >= 0 and b >= 0:
                parent[b] = a  # both are class roots
            loads.append(load_a[j] + load_b[k - 1 - j])
            reps.append(a if a >= 0 else b)
        order = sorted(range(k), key=lambda j: -loads[j])  # stable: deterministic on ties
        loads, reps = [loads[j] for j in order], [reps[j] for j in order]
        heapq.heappush(heap, (-(loads[0] - loads[-1]), tie, loads, reps))
        tie += 1

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    rank_of = np.zeros(n, dtype=np.int64)
    if heap:
        label = {rep: r for r, rep in enumerate(heap[0][3]) if rep >= 0}
        rank_of[:] = [label[find(i)] for i in range(n)]
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


def _exact(w: np.ndarray, k: int, incumbent: np.ndarray, node_budget: int) -> tuple[np.ndarray, bool]:
    """Branch and bound over assignments (heaviest items first, ranks of equal load tried
    once). Returns the best assignment found and whether the search finished."""
    n = len(w)
    order = np.lexsort((np.arange(n), -w)).tolist()
    ws = [float(w[i]) for i in order]
    suffix = np.concatenate([np.cumsum(ws[::-1])[::-1], [0.0]]).tolist()
    best_rank = incumbent.copy()
    best = float(_loads(w, incumbent, k).max())
    lower = max(ws[0] if ws else 0.0, float(w.sum()) / k)
    if best <= lower * (1 + 1e-9):
        return best_rank, True
    loads = [0.0] * k
    current = [0] * n
    visited = 0
    finished = True

    def dfs(pos: int, cur_max: float) -> None:
        nonlocal best, best_rank, visited, finished
        if visited >= node_budget:
            finished = False
            return
        visited += 1
        if pos == n:
            if cur_max < best * (1 - 1e-12):
                best = cur_max
                best_rank = np.empty(n, dtype=np.int64)
                best_rank[order] = current
            return
        # Even a perfect spread of what is left cannot beat the incumbent: prune.
        if max(cur_max, (sum(loads) + suffix[pos]) / k) >= best * (1 - 1e-12):
            return
        seen: set[float] = set()
        for r in range(k):
            load = loads[r]
            if load in seen or load + ws[pos] >= best * (1 - 1e-12):
                continue
            seen.add(load)
            loads[r] = load + ws[pos]
            current[pos] = r
            dfs(pos + 1, max(cur_max, loads[r]))
            loads[r] = load
            if best <= lower * (1 + 1e-9):
                return

    dfs(0, 0.0)
    return best_rank, finished or best <= lower * (1 + 1e-9)


def assign(
    weights: Sequence[float] | np.ndarray,
    num_ranks: int,
    *,
    exact_max_pieces: int = 12,
    node_budget: int = 200_000,
    refine: bool = True,
) -> Assignment:
    """Assign items of non-negative ``weights`` (seconds) to ``num_ranks`` ranks,
    minimising the largest per-rank sum (multiway number partitioning, NP-hard).

    LPT and Karmarkar-Karp, the better kept (LPT on ties), then :func:`_refine`; with at
    most ``exact_max_pieces`` items, branch and bound from there (``node_budget`` search
    nodes). Bound: makespan <= (4/3 - 1/(3 num_ranks)) x optimum (never worse than LPT);
    ``optimal`` is True when proven optimal. Deterministic: ties go to the lower index.
    """
    w = np.asarray(weights, dtype=np.float64)
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError("weights must be finite and non-negative")
    k = num_ranks
    if len(w) == 0:
        return Assignment(np.zeros(0, dtype=np.int64), np.zeros(k), "empty", True)
    candidates = [("lpt", _lpt(w, k)), ("kk", _karmarkar_karp(w, k))]
    method, rank_of = min(candidates, key=lambda c: _loads(w, c[1], k).max())  # first on ties
    if refine:
        refined = _refine(w, rank_of, k)
        if _loads(w, refined, k).max() < _loads(w, rank_of, k).max():
            method, rank_of = method + "+refine", refined
    optimal = len(w) <= k  # one item per rank (or fewer): nothing to balance
    if not optimal and len(w) <= exact_max_pieces:
        exact, optimal = _exact(w, k, rank_of, node_budget)
        if _loads(w, exact, k).max() < _loads(w, rank_of, k).max():
            method, rank_of = "exact", exact
    return Assignment(rank_of, _loads(w, rank_of, k), method, optimal)


# ========================================================================= partition
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

    def __init__(self, forest: _Forest, cost_model: CostModel):
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
    exact_max_pieces: int = 12,
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
    4. The final assignment is solved exactly when there are at most ``exact_max_pieces``
       pieces (:func:`assign`).

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
    forest = _Forest(tree)
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

    best = assign(costs, k, exact_max_pieces=0)
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
            trial = assign(trial_costs, k, exact_max_pieces=0)
            if _lex_better(trial.loads, best.loads):
                pieces, feats, costs, best = trial_pieces, trial_feats, trial_costs, trial
                accepted = True
                break
        if not accepted:
            break
        splits += 1

    final = assign(costs, k, exact_max_pieces=exact_max_pieces)
    return _finish(tree, forest, sp, pieces, feats, costs, final, cm)


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
    forest = _Forest(tree)
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
