"""Token-keyed prefix cache (LRU) of prompt K/V across ``generate`` calls.

Multi-turn episodes and agents send prompts that extend earlier ones. The streaming path
stores each prompt it prefills (K/V of every layer ``[Hkv, P, D]``, post-RoPE at positions
``0..P-1``, and the logits after its last token) under its token ids; a later prompt whose
first ``m`` tokens equal a stored prompt reuses that K/V and prefills only its tokens from
``m`` on. Entries hold the weight version they were computed with and are dropped once the
weights change. A stored prompt that a newer one extends is superseded (dropped): the newer
entry covers it. Least recently used entries are evicted to stay within ``max_tokens``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    """One stored prompt: ``keys[l]``/``values[l]`` are ``[Hkv, P, D]``, ``logits [V]``."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor
    version: int

    def __len__(self) -> int:
        return len(self.tokens)


class PrefixCache:
    """LRU of :class:`PrefixEntry`, at most ``max_tokens`` stored tokens in all."""

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self.tokens = 0  # stored tokens

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        self.tokens -= len(self._entries.pop(key))

    def lookup(self, tokens: list[int] | tuple[int, ...], version: int) -> PrefixEntry | None:
        """The longest stored prompt (of weights ``version``) that ``tokens`` starts with,
        marked most recently used; None if there is none."""
        tokens = tuple(tokens)
        best = None
        for key, entry in list(self._entries.items()):
            if entry.version != version:
                self._drop(key)
            elif len(key) <= len(tokens) and (best is None or len(key) > len(best)) and tokens[: len(key)] == key:
                best = entry
        if best is not None:
            self._entries.move_to_end(best.tokens)
        return best

    def insert(self, entry: PrefixEntry) -> None:
        """Store ``entry`` (if it fits at all); drop the stored prompts it extends and the
        least recently used ones beyond ``max_tokens``."""
        if len(entry) > self.max_tokens:
            return
        for key in [k for k in self._entries if len(k) <= len(entry) and entry.tokens[: len(k)] == k]:
            self._drop(key)
        self._entries[entry.tokens] = entry
        self.tokens += len(entry)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
