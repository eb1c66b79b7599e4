"""Multi-turn environments and episodes whose per-turn training sequences form a chain.

An :class:`Environment` has ``reset(problem) -> observation`` and
``step(action) -> (observation, reward, done)`` over text. :func:`run_episode` (or the
batched :func:`run_episodes`, or :class:`EpisodeRunner` step by step) alternates a
policy and an environment over **token ids**: the conversation is one growing token
list, observations are tokenized once and appended, actions are appended exactly as
the policy produced them (never re-tokenized). So:

- turn ``k``'s training sequence is the conversation up to and including action ``k``;
- sequence ``k`` is a strict prefix of sequence ``k + 1`` (a chain in the prefix tree);
- each sequence's ``loss_mask`` marks only action ``k``'s tokens, so every action is
  trained exactly once across the episode (earlier actions are context, like
  observations). :meth:`Episode.full_sequence` is the single-sequence alternative:
  the last sequence with every action marked. Both give the same gradient.

Token alignment (the engine's convention): for a sequence of ``L`` tokens,
``loss_mask`` and ``behaviour_logprobs`` have ``L - 1`` elements and element ``t``
refers to token ``t + 1`` (the token predicted from positions ``<= t``). Behaviour
logprobs hold the policy's logprob on every action token (this turn's and earlier ones),
0.0 on observation/format tokens.

Layout with :class:`ChatFormat` (``CharTokenizer`` default)::

    <bos><user> obs_0 <assistant> action_0 <tool> obs_1 <assistant> action_1 ...

An action usually ends with the policy's eos token; the environment sees it decoded with
special tokens skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from .base import Problem, SingleTurnEnv, _short, check_reward_value  # noqa: F401 (SingleTurnEnv: re-exported)

#: ``policy(context_token_ids) -> (action_token_ids, behaviour_logprobs)``
Policy = Callable[[list[int]], tuple[Sequence[int], Sequence[float]]]
#: ``batch_policy(contexts) -> [(action_token_ids, behaviour_logprobs), ...]``
BatchPolicy = Callable[[list[list[int]]], Sequence[tuple[Sequence[int], Sequence[float]]]]

MAX_TURNS = "max_turns"
MAX_TOTAL_TOKENS = "max_total_tokens"


@runtime_checkable
class Environment(Protocol):
    """A text environment; one instance runs one episode at a time."""

    def reset(self, problem: Problem) -> str:
        """Start an episode; return the first observation (usually the prompt)."""
        ...

    def step(self, action: str) -> tuple[str, float, bool]:
        """Apply the policy's action; return ``(observation, reward, done)``."""
        ...


@dataclass(frozen=True)
class ChatFormat:
    """Token ids framing observations; the policy acts right after ``obs_suffix``."""

    first_prefix: tuple[int, ...] = ()  # before the first observation (e.g. bos, user)
    obs_prefix: tuple[int, ...] = ()  # before every later observation (e.g. tool)
    obs_suffix: tuple[int, ...] = ()  # after every observation (e.g. assistant)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> "ChatFormat":
        """Role markers when the tokenizer has them (:class:`CharTokenizer`), else bos only."""
        ids = [getattr(tokenizer, f"{r}_token_id", None) for r in ("user", "assistant", "tool")]
        bos = getattr(tokenizer, "bos_token_id", None)
        head = (bos,) if bos is not None else ()
        if all(i is not None for i in ids):
            user, assistant, tool = ids
            return cls(head + (user,), (tool,), (assistant,))
        return cls(head)

    def render(self, tokenizer: Any, observation: str, first: bool) -> list[int]:
        body = tokenizer.encode(observation, add_special_tokens=False)
        return [*(self.first_prefix if first else self.obs_prefix), *body, *self.obs_suffix]

    def prompt_ids(self, tokenizer: Any, prompt: str) -> list[int]:
        """Context ids of a single-turn prompt, identical to :func:`run_episode`'s first context."""
        return self.render(tokenizer, prompt, first=True)


@dataclass
class TurnSequence:
    """Training sequence of one turn: the conversation through this turn's action."""

    token_ids: list[int]  # L tokens
    loss_mask: list[bool]  # L - 1; [t] is for token t + 1; True only on this turn's action
    behaviour_logprobs: list[float]  # L - 1; [t] is for token t + 1; 0.0 off action tokens
    turn: int
    action_start: int  # index in token_ids of this turn's first action token
    reward: float = 0.0  # the episode's reward (filled in when the episode ends)
    turn_reward: float = 0.0  # the environment's reward for this step alone


@dataclass
class Episode:
    """One finished episode.

    ``observations[0]`` is the first observation, ``observations[k + 1]`` the one after
    action ``k`` (the last one may be untokenized: given with ``done`` or cut off).
    ``reward`` is the sum of the step rewards; ``truncated`` is set (with ``truncation``
    = "max_turns" or "max_total_tokens") when a limit ended the episode before the
    environment did. A first observation longer than the token budget gives no sequences.
    """

    problem: Problem
    sequences: list[TurnSequence] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    observations: list[str] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    truncated: bool = False
    truncation: str | None = None

    @property
    def num_turns(self) -> int:
        return len(self.sequences)

    def full_sequence(self) -> TurnSequence:
        """The last sequence with every action's tokens marked (one sequence per episode)."""
        if not self.sequences:
            raise ValueError("episode has no sequences (its first observation exceeded the token budget)")
        last = self.sequences[-1]
        mask = [False] * len(last.loss_mask)
        for s in self.sequences:
            for t in range(s.action_start, len(s.token_ids)):
                mask[t - 1] = True
        return TurnSequence(
            list(last.token_ids), mask, list(last.behaviour_logprobs), last.turn, self.sequences[0].action_start,
            self.reward, sum(self.turn_rewards),
        )

    def transcript(self) -> str:
        parts = [f"[obs] {self.observations[0]}"] if self.observations else []
        for k, a in enumerate(self.actions):
            parts.append(f"[act] {a}")
            if k + 1 < len(self.observations):
                parts.append(f"[obs] {self.observations[k + 1]}")
        return "\n".join(parts)


class EpisodeRunner:
    """Steps one episode: read :attr:`context`, generate, call :meth:`act` until :attr:`finished`.

    ``max_turns`` bounds the number of actions; ``max_total_tokens`` bounds the length
    of every sequence (an action that would exceed it is cut to fit and ends the
    episode, truncated; an observation that fills it ends the episode before the next
    action).
    """

    def __init__(
        self,
        env: Environment,
        problem: Problem,
        tokenizer: Any,
        *,
        max_turns: int = 8,
        max_total_tokens: int = 1024,
        chat_format: ChatFormat | None = None,
    ) -> None:
        if max_turns < 1 or max_total_tokens < 2:
            raise ValueError(f"need max_turns >= 1 and max_total_tokens >= 2, got {max_turns}, {max_total_tokens}")
        self.env, self.tokenizer = env, tokenizer
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.format = chat_format or ChatFormat.for_tokenizer(tokenizer)
        self.episode = Episode(problem)
        self._tokens: list[int] = []
        self._logprobs: list[float] = []  # per token (index = position); 0.0 off actions
        self.finished = False
        obs = env.reset(problem)
        self._observe(obs, first=True)
        if not self._tokens:
            raise ValueError(
                f"{self._where()}: the first context is empty (no bos token and an empty observation); "
                "the first action token would have nothing to be predicted from"
            )

    @property
    def context(self) -> list[int]:
        """Token ids the policy continues (a copy)."""
        if self.finished:
            raise RuntimeError("episode is finished")
        return list(self._tokens)

    def _where(self) -> str:
        return f"episode of {type(self.env).__name__} on prompt {_short(self.episode.problem.prompt)}, turn {len(self.episode.actions)}"

    def _observe(self, observation: str, first: bool) -> None:
        if not isinstance(observation, str):
            raise TypeError(f"{self._where()}: observation must be a str, got {type(observation).__name__}")
        self.episode.observations.append(observation)
        ids = self.format.render(self.tokenizer, observation, first)
        self._tokens.extend(ids)
        self._logprobs.extend([0.0] * len(ids))
        if len(self._tokens) >= self.max_total_tokens:
            self._end(truncation=MAX_TOTAL_TOKENS)

    def _end(self, truncation: str | None = None, done: bool = False) -> None:
        ep = self.episode
        ep.done, ep.truncated, ep.truncation = done, truncation is not None, truncation
        ep.reward = float(math.fsum(ep.turn_rewards))
        for s in ep.sequences:
            s.reward = ep.reward
        self.finished = True

    def act(self, action_ids: Sequence[int], logprobs: Sequence[float]) -> None:
        """Append the policy's action, record its training sequence, step the environment."""
        if self.finished:
            raise RuntimeError(f"{self._where()}: act() after the episode finished")
        ids = [int(i) for i in (action_ids.tolist() if hasattr(action_ids, "tolist") else action_ids)]
        lps = [float(x) for x in (logprobs.tolist() if hasattr(logprobs, "tolist") else logprobs)]
        if not ids:
            raise ValueError(f"{self._where()}: the policy returned an empty action")
        if len(lps) != len(ids):
            raise ValueError(f"{self._where()}: {len(ids)} action tokens but {len(lps)} behaviour logprobs")
        if not all(math.isfinite(x) for x in lps):
            raise ValueError(f"{self._where()}: behaviour logprobs must be finite, got {lps}")
        room = self.max_total_tokens - len(self._tokens)
        cut = len(ids) > room
        ids, lps = ids[:room], lps[:room]

        start = len(self._tokens)
        self._tokens.extend(ids)
        self._logprobs.extend(lps)
        length = len(self._tokens)
        mask = [False] * (start - 1) + [True] * (length - start)
        turn = len(self.episode.actions)
        self.episode.sequences.append(
            TurnSequence(list(self._tokens), mask, self._logprobs[1:length], turn, start)
        )
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        self.episode.actions.append(text)
        if cut:
            self.episode.turn_rewards.append(0.0)
            self._end(truncation=MAX_TOTAL_TOKENS)
            return
        try:
            obs, reward, done = self.env.step(text)
        except Exception as e:
            e.add_note(f"while stepping the {self._where()}")
            raise
        reward = check_reward_value(reward, f"environment step ({self._where()})")
        self.episode.sequences[-1].turn_reward = reward
        self.episode.turn_rewards.append(reward)
        if done:
            self.episode.observations.append(obs)
            self._end(done=True)
        elif turn + 1 >= self.max_turns:
            self.episode.observations.append(obs)
            self._end(truncation=MAX_TURNS)
        else:
            self._observe(obs, first=False)


def run_episodes(
    envs: Sequence[Environment],
    problems: Sequence[Problem],
    batch_policy: BatchPolicy,
    tokenizer: Any,
    *,
    max_turns: int = 8,
    max_total_tokens: int = 1024,
    chat_format: ChatFormat | None = None,
) -> list[Episode]:
    """Run one episode per (env, problem), asking ``batch_policy`` for all live contexts at once."""
    if len(envs) != len(problems):
        raise ValueError(f"run_episodes: {len(envs)} environments but {len(problems)} problems")
    kw = dict(max_turns=max_turns, max_total_tokens=max_total_tokens, chat_format=chat_format)
    runners = [EpisodeRunner(e, p, tokenizer, **kw) for e, p in zip(envs, problems)]
    while live := [r for r in runners if not r.finished]:
        actions = batch_policy([r.context for r in live])
        if len(actions) != len(live):
            raise ValueError(f"run_episodes: batch_policy returned {len(actions)} actions for {len(live)} contexts")
        for r, (ids, lps) in zip(live, actions):
            r.act(ids, lps)
    return [r.episode for r in runners]


def run_episode(
    env: Environment,
    problem: Problem,
    policy: Policy,
    tokenizer: Any,
    *,
    max_turns: int = 8,
    max_total_tokens: int = 1024,
    chat_format: ChatFormat | None = None,
) -> Episode:
    """Run one episode of ``env`` on ``problem`` with ``policy``; see the module docstring."""
    runner = EpisodeRunner(
        env, problem, tokenizer, max_turns=max_turns, max_total_tokens=max_total_tokens, chat_format=chat_format
    )
    while not runner.finished:
        runner.act(*policy(runner.context))
    return runner.episode


def scripted_policy(actions: Sequence[str], tokenizer: Any, *, logprob: float = 0.0, add_eos: bool = True) -> Policy:
    """A policy that emits ``actions`` in order (then raises); for tests and supervised warm-up.

    Use one per episode. Each action is encoded and, with ``add_eos``, ends with eos.
    """
    queue = list(actions)

    def policy(context: list[int]) -> tuple[list[int], list[float]]:
        if not queue:
            raise RuntimeError(f"scripted policy ran out of actions (had {len(actions)})")
        ids = tokenizer.encode(queue.pop(0), add_special_tokens=False)
        if add_eos:
            ids = [*ids, tokenizer.eos_token_id]
        return ids, [logprob] * len(ids)

    return policy
