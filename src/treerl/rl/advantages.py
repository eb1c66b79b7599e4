"""Advantage estimators.

Per-sequence estimators (GRPO, Dr.GRPO, RLOO) map rewards ``[S]`` and group ids ``[S]``
to advantages ``[S]``; :func:`~treerl.rl.batch.broadcast_to_tokens` spreads them over
each sequence's trained tokens. Token-level estimators (REINFORCE++, GAE) return ``[T]``
in the flat per-token layout of :class:`~treerl.rl.batch.TokenBatch`. Call them on the
rewards of the whole global batch (group statistics and whitening are global).
Non-finite rewards raise ValueError naming the sample.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch
from torch import Tensor

from .batch import sequence_ids


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[Hashable],
    *,
    normalise_std: bool = True,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)`` -> ``[S]``.

    ``normalise_std=False`` gives ``r - mean_group`` (Dr.GRPO). ``std`` is the sample
    standard deviation (``unbiased_std``, like ``torch.std``); a group of one sample or of
    identical rewards gets advantage exactly 0.
    """
    rewards = _check_rewards(rewards)
    group, num_groups = _group_index(group_ids, rewards)
    count = _group_sum(torch.ones_like(rewards), group, num_groups)
    mean = _group_sum(rewards, group, num_groups) / count
    centred = _zero_constant_groups(rewards - mean[group], rewards, group, num_groups)
    if not normalise_std:
        return centred
    dof = (count - 1).clamp(min=1) if unbiased_std else count
    std = (_group_sum(centred * centred, group, num_groups) / dof).sqrt()
    return centred / (std[group] + eps)


def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor | Sequence[Hashable]) -> Tensor:
    """Dr.GRPO: ``r - mean_group`` (no std division) -> ``[S]``.

    Pair it with the constant loss normaliser: ``PolicyLossConfig(aggregation=
    "seq-mean-token-sum", norm_constant=max_new_tokens)``, so each sequence's loss is its
    token sum divided by the generation length limit (not by its own length).
    """
    return grpo_advantages(rewards, group_ids, normalise_std=False)


def rloo_advantages(rewards: Tensor, group_ids: Tensor | Sequence[Hashable]) -> Tensor:
    """RLOO: ``r_i - mean_{j != i in group} r_j`` -> ``[S]``. Groups of one raise ValueError."""
    rewards = _check_rewards(rewards)
    group, num_groups = _group_index(group_ids, rewards)
    count = _group_sum(torch.ones_like(rewards), group, num_groups)
    single = (count[group] < 2).nonzero()
    if len(single):
        i = int(single[0, 0])
        raise ValueError(
            f"RLOO needs at least 2 samples per group: sample {i} is alone in its group "
            f"(group id {_group_label(group_ids, i)})"
        )
    total = _group_sum(rewards, group, num_groups)[group]
    return _zero_constant_groups(rewards - (total - rewards) / (count[group] - 1), rewards, group, num_groups)


def reinforce_pp_advantages(
    rewards: Tensor,
    seq_lengths: Tensor,
    loss_mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    group_ids: Tensor | Sequence[Hashable] | None = None,
    eps: float = 1e-8,
) -> Tensor:
    """REINFORCE++ -> ``[T]``.

    Per-token rewards: ``-kl_coef * kl_t`` on every trained token (``kl`` ``[T]``, e.g.
    :func:`~treerl.rl.kl.kl_estimate` of behaviour vs reference logprobs), plus the
    sequence reward (minus its group mean if ``group_ids``: "REINFORCE++-baseline") on the
    sequence's last trained token. Advantage = discounted return-to-go over the trained
    tokens, whitened (mean and population std) over all trained tokens of the batch;
    0 on untrained tokens. A sequence without trained tokens contributes nothing.
    """
    rewards = _check_rewards(rewards)
    seq_lengths = torch.as_tensor(seq_lengths).cpu().to(torch.int64)
    loss_mask = loss_mask.to(device=rewards.device, dtype=torch.bool)
    if rewards.shape[0] != seq_lengths.shape[0]:
        raise ValueError(f"rewards has {rewards.shape[0]} samples but seq_lengths has {seq_lengths.shape[0]} sequences")
    if loss_mask.shape != (int(seq_lengths.sum()),):
        raise ValueError(f"loss_mask has shape {tuple(loss_mask.shape)}, expected ({int(seq_lengths.sum())},)")
    if group_ids is not None:
        rewards = grpo_advantages(rewards, group_ids, normalise_std=False)
    token_rewards = torch.zeros(loss_mask.shape[0], dtype=rewards.dtype, device=rewards.device)
    if kl is not None and kl_coef != 0.0:
        _check_finite_tokens("kl", kl, seq_lengths)
        token_rewards = torch.where(loss_mask, -kl_coef * kl.to(rewards.dtype), token_rewards)
    last = _last_masked(loss_mask, seq_lengths)
    has = last >= 0
    token_rewards = token_rewards.index_add(0, last[has], rewards[has])
    returns, _ = gae(token_rewards, torch.zeros_like(token_rewards), loss_mask, seq_lengths, gamma=gamma, lam=1.0)
    n = loss_mask.sum().clamp(min=1)
    mean = returns.sum() / n  # returns are 0 off the mask
    centred = torch.where(loss_mask, returns - mean, torch.zeros_like(returns))
    std = ((centred * centred).sum() / n).sqrt()
    return centred / (std + eps)


def gae(
    rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    seq_lengths: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each sequence's trained tokens.

    Args (all ``[T]`` except ``seq_lengths`` ``[S]``): ``rewards`` per token (must be 0
    on untrained tokens), ``values`` the critic's value at each token (the state before
    the token is generated, same alignment as the logprobs), ``loss_mask``.

    The recursion runs over the trained tokens of a sequence in order, skipping untrained
    ones (e.g. tool outputs between turns); the value after a sequence's last trained
    token is 0 (terminal). ``delta_k = r_k + gamma V_{k+1} - V_k``, ``A_k = delta_k +
    gamma lam A_{k+1}``. Returns ``(advantages, returns = advantages + values)``, both 0
    on untrained tokens. Vectorised across sequences: a reverse scan over the longest
    sequence's trained-token count.
    """
    seq_lengths = torch.as_tensor(seq_lengths).cpu().to(torch.int64)
    T = int(seq_lengths.sum())
    for name, t in (("rewards", rewards), ("values", values), ("loss_mask", loss_mask)):
        if t.shape != (T,):
            raise ValueError(f"{name} has shape {tuple(t.shape)} but seq_lengths sum to {T}: expected ({T},)")
    _check_finite_tokens("rewards", rewards, seq_lengths)
    _check_finite_tokens("values", values, seq_lengths)
    device, dtype = rewards.device, torch.promote_types(rewards.dtype, values.dtype)
    loss_mask = loss_mask.to(device=device, dtype=torch.bool)
    values = values.to(device=device, dtype=dtype)
    stray = ((rewards != 0) & ~loss_mask).nonzero()
    if len(stray):
        pos = int(stray[0, 0])
        seq, tok = _locate(pos, seq_lengths)
        raise ValueError(
            f"sequence {seq} has reward {float(rewards[pos])} on untrained token {tok} (loss_mask False): "
            f"put rewards on trained tokens"
        )
    S = seq_lengths.shape[0]
    seq = sequence_ids(seq_lengths).to(device)
    starts = (seq_lengths.cumsum(0) - seq_lengths).to(device)
    cum = loss_mask.to(torch.int64).cumsum(0)
    before = torch.cat([cum.new_zeros(1), cum])[starts]  # trained tokens before each sequence
    rank = cum - 1 - before[seq]  # rank of a trained token among its sequence's trained tokens
    pos = loss_mask.nonzero()[:, 0]
    width = int(rank[pos].max()) + 1 if len(pos) else 0
    R = torch.zeros(S, width + 1, dtype=dtype, device=device)
    V = torch.zeros(S, width + 1, dtype=dtype, device=device)
    R[seq[pos], rank[pos]] = rewards[pos].to(dtype)
    V[seq[pos], rank[pos]] = values[pos]
    A = torch.zeros_like(R)
    for k in range(width - 1, -1, -1):  # column `width` is the terminal padding (zeros)
        A[:, k] = R[:, k] + gamma * V[:, k + 1] - V[:, k] + gamma * lam * A[:, k + 1]
    adv = torch.zeros(T, dtype=dtype, device=device)
    adv[pos] = A[seq[pos], rank[pos]]
    ret = torch.where(loss_mask, adv + values, torch.zeros_like(adv))
    return adv, ret


# ------------------------------------------------------------------- helpers
def _check_rewards(rewards: Tensor) -> Tensor:
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (one per sample), got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad = (~torch.isfinite(rewards)).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        raise ValueError(f"reward of sample {i} is {float(rewards[i])}: rewards must be finite")
    return rewards


def _check_finite_tokens(name: str, values: Tensor, seq_lengths: Tensor) -> None:
    bad = (~torch.isfinite(values)).nonzero()
    if len(bad):
        pos = int(bad[0, 0])
        seq, tok = _locate(pos, seq_lengths)
        raise ValueError(f"{name} of sequence {seq} is {float(values[pos])} at token {tok}: must be finite")


def _locate(pos: int, seq_lengths: Tensor) -> tuple[int, int]:
    ends = seq_lengths.cumsum(0)
    seq = int(torch.searchsorted(ends, pos, right=True))
    return seq, pos - int(ends[seq] - seq_lengths[seq])


def _group_index(group_ids: Tensor | Sequence[Hashable], rewards: Tensor) -> tuple[Tensor, int]:
    """Dense group index ``[S]`` (on the rewards' device) and the number of groups."""
    if isinstance(group_ids, Tensor):
        if group_ids.dim() != 1:
            raise ValueError(f"group_ids must be 1-D, got shape {tuple(group_ids.shape)}")
        _, inverse = torch.unique(group_ids, return_inverse=True)
    else:
        labels: dict = {}
        inverse = torch.tensor([labels.setdefault(g, len(labels)) for g in group_ids], dtype=torch.int64)
    if inverse.shape[0] != rewards.shape[0]:
        raise ValueError(f"group_ids has {inverse.shape[0]} entries but rewards has {rewards.shape[0]}")
    num = int(inverse.max()) + 1 if inverse.numel() else 0
    return inverse.to(rewards.device), num


def _group_label(group_ids, i: int):
    g = group_ids[i]
    return g.item() if isinstance(g, Tensor) else g


def _group_sum(x: Tensor, group: Tensor, num_groups: int) -> Tensor:
    return x.new_zeros(num_groups).index_add_(0, group, x)


def _zero_constant_groups(adv: Tensor, rewards: Tensor, group: Tensor, num_groups: int) -> Tensor:
    """``adv`` with exact zeros in groups whose rewards are all equal (no rounding residue)."""
    high = rewards.new_full((num_groups,), -torch.inf).scatter_reduce(0, group, rewards, "amax")
    low = rewards.new_full((num_groups,), torch.inf).scatter_reduce(0, group, rewards, "amin")
    return torch.where((high == low)[group], torch.zeros_like(adv), adv)


def _last_masked(loss_mask: Tensor, seq_lengths: Tensor) -> Tensor:
    """``[S]`` flat position of each sequence's last trained token, -1 if none."""
    device = loss_mask.device
    seq = sequence_ids(seq_lengths).to(device)
    pos = torch.arange(loss_mask.shape[0], device=device)
    marked = torch.where(loss_mask, pos, torch.full_like(pos, -1))
    return torch.full((seq_lengths.shape[0],), -1, dtype=torch.int64, device=device).scatter_reduce(
        0, seq, marked, "amax"
    )
