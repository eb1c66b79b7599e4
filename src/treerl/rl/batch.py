"""Per-token training data of a global batch, flat over its sequences.

Alignment (the engine's): a training sequence of ``L`` tokens has ``L - 1`` predicted
tokens; element ``t`` of every per-token tensor belongs to token ``t + 1`` (its logprob
is ``log p(token t+1 | tokens 0..t)``). Sequence ``i`` occupies the flat slice
``offsets[i]:offsets[i + 1]`` with ``offsets = [0, cumsum(seq_lengths)]``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

# Floating per-token fields, checked for NaN/inf on construction.
FLOAT_FIELDS = (
    "advantages",
    "behaviour_logprobs",
    "proximal_logprobs",
    "reference_logprobs",
    "values",
    "returns",
)
TOKEN_FIELDS = ("loss_mask",) + FLOAT_FIELDS + ("versions",)


@dataclass(frozen=True, eq=False)
class TokenBatch:
    """Flat per-token tensors of a global batch of ``S`` sequences, ``T`` predicted tokens.

    Fields (all ``[T]`` unless said, same device):
        seq_lengths: ``[S]`` int64 on CPU, ``L_i - 1`` per sequence (0 is allowed).
        loss_mask: bool, which predicted tokens are trained (e.g. completion tokens).
        advantages: float, per-token advantage (0 where not trained).
        behaviour_logprobs: logprobs of the policy that sampled the tokens (PPO "old").
        proximal_logprobs: logprobs of the proximal policy (decoupled PPO); when absent,
            the behaviour logprobs are the proximal ones (standard PPO).
        reference_logprobs: logprobs of the frozen reference model (KL penalty).
        values: the critic's values when the rollout was scored (value clipping; GAE).
        returns: value targets for the critic.
        versions: int64, policy version that generated each token (bookkeeping only).

    Construction validates lengths, dtypes and that float fields are finite (one host
    sync if the tensors are on a GPU).
    """

    seq_lengths: Tensor
    loss_mask: Tensor
    advantages: Tensor
    behaviour_logprobs: Tensor | None = None
    proximal_logprobs: Tensor | None = None
    reference_logprobs: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None
    versions: Tensor | None = None

    def __post_init__(self) -> None:
        lengths = torch.as_tensor(self.seq_lengths).detach().cpu()
        if lengths.dim() != 1 or lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise ValueError(f"seq_lengths must be a 1-D integer tensor, got {tuple(lengths.shape)} {lengths.dtype}")
        lengths = lengths.to(torch.int64)
        negative = (lengths < 0).nonzero()
        if len(negative):
            i = int(negative[0, 0])
            raise ValueError(f"seq_lengths[{i}] is {int(lengths[i])}: lengths must be >= 0")
        object.__setattr__(self, "seq_lengths", lengths)
        total = int(lengths.sum())
        device = self.loss_mask.device if isinstance(self.loss_mask, Tensor) else None
        for name in TOKEN_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, Tensor):
                raise TypeError(f"{name} must be a tensor, got {type(value).__name__}")
            if value.dim() != 1 or value.shape[0] != total:
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)} but the sequences have {total} predicted tokens "
                    f"in all (sum of seq_lengths): expected ({total},)"
                )
            if value.device != device:
                raise ValueError(f"{name} is on {value.device} but loss_mask is on {device}: put all fields on one device")
        if self.loss_mask.dtype != torch.bool:
            raise ValueError(f"loss_mask must be a bool tensor, got {self.loss_mask.dtype}")
        if self.versions is not None and (self.versions.is_floating_point() or self.versions.dtype == torch.bool):
            raise ValueError(f"versions must be an integer tensor, got {self.versions.dtype}")
        for name in FLOAT_FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if not value.is_floating_point():
                raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
            bad = (~torch.isfinite(value)).nonzero()
            if len(bad):
                pos = int(bad[0, 0])
                seq = int(torch.searchsorted(self.offsets, pos, right=True)) - 1
                raise ValueError(
                    f"{name} of sequence {seq} is {float(value[pos])} at token {pos - int(self.offsets[seq])}: "
                    f"per-token data must be finite"
                )
        if self.proximal_logprobs is not None and self.behaviour_logprobs is None:
            raise ValueError("proximal_logprobs needs behaviour_logprobs (the behaviour weight uses both)")

    # ------------------------------------------------------------------ building
    @classmethod
    def from_sequences(
        cls,
        loss_mask: Sequence[Tensor],
        advantages: Tensor | Sequence[Tensor],
        **fields: Sequence[Tensor] | None,
    ) -> "TokenBatch":
        """Concatenate per-sequence tensors (each ``[L_i - 1]``) into a batch.

        ``loss_mask`` gives the sequence lengths. ``advantages`` is either per-token
        tensors or one ``[S]`` tensor of per-sequence advantages, broadcast over each
        sequence's masked tokens. ``fields`` are the optional per-token fields of
        :class:`TokenBatch` as per-sequence lists. A length mismatch names the field,
        the sequence and both lengths.
        """
        unknown = set(fields) - set(TOKEN_FIELDS)
        if unknown:
            raise TypeError(f"unknown TokenBatch field(s): {', '.join(sorted(unknown))}")
        masks = [torch.as_tensor(m) for m in loss_mask]
        if not masks:
            raise ValueError("a TokenBatch needs at least one sequence")
        lengths = torch.tensor([m.shape[0] if m.dim() == 1 else -1 for m in masks], dtype=torch.int64)
        for i, m in enumerate(masks):
            if m.dim() != 1:
                raise ValueError(f"loss_mask of sequence {i} must be 1-D, got shape {tuple(m.shape)}")
        flat_mask = torch.cat(masks)
        if isinstance(advantages, Tensor):
            if advantages.dim() != 1 or advantages.shape[0] != len(masks):
                raise ValueError(
                    f"per-sequence advantages must have shape ({len(masks)},) (one per sequence), "
                    f"got {tuple(advantages.shape)}"
                )
            flat_adv = broadcast_to_tokens(advantages, lengths, flat_mask)
        else:
            flat_adv = _cat_checked("advantages", advantages, lengths)
        flat = {name: _cat_checked(name, value, lengths) for name, value in fields.items() if value is not None}
        return cls(seq_lengths=lengths, loss_mask=flat_mask, advantages=flat_adv, **flat)

    def replace(self, **changes: Tensor | None) -> "TokenBatch":
        """A copy with some fields replaced (validated again)."""
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> "TokenBatch":
        """The batch with every per-token tensor on ``device`` (``seq_lengths`` stays on CPU)."""
        moved = {n: getattr(self, n).to(device) for n in TOKEN_FIELDS if getattr(self, n) is not None}
        return dataclasses.replace(self, **moved)

    # ------------------------------------------------------------------- layout
    @property
    def num_sequences(self) -> int:
        return self.seq_lengths.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.loss_mask.shape[0]

    @property
    def device(self) -> torch.device:
        return self.loss_mask.device

    @property
    def offsets(self) -> Tensor:
        """``[S + 1]`` int64 on CPU: where each sequence starts in the flat tensors."""
        return torch.cat([torch.zeros(1, dtype=torch.int64), self.seq_lengths.cumsum(0)])

    def seq_ids(self) -> Tensor:
        """``[T]`` int64 on the batch's device: the sequence of every flat token."""
        return sequence_ids(self.seq_lengths).to(self.device)

    def masked_counts(self) -> Tensor:
        """``[S]`` int64 on the batch's device: trained tokens per sequence."""
        counts = torch.zeros(self.num_sequences, dtype=torch.int64, device=self.device)
        return counts.index_add_(0, self.seq_ids(), self.loss_mask.to(torch.int64))

    def token_index(self, index: Tensor | Sequence[int] | None) -> tuple[Tensor | None, list[int]]:
        """Flat token positions (CPU int64, in the order of ``index``) of the sequences
        ``index``, and those sequences as a list. ``None`` = all sequences in order, for
        which the positions are ``None`` (no gather needed)."""
        S = self.num_sequences
        if index is None:
            return None, list(range(S))
        seqs = torch.as_tensor(index).detach().cpu().to(torch.int64).reshape(-1)
        out_of_range = ((seqs < 0) | (seqs >= S)).nonzero()
        if len(out_of_range):
            raise IndexError(f"sequence index {int(seqs[out_of_range[0, 0]])} is outside the batch of {S} sequences")
        seq_list = seqs.tolist()
        if seq_list == list(range(S)):
            return None, seq_list
        lengths = self.seq_lengths[seqs]
        starts = self.offsets[seqs]
        local_starts = lengths.cumsum(0) - lengths
        flat = torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts - local_starts, lengths)
        return flat, seq_list


def sequence_ids(seq_lengths: Tensor) -> Tensor:
    """``[T]`` int64 (CPU): the index of the sequence each flat token belongs to."""
    lengths = torch.as_tensor(seq_lengths).cpu().to(torch.int64)
    return torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths)


def broadcast_to_tokens(per_sequence: Tensor, seq_lengths: Tensor, loss_mask: Tensor | None = None) -> Tensor:
    """``[S]`` per-sequence values -> ``[T]`` per-token values, 0 where ``loss_mask`` is False."""
    ids = sequence_ids(seq_lengths).to(per_sequence.device)
    out = per_sequence[ids]
    if loss_mask is not None:
        out = torch.where(loss_mask.to(out.device), out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out


def _cat_checked(name: str, tensors: Sequence[Tensor], lengths: Tensor) -> Tensor:
    if isinstance(tensors, Tensor):
        raise TypeError(f"{name} must be a list of per-sequence tensors, got one tensor")
    if len(tensors) != len(lengths):
        raise ValueError(f"{name} has {len(tensors)} sequences but loss_mask has {len(lengths)}")
    for i, (t, n) in enumerate(zip(tensors, lengths.tolist())):
        shape = tuple(torch.as_tensor(t).shape)
        if shape != (n,):
            got = shape[0] if len(shape) == 1 else f"shape {shape}"
            raise ValueError(f"{name} of sequence {i} has {got} tokens but its loss_mask has {n}")
    return torch.cat([torch.as_tensor(t) for t in tensors])
