"""The prefix tree: a forest of token sequences with every shared prefix stored once.

Layout (DESIGN.md, "The tree"): tree tokens in DFS preorder, children in lexicographic
order of their sequences. Per tree token: ``token_ids``, ``position`` (depth on its
root-to-leaf path, used by RoPE), ``parent`` (previous token on the path, -1 at a root)
and ``subtree_end`` (exclusive end of its subtree in the layout). Query ``q`` may attend
key ``k`` iff ``k <= q < subtree_end[k]``. A *node* is a maximal run of tokens shared by
the same set of sequences. Every sequence keeps its identity through a gather map, so
duplicates and strict prefixes of other sequences are legal.

Building is vectorised (one sort of the sequences, longest common prefixes of sorted
neighbours, forward fills): it runs every training step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

TokenSequence = Sequence[int] | torch.Tensor | np.ndarray


@dataclass(frozen=True)
class PrefixTree:
    """A prefix forest over ``num_sequences`` token sequences (all tensors int64, on CPU).

    Tree-token arrays have length ``N = num_tree_tokens``; node arrays length ``M``;
    ``seq_index`` (length ``num_flat_tokens``) lists, sequence after sequence in input
    order, the tree token at each position of each sequence; sequence ``i`` occupies
    ``seq_index[seq_offsets[i]:seq_offsets[i + 1]]``.
    """

    token_ids: torch.Tensor  # [N] vocabulary ids
    position: torch.Tensor  # [N] depth (0 at a root)
    parent: torch.Tensor  # [N] index of the previous token on the path, -1 at a root
    subtree_end: torch.Tensor  # [N] exclusive end of the token's subtree in the layout
    node_start: torch.Tensor  # [M] first tree token of each node
    node_end: torch.Tensor  # [M] exclusive end of each node (a node is contiguous)
    node_parent: torch.Tensor  # [M] parent node, -1 at a root
    seq_index: torch.Tensor  # [F] tree token of every flat token, input order
    seq_offsets: torch.Tensor  # [S + 1]

    # ----------------------------------------------------------------- sizes
    @property
    def num_sequences(self) -> int:
        return len(self.seq_offsets) - 1

    @property
    def num_flat_tokens(self) -> int:
        """Sum of the sequences' lengths: what training without sharing processes."""
        return len(self.seq_index)

    @property
    def num_tree_tokens(self) -> int:
        """Unique token positions: what the tree engines process."""
        return len(self.token_ids)

    @property
    def num_nodes(self) -> int:
        return len(self.node_start)

    @property
    def num_roots(self) -> int:
        return int((self.node_parent < 0).sum())

    @property
    def num_leaves(self) -> int:
        """Nodes without children."""
        has_child = torch.zeros(self.num_nodes, dtype=torch.bool)
        has_child[self.node_parent[self.node_parent >= 0]] = True
        return int((~has_child).sum())

    @property
    def seq_lengths(self) -> torch.Tensor:
        return self.seq_offsets[1:] - self.seq_offsets[:-1]

    @property
    def ideal_ratio(self) -> float:
        """Flat tokens over tree tokens: the speed-up if cost were linear in tokens."""
        return self.num_flat_tokens / self.num_tree_tokens

    @property
    def attention_pairs(self) -> int:
        """Query-key pairs of tree attention: each token sees its depth + 1 keys."""
        return int((self.position + 1).sum())

    # ------------------------------------------------------------ sequences
    def path(self, i: int) -> torch.Tensor:
        """Tree tokens of sequence ``i``, root first (length = the sequence's length)."""
        return self.seq_index[self.seq_offsets[i] : self.seq_offsets[i + 1]]

    def sequence(self, i: int) -> torch.Tensor:
        """Token ids of sequence ``i`` as given."""
        return self.token_ids[self.path(i)]

    def sequences(self) -> list[torch.Tensor]:
        flat = self.token_ids[self.seq_index]
        return list(torch.split(flat, self.seq_lengths.tolist()))

    def unshared(self) -> "PrefixTree":
        """The same sequences with no sharing: one chain per sequence, in input order."""
        return PrefixTree.from_sequences(self.sequences(), share_prefixes=False)

    def node_of_token(self) -> torch.Tensor:
        """[N] node index of each tree token."""
        starts = torch.zeros(self.num_tree_tokens, dtype=torch.int64)
        starts[self.node_start] = 1
        return torch.cumsum(starts, 0) - 1

    def stats(self) -> dict[str, float]:
        return {
            "sequences": self.num_sequences,
            "flat_tokens": self.num_flat_tokens,
            "tree_tokens": self.num_tree_tokens,
            "ideal_ratio": self.ideal_ratio,
            "nodes": self.num_nodes,
            "roots": self.num_roots,
            "leaves": self.num_leaves,
            "max_depth": int(self.position.max()) + 1,
        }

    def __repr__(self) -> str:
        return (
            f"PrefixTree(sequences={self.num_sequences}, flat_tokens={self.num_flat_tokens}, "
            f"tree_tokens={self.num_tree_tokens}, nodes={self.num_nodes}, "
            f"ideal_ratio={self.ideal_ratio:.2f})"
        )

    # -------------------------------------------------------------- building
    @staticmethod
    def from_sequences(seqs: Sequence[TokenSequence], share_prefixes: bool = True) -> "PrefixTree":
        """Merge sequences into a prefix forest.

        ``seqs``: token-id lists or 1-D integer tensors/arrays, each non-empty with
        non-negative ids. ``share_prefixes=False`` keeps every sequence as its own chain
        (the ``flat`` layout). Raises ``ValueError``/``TypeError`` naming the bad sequence.
        """
        arrays = _validated_arrays(seqs)
        return _build(arrays, share_prefixes)


# --------------------------------------------------------------------------- validation
def _validated_arrays(seqs: Sequence[TokenSequence]) -> list[np.ndarray]:
    if isinstance(seqs, (str, bytes)) or not hasattr(seqs, "__len__"):
        raise TypeError(f"expected a list of token sequences, got {type(seqs).__name__}")
    if len(seqs) == 0:
        raise ValueError("no sequences: pass at least one token sequence")
    arrays = []
    for i, seq in enumerate(seqs):
        if isinstance(seq, torch.Tensor):
            if seq.is_floating_point() or seq.is_complex() or seq.dtype == torch.bool:
                raise TypeError(f"sequence {i}: token ids must be integers, got a {seq.dtype} tensor")
            if seq.dim() != 1:
                raise ValueError(f"sequence {i}: expected a 1-D tensor, got shape {tuple(seq.shape)}")
            arr = seq.detach().cpu().numpy().astype(np.int64, copy=False)
        else:
            if isinstance(seq, (str, bytes)) or not hasattr(seq, "__len__"):
                raise TypeError(f"sequence {i}: expected a list of token ids, got {type(seq).__name__}")
            ok = object()  # sentinel: None may be the offending element
            if isinstance(seq, np.ndarray):
                arr = seq
                bad = ok if arr.dtype.kind in "iu" else arr.dtype
            else:  # a list: every element must be an int (not a bool, float, str, None or list)
                bad = next((x for x in seq if isinstance(x, (bool, np.bool_))
                            or not isinstance(x, (int, np.integer))), ok)
                if bad is ok:
                    arr = np.asarray(seq) if len(seq) else np.zeros(0, dtype=np.int64)
            if isinstance(bad, (list, tuple, np.ndarray)):
                try:
                    shape = f" of shape {np.asarray(seq).shape}"
                except ValueError:
                    shape = " (ragged)"
                raise ValueError(f"sequence {i}: expected a flat list of token ids, got a nested list{shape}")
            if bad is not ok:
                raise TypeError(f"sequence {i}: token ids must be integers, found {bad!r} ({type(bad).__name__})")
            if arr.ndim != 1:
                raise ValueError(f"sequence {i}: expected a flat list of token ids, got shape {arr.shape}")
            if arr.dtype == np.uint64 and arr.size and arr.max() > np.iinfo(np.int64).max:
                raise ValueError(f"sequence {i}: token id {int(arr.max())} is too large")
            arr = arr.astype(np.int64, copy=False)
        if arr.size == 0:
            raise ValueError(f"sequence {i} is empty: every sequence needs at least one token")
        if arr.min() < 0:
            j = int(np.argmin(arr))
            raise ValueError(f"sequence {i}: token id {int(arr[j])} at position {j} is negative")
        arrays.append(arr)
    return arrays


# --------------------------------------------------------------------------- building
def _segment_arange(lengths: np.ndarray) -> np.ndarray:
    """[sum(lengths)] position within its segment: 0..len-1 for each segment in turn."""
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def _sorted_order(arrays: list[np.ndarray]) -> np.ndarray:
    """Lexicographic order of the sequences (a prefix sorts before its extensions)."""
    keys = [a.astype(">u8").tobytes() for a in arrays]  # big-endian bytes sort like the ints
    return np.array(sorted(range(len(arrays)), key=keys.__getitem__), dtype=np.int64)


def _longest_common_prefixes(flat: np.ndarray, lengths: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """lcp[k] = common prefix length of sequences k-1 and k (lcp[0] = 0)."""
    n = len(lengths)
    lcp = np.zeros(n, dtype=np.int64)
    if n < 2:
        return lcp
    common = np.minimum(lengths[1:], lengths[:-1])  # comparable positions per pair k=1..n-1
    d = _segment_arange(common)
    pair = np.repeat(np.arange(1, n), common)
    differs = flat[offsets[pair] + d] != flat[offsets[pair - 1] + d]
    lcp[1:] = common
    first_pair, first_at = np.unique(pair[differs], return_index=True)
    lcp[first_pair] = d[differs][first_at]
    return lcp


def _next_not_deeper(depth: np.ndarray) -> np.ndarray:
    """For each i, the first j > i with depth[j] <= depth[i] (len(depth) if none).

    Binary lifting over a sparse table of range minima: O(M log M), all vectorised.
    """
    m = len(depth)
    tables = [depth]
    while (1 << len(tables)) <= m:
        prev, half = tables[-1], 1 << (len(tables) - 1)
        nxt = prev.copy()
        nxt[: m - half] = np.minimum(prev[: m - half], prev[half:])
        tables.append(nxt)
    pos = np.arange(1, m + 1, dtype=np.int64)
    for level in range(len(tables) - 1, -1, -1):
        width = 1 << level
        ok = pos + width <= m
        idx = np.where(ok, pos, 0)
        deeper = ok & (tables[level][idx] > depth)
        pos = np.where(deeper, pos + width, pos)
    return pos


def _build(arrays: list[np.ndarray], share_prefixes: bool) -> PrefixTree:
    n = len(arrays)
    in_lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    order = _sorted_order(arrays) if share_prefixes else np.arange(n, dtype=np.int64)
    lengths = in_lengths[order]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.concatenate([arrays[k] for k in order])
    lcp = _longest_common_prefixes(flat, lengths, offsets) if share_prefixes else np.zeros(n, np.int64)

    # Every flat position (k, d) of the sorted sequences: new tokens are d >= lcp[k].
    depth = _segment_arange(lengths)
    seq_of = np.repeat(np.arange(n), lengths)
    is_new = depth >= lcp[seq_of]
    tree_of_flat = np.cumsum(is_new) - 1  # valid where is_new
    # A shared position (k, d) is the tree token of the last sequence <= k that created
    # depth d: a forward fill within each depth, in (depth, k) order. The first entry of
    # each depth is always new, so the fill never crosses depths.
    by_depth = np.argsort(depth, kind="stable")
    marks = np.where(is_new[by_depth], np.arange(len(flat)), 0)
    last_new = np.maximum.accumulate(marks)
    tree_of_flat[by_depth] = tree_of_flat[by_depth][last_new]

    token_ids = flat[is_new]
    position = depth[is_new]
    prev_flat = np.concatenate([[0], tree_of_flat[:-1]])
    parent = np.where(depth > 0, prev_flat, -1)[is_new]
    num_tokens = len(token_ids)

    # Nodes: a token starts one at a root, after a branch point, or after a sequence end.
    children = np.bincount(parent[parent >= 0], minlength=num_tokens)
    ends_here = np.zeros(num_tokens, dtype=bool)
    ends_here[tree_of_flat[offsets[1:] - 1]] = True
    safe_parent = np.maximum(parent, 0)
    starts = (parent < 0) | (children[safe_parent] != 1) | ends_here[safe_parent]
    node_start = np.flatnonzero(starts)
    node_end = np.append(node_start[1:], num_tokens)
    node_of = np.cumsum(starts) - 1
    node_parent = np.where(parent[node_start] >= 0, node_of[safe_parent[node_start]], -1)
    next_outside = _next_not_deeper(position[node_start])
    node_subtree_end = np.append(node_start, num_tokens)[next_outside]
    subtree_end = node_subtree_end[node_of]

    # Gather maps in input order.
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n)
    in_seq = np.repeat(np.arange(n), in_lengths)
    in_depth = _segment_arange(in_lengths)
    seq_index = tree_of_flat[offsets[rank[in_seq]] + in_depth]
    seq_offsets = np.concatenate([[0], np.cumsum(in_lengths)])

    t = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))  # noqa: E731
    return PrefixTree(
        token_ids=t(token_ids),
        position=t(position),
        parent=t(parent),
        subtree_end=t(subtree_end),
        node_start=t(node_start),
        node_end=t(node_end),
        node_parent=t(node_parent),
        seq_index=t(seq_index),
        seq_offsets=t(seq_offsets),
    )
