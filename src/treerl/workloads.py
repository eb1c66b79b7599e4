"""Deterministic benchmark workloads (DESIGN.md, "Performance"): token sequences with the
sharing patterns of real RL batches. Token ids are random; only the shapes matter.

- ``grpo``: P prompts x G samples; each sample = its prompt + a response.
- ``agentic``: groups of multi-turn trajectories from a shared prefix (tau2-like); each
  trajectory yields one training sequence per turn, each extending the previous one.
- ``none``: independent sequences sharing nothing (distinct first tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORKLOADS = ("grpo", "agentic", "none")


@dataclass(frozen=True)
class WorkloadSpec:
    """Shapes of the three workloads. Ranges are inclusive (low, high) token counts."""

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


SCALES = {
    # The H100 workloads.
    "paper": WorkloadSpec(),
    # Small enough for a CPU in seconds with the "small"/"tiny" model shapes.
    "small": WorkloadSpec(
        prompts=4, group=4, prompt_len=(96, 96), response_len=(16, 64),
        agent_groups=2, trajectories=3, turns=4, prefix_len=128,
        observation_len=(8, 32), action_len=(4, 24), none_sequences=16, none_len=(48, 160),
    ),
    "tiny": WorkloadSpec(
        prompts=2, group=3, prompt_len=(12, 12), response_len=(2, 8),
        agent_groups=2, trajectories=2, turns=3, prefix_len=10,
        observation_len=(2, 5), action_len=(1, 4), none_sequences=5, none_len=(4, 12),
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


def make_workload(name: str, spec: WorkloadSpec, vocab_size: int, seed: int = 0) -> list[np.ndarray]:
    """The sequences of workload ``name`` (one of WORKLOADS)."""
    builders = {"grpo": grpo, "agentic": agentic, "none": no_sharing}
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")
    return builders[name](spec, vocab_size, seed)
