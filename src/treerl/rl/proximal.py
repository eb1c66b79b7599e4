"""Proximal logprobs for decoupled PPO without a forward pass: AReaL's log-linear
approximation (inclusionAI/AReaL, docs/algorithms/prox_approx.md, ``prox_logp_method:
loglinear``).

Decoupled PPO (DESIGN.md, RL layer) needs ``logp_prox``, the logprobs of the proximal
policy: the weights the trainer holds when the step starts (version ``V``). ``recompute``
gets them exactly with a tree forward (what ``Trainer.train_on`` does for stale samples).
The log-linear approximation interpolates, per token, between the behaviour logprob
(version ``v_b`` that sampled the token) and the current policy's logprob (``v_theta``,
the policy being optimised)::

    alpha     = (v_prox - v_b) / (v_theta - v_b),   v_prox = V,  v_theta = V + 1
    logp_prox ~ logp_behav + alpha * (logp_theta - logp_behav)

``logp_theta`` is the training forward's own logprob (detached), so no extra forward is
needed. It is exact for fresh tokens (``v_b = V``: ``alpha = 0`` and the behaviour policy
*is* the proximal one) and approximate for stale ones.

``Trainer.train_on(samples, proximal="loglinear")`` uses it for stale samples.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import Tensor

from .batch import TokenBatch
from .losses import PolicyLoss, PolicyLossConfig


def loglinear_alpha(versions: Tensor, trainer_version: int) -> Tensor:
    """Per-token interpolation weight ``(V - v_b) / (V + 1 - v_b)`` in [0, 1) (float64)."""
    v = versions.to(torch.float64)
    if (v > trainer_version).any():
        raise ValueError(f"token versions newer than the trainer's {trainer_version}")
    return (trainer_version - v) / (trainer_version + 1 - v)


def loglinear_proximal_logprobs(behaviour: Tensor, current: Tensor, versions: Tensor, trainer_version: int) -> Tensor:
    """``logp_behav + alpha * (logp_theta - logp_behav)`` per token (``current`` detached)."""
    alpha = loglinear_alpha(versions, trainer_version).to(behaviour.device, behaviour.dtype)
    return behaviour + alpha * (current.detach().to(behaviour.dtype) - behaviour)


class LogLinearPolicyLoss(PolicyLoss):
    """:class:`~treerl.rl.PolicyLoss` whose proximal logprobs are the log-linear
    approximation, computed in each call from that call's (detached) current logprobs.

    ``alpha``: ``[T]`` per-token weights (:func:`loglinear_alpha`).
    """

    def __init__(self, batch: TokenBatch, config: PolicyLossConfig = PolicyLossConfig(), *, alpha: Tensor,
                 normalisers=None):
        if batch.behaviour_logprobs is None:
            raise ValueError("the log-linear proximal needs behaviour logprobs")
        self.alpha = alpha.to(batch.behaviour_logprobs.dtype)
        super().__init__(dataclasses.replace(batch, proximal_logprobs=None), config, normalisers=normalisers)

    def _tensors(self) -> dict[str, Tensor]:
        return {**super()._tensors(), "alpha": self.alpha}

    def _proximal(self, logp: Tensor, take: Callable[[str], Tensor]) -> Tensor:
        behav = take("behav")
        return behav + take("alpha") * (logp.detach().to(behav.dtype) - behav)
