"""The unit that flows from rollout to training: one scored token sequence (:class:`Sample`).

Produced by :mod:`treerl.sampler` (and by asynchronous rollout workers), consumed by
:mod:`treerl.learner`, logged by :mod:`treerl.runlog`. It sits below all of them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Sample:
    """One training sequence of ``L`` tokens. Per-token lists have length ``L - 1``
    (element ``t`` is about token ``t + 1``, the token predicted from positions ``<= t``)."""

    token_ids: list[int]  # [L]
    loss_mask: list[bool]  # [L - 1]: True on tokens the policy generated and is trained on
    behaviour_logprobs: list[float]  # [L - 1]: the sampling policy's logprobs (0.0 off the mask)
    versions: list[int]  # [L - 1]: weight version that produced each token
    reward: float
    group: int  # samples of one group share a problem (GRPO baselines)
    episode: int  # per-turn sequences of one episode share it
    completion: str = ""
