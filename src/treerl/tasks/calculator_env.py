"""A tool-use task: arithmetic solved by calling a calculator.

Episode (the observation is the expression, e.g. ``37*48+5``)::

    action  <calc>37*48+5</calc>        -> observation <result>1781</result>, reward 0
    action  <answer>1781</answer>       -> done, reward 1 if correct

In each action the first ``<calc>...</calc>`` or ``<answer>...</answer>`` tag counts
(text before it is ignored). An action with neither tag ends the episode with reward
``-malformed_penalty``; a calculator call that does not parse (or divides by zero)
returns ``<result>error</result>``, costs ``malformed_penalty`` and the episode goes on.
With ``require_call`` a correct answer given before any calculator call earns only
``format_reward``. Expressions are evaluated by :mod:`treerl.tasks.arith`, never ``eval``.

Single-turn use: :meth:`CalculatorTask.reward` scores a whole completion by its last
``<answer>`` tag (1 if correct, ``format_reward`` if a number, else 0).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from fractions import Fraction

from .arith import ExpressionError, evaluate, format_number
from .base import Problem, SyntheticTask
from .synthetic import _random_int

_TAG = re.compile(r"<calc>(.*?)</calc>|<answer>(.*?)</answer>", re.S)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
_NUMBER = re.compile(r"\s*([-+]?\d+)(?:\s*/\s*(\d+))?\s*")
ALPHABET = "0123456789+-*/() <>acelnorstuw"  # digits, operators, the letters of calc/result/answer/error


def parse_answer(text: str) -> Fraction | None:
    """An integer or ``a/b`` answer, else None."""
    m = _NUMBER.fullmatch(text)
    if m is None or m[2] is not None and int(m[2]) == 0:
        return None
    return Fraction(int(m[1]), int(m[2]) if m[2] else 1)


def _truth(prompt: str) -> Fraction:
    try:
        return evaluate(prompt).value
    except ExpressionError as e:
        raise ValueError(f"calculator: prompt {prompt!r} is not an arithmetic expression ({e})") from None


class CalculatorEnv:
    """The calculator environment (see the module docstring)."""

    def __init__(self, *, require_call: bool = True, malformed_penalty: float = 0.0, format_reward: float = 0.0):
        self.require_call = require_call
        self.malformed_penalty = malformed_penalty
        self.format_reward = format_reward
        self._truth: Fraction | None = None
        self.calls = 0

    def reset(self, problem: Problem) -> str:
        self._truth = _truth(problem.prompt)
        self.calls = 0
        return problem.prompt

    def step(self, action: str) -> tuple[str, float, bool]:
        if self._truth is None:
            raise RuntimeError("CalculatorEnv.step called before reset (or after the episode ended)")
        m = _TAG.search(action)
        if m is None:
            self._truth = None
            return "", -self.malformed_penalty, True
        if m[1] is not None:
            self.calls += 1
            try:
                value = evaluate(m[1])
            except ExpressionError:
                return "<result>error</result>", -self.malformed_penalty, False
            return f"<result>{format_number(value.value)}</result>", 0.0, False
        truth, self._truth = self._truth, None
        answer = parse_answer(m[2])
        if answer is None:
            return "", -self.malformed_penalty, True
        if answer == truth and (self.calls > 0 or not self.require_call):
            return "", 1.0, True
        return "", self.format_reward, True


@dataclass
class CalculatorTask(SyntheticTask):
    """Expressions of ``num_ops`` operators from ``ops`` over ``min_digits``..``digits``-digit integers."""

    digits: int = 2
    min_digits: int = 1
    num_ops: int = 1
    ops: str = "+-*"
    require_call: bool = True
    malformed_penalty: float = 0.0
    format_reward: float = 0.0

    name = "calculator"
    alphabet = ALPHABET
    stop = ("</calc>", "</answer>")
    max_turns = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.digits:
            raise ValueError(f"calculator: need 1 <= min_digits <= digits, got {self.min_digits}, {self.digits}")
        if self.num_ops < 1 or not self.ops or set(self.ops) - set("+-*"):
            raise ValueError("calculator: need num_ops >= 1 and ops a non-empty subset of '+-*'")
        width = (self.num_ops + 1) * (self.digits + 1)
        self.max_new_tokens = width + len("<calc></calc>") + 4

    def sample(self, rng: random.Random) -> Problem:
        parts = [str(_random_int(rng, self.min_digits, self.digits))]
        for _ in range(self.num_ops):
            parts += [rng.choice(self.ops), str(_random_int(rng, self.min_digits, self.digits))]
        prompt = "".join(parts)
        return Problem(prompt, format_number(evaluate(prompt).value))

    def expert_actions(self, problem: Problem) -> list[str]:
        """The actions of a perfect episode: call the calculator, then answer."""
        return [f"<calc>{problem.prompt}</calc>", f"<answer>{format_number(_truth(problem.prompt))}</answer>"]

    def target(self, problem: Problem) -> str:
        """Single-turn target: the answer tag."""
        return f"<answer>{format_number(_truth(problem.prompt))}</answer>"

    def reward(self, prompt: str, completion: str, **fields) -> float:
        truth = _truth(prompt)
        found = _ANSWER.findall(completion)
        answer = parse_answer(found[-1]) if found else None
        if answer is None:
            return 0.0
        return 1.0 if answer == truth else self.format_reward

    def make_env(self) -> CalculatorEnv:
        return CalculatorEnv(
            require_call=self.require_call, malformed_penalty=self.malformed_penalty, format_reward=self.format_reward
        )
