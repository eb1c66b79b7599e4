"""Problems, tasks, reward scoring, and the one-step environment every task has by default.

A reward is any callable ``reward(prompt, completion, **sample_fields) -> float``; the
sample fields are :meth:`Problem.reward_fields` (``answer`` plus the dataset's extra
fields). :func:`score` calls a reward over a batch and turns every failure (an exception,
NaN, inf, a non-number) into a :class:`RewardError` that names the sample.
"""

from __future__ import annotations

import math
import numbers
import random
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .tokenizer import CharTokenizer

RewardFn = Callable[..., float]
SPLITS = ("train", "eval")
RESERVED_FIELDS = ("prompt", "completion")


@dataclass(frozen=True)
class Problem:
    """One task instance: the prompt, its reference answer, and any extra dataset fields."""

    prompt: str
    answer: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)

    def reward_fields(self) -> dict[str, Any]:
        """Keyword arguments for a reward call: ``answer`` plus the extra fields."""
        return {"answer": self.answer, **self.fields}


class DatasetError(ValueError):
    """A dataset is missing, empty, unreadable, or too small for what is asked of it (the
    message names the file and line, or the split, and what to change)."""


class RewardError(RuntimeError):
    """A reward function raised, or returned something that is not a finite number."""


def _short(text: str, limit: int = 60) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def check_reward_value(value: Any, where: str = "reward") -> float:
    """``value`` as a finite float, else a :class:`RewardError` starting with ``where``."""
    v = value
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # numpy / torch scalars
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise RewardError(f"{where} returned {type(value).__name__} {shown}, expected a float")
    f = float(v)
    if not math.isfinite(f):
        raise RewardError(f"{where} returned {f}, expected a finite float")
    return f


def score(
    reward_fn: RewardFn,
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Sequence[Mapping[str, Any]] | None = None,
) -> list[float]:
    """Call ``reward_fn(prompt, completion, **fields[i])`` for every sample.

    Raises :class:`RewardError` naming the sample index, its prompt (truncated) and the
    exception or the bad value; never skips a sample.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"score: {len(prompts)} prompts but {len(completions)} completions")
    if fields is not None and len(fields) != len(prompts):
        raise ValueError(f"score: {len(prompts)} prompts but {len(fields)} field dicts")
    name = getattr(reward_fn, "__qualname__", None) or type(reward_fn).__name__
    out: list[float] = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        kwargs = dict(fields[i]) if fields is not None else {}
        bad = [k for k in RESERVED_FIELDS if k in kwargs]
        if bad:
            raise RewardError(f"reward {name}, sample {i}: field {bad[0]!r} collides with a reward argument")
        try:
            value = reward_fn(prompt, completion, **kwargs)
        except Exception as e:
            raise RewardError(
                f"reward {name} raised on sample {i} (prompt {_short(prompt)}, completion "
                f"{_short(completion, 40)}): {type(e).__name__}: {e}"
            ) from e
        out.append(check_reward_value(value, f"reward {name} on sample {i} (prompt {_short(prompt)})"))
    return out


def score_problems(reward_fn: RewardFn, problems: Sequence[Problem], completions: Sequence[str]) -> list[float]:
    """:func:`score` with prompts and fields taken from ``problems``."""
    return score(reward_fn, [p.prompt for p in problems], completions, [p.reward_fields() for p in problems])


def check_split(split: str) -> str:
    if split == "test":
        split = "eval"
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS} ('test' means 'eval')")
    return split


class Task(ABC):
    """A set of problems with a reward.

    Subclasses set ``name``, ``max_new_tokens`` (a recommended generation budget per
    action), ``max_turns`` (actions per episode of :meth:`make_env`), ``stop`` (stop
    strings, besides the tokenizer's eos) and ``alphabet`` (every character of prompts,
    completions and observations, for :meth:`tokenizer`; None when a real model's
    tokenizer is meant).
    """

    name: str = "task"
    max_new_tokens: int = 16
    max_turns: int = 1
    stop: tuple[str, ...] = ()
    alphabet: str | None = None

    @abstractmethod
    def problems(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
        """``n`` problems of ``split`` ("train" or "eval"), the same for the same seed."""

    @abstractmethod
    def reward(self, prompt: str, completion: str, **fields: Any) -> float:
        """Reward in [0, 1] (unless documented otherwise) of ``completion`` for ``prompt``."""

    def is_correct(self, prompt: str, completion: str, **fields: Any) -> bool:
        """Whether the completion solves the problem (for accuracy); default: full reward."""
        return self.reward(prompt, completion, **fields) >= 1.0 - 1e-9

    def target(self, problem: Problem) -> str:
        """A completion that earns full reward (for supervised warm-up)."""
        return problem.answer

    def train_problems(self, n: int | None = None, seed: int = 0) -> list[Problem]:
        return self.problems("train", n, seed)

    def eval_problems(self, n: int | None = None, seed: int = 0) -> list[Problem]:
        return self.problems("eval", n, seed)

    def tokenizer(self) -> CharTokenizer:
        """A character tokenizer covering this task's alphabet."""
        if not self.alphabet:
            raise ValueError(f"task {self.name!r} has no fixed alphabet; use a model's own tokenizer")
        return CharTokenizer(alphabet=self.alphabet)

    def make_env(self):
        """A fresh environment for one episode (:mod:`treerl.tasks.env`); single-turn tasks
        answer in one step."""
        return SingleTurnEnv(self)


class SingleTurnEnv:
    """Any :class:`Task` as a one-step environment: the completion is scored, then done."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.problem: Problem | None = None

    def reset(self, problem: Problem) -> str:
        self.problem = problem
        return problem.prompt

    def step(self, action: str) -> tuple[str, float, bool]:
        if self.problem is None:
            raise RuntimeError("SingleTurnEnv.step called before reset (or after the episode ended)")
        p, self.problem = self.problem, None
        return "", self.task.reward(p.prompt, action, **p.reward_fields()), True


class SyntheticTask(Task):
    """A generated task: problems are sampled, train and eval prompts never overlap.

    The held-out split is a fixed ``1/eval_buckets`` of the prompt space, chosen by a
    checksum of the prompt, so no seed or size makes a training prompt appear in eval.
    Train problems are drawn with replacement; eval problems are distinct.
    """

    eval_buckets: int = 10
    default_sizes = {"train": 10_000, "eval": 200}

    @abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """One problem drawn from the whole prompt space."""

    def split_of(self, prompt: str) -> str:
        return "eval" if zlib.crc32(prompt.encode("utf-8")) % self.eval_buckets == 0 else "train"

    def problems(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
        split = check_split(split)
        n = self.default_sizes[split] if n is None else int(n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        unique = split == "eval"
        out: list[Problem] = []
        seen: set[str] = set()
        attempts, limit = 0, 100 * n + 10_000
        while len(out) < n:
            attempts += 1
            if attempts > limit:
                raise DatasetError(
                    f"task {self.name!r}: found only {len(out)} of {n} {'distinct ' if unique else ''}"
                    f"{split} problems; the problem space is too small for this size"
                    + (" (lower train.eval_problems or eval -n)" if split == "eval" else "")
                )
            p = self.sample(rng)
            if self.split_of(p.prompt) != split or (unique and p.prompt in seen):
                continue
            seen.add(p.prompt)
            out.append(p)
        return out
