"""Deterministic benchmark workloads (DESIGN.md, "Performance"): token sequences with the
sharing patterns of real RL batches. Token ids are random; only the shapes matter.

- ``grpo``: P prompts x G samples; each sample = its prompt + a response.
- ``agentic``: groups of multi-turn trajectories from a shared prefix (tau2-like); each
  trajectory yields one training sequence per turn, each extending the previous one.
- ``none``: independent sequences sharing nothing (distinct first tokens).
- ``long``: long context: groups of one long prefix (12,000 tokens at scale ``paper``)
  followed by several responses (6 of 200-800 tokens); one sequence per response.
- ``tree``: tree rollouts. Each tree starts with a prompt (1,024 tokens at ``paper``) and
  an observation; at each of ``tree_turns`` turns (4) every open branch forks into 2-3
  actions (``tree_branching``, drawn per fork; actions 20-200 tokens), each action
  followed by its own observation (50-400 tokens; none after the last turn's actions).
  Training sequences: every context that ends with an action, i.e. every root-to-leaf
  path and every intermediate context (prompt ... action of turn k < last), as a
  multi-turn agent trains on each of its turns. At ``paper`` scale: 2 trees; per tree on
  average 2.5^4 ~ 39 leaves (16-81) and ~63 sequences, leaves of ~2,800 tokens, ~14k
  unique and ~140k flat tokens (ideal ratio ~10; seed 0: 109 sequences, 233k flat and
  23.6k unique tokens in all, ratio 9.9).
- ``long_prefix``: one very long shared prompt (32,000 tokens at ``paper``) and 8
  responses of 1,000-2,500 tokens: one ~46k-token tree whose longest sequence is up to
  34.5k (issue 24's "32k-token shared prefix"; seed 0: 43.5k tokens, longest 34.2k).
- ``episodes``: long agent episodes: ``episode_tasks`` tasks (2) x ``episode_trajectories``
  trajectories (4) x ``episode_turns`` turns (12) of 800-1,600 tokens (observation and
  action together) after a 3,000-token prompt; one training sequence per turn, each
  extending the previous (issue 24's "12-turn agent episodes"; seed 0: 1.01M flat and
  119k unique tokens, sequences up to 19.1k, two trees of ~60k).

Every sibling set (the responses of a prefix, the actions of a fork) starts with distinct
tokens, so the divergence points are exactly where the shapes put them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("grpo", "agentic", "none", "long", "tree", "long_prefix", "episodes")


@dataclass(frozen=True)
class WorkloadSpec:
    """Shapes of the workloads. Ranges are inclusive (low, high) token counts. ``tree``
    shares ``observation_len``/``action_len`` with ``agentic``."""

    prompts: int = 8
    group: int = 8
    prompt_len: tuple[int, int] = (1024, 1024)
    response_len: tuple[int, int] = (256, 1024)
    agent_groups: int = 4
    trajectories: int = 4
    turns: int = 6
    prefix_len: int = 2048
    observation_len: tuple[int, int] = (50, 400)
    action_len: tuple[int, int] = (20, 200)
    none_sequences: int = 64
    none_len: tuple[int, int] = (512, 2048)
    long_groups: int = 2
    long_prefix_len: int = 12000
    long_responses: int = 6
    long_response_len: tuple[int, int] = (200, 800)
    tree_groups: int = 2
    tree_prompt_len: int = 1024
    tree_turns: int = 4
    tree_branching: tuple[int, int] = (2, 3)
    long_prefix_len_one: int = 32000
    long_prefix_responses: int = 8
    long_prefix_response_len: tuple[int, int] = (1000, 2500)
    episode_tasks: int = 2
    episode_trajectories: int = 4
    episode_turns: int = 12
    episode_prompt_len: int = 3000
    episode_turn_len: tuple[int, int] = (800, 1600)


SCALES = {
    # The H100 workloads.
    "paper": WorkloadSpec(),
    # Small enough for a CPU in seconds with the "small"/"tiny" model shapes.
    "small": WorkloadSpec(
        prompts=4, group=4, prompt_len=(96, 96), response_len=(16, 64),
        agent_groups=2, trajectories=3, turns=4, prefix_len=128,
        observation_len=(8, 32), action_len=(4, 24), none_sequences=16, none_len=(48, 160),
        long_groups=2, long_prefix_len=768, long_responses=6, long_response_len=(16, 64),
        tree_groups=1, tree_prompt_len=96, tree_turns=3, tree_branching=(2, 3),
        long_prefix_len_one=512, long_prefix_responses=8, long_prefix_response_len=(16, 64),
        episode_tasks=2, episode_trajectories=2, episode_turns=4, episode_prompt_len=64, episode_turn_len=(8, 24),
    ),
    "tiny": WorkloadSpec(
        prompts=2, group=3, prompt_len=(12, 12), response_len=(2, 8),
        agent_groups=2, trajectories=2, turns=3, prefix_len=10,
        observation_len=(2, 5), action_len=(1, 4), none_sequences=5, none_len=(4, 12),
        long_groups=2, long_prefix_len=24, long_responses=3, long_response_len=(2, 8),
        tree_groups=1, tree_prompt_len=10, tree_turns=3, tree_branching=(2, 3),
        long_prefix_len_one=20, long_prefix_responses=3, long_prefix_response_len=(2, 6),
        episode_tasks=1, episode_trajectories=2, episode_turns=3, episode_prompt_len=6, episode_turn_len=(2, 4),
    ),
}


def _draw(rng: np.random.Generator, lo_hi: tuple[int, int]) -> int:
    return int(rng.integers(lo_hi[0], lo_hi[1] + 1))


def grpo(spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(spec.prompts):
        prompt = rng.integers(0, vocab_size, _draw(rng, spec.prompt_len))
        for _ in range(spec.group):
            seqs.append(np.concatenate([prompt, rng.integers(0, vocab_size, _draw(rng, spec.response_len))]))
    return seqs


def agentic(spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(spec.agent_groups):
        prefix = rng.integers(0, vocab_size, spec.prefix_len)
        for _ in range(spec.trajectories):
            conversation = prefix
            for _ in range(spec.turns):
                observation = rng.integers(0, vocab_size, _draw(rng, spec.observation_len))
                action = rng.integers(0, vocab_size, _draw(rng, spec.action_len))
                conversation = np.concatenate([conversation, observation, action])
                seqs.append(conversation)
    return seqs


def no_sharing(spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if spec.none_sequences > vocab_size:
        raise ValueError("the 'none' workload needs a distinct first token per sequence: vocabulary too small")
    firsts = rng.permutation(vocab_size)[: spec.none_sequences]
    return [
        np.concatenate([[first], rng.integers(0, vocab_size, _draw(rng, spec.none_len) - 1)])
        for first in firsts
    ]


def distinct_starts(rng: np.random.Generator, vocab_size: int, lengths: list[int]) -> list[np.ndarray]:
    """Random pieces of the given lengths whose first tokens differ (siblings diverge at
    their first token)."""
    if len(lengths) > vocab_size:
        raise ValueError(f"{len(lengths)} siblings need distinct first tokens: vocabulary of {vocab_size} too small")
    firsts = rng.choice(vocab_size, size=len(lengths), replace=False)
    return [np.concatenate([[f], rng.integers(0, vocab_size, n - 1)]) for f, n in zip(firsts, lengths)]


def long_context(spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(spec.long_groups):
        prefix = rng.integers(0, vocab_size, spec.long_prefix_len)
        lengths = [_draw(rng, spec.long_response_len) for _ in range(spec.long_responses)]
        seqs += [np.concatenate([prefix, r]) for r in distinct_starts(rng, vocab_size, lengths)]
    return seqs


def tree_rollout(spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """Sequences in depth-first order: each context ending with an action, then its subtree."""
    rng = np.random.default_rng(seed)
    seqs: list[np.ndarray] = []

    def fork(context: np.ndarray, turn: int) -> None:
        width = _draw(rng, spec.tree_branching)
        actions = distinct_starts(rng, vocab_size, [_draw(rng, spec.action_len) for _ in range(width)])
        for action in actions:
            seq = np.concatenate([context, action])
            seqs.append(seq)
            if turn + 1 < spec.tree_turns:
                fork(np.concatenate([seq, rng.integers(0, vocab_size, _draw(rng, spec.observation_len))]), turn + 1)

    for _ in range(spec.tree_groups):
        root = rng.integers(0, vocab_size, spec.tree_prompt_len + _draw(rng, spec.observation_len))
        fork(root, 0)
    return seqs


def prefix_fan(prompt_len: int, responses: int, response_len: tuple[int, int], vocab_size: int, seed: int = 0
               ) -> list[np.ndarray]:
    """One prompt of ``prompt_len`` tokens and ``responses`` sequences extending it by
    ``response_len`` tokens each (one tree of ``prompt_len`` + the responses' tokens)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, vocab_size, prompt_len)
    lengths = [_draw(rng, response_len) for _ in range(responses)]
    return [np.concatenate([prompt, r]) for r in distinct_starts(rng, vocab_size, lengths)]


def long_prefix(spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """One prompt of ``long_prefix_len_one`` tokens, ``long_prefix_responses`` responses."""
    return prefix_fan(spec.long_prefix_len_one, spec.long_prefix_responses, spec.long_prefix_response_len,
                      vocab_size, seed)


def memory_sweep_tree(tokens: int, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """A tree of ``tokens`` tokens shaped like ``long_prefix``: a prompt of half of them and
    8 responses of 1/16 each (its longest path 9/16 of the tree), for memory sweeps."""
    return prefix_fan(tokens // 2, 8, (tokens // 16, tokens // 16), vocab_size, seed)


def episodes(spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """Per task a prompt; per trajectory ``episode_turns`` turns, each a training sequence
    extending the previous; trajectories diverge at their first turn."""
    rng = np.random.default_rng(seed)
    seqs = []
    for _ in range(spec.episode_tasks):
        prompt = rng.integers(0, vocab_size, spec.episode_prompt_len)
        firsts = distinct_starts(rng, vocab_size, [_draw(rng, spec.episode_turn_len)
                                                   for _ in range(spec.episode_trajectories)])
        for first in firsts:
            conversation = np.concatenate([prompt, first])
            seqs.append(conversation)
            for _ in range(spec.episode_turns - 1):
                turn = rng.integers(0, vocab_size, _draw(rng, spec.episode_turn_len))
                conversation = np.concatenate([conversation, turn])
                seqs.append(conversation)
    return seqs


def make_workload(name: str, spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """The sequences of workload ``name`` (one of WORKLOADS)."""
    builders = {"grpo": grpo, "agentic": agentic, "none": no_sharing, "long": long_context, "tree": tree_rollout,
                "long_prefix": long_prefix, "episodes": episodes}
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    return builders[name](spec, vocab_size, seed)
