"""A separable loss over chained trees in one pass: no phase 1.

A separable loss is a sum of per-sequence terms, so a sequence's term can be taken as soon
as all of its logprobs exist. In depth-first order that is right after the call of the
segment holding the sequence's last token: every other token of the sequence lies in that
segment's ancestors, which ran before. The term's gradient goes to the segment's own
logprobs, whose backward runs at once for a segment without children, and to its
ancestors' logprobs, which wait in the batch's dL/dlogprob buffer until their chain closes
(after all of its descendants, as in phase 2).

So every segment without children runs its forward once, with grad, where the two phases
(:mod:`.two_phase`) ran it twice (a no-grad forward for the loss's inputs, then again with
grad); a chain segment runs as in phase 2: once with grad when it retains its graph, else a
no-grad call (now with the LM head, for its logprobs) and its recompute when it closes. The
loss inputs are the same values the two phases give (a recomputed chain's from its no-grad
call), so the gradients are the same. The live bytes are phase 2's: the planner's model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .batch import Batch, sequences_ending_in
from .two_phase import LossFn, loss_gradients

if TYPE_CHECKING:
    from .tree_engine import TreeEngine


class SegmentLosses:
    """The loss of the sequences ending in each segment of ``only``, taken as the segments run.

    ``g_lp`` / ``g_ent`` [N tree tokens]: dL/dlogprob (dL/dentropy) gathered so far; a
    segment's entries are complete once every segment below it has run."""

    def __init__(self, engine: "TreeEngine", b: Batch, loss_fn: LossFn, entropy: bool, only: set[int]):
        self.b, self.loss_fn = b, loss_fn
        self.lp_all, self.ent_all = engine._buffers(b, entropy)
        self.g_lp = torch.zeros_like(self.lp_all)
        self.g_ent = torch.zeros_like(self.ent_all) if self.ent_all is not None else None
        self.ending = sequences_ending_in(b, only)
        self.total = torch.zeros((), dtype=torch.float64, device=engine.device)

    def after(self, i: int, lp: torch.Tensor | None, ent: torch.Tensor | None) -> None:
        """Segment ``i`` ran and gave ``lp`` (``ent``) at its targets (None: it made no call):
        keep their values and take the loss of the sequences ending in it."""
        if lp is not None:
            self.lp_all[self.b.targets[i]] = lp.detach()
            if self.ent_all is not None:
                self.ent_all[self.b.targets[i]] = ent.detach()
        if i in self.ending:
            seqs, targets, lengths = self.ending[i]
            loss, _, _ = loss_gradients(self.b, self.lp_all, self.ent_all, self.loss_fn, True, seqs, targets,
                                        lengths, into=(self.g_lp, self.g_ent))
            self.total += loss.reshape(()).to(torch.float64)


def forward_backward(engine: "TreeEngine", b: Batch, loss_fn: LossFn, entropy: bool, only: set[int]) -> float:
    """A separable loss over the segments ``only`` (whole trees) in one pass; returns the loss."""
    losses = SegmentLosses(engine, b, loss_fn, entropy, only)
    engine._grad_pass(b, losses.g_lp, losses.g_ent, only, losses=losses)
    return float(losses.total)
