"""Finding where a completion stops: stop tokens and stop strings.

A completion's tokens are checked in blocks (the engine syncs every few steps). Both
kinds of stop end the completion *after* the token that triggered it (that token is
kept). Stop strings are searched in decoded text: only a window of the last tokens is
decoded (the new block plus an overlap long enough to hold any stop string), and a
binary search finds the first token whose prefix text completes a stop string.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .params import Decoder


class StopChecker:
    """Stop tokens and stop strings of one generate call."""

    def __init__(self, stop_token_ids: Sequence[int], stop_strings: Sequence[str], decode: Decoder | None):
        self.stop_tokens = np.asarray(sorted(set(int(t) for t in stop_token_ids)), dtype=np.int64)
        self.stop_strings = list(stop_strings)
        self.decode = decode
        # A byte-level tokenizer may spread one character over up to 4 tokens.
        self.overlap = 4 * max((len(s) for s in self.stop_strings), default=0) + 4

    def find(self, tokens: np.ndarray, start: int) -> tuple[int, int | str] | None:
        """First stop in ``tokens`` (one row's completion so far) ending at or after
        ``start`` (stops ending before ``start`` were checked already).

        Returns ``(length, stop)``: keep ``tokens[:length]``; ``stop`` is the stop token id
        or the stop string found. None if no stop.
        """
        best: tuple[int, int | str] | None = None
        if len(self.stop_tokens):
            hits = np.flatnonzero(np.isin(tokens[start:], self.stop_tokens))
            if len(hits):
                i = start + int(hits[0])
                best = (i + 1, int(tokens[i]))
        if self.stop_strings:
            end = best[0] if best is not None else len(tokens)
            found = self._find_string(tokens, start, end)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
        return best

    def _find_string(self, tokens: np.ndarray, start: int, end: int) -> tuple[int, str] | None:
        """First ``t`` in ``(start, end]`` whose text ``tokens[w0:t]`` holds a stop string."""
        if end <= start:
            return None
        w0 = max(0, start - self.overlap)
        window = tokens[w0:end].tolist()

        def hit(t: int) -> str | None:  # t: tokens kept, absolute
            text = self.decode(window[: t - w0])
            found = [(text.find(s), s) for s in self.stop_strings]
            found = [(i, s) for i, s in found if i >= 0]
            return min(found)[1] if found else None

        if hit(end) is None:
            return None
        lo, hi = start + 1, end  # hit(hi) holds; find the smallest such t
        while lo < hi:
            mid = (lo + hi) // 2
            if hit(mid) is not None:
                hi = mid
            else:
                lo = mid + 1
        return lo, hit(lo)
