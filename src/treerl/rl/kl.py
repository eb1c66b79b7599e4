"""Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi (Schulman's k1, k2, k3)."""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Elementwise KL estimate, same shape as the inputs. With ``d = ref - logp``:

    - ``k1 = -d`` (unbiased, can be negative),
    - ``k2 = d**2 / 2`` (biased, non-negative),
    - ``k3 = exp(d) - d - 1`` (unbiased, non-negative).
    """
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r}: choose one of {', '.join(KL_ESTIMATORS)}")
