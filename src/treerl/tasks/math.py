"""JSONL datasets and a math answer checker.

A dataset is a JSONL file, one JSON object per line, with a string ``prompt``, an
``answer`` (string or number) and any extra fields (kept in :attr:`Problem.fields`).
Blank lines are skipped; any other defect is a :class:`DatasetError` naming the file and
line.

The checker takes the final answer of a completion — the content of the last
``\\boxed{...}`` (nested braces allowed), else the last number in the text — and compares
it with the reference: numerically when both parse as numbers (integers, decimals,
fractions ``3/4`` or ``\\frac{3}{4}``, thousands separators ``1,234``, leading ``+``/``-``;
exact for integers and fractions, ``rel_tol`` for decimals), otherwise as normalised
strings (LaTeX spacing, ``$``, ``\\left``/``\\right``, ``\\text{}`` and whitespace removed).
A reference written GSM8K-style (``... #### 72``) or boxed is reduced to its answer.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from .base import RESERVED_FIELDS, DatasetError, Problem, RewardFn, Task, check_split

__all__ = ["DatasetError", "JsonlTask", "MathTask", "load_jsonl", "extract_boxed", "last_number", "extract_answer",
           "reference_answer", "normalize_string", "parse_number", "answers_match", "check_answer", "math_reward"]


# ---------------------------------------------------------------------------- loading
def load_jsonl(
    path: str | os.PathLike,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    require_answer: bool = False,
) -> list[Problem]:
    """Problems of a JSONL file; extra keys go to ``fields``. Raises :class:`DatasetError`."""
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DatasetError(f"{path}: cannot open dataset ({e.strerror or e})") from None
    problems: list[Problem] = []
    with f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a leading BOM is fine
            except UnicodeDecodeError as e:
                raise DatasetError(f"{where}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                   f"save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if prompt_key not in obj:
                raise DatasetError(f"{where}: missing {prompt_key!r} (keys: {sorted(obj)})")
            prompt = obj.pop(prompt_key)
            if not isinstance(prompt, str):
                raise DatasetError(f"{where}: {prompt_key!r} must be a string, got {type(prompt).__name__}")
            answer = obj.pop(answer_key, None)
            if answer is None:
                if require_answer:
                    raise DatasetError(f"{where}: missing {answer_key!r} (keys: {sorted([prompt_key, *obj])})")
                answer = ""
            elif isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise DatasetError(f"{where}: {answer_key!r} must be a string or a number, got {type(answer).__name__}")
            for key in RESERVED_FIELDS + ("answer",):
                if key in obj:
                    raise DatasetError(f"{where}: field {key!r} is reserved (it collides with a reward argument)")
            problems.append(Problem(prompt, str(answer), obj))
    if not problems:
        raise DatasetError(f"{path}: dataset is empty (no JSON lines)")
    return problems


# ---------------------------------------------------------------------------- extraction
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_BARE = re.compile(r"\\boxed\s+([^\s${}]+)")
_FRAC = re.compile(r"\\[dt]?frac\s*\{\s*([-+]?[\d.,]+)\s*\}\s*\{\s*([-+]?[\d.,]+)\s*\}")
_NUMBER = re.compile(
    r"(?:(?<![\w)\]}])[-+])?"  # a sign, unless it is a binary operator after an operand
    r"(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)"
    r"(?:[eE][-+]?\d+)?(?!\d)(?!,\d)"
)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced) or ``\\boxed x``."""
    best: tuple[int, str] | None = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            best = (m.start(), text[m.end() : i - 1])
    for m in _BOXED_BARE.finditer(text):
        if best is None or m.start() > best[0]:
            best = (m.start(), m[1])
    return None if best is None else best[1].strip()


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``\\frac{a}{b}`` read as ``a/b``), as written."""
    text = _FRAC.sub(lambda m: f"{m[1]}/{m[2]}", text.replace("\u2212", "-"))
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def extract_answer(completion: str) -> str | None:
    """The final answer of a completion: the last boxed content, else the last number."""
    boxed = extract_boxed(completion)
    return boxed if boxed is not None else last_number(completion)


def reference_answer(answer: str) -> str:
    """The answer part of a reference: after the last ``####``, else the boxed content, else all."""
    answer = str(answer)
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    boxed = extract_boxed(answer)
    return boxed if boxed is not None else answer.strip()


# ---------------------------------------------------------------------------- comparison
_LATEX_NOISE = re.compile(r"\\[!,;: ]|\\left|\\right|\\displaystyle|\$")
_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_UNITS = re.compile(r"\\(?:text|mathrm|mbox)\s*\{[^{}]*\}|\^\s*\{?\\circ\}?|\\%|%|\\degree")
_PLAIN_NUMBER = re.compile(
    r"([-+]?)(\d{1,3}(?:,\d{3})+(?:\.\d*)?|\d+(?:\.\d*)?|\.\d+)([eE][-+]?\d+)?"
)
_VAR_PREFIX = re.compile(r"^[a-zA-Z]\w*\s*=\s*")


def normalize_string(text: str) -> str:
    """Lower-case text without LaTeX spacing, ``$``, ``\\left``/``\\right``, ``\\text{}`` or whitespace."""
    text = _LATEX_NOISE.sub("", str(text))
    text = _TEXT_CMD.sub(lambda m: m[1], text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\s+", "", text).rstrip(".").lower()
    return text


def _parse_plain(text: str) -> tuple[Fraction, bool] | None:
    m = _PLAIN_NUMBER.fullmatch(text)
    if m is None:
        return None
    sign, body, exp = m.groups()
    value = Fraction(body.replace(",", "") + (exp or ""))
    exact = "." not in body and not exp
    return (-value if sign == "-" else value), exact


def parse_number(text: str) -> tuple[Fraction, bool] | None:
    """``(value, exact)`` of a number written as an integer, decimal, ``a/b`` or ``\\frac{a}{b}``.

    ``exact`` is False when a decimal point or exponent is involved (compare with a
    tolerance). Units (``\\text{cm}``, ``%``, degrees) and a ``x =`` prefix are ignored.
    Returns None when ``text`` is not a number.
    """
    s = _LATEX_NOISE.sub("", str(text).replace("\u2212", "-"))
    s = _UNITS.sub("", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = _VAR_PREFIX.sub("", s)
    sign = ""
    if s[:1] in "+-" and s[1:2] in ("\\", "("):
        sign, s = s[0], s[1:]
    if s.startswith("(") and s.endswith(")"):
        s = s[1:-1]
    m = _FRAC.fullmatch(s)
    if m is not None:
        parts = [m[1], m[2]]
    elif s.count("/") == 1:
        parts = s.split("/")
    else:
        parts = [s]
    parsed = [_parse_plain(p) for p in parts]
    if any(p is None for p in parsed):
        return None
    value, exact = parsed[0]  # type: ignore[misc]
    if len(parsed) == 2:
        den, den_exact = parsed[1]  # type: ignore[misc]
        if den == 0:
            return None
        value, exact = value / den, exact and den_exact
    return (-value if sign == "-" else value), exact


def answers_match(predicted: str, reference: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Whether two final answers agree: numerically if both are numbers, else as normalised strings."""
    p, r = parse_number(predicted), parse_number(reference)
    if p is not None and r is not None:
        (pv, pe), (rv, re_) = p, r
        if pv == rv:
            return True
        if pe and re_:
            return False
        return math.isclose(float(pv), float(rv), rel_tol=rel_tol, abs_tol=abs_tol)
    return normalize_string(predicted) == normalize_string(reference) != ""


def check_answer(completion: str, answer: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Whether ``completion``'s final answer matches the reference ``answer``."""
    predicted = extract_answer(completion)
    if predicted is None:
        return False
    return answers_match(predicted, reference_answer(answer), rel_tol=rel_tol, abs_tol=abs_tol)


def math_reward(prompt: str, completion: str, answer: str | None = None, **fields: Any) -> float:
    """1.0 if the completion's final answer matches ``answer``, else 0.0."""
    if answer is None:
        raise ValueError("math_reward needs the sample's 'answer' field")
    return 1.0 if check_answer(completion, answer) else 0.0


# ---------------------------------------------------------------------------- task
@dataclass
class JsonlTask(Task):
    """A task over JSONL problems, rewarded by ``reward_fn`` (default: :func:`math_reward`).

    The held-out split is ``eval_path`` if given, else a ``eval_fraction`` share of
    ``path`` chosen with ``split_seed``. ``problems(split, n=None)`` returns the whole
    split in file order; with ``n``, a seeded shuffle (train repeats past one epoch).
    """

    path: str
    eval_path: str | None = None
    eval_fraction: float = 0.1
    split_seed: int = 0
    reward_fn: RewardFn | None = None
    format_reward: float = 0.0
    max_new_tokens: int = 512
    stop: tuple[str, ...] = ()
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    _splits: dict = field(init=False, repr=False, compare=False)

    name = "math_jsonl"

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction: {self.eval_fraction!r} is not allowed; allowed: in [0, 1)")
        load = dict(prompt_key=self.prompt_key, answer_key=self.answer_key, require_answer=self.reward_fn is None)
        train = load_jsonl(self.path, **load)
        if self.eval_path is not None:
            held_out = load_jsonl(self.eval_path, **load)
        else:
            order = list(range(len(train)))
            random.Random(self.split_seed).shuffle(order)
            k = math.ceil(len(train) * self.eval_fraction) if len(train) > 1 else 0
            chosen = set(order[:k])
            held_out = [p for i, p in enumerate(train) if i in chosen]
            train = [p for i, p in enumerate(train) if i not in chosen]
            if not train or (self.eval_fraction > 0 and not held_out):
                raise DatasetError(
                    f"{self.path}: {len(order)} problem(s) are too few for a held-out split of eval_fraction="
                    f"{self.eval_fraction} ({len(train)} train, {len(held_out)} held out): add problems, change "
                    f"task.kwargs.eval_fraction, or give task.kwargs.eval_path")
        self._splits = {"train": train, "eval": held_out}

    def problems(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Problem]:
        split = check_split(split)
        pool = self._splits[split]
        if not pool:
            fix = "set task.kwargs.eval_fraction > 0 or task.kwargs.eval_path" if split == "eval" else "add problems"
            raise DatasetError(f"{self.name}: the {split} split of {self.path} is empty: {fix}")
        if n is None:
            return list(pool)
        if n > len(pool) and split == "eval":
            raise DatasetError(f"{self.name}: asked for {n} held-out problems (train.eval_problems, or eval -n), "
                               f"the held-out split of {self.eval_path or self.path} has {len(pool)}: ask for at "
                               f"most {len(pool)} or enlarge the split (task.kwargs.eval_fraction / eval_path)")
        rng = random.Random(f"{self.name}:{split}:{seed}")
        out: list[Problem] = []
        while len(out) < n:
            epoch = list(pool)
            rng.shuffle(epoch)
            out.extend(epoch[: n - len(out)])
        return out

    def reward(self, prompt: str, completion: str, **fields: Any) -> float:
        if self.reward_fn is not None:
            return self.reward_fn(prompt, completion, **fields)
        value = math_reward(prompt, completion, **fields)
        if value == 0.0 and self.format_reward and extract_boxed(completion) is not None:
            return self.format_reward
        return value


MathTask = JsonlTask
