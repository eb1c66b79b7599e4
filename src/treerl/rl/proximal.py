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
from typing import Sequence

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

    ``alpha``: ``[T]`` per-token weights (:func:`loglinear_alpha`). Behaviour-weight
    statistics (``behaviour_weight_mean/max/min/capped_fraction``) are over the tokens of
    every call since the last ``reset_metrics``.
    """

    def __init__(self, batch: TokenBatch, config: PolicyLossConfig = PolicyLossConfig(), *, alpha: Tensor,
                 normalisers=None):
        if batch.behaviour_logprobs is None:
            raise ValueError("the log-linear proximal needs behaviour logprobs")
        self.alpha = alpha.to(batch.behaviour_logprobs.dtype)
        self._override: dict[str, Tensor] | None = None
        super().__init__(dataclasses.replace(batch, proximal_logprobs=batch.behaviour_logprobs), config,
                         normalisers=normalisers)

    def _behaviour_weight_stats(self) -> None:  # per call instead (see __call__)
        return

    def _fields(self, device: torch.device) -> dict[str, Tensor]:
        f = super()._fields(device)
        return f if self._override is None else {**f, **self._override}

    def __call__(self, logprobs: Sequence[Tensor], entropies: Sequence[Tensor] | None = None, *, index=None) -> Tensor:
        tokens, _ = self.batch.token_index(index)
        current = torch.cat([lp.detach() for lp in logprobs]) if len(logprobs) else self.alpha.new_zeros(0)
        dev = current.device
        behav = self.batch.behaviour_logprobs.to(dev)
        alpha = self.alpha.to(dev)
        mask = self.batch.loss_mask.to(dev)
        sel = slice(None) if tokens is None else tokens.to(dev)
        prox = behav.clone()
        prox[sel] = behav[sel] + alpha[sel] * (current.to(behav.dtype) - behav[sel])
        raw = torch.exp(torch.where(mask, prox - behav, 0.0))
        cap = self.config.behaviour_weight_cap
        keep = mask if cap is None else mask & (raw <= cap)
        self._override = {"old": prox, "bw": torch.where(keep, raw, torch.zeros_like(raw))}
        try:
            loss = super().__call__(logprobs, entropies, index=index)
        finally:
            self._override = None
        m = mask[sel]
        w = raw[sel]
        self._accumulate(bw_sum=torch.where(m, w, 0.0).sum(), bw_tokens=m.sum(),
                         bw_capped=(m & ~keep[sel]).sum(),
                         bw_max=torch.where(m, w, -torch.inf).amax() if w.numel() else torch.tensor(-torch.inf),
                         bw_min=torch.where(m, w, torch.inf).amin() if w.numel() else torch.tensor(torch.inf))
        return loss

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        raw = self._read()
        if raw.get("bw_tokens", 0) > 0:
            n = raw["bw_tokens"]
            out.update(behaviour_weight_mean=raw["bw_sum"] / n, behaviour_weight_max=raw["bw_max"],
                       behaviour_weight_min=raw["bw_min"], behaviour_weight_capped_fraction=raw["bw_capped"] / n)
        for k in ("bw_sum", "bw_tokens", "bw_capped", "bw_max", "bw_min"):
            out.pop(k, None)
        return out
