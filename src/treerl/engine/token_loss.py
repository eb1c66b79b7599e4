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

from .batch import Batch, segment_of_sequences, seq_targets, upload_indices

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
    """Single-level plans: :class:`SegmentTokens` of every segment, for the head's chunks of
    ``chunk_rows`` rows (vectorised on the CPU, one upload)."""
    tree, targets = b.tree, b.plan.targets
    _, seg_of_seq = segment_of_sequences(b)
    lengths = torch.tensor(b.seq_lengths, dtype=torch.long)
    row_of = torch.full((tree.num_tree_tokens,), -1, dtype=torch.long)
    for t in targets:
        row_of[t] = torch.arange(len(t))
    entry_rows = row_of[seq_targets(tree)]
    if len(entry_rows) and int(entry_rows.min()) < 0:
        raise AssertionError("a sequence token is predicted by no segment of a single-level plan")
    seg_of_entry = torch.repeat_interleave(seg_of_seq, lengths)
    by_row = torch.argsort(entry_rows, stable=True)
    order = by_row[torch.argsort(seg_of_entry[by_row], stable=True)]  # by segment, then row
    counts = torch.bincount(seg_of_entry, minlength=len(targets)).tolist()
    rows_cpu = entry_rows[order].split(counts)
    bounds = []
    for r, t in zip(rows_cpu, targets):
        edges = list(range(0, len(t), chunk_rows)) + [len(t)]
        bounds.append(dict(zip(edges, torch.searchsorted(r, torch.tensor(edges)).tolist())))
    uploaded = upload_indices([entry_rows[order], order], device)
    rows_dev, tokens_dev = (x.split(counts) for x in uploaded)
    return [SegmentTokens(r, t, bd) for r, t, bd in zip(rows_dev, tokens_dev, bounds)]


class TokenLossGrad:
    """``token_grad`` for :func:`token_loss_head`: rows ``start:stop`` of one segment's
    targets -> (their loss, d loss / d logprob, d loss / d entropy or None), summing the
    terms of every sequence that shares a row."""

    def __init__(self, token_loss: TokenLoss, entries: SegmentTokens):
        self.token_loss, self.entries = token_loss, entries

    def __call__(self, start: int, stop: int, logprob: torch.Tensor, entropy: torch.Tensor | None):
        e = self.entries
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
