"""Rollout/trainer agreement: the trainer's per-step mismatch metrics (mean and max
|logp_rollout - logp_train| over tokens sampled with the current weights) and the truncated
importance-sampling (TIS) option of the decoupled-PPO behaviour weight."""

import math

import pytest
import torch

from treerl.rl.batch import TokenBatch
from treerl.rl.losses import PolicyLoss, PolicyLossConfig
from treerl.learner import rollout_mismatch
from treerl.trainer import Sample


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 8, 3]
    masks = [torch.rand(n, generator=g) < 0.8 for n in lengths]
    adv = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    behav = [torch.randn(n, generator=g, dtype=torch.float64) * 0.3 - 1 for n in lengths]
    prox = [b + torch.randn(n, generator=g, dtype=torch.float64) * 0.4 for b, n in zip(behav, lengths)]
    return TokenBatch.from_sequences(masks, adv, behaviour_logprobs=behav, proximal_logprobs=prox), masks, adv, behav, prox


@pytest.mark.parametrize("truncate", [False, True], ids=["mask", "truncate"])
def test_truncated_importance_sampling_weight(truncate):
    """w = min(exp(prox - behav), cap) (TIS) or 0 above the cap (masking), in the loss."""
    batch, masks, adv, behav, prox = _batch()
    cap = 1.2
    cfg = PolicyLossConfig(behaviour_weight_cap=cap, behaviour_weight_truncate=truncate, eps_low=0.1,
                           eps_high=0.1)
    g = torch.Generator().manual_seed(1)
    logp = [(p + torch.randn(len(p), generator=g, dtype=torch.float64) * 0.05).requires_grad_() for p in prox]
    loss = PolicyLoss(batch, cfg)(logp)
    want, n, capped = 0.0, 0, 0
    for i in range(len(masks)):
        for t in range(len(masks[i])):
            if not masks[i][t]:
                continue
            n += 1
            A, old, lp = float(adv[i]), float(prox[i][t]), float(logp[i][t].detach())
            r = math.exp(lp - old)
            pg = max(-A * r, -A * min(max(r, 0.9), 1.1))
            raw = math.exp(old - float(behav[i][t]))
            capped += raw > cap
            w = min(raw, cap) if truncate else (raw if raw <= cap else 0.0)
            want += w * pg
    assert 0 < capped < n
    assert loss.item() == pytest.approx(want / n, rel=1e-12)


def test_trainer_rollout_mismatch_metric():
    """Mean and max |behaviour - proximal| over trained tokens of the current version only."""
    behav = [torch.tensor([0.0, -1.0, -2.0, -0.5], dtype=torch.float64), torch.tensor([-3.0, -1.5], dtype=torch.float64)]
    prox = [torch.tensor([0.0, -1.1, -2.5, -0.2], dtype=torch.float64), torch.tensor([-2.0, -1.25], dtype=torch.float64)]
    samples = [
        Sample([1, 2, 3, 4, 5], [False, True, True, True], [0.0] * 4, [3, 3, 3, 2], 0.0, 0, 0),  # last token stale
        Sample([1, 2, 3], [True, True], [0.0] * 2, [3, 3], 0.0, 0, 1),
    ]
    m = rollout_mismatch(samples, {"behaviour_logprobs": behav, "proximal_logprobs": prox}, version=3)
    diffs = [0.1, 0.5, 1.0, 0.25]
    assert m["rollout/logp_mismatch_mean"] == pytest.approx(sum(diffs) / 4, rel=1e-12)
    assert m["rollout/logp_mismatch_max"] == pytest.approx(1.0, rel=1e-12)
    # nothing sampled with the current weights (version 4): no metric
    assert rollout_mismatch(samples, {"behaviour_logprobs": behav, "proximal_logprobs": prox}, version=4) == {}
