"""Completion text: whole (:func:`completion_text`) and incremental (:class:`TextStream`).

A streamed choice's text deltas concatenate to exactly the non-streamed text: the stream
decodes the tokens received so far the way :func:`completion_text` decodes the whole
completion and emits only the part that cannot change any more — not a trailing
replacement character (an incomplete multi-byte character: a byte-level BPE token may hold
part of one), not the last ``len(longest stop string) - 1`` characters (they may begin a
stop string), nothing at or after a stop string. At the end, :meth:`TextStream.finish`
emits the rest of the final text.

Decoding all tokens so far at every batch of new ones costs quadratic time in the
completion's length (a 2,048-token stream, a batch every 8 tokens: 262k tokens decoded).
Where the tokenizer's decoding is *concatenative* (:func:`concatenative`: a Hugging Face
tokenizer with a byte-level decoder and no space clean-up: the tokens' bytes joined, then
read as UTF-8), the text of the tokens up to the last point where it ended in a whole
character is kept, and only the tokens after it are decoded: the same text, in linear time.
Other tokenizers decode everything each time.
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


def concatenative(tokenizer: Any) -> bool:
    """Whether ``decode(a + b) == decode(a) + decode(b)`` whenever ``decode(a)`` ends in a
    whole character (not a replacement character): a Hugging Face fast tokenizer that decodes
    with the library's own ``decode`` (the Rust tokenizer's, then the optional space clean-up:
    off), whose decoder is byte-level (the tokens' bytes joined, then read as UTF-8 with
    replacement: after a whole character the reading starts afresh)."""
    try:
        from tokenizers import decoders
        from transformers import PreTrainedTokenizerFast
    except ImportError:  # pragma: no cover - both come with transformers
        return False
    cls = PreTrainedTokenizerFast
    if not isinstance(tokenizer, cls) or type(tokenizer).decode is not cls.decode or \
            getattr(type(tokenizer), "_decode", None) is not getattr(cls, "_decode", None):
        return False  # (a subclass may decode otherwise)
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False  # (the clean-up rewrites spaces around punctuation, across any split)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and isinstance(backend.decoder, decoders.ByteLevel)


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
        self._concat = concatenative(tokenizer)
        self._head, self._head_text = 0, ""  # decode(ids[:head]), which ends in a whole character

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in ids)
        if self.stopped:
            return ""
        text, self.stopped = cut_at_stop(self._text(), self.stops)
        if not self.stopped:
            text = text.rstrip(REPLACEMENT)
            text = text[: len(text) - self.hold] if self.hold else text
        return self._emit(text)

    def _text(self) -> str:
        """``decode(self.ids)``: only the tokens after the head decoded where the tokenizer is
        :func:`concatenative` (the head moves to the end whenever the text ends in a whole
        character)."""
        if not self._concat:
            return decode(self.tokenizer, self.ids, self.skip)
        text = self._head_text + decode(self.tokenizer, self.ids[self._head:], self.skip)
        if not text.endswith(REPLACEMENT):
            self._head, self._head_text = len(self.ids), text
        return text

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the whole completion's text, as non-streamed)."""
        self.stopped = True
        return self._emit(final_text)

    def _emit(self, text: str) -> str:
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
