"""Loss aggregation as fixed per-token weights, normalised over the global batch.

Every aggregation is ``loss = sum_t weight_t * term_t`` over trained tokens, with
weights computed once from the whole batch, so the loss of any partition of the
sequences into calls sums to the loss of the full batch (the engine's ``separable``):

- ``token-mean``: ``weight = 1 / N`` (``N`` trained tokens in the global batch);
- ``seq-mean-token-sum``: ``weight = 1 / (S * C)`` (``S`` sequences with at least one
  trained token; ``C = norm_constant`` or 1). Dr.GRPO: ``C`` = the maximum generation
  length, a constant, so a sequence's loss is its token sum / max length;
- ``seq-mean-token-mean``: ``weight = 1 / (S * n_i)`` (``n_i`` trained tokens of
  sequence ``i``): each sequence's mean, averaged over sequences.

Sequences with no trained token contribute nothing and are not counted in ``S``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .batch import TokenBatch

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def check_aggregation(mode: str, norm_constant: float | None) -> None:
    """Raise ValueError for an unknown mode or a misplaced / non-positive constant."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}: choose one of {', '.join(AGGREGATIONS)}")
    if norm_constant is not None:
        if mode != "seq-mean-token-sum":
            raise ValueError(f"norm_constant (Dr.GRPO) applies to seq-mean-token-sum only, not {mode!r}")
        if not norm_constant > 0:
            raise ValueError(f"norm_constant must be positive, got {norm_constant}")


@dataclass(frozen=True)
class Normalisers:
    """Global counts the aggregation divides by.

    num_tokens: trained tokens in the global batch; num_sequences: sequences with at
    least one trained token. With data parallelism, build each rank's from its own
    batch and :meth:`all_reduce` them.
    """

    num_tokens: int
    num_sequences: int

    @classmethod
    def of(cls, batch: TokenBatch) -> "Normalisers":
        counts = batch.masked_counts()
        return cls(int(counts.sum()), int((counts > 0).sum()))

    def all_reduce(self, group=None, device: torch.device | str = "cpu") -> "Normalisers":
        """Sum over the ranks of ``group`` (``device`` must suit the backend: CUDA for NCCL)."""
        import torch.distributed as dist

        t = torch.tensor([self.num_tokens, self.num_sequences], dtype=torch.int64, device=device)
        dist.all_reduce(t, group=group)
        return Normalisers(int(t[0]), int(t[1]))


def token_weights(
    batch: TokenBatch,
    mode: str,
    normalisers: Normalisers | None = None,
    norm_constant: float | None = None,
) -> Tensor:
    """``[T]`` float64 weights (0 where untrained) such that ``loss = sum(weight * term)``.

    ``normalisers`` default to the batch's own counts (the batch is the global batch).
    """
    check_aggregation(mode, norm_constant)
    norm = normalisers if normalisers is not None else Normalisers.of(batch)
    mask = batch.loss_mask.to(torch.float64)
    if mode == "token-mean":
        return mask / max(norm.num_tokens, 1)
    seqs = max(norm.num_sequences, 1)
    if mode == "seq-mean-token-sum":
        return mask / (seqs * (norm_constant if norm_constant is not None else 1.0))
    counts = batch.masked_counts().clamp(min=1).to(torch.float64)
    return mask / (seqs * counts[batch.seq_ids()])
