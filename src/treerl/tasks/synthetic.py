"""Synthetic tasks small enough for a tiny transformer trained on a CPU.

Prompts are short (under ~20 characters), answers shorter. Every reward re-derives the
truth from the prompt alone (extra fields are ignored), reads the completion's first line
(up to a newline or a special token such as ``<|eos|>``) stripped, and returns 1.0 when
correct, ``format_reward`` (default 0) when it is well-formed but wrong, else 0.0.

=============  ==================  ===========  =====================================
task           prompt              completion   knobs
=============  ==================  ===========  =====================================
addition       ``12+34=``          ``46``       ``min_digits``, ``digits``
sorting        ``31425>``          ``12345``    ``min_length``, ``max_length``
countdown      ``3,5,7>38=``       ``3+5*7``    ``num_numbers``, ``max_number``, ``ops``
=============  ==================  ===========  =====================================
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from .arith import ExpressionError, evaluate
from .base import Problem, SyntheticTask

DIGITS = "0123456789"


def first_line(completion: str) -> str:
    """What synthetic rewards read: the completion up to its first newline or special token
    (``<|``, e.g. a ``<|eos|>`` left in by decoding without ``skip_special_tokens``), stripped."""
    return completion.split("\n", 1)[0].split("<|", 1)[0].strip()


def _bad_prompt(task: str, prompt: str, form: str) -> ValueError:
    return ValueError(f"{task}: prompt {prompt!r} is not of the form {form}")


def _random_int(rng: random.Random, min_digits: int, max_digits: int) -> int:
    d = rng.randint(min_digits, max_digits)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


@dataclass
class AdditionTask(SyntheticTask):
    """``a+b=`` -> ``a+b``; each operand has between ``min_digits`` and ``digits`` digits."""

    digits: int = 2
    min_digits: int = 1
    format_reward: float = 0.0

    name = "addition"
    alphabet = DIGITS + "+="
    stop = ("\n",)
    _PROMPT = re.compile(r"(\d+)\+(\d+)=")

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.digits:
            raise ValueError(f"addition: need 1 <= min_digits <= digits, got {self.min_digits}, {self.digits}")
        self.max_new_tokens = self.digits + 2  # the sum, eos, one spare

    def sample(self, rng: random.Random) -> Problem:
        a = _random_int(rng, self.min_digits, self.digits)
        b = _random_int(rng, self.min_digits, self.digits)
        return Problem(f"{a}+{b}=", str(a + b))

    def reward(self, prompt: str, completion: str, **fields) -> float:
        m = self._PROMPT.fullmatch(prompt)
        if m is None:
            raise _bad_prompt(self.name, prompt, "'<digits>+<digits>='")
        text = first_line(completion)
        if text == str(int(m[1]) + int(m[2])):
            return 1.0
        return self.format_reward if text.isdigit() and text.isascii() else 0.0


@dataclass
class SortingTask(SyntheticTask):
    """``31425>`` -> ``12345``: sort a string of ``min_length``..``max_length`` digits."""

    min_length: int = 3
    max_length: int = 6
    format_reward: float = 0.0

    name = "sorting"
    alphabet = DIGITS + ">"
    stop = ("\n",)
    _PROMPT = re.compile(r"(\d+)>")

    def __post_init__(self) -> None:
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"sorting: need 1 <= min_length <= max_length, got {self.min_length}, {self.max_length}")
        self.max_new_tokens = self.max_length + 2

    def sample(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_length, self.max_length)
        digits = "".join(rng.choice(DIGITS) for _ in range(n))
        return Problem(f"{digits}>", "".join(sorted(digits)))

    def reward(self, prompt: str, completion: str, **fields) -> float:
        m = self._PROMPT.fullmatch(prompt)
        if m is None or not m[1].isascii():
            raise _bad_prompt(self.name, prompt, "'<digits>>'")
        text = first_line(completion)
        if text == "".join(sorted(m[1])):
            return 1.0
        return self.format_reward if sorted(text) == sorted(m[1]) else 0.0


@dataclass
class CountdownTask(SyntheticTask):
    """``3,5,7>38=`` -> an expression over the numbers that equals the target, e.g. ``3+5*7``.

    Numbers are 1..``max_number``; the expression may use ``ops`` (a subset of ``+-*``,
    ``/`` allowed too when listed, exact rationals) and parentheses, each given number at
    most once (as many times as it is listed), no unary minus and no other literals.
    Generated targets are non-negative and reachable with every number (``answer`` is one
    such expression); numbers are listed in random order unless ``shuffle=False``.
    """

    num_numbers: int = 3
    max_number: int = 9
    ops: str = "+-*"
    shuffle: bool = True
    format_reward: float = 0.0

    name = "countdown"
    stop = ("\n",)
    _PROMPT = re.compile(r"(\d+(?:,\d+)*)>(\d+)=")

    def __post_init__(self) -> None:
        if self.num_numbers < 1 or self.max_number < 1:
            raise ValueError("countdown: num_numbers and max_number must be >= 1")
        if not self.ops or set(self.ops) - set("+-*/"):
            raise ValueError(f"countdown: ops must be a non-empty subset of '+-*/', got {self.ops!r}")
        self.alphabet = DIGITS + ",>=()" + "".join(sorted(set(self.ops), key="+-*/".index))
        width = len(str(self.max_number))
        self.max_new_tokens = self.num_numbers * (width + 1) + 4

    def sample(self, rng: random.Random) -> Problem:
        while True:
            nums = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
            expr = str(nums[0]) + "".join(rng.choice(self.ops) + str(x) for x in nums[1:])
            try:
                value = evaluate(expr).value
            except ExpressionError:  # division by zero cannot happen (numbers >= 1), kept for safety
                continue
            if value >= 0 and value.denominator == 1:
                break
        shown = list(nums)
        if self.shuffle:
            rng.shuffle(shown)
        return Problem(f"{','.join(map(str, shown))}>{value.numerator}=", expr)

    def parse_prompt(self, prompt: str) -> tuple[list[int], int]:
        """The numbers and the target of a prompt."""
        m = self._PROMPT.fullmatch(prompt)
        if m is None or not prompt.isascii():
            raise _bad_prompt(self.name, prompt, "'<n>,<n>,...><target>='")
        return [int(x) for x in m[1].split(",")], int(m[2])

    def check(self, prompt: str, completion: str) -> tuple[bool, bool]:
        """``(well_formed, correct)``: valid expression over the given numbers; and it hits the target."""
        numbers, target = self.parse_prompt(prompt)
        text = first_line(completion)
        if not text or set(text) - set(DIGITS + "() " + self.ops):
            return False, False
        try:
            ev = evaluate(text, allow_division="/" in self.ops, allow_unary=False)
        except ExpressionError:
            return False, False
        available = list(numbers)
        for lit in ev.literals:
            if lit not in available:
                return False, False
            available.remove(lit)
        return True, ev.value == target

    def reward(self, prompt: str, completion: str, **fields) -> float:
        well_formed, correct = self.check(prompt, completion)
        return 1.0 if correct else (self.format_reward if well_formed else 0.0)
