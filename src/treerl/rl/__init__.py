"""RL algorithms: advantages, policy and value losses, KL estimators, over a flat
per-token :class:`TokenBatch` (alignment: element t of a sequence's tensors is the
prediction of token t + 1, like the engine's logprobs)."""

from .advantages import dr_grpo_advantages, gae, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from .aggregation import AGGREGATIONS, Normalisers, token_weights
from .batch import TokenBatch, broadcast_to_tokens, sequence_ids
from .kl import KL_ESTIMATORS, kl_estimate
from .losses import PolicyLoss, PolicyLossConfig, ValueLoss, ValueLossConfig
from .proximal import LogLinearPolicyLoss, loglinear_alpha, loglinear_proximal_logprobs

__all__ = [
    "TokenBatch",
    "broadcast_to_tokens",
    "sequence_ids",
    "grpo_advantages",
    "dr_grpo_advantages",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "gae",
    "kl_estimate",
    "KL_ESTIMATORS",
    "AGGREGATIONS",
    "Normalisers",
    "token_weights",
    "PolicyLoss",
    "PolicyLossConfig",
    "ValueLoss",
    "ValueLossConfig",
    "LogLinearPolicyLoss",
    "loglinear_alpha",
    "loglinear_proximal_logprobs",
]
