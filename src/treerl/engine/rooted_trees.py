"""The trees of a model call without prefix and their root chains (the root split's unit,
:mod:`treerl.engine.attention`): below the attention, the memory model and the engine, which share it."""

from __future__ import annotations

from typing import NamedTuple

import torch


class RootedTree(NamedTuple):
    """One tree of a call without prefix (its rows ``start`` to ``end`` of the call's queries and
    keys) whose first ``root`` tokens are its root chain (seen by every later token of the tree)."""

    start: int
    root: int
    end: int

    @property
    def rest(self) -> int:
        """The tree's queries after its root chain (its group; 0: the tree is one chain)."""
        return self.end - self.start - self.root


def rooted_trees(ends: torch.Tensor, start: int) -> tuple[RootedTree, ...]:
    """The trees of a call without prefix, in call order, from the subtree ends ``ends`` [N] (on the
    CPU) of its tokens (tree indices ``start`` to ``start + N``): trees in a call are contiguous in
    preorder, a tree starting at row ``s`` ends at ``ends[s] - start`` (cut at the call's end), and its
    root chain is its first tokens whose subtree reaches the tree's end."""
    n = len(ends)
    stop = (ends - start).clamp(max=n)  # [N] one past each token's subtree's last row in the call
    row = torch.arange(n)
    first = torch.ones(n, dtype=torch.bool)  # a tree's first token: no earlier subtree reaches it
    first[1:] = stop.cummax(0).values[:-1] <= row[1:]
    starts = first.nonzero()[:, 0]
    tree, tree_end = first.cumsum(0) - 1, stop[starts]  # [N] each token's tree, [K] the trees' ends
    below = stop < tree_end[tree]  # [N] not in its tree's root chain
    root_end = tree_end.scatter_reduce(0, tree, torch.where(below, row, n), "amin")
    return tuple(RootedTree(s, r - s, e) for s, r, e in zip(starts.tolist(), root_end.tolist(), tree_end.tolist()))
