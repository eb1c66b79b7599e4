"""Losses that are sums of per-token terms, through the fused loss head.

A loss object may offer ``token_loss(logprob, entropy, tokens) -> scalar``: its value on
the flat tokens ``tokens`` (positions in the concatenation of every sequence's tokens
1..L-1, input order) given their logprobs and entropies (``entropy`` None when the engine
runs without entropies), each token's term depending on that token's values alone
(PPO's token ratio, KL to a reference, entropy bonuses; not GSPO's sequence ratio). Its
sum over any partition of the tokens must equal the loss's ``__call__`` on them.

The engine then asks it for each logits chunk's derivative while the chunk's logits are
at hand (:func:`treerl.engine.loss_head.token_loss_head`), which saves the head's second
logits product. :func:`token_entries` lays out, per segment, which flat tokens each
target row carries (a tree token shared by several sequences carries several).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .batch import Batch, seq_targets, upload_indices

TokenLoss = Callable[[torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]


@dataclass
class SegmentTokens:
    """One segment's flat tokens ordered by the target row that predicts them.

    rows [E] (device): each entry's row among the segment's targets; tokens [E] (device):
    its flat token position; bounds: row -> first entry at or after it, for every chunk
    start and the row count (host ints: slicing needs no host sync)."""

    rows: torch.Tensor
    tokens: torch.Tensor
    bounds: dict[int, int]


def token_entries(b: Batch, device: torch.device, chunk_rows: int) -> list[SegmentTokens]:
    """:class:`SegmentTokens` of every segment (each flat token goes to the segment whose
    row predicts its tree token), for the head's chunks of ``chunk_rows`` rows: one sort on
    the CPU, one upload."""
    targets = b.plan.targets
    sizes = torch.tensor([len(t) for t in targets], dtype=torch.long)
    first_row = torch.cumsum(sizes, 0) - sizes  # of each segment, in the targets' concatenation
    row_of = torch.full((b.tree.num_tree_tokens,), -1, dtype=torch.long)
    row_of[torch.cat(targets)] = torch.arange(int(sizes.sum()))
    entry_rows = row_of[seq_targets(b.tree)]  # the row predicting each flat token
    if len(entry_rows) and int(entry_rows.min()) < 0:
        raise AssertionError("a sequence token is predicted by no segment")
    order = torch.argsort(entry_rows, stable=True)  # by segment, then row (flat order within a row)
    rows = entry_rows[order]
    edges = [range(0, n, chunk_rows) for n in sizes.tolist()]
    starts = torch.cat([torch.tensor(list(e) + [n], dtype=torch.long) + f
                        for e, n, f in zip(edges, sizes.tolist(), first_row.tolist())])
    at = torch.searchsorted(rows, starts).tolist()  # first entry at or after every chunk edge
    counts, bounds, k = [], [], 0
    for e, n in zip(edges, sizes.tolist()):
        ptr = at[k: k + len(e) + 1]
        k += len(e) + 1
        bounds.append({row: p - ptr[0] for row, p in zip(list(e) + [n], ptr)})
        counts.append(ptr[-1] - ptr[0])
    local = rows - torch.repeat_interleave(first_row, torch.tensor(counts))
    rows_dev, tokens_dev = (x.split(counts) for x in upload_indices([local, order], device))
    return [SegmentTokens(r, t, bd) for r, t, bd in zip(rows_dev, tokens_dev, bounds)]


class TokenLossGrad:
    """``token_grad`` for :func:`token_loss_head`: rows ``start:stop`` of one segment's
    targets -> (their loss, d loss / d logprob, d loss / d entropy or None), summing the
    terms of every sequence that shares a row. ``entries()``: the segment's
    :class:`SegmentTokens`."""

    def __init__(self, token_loss: TokenLoss, entries: Callable[[], SegmentTokens]):
        # (built at the head's first chunk: on CUDA the host lays them out while the decoder runs)
        self.token_loss, self.entries = token_loss, entries

    def __call__(self, start: int, stop: int, logprob: torch.Tensor, entropy: torch.Tensor | None):
        e = self.entries()
        a, z = e.bounds[start], e.bounds[stop]
        g_ent = None if entropy is None else torch.zeros_like(entropy)
        if a == z:  # no sequence token in these rows
            return logprob.new_zeros(()), torch.zeros_like(logprob), g_ent
        rows = e.rows[a:z] - start
        with torch.enable_grad():
            lp = logprob[rows].detach().requires_grad_()
            ent = None if entropy is None else entropy[rows].detach().requires_grad_()
            part = self.token_loss(lp, ent, e.tokens[a:z])
            if not isinstance(part, torch.Tensor) or part.numel() != 1:
                raise TypeError(f"token_loss must return a scalar tensor, got {type(part).__name__}")
            if not part.requires_grad:
                raise ValueError("token_loss returned a tensor that does not depend on the logprobs it was given")
            inputs = [lp] if ent is None else [lp, ent]
            grads = torch.autograd.grad(part.reshape(()), inputs, allow_unused=True)
        g_lp = torch.zeros_like(logprob)
        if grads[0] is not None:
            g_lp.index_add_(0, rows, grads[0].to(g_lp.dtype))
        if ent is not None and grads[1] is not None:
            g_ent.index_add_(0, rows, grads[1].to(g_ent.dtype))
        return part.detach().reshape(()), g_lp, g_ent


class KnownGrad:
    """``token_grad`` for rows whose gradients are known before the call (the two phases'
    recomputing backward, a chain segment's recompute once its subtree has run): the head
    then takes its gradients in its forward too. Its loss part is 0 (the loss was taken
    elsewhere); only its gradients count."""

    def __init__(self, g_lp: torch.Tensor, g_ent: torch.Tensor | None):
        self.g_lp, self.g_ent = g_lp, g_ent  # [T] per target row

    @classmethod
    def at(cls, targets: torch.Tensor, g_lp: torch.Tensor, g_ent: torch.Tensor | None) -> "KnownGrad":
        """The rows of a call's ``targets`` (tree tokens) in the batch's gradients [N]."""
        return cls(g_lp[targets], None if g_ent is None else g_ent[targets])

    def __call__(self, start: int, stop: int, logprob: torch.Tensor, entropy: torch.Tensor | None):
        g_ent = None if self.g_ent is None or entropy is None else self.g_ent[start:stop]
        return logprob.new_zeros(()), self.g_lp[start:stop], g_ent
