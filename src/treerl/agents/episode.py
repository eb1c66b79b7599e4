"""An episode's recorded calls -> training sequences (one prefix tree per episode).

Every choice of every call is one training sequence: the call's prompt followed by that
choice's completion, trained on the completion tokens only. A call whose prompt extends an
earlier call's prompt + completion (the next turn) makes a sequence that contains the
earlier one: a chain in the prefix tree, shared prefixes computed once by the tree engine.
Concurrent calls (``asyncio.gather``) and the ``n`` choices of one call branch where they
differ. Each completion token is trained exactly once, in the sequence of the call that
sampled it (as :mod:`treerl.tasks.env` does for environment episodes).

Alignment (the engine's): a sequence of ``L`` tokens has ``L - 1`` per-token entries,
entry ``t`` for token ``t + 1``.

Rewards: the agent returns the episode's reward (a number) or an :class:`EpisodeReward`
with rewards per turn (keyed by call index: the order in which the episode sent its calls,
from 0). A sequence's reward is the episode reward plus the turn rewards of its call and of
the calls that extend it (reward to go along its branch); so the first call's sequences
carry the whole return, which group baselines (GRPO, RLOO, Dr.GRPO) use, and per-sequence
methods (REINFORCE++, GAE) see each turn's reward to go.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping

from .record import CallRecord


@dataclass(frozen=True)
class EpisodeReward:
    """An episode's reward with optional per-turn rewards ``{call index: reward}``."""

    total: float
    turns: Mapping[int, float] = field(default_factory=dict)


def as_reward(value: Any) -> EpisodeReward:
    """The agent's return value as an :class:`EpisodeReward`; anything else is a TypeError."""
    if isinstance(value, EpisodeReward):
        out = value
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        out = EpisodeReward(float(value))
    else:
        raise TypeError(f"the agent returned {value!r}; it must return a number (the episode's reward) "
                        f"or treerl.agents.EpisodeReward")
    values = [out.total, *out.turns.values()]
    if not all(isinstance(v, numbers.Real) and math.isfinite(float(v)) for v in values):
        raise ValueError(f"the agent's reward must be finite numbers, got {out}")
    return out


def _extends(longer: list[int], shorter: list[int]) -> bool:
    return len(longer) >= len(shorter) and longer[: len(shorter)] == shorter


def exact_turn_share(calls: list[CallRecord]) -> float | None:
    """Of an episode's calls that continue an earlier call (their prompt extends its prompt),
    the share that extend its prompt + one of its completions token for token (the turn the
    model produced re-entered the conversation as produced: a chain in the prefix tree).
    None when no call continues another."""
    calls = sorted(calls, key=lambda c: c.index)
    continued = exact = 0
    for k, call in enumerate(calls):
        earlier = [c for c in calls[:k] if _extends(call.prompt_ids, c.prompt_ids)]
        if not earlier:
            continue
        continued += 1
        exact += any(_extends(call.prompt_ids, c.prompt_ids + ch.token_ids) for c in earlier for ch in c.choices)
    return exact / continued if continued else None


def episode_sequences(calls: list[CallRecord], reward: EpisodeReward) -> list[dict]:
    """Training sequences of one episode, in call order: dicts with ``token_ids``,
    ``loss_mask``, ``behaviour_logprobs``, ``versions`` (``[L - 1]`` each), ``reward``,
    ``call`` (index) and ``choice``."""
    calls = sorted(calls, key=lambda c: c.index)
    unknown = set(reward.turns) - {c.index for c in calls}
    if unknown:
        raise ValueError(f"turn rewards for calls {sorted(unknown)}, but the episode recorded calls "
                         f"{[c.index for c in calls]}")
    out = []
    for call in calls:
        to_go = sum(float(reward.turns.get(c.index, 0.0)) for c in calls
                    if c.index >= call.index and _extends(c.prompt_ids, call.prompt_ids))
        P = len(call.prompt_ids)
        for j, ch in enumerate(call.choices):
            if not ch.token_ids:
                continue
            oldest = min(ch.versions)
            out.append(dict(
                token_ids=call.prompt_ids + ch.token_ids,
                loss_mask=[False] * (P - 1) + [True] * len(ch.token_ids),
                behaviour_logprobs=[0.0] * (P - 1) + ch.logprobs,
                versions=[oldest] * (P - 1) + ch.versions,
                reward=reward.total + to_go, call=call.index, choice=j,
            ))
    return out
