"""A benchmark workload with long-tailed generation lengths, for any model shape.

Random-weight models rarely emit EOS, so lengths are set by a stop rule instead: each
completion gets a target length drawn from a Pareto distribution (``P(L > x) =
(min_tokens / x) ** alpha``, capped at ``max_new_tokens``), keyed by a hash of its first
two tokens (so rows of one group differ, and a regenerated row with the same tokens gets
the same length). :class:`LengthTokenizer`'s ``decode`` appends the stop string once a
completion has reached its target; the rollout engine's stop-string search then ends it
exactly there. The stop string is long enough that the engine always decodes the whole
completion (its search window covers ``4 * len(stop) + 4`` tokens).

Rewards are a deterministic pseudo-random function of the completion (non-zero
advantages, real gradients); the benchmark uses a tiny learning rate so the length
distribution stays put while it measures wall-clock time.

``register()`` adds the task to the registry as ``longtail`` (workers call it through
``AsyncOptions.setup = "treerl.devtools.longtail:register"``).
"""

from __future__ import annotations

import hashlib
import math
import random
import zlib
from dataclasses import dataclass

from ..tasks.base import Problem, SyntheticTask
from ..tasks.registry import get_task, register_task
from ..tasks.tokenizer import CharTokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789:"
FILLER = 0x4E00  # decoded text of ids beyond the alphabet: CJK code points, never in the stop string


def target_length(ids: list[int], min_tokens: int, alpha: float, cap: int) -> int:
    """Pareto length keyed by the first two completion tokens (>= 2, <= cap)."""
    digest = hashlib.blake2b(bytes(str(ids[:2]), "ascii"), digest_size=8).digest()
    u = (int.from_bytes(digest, "big") + 1) / 2**64  # uniform in (0, 1]
    return max(2, min(cap, math.ceil(min_tokens / u ** (1.0 / alpha))))


@dataclass(frozen=True)
class LengthTokenizer(CharTokenizer):
    """A character tokenizer whose ``decode`` appends ``stop`` once the ids reach their
    target length; ids outside its vocabulary (a bigger model vocabulary) decode to
    filler characters."""

    min_tokens: int = 16
    alpha: float = 1.0
    max_new_tokens: int = 256
    stop: str = "\x00"

    def decode(self, ids, skip_special_tokens: bool = False) -> str:  # noqa: D102
        ids = [int(i) for i in ids]
        n = self.vocab_size
        text = super().decode([i for i in ids if i < n], skip_special_tokens=skip_special_tokens)
        text += "".join(chr(FILLER + (i % 20000)) for i in ids if i >= n)
        if len(ids) >= 2 and len(ids) >= target_length(ids, self.min_tokens, self.alpha, self.max_new_tokens):
            text += self.stop
        return text

    def save_pretrained(self, path) -> None:  # checkpoints: the char tokenizer part suffices
        CharTokenizer(alphabet=self.alphabet).save_pretrained(path)


@dataclass
class LongTailTask(SyntheticTask):
    """Prompts of ``prompt_tokens`` random characters; completions of Pareto lengths."""

    prompt_tokens: int = 16
    min_tokens: int = 16
    alpha: float = 1.0
    max_tokens: int = 256

    name = "longtail"
    alphabet = ALPHABET

    def __post_init__(self) -> None:
        self.max_new_tokens = self.max_tokens
        self.stop = ("\x00" * (self.max_tokens // 4 + 1),)

    def tokenizer(self) -> LengthTokenizer:
        return LengthTokenizer(alphabet=self.alphabet, min_tokens=self.min_tokens, alpha=self.alpha,
                               max_new_tokens=self.max_tokens, stop=self.stop[0])

    def sample(self, rng: random.Random) -> Problem:
        return Problem("".join(rng.choice(self.alphabet) for _ in range(self.prompt_tokens)) + ":")

    def reward(self, prompt: str, completion: str, **fields) -> float:
        return (zlib.crc32(completion.encode("utf-8", "surrogatepass")) % 1000) / 1000


def register() -> None:
    """Make ``get_task("longtail", ...)`` available (idempotent)."""
    try:
        get_task("longtail")
    except ValueError:
        register_task("longtail", LongTailTask)
