"""What a prefix tree costs the engine, as numbers (the cost model's inputs).

:class:`TreeFeatures`: unique tokens, attention pairs (sum over tokens of the keys each
sees, ``position + 1``), nodes, leaves and sequences of a tree, of each root tree of a
forest, or of any subset of the sequences -- always exactly the features of
``PrefixTree.from_sequences(subset)``, computed with vectorised numpy on the existing tree
(no rebuild). :class:`Forest` holds the per-node tables this and the partitioner
(:mod:`treerl.distributed.partitioner`) need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..engine.tree import PrefixTree

__all__ = ["TreeFeatures", "Forest", "tree_features", "root_features", "sequence_set_features"]


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
    f = Forest(tree)
    return [TreeFeatures(*row) for row in f.root_table().tolist()]


def sequence_set_features(tree: PrefixTree, seq_ids: Sequence[int] | np.ndarray) -> TreeFeatures:
    """Exact features of ``PrefixTree.from_sequences([tree.sequence(i) for i in seq_ids])``
    (without building it); ``seq_ids`` are distinct input sequence indices. O(tree tokens)."""
    return Forest(tree).set_features(np.asarray(seq_ids, dtype=np.int64))


class Forest:
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
