"""Sampling parameters of one :meth:`RolloutEngine.generate <treerl.rollout.RolloutEngine.generate>` call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

Decoder = Callable[[list[int]], str]


@dataclass
class SamplingParams:
    """How to sample completions.

    - ``n``: samples per prompt (the group size G). Each prompt is prefilled once and
      its KV shared by its G samples.
    - ``temperature``: ``0`` is greedy (argmax). Otherwise logits are divided by it.
    - ``top_k`` (``0`` = off), ``top_p`` (``1.0`` = off) and ``min_p`` (``0`` = off: tokens
      less likely than ``min_p`` times the most likely one are dropped) truncate the
      temperature-scaled distribution before sampling (top-k, then top-p, then min-p; ties
      at the k-th logit are kept).
    - ``max_new_tokens``: the most tokens generated per completion.
    - ``stop_token_ids``: a completion ends at the first of these; the stop token is kept
      in ``completion_ids`` (it has a logprob and is trained on).
    - ``stop_strings``: a completion ends at the first token whose decoded text completes
      one of them; that token is kept (so the decoded completion contains the stop string,
      possibly followed by the rest of that token's text). Needs ``decode``: a function
      ``list[int] -> str`` or a tokenizer with ``.decode``.
    - ``seed``: same seed, inputs, engine settings and weights -> same samples. ``None``
      draws a seed from torch's global generator (so ``torch.manual_seed`` fixes it too).
      The stream's seed seeds its generator (its samples depend on the batch's
      composition); a group's own settings with a seed (``PromptQueue.put(params=...)``,
      ``generate`` with a list) draw each token from the seed, the row's branch and the
      token's index alone: the same sample whatever else runs in the batch.
    - ``top_logprobs``: ``k`` (0..20) most likely tokens and their behaviour logprobs per
      generated token (``Completion.top_logprobs``).
    - Tree rollouts: ``branch_points`` (completion lengths, in tokens, at which every
      unfinished partial completion forks into ``branch_factor`` continuations; one factor
      for all points or one per point) and/or ``branch_every`` (a branch point every that
      many tokens). A prompt then yields up to ``n * prod(factors)`` completions, which
      share the prompt and the tokens before each fork.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_new_tokens: int = 256
    stop_token_ids: Sequence[int] = ()
    stop_strings: Sequence[str] = ()
    decode: Decoder | Any | None = None
    seed: int | None = None
    branch_points: Sequence[int] = ()
    branch_factor: int | Sequence[int] = 2
    branch_every: int = 0
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Check every field; raises ``ValueError`` with the offending field. Returns self."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n (samples per prompt) must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0 = off), got {self.min_p!r}")
        if not isinstance(self.top_logprobs, int) or not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be an integer in [0, 20], got {self.top_logprobs!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"stop token id {t!r} is not a token of the model's vocabulary ({vocab_size})")
        if isinstance(self.stop_strings, str):
            raise ValueError("stop_strings must be a sequence of strings, not one string")
        for s in self.stop_strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        if self.stop_strings and self.decode is None:
            raise ValueError("stop_strings need a decode function or a tokenizer (SamplingParams.decode)")
        if self.decode is not None and not callable(self.decode) and not hasattr(self.decode, "decode"):
            raise ValueError("decode must be a function list[int] -> str or an object with a .decode method")
        self._branch_schedule()
        return self

    def check_group(self, stream: "SamplingParams") -> "SamplingParams":
        """These settings, validated, for one group of a stream running with ``stream``'s: the
        tree-rollout fields must equal the stream's, ``n`` and ``max_new_tokens`` may not
        exceed them (a group slot's rows and own slots). ``ValueError`` naming the field."""
        for name in ("branch_points", "branch_factor", "branch_every"):
            mine, theirs = getattr(self, name), getattr(stream, name)
            if (list(mine) if not isinstance(mine, int) else mine) != \
                    (list(theirs) if not isinstance(theirs, int) else theirs):
                if name == "branch_factor" and not self.branch_points and not self.branch_every \
                        and not stream.branch_points and not stream.branch_every:
                    continue  # no forks: the factor is not used
                raise ValueError(f"{name}={mine!r} differs from the running stream's {theirs!r}: a group's tree "
                                 "rollout fields must equal the stream's (start another stream)")
        if self.n > stream.n:
            raise ValueError(f"n={self.n} is more than the running stream's n={stream.n} (rows per group slot)")
        if self.max_new_tokens > stream.max_new_tokens:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} is more than the running stream's "
                             f"{stream.max_new_tokens} (own K/V slots per row)")
        return self

    def sampling_fields(self) -> tuple:
        """What the sampler uses: ``(temperature, top_p, top_k, min_p)``."""
        return (float(self.temperature), float(self.top_p), int(self.top_k), float(self.min_p))

    def decoder(self) -> Decoder | None:
        """``decode`` as a function ``list[int] -> str`` (None if not given)."""
        if self.decode is None:
            return None
        if hasattr(self.decode, "decode"):
            return self.decode.decode
        return self.decode

    def branch_schedule(self) -> dict[int, int]:
        """``{completion length: factor}`` of every branch point (validated)."""
        return self._branch_schedule()

    def _branch_schedule(self) -> dict[int, int]:
        points = [int(p) for p in self.branch_points]
        if isinstance(self.branch_factor, int):
            factors = [self.branch_factor] * len(points)
        else:
            factors = [int(f) for f in self.branch_factor]
            if len(factors) != len(points):
                raise ValueError(
                    f"branch_factor has {len(factors)} entries for {len(points)} branch_points"
                )
        if len(set(points)) != len(points):
            raise ValueError(f"branch_points must be distinct, got {points}")
        schedule = dict(zip(points, factors))
        if self.branch_every:
            if not isinstance(self.branch_every, int) or self.branch_every < 1:
                raise ValueError(f"branch_every must be a positive integer, got {self.branch_every!r}")
            if not isinstance(self.branch_factor, int):
                raise ValueError("branch_every needs a single integer branch_factor")
            for p in range(self.branch_every, self.max_new_tokens, self.branch_every):
                schedule.setdefault(p, self.branch_factor)
        for p, f in schedule.items():
            if not 0 < p < self.max_new_tokens:
                raise ValueError(
                    f"branch point {p} must be inside (0, max_new_tokens={self.max_new_tokens})"
                )
            if f < 1:
                raise ValueError(f"branch factor at point {p} must be >= 1, got {f}")
        return dict(sorted(schedule.items()))

    @property
    def max_leaves(self) -> int:
        """Most completions one prompt can yield: ``n`` times the product of the factors."""
        total = self.n
        for f in self._branch_schedule().values():
            total *= f
        return total
