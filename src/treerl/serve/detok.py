"""Completion text: whole (:func:`completion_text`) and incremental (:class:`TextStream`).

A streamed choice's text deltas concatenate to exactly the non-streamed text: the stream
decodes the tokens received so far the way :func:`completion_text` decodes the whole
completion and emits only the part that cannot change any more — not a trailing
replacement character (an incomplete multi-byte character: a byte-level BPE token may hold
part of one), not the last ``len(longest stop string) - 1`` characters (they may begin a
stop string), nothing at or after a stop string. At the end, :meth:`TextStream.finish`
emits the rest of the final text.
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"


def decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` before the earliest stop string, and whether one was found."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def completion_text(tokenizer: Any, ids: Sequence[int], stop: int | str | None, *, skip_special_tokens: bool = True,
                    include_stop_str: bool = False) -> str:
    """A completion's text: its tokens decoded, cut before the stop string that ended it
    (``stop``, when a string) unless ``include_stop_str``."""
    text = decode(tokenizer, ids, skip_special_tokens)
    if isinstance(stop, str) and not include_stop_str:
        cut = text.find(stop)
        if cut >= 0:
            text = text[:cut]
    return text


class TextStream:
    """Text deltas of one streamed choice (module docstring). ``push(ids)`` with each new
    batch of tokens returns the text that became stable; ``finish(final_text)`` the rest."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), *, skip_special_tokens: bool = True,
                 include_stop_str: bool = False):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.stops = () if include_stop_str else tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False  # a stop string was seen: nothing more is emitted before finish

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in ids)
        if self.stopped:
            return ""
        text = decode(self.tokenizer, self.ids, self.skip)
        text, self.stopped = cut_at_stop(text, self.stops)
        if not self.stopped:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - self.hold] if self.hold else text
        return self._emit(text)

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the whole completion's text, as non-streamed)."""
        self.stopped = True
        return self._emit(final_text)

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
