"""What one request may cost on ``treerl serve``: :class:`ServeLimits`.

- ``max_body_bytes``: a larger request body gets 413 before it is read (or as soon as it
  passes the limit, without a ``Content-Length``);
- ``max_prompt_chars``: a text prompt (or a chat's messages together) longer than this gets
  400 *before it is tokenized*. Default: the context times the longest token of the
  vocabulary in characters, times 2 — a prompt that long cannot fit the context (each
  token covers at most that many characters; the 2 leaves room for normalisers);
- ``max_n`` and ``max_tokens``: caps on the request fields (400 naming the field and the cap);
- ``max_queued``: generation requests admitted at once (waiting or running); one more gets
  429 with ``Retry-After: retry_after_s``.

The HTTP-level limits (body size, admission) are enforced by :class:`~treerl.serve.security.Guard`,
the field limits by the handlers (:meth:`ServeLimits.check_request`, :meth:`ServeLimits.check_chars`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .protocol import APIError


@dataclass(frozen=True)
class ServeLimits:
    """Caps per request (see the module docstring); every value must be >= 1."""

    max_n: int = 128
    max_tokens: int | None = None  # None: only the context bounds max_tokens
    max_body_bytes: int = 4 << 20
    max_prompt_chars: int | None = None  # None: from the context and the vocabulary (resolved)
    max_queued: int = 1024
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"serve limit {f.name} must be an integer >= 1, got {value!r}")

    def resolved(self, context: int | None, tokenizer: Any) -> "ServeLimits":
        """A copy with ``max_prompt_chars`` set from ``context`` and ``tokenizer`` when unset
        (left unset when either is unknown)."""
        if self.max_prompt_chars is not None or context is None:
            return self
        longest = longest_token_chars(tokenizer)
        return self if longest is None else dataclasses.replace(self, max_prompt_chars=2 * context * longest)

    def check_request(self, n: int, max_tokens: int | None) -> None:
        """400 naming ``n`` or ``max_tokens`` when a cap is passed."""
        if n > self.max_n:
            raise APIError(f"n={n} is above this server's cap of {self.max_n} (treerl serve --max-n)", "n")
        if max_tokens is not None and self.max_tokens is not None and max_tokens > self.max_tokens:
            raise APIError(f"max_tokens={max_tokens} is above this server's cap of {self.max_tokens} "
                           f"(treerl serve --max-tokens-limit)", "max_tokens")

    def check_chars(self, chars: int, param: str) -> None:
        """400 before tokenizing a text of ``chars`` characters that cannot fit the context."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise APIError(f"{param} has {chars} characters, more than this server takes ({self.max_prompt_chars}: "
                           f"it cannot fit the model's context); it was not tokenized", param)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The longest token string of ``tokenizer``'s vocabulary, in characters (None: unknown)."""
    try:
        size = len(tokenizer)
    except TypeError:
        size = getattr(tokenizer, "vocab_size", None)
    if not size:
        return None
    ids = list(range(int(size)))
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        tokens = tokenizer.convert_ids_to_tokens(ids)
    elif hasattr(tokenizer, "decode"):
        tokens = [tokenizer.decode([i]) for i in ids]
    else:
        return None
    return max((len(t) for t in tokens if isinstance(t, str)), default=None) or None


__all__ = ["ServeLimits", "longest_token_chars"]
