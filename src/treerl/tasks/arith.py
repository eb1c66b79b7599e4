"""Safe evaluation of integer arithmetic: ``+ - * /``, unary minus, parentheses.

A small recursive-descent parser over exact rationals (:class:`fractions.Fraction`);
never ``eval``. Used by the countdown reward and the calculator tool.

Grammar::

    expr   := term (("+" | "-") term)*
    term   := unary (("*" | "/") unary)*
    unary  := ("-" | "+") unary | atom
    atom   := INTEGER | "(" expr ")"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

MAX_LENGTH = 256  # characters; bounds the recursion depth and the size of the numbers
MAX_DIGITS = 30  # per integer literal


class ExpressionError(ValueError):
    """The text is not a valid expression, or it divides by zero."""


@dataclass
class Evaluation:
    """Value of an expression and the integer literals it used, in order."""

    value: Fraction
    literals: list[int] = field(default_factory=list)


def evaluate(text: str, *, allow_division: bool = True, allow_unary: bool = True) -> Evaluation:
    """Parse and evaluate ``text``; raise :class:`ExpressionError` on anything invalid."""
    if not isinstance(text, str):
        raise ExpressionError(f"expression must be a string, got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ExpressionError(f"expression longer than {MAX_LENGTH} characters")
    return _Parser(text, allow_division, allow_unary).parse()


def format_number(value: Fraction) -> str:
    """``408``, ``-3``, or ``7/2`` for a non-integer."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


class _Parser:
    def __init__(self, text: str, allow_division: bool, allow_unary: bool) -> None:
        self.tokens = _tokenize(text, allow_division)
        self.i = 0
        self.allow_unary = allow_unary
        self.literals: list[int] = []

    def parse(self) -> Evaluation:
        if not self.tokens:
            raise ExpressionError("empty expression")
        value = self._expr()
        if self.i != len(self.tokens):
            raise ExpressionError(f"unexpected {self.tokens[self.i]!r}")
        return Evaluation(value, self.literals)

    def _peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _expr(self) -> Fraction:
        value = self._term()
        while self._peek() in ("+", "-"):
            op = self.tokens[self.i]
            self.i += 1
            rhs = self._term()
            value = value + rhs if op == "+" else value - rhs
        return value

    def _term(self) -> Fraction:
        value = self._unary()
        while self._peek() in ("*", "/"):
            op = self.tokens[self.i]
            self.i += 1
            rhs = self._unary()
            if op == "*":
                value = value * rhs
            else:
                if rhs == 0:
                    raise ExpressionError("division by zero")
                value = value / rhs
        return value

    def _unary(self) -> Fraction:
        tok = self._peek()
        if tok in ("-", "+"):
            if not self.allow_unary:
                raise ExpressionError(f"unary {tok!r} not allowed")
            self.i += 1
            value = self._unary()
            return -value if tok == "-" else value
        return self._atom()

    def _atom(self) -> Fraction:
        tok = self._peek()
        if tok is None:
            raise ExpressionError("expression ends early")
        self.i += 1
        if tok == "(":
            value = self._expr()
            if self._peek() != ")":
                raise ExpressionError("missing ')'")
            self.i += 1
            return value
        if tok.isdigit():
            n = int(tok)
            self.literals.append(n)
            return Fraction(n)
        raise ExpressionError(f"unexpected {tok!r}")


def _tokenize(text: str, allow_division: bool) -> list[str]:
    ops = "+-*/()" if allow_division else "+-*()"
    tokens: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in " \t":
            i += 1
        elif "0" <= ch <= "9":
            j = i
            while j < n and "0" <= text[j] <= "9":
                j += 1
            if j - i > MAX_DIGITS:
                raise ExpressionError(f"number longer than {MAX_DIGITS} digits")
            tokens.append(text[i:j])
            i = j
        elif ch in ops:
            tokens.append(ch)
            i += 1
        else:
            raise ExpressionError(f"invalid character {ch!r}")
    return tokens
