"""Token-keyed prefix cache (LRU) of prompt K/V across ``generate`` calls.

Multi-turn episodes and agents send prompts that extend earlier ones. The streaming path
stores each prompt it prefills (K/V of every layer, ``[layers, Hkv, P, D]``, post-RoPE at
positions ``0..P-1``, and the logits after its last token) under its token ids; a later
prompt whose first ``m`` tokens equal a stored prompt reuses that K/V and prefills only its
tokens from ``m`` on. Entries hold the weight version they were computed with; a lookup or
insert under other weights drops them all. A stored prompt that a newer one extends is
superseded (dropped): the newer entry covers it. Least recently used entries are evicted to
stay within ``max_tokens``.

Lookups cost ``O(prompt length)``, not ``O(entries x length)``: each entry is indexed by a
hash chained over its full blocks of :data:`BLOCK` tokens (``h_0 = 0``,
``h_k = hash((h_{k-1}, block_k))``); a lookup computes the chain of the prompt and, from the
longest block boundary down, compares the prompt only with the entries filed under its hash
there (an entry of ``l`` tokens is filed under ``h_{l // BLOCK}`` of its own tokens, so a
stored prefix of the prompt is always found under the prompt's chain; a hash collision
costs one comparison, never a wrong answer).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per hashed block of the index


@dataclass
class PrefixEntry:
    """One stored prompt: ``keys``/``values`` ``[layers, Hkv, P, D]``, ``logits [V]``
    (after its last token)."""

    tokens: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    logits: torch.Tensor
    version: int

    def __len__(self) -> int:
        return len(self.tokens)


def block_hashes(tokens: tuple[int, ...]) -> list[int]:
    """``[h_0, ..., h_n]``, ``n = len(tokens) // BLOCK``: ``h_k`` identifies ``tokens[:k * BLOCK]``."""
    h = [0]
    for k in range(len(tokens) // BLOCK):
        h.append(hash((h[-1], tokens[k * BLOCK : (k + 1) * BLOCK])))
    return h


class PrefixCache:
    """LRU of :class:`PrefixEntry`, at most ``max_tokens`` stored tokens in all, all of one
    weight version."""

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()  # least recent first
        self._index: dict[int, set[tuple[int, ...]]] = {}  # chain hash -> entries filed under it
        self._filed: dict[tuple[int, ...], int] = {}  # entry -> its chain hash
        self.tokens = 0  # stored tokens
        self.version: int | None = None  # the weights of the stored entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._filed.clear()
        self.tokens = 0

    def _use_version(self, version: int) -> None:
        if version != self.version:
            self.clear()
            self.version = version

    def _drop(self, key: tuple[int, ...]) -> None:
        self.tokens -= len(self._entries.pop(key))
        h = self._filed.pop(key)
        bucket = self._index[h]
        bucket.discard(key)
        if not bucket:
            del self._index[h]

    def _stored_prefixes(self, tokens: tuple[int, ...], hashes: list[int]):
        """Stored keys that ``tokens`` starts with (its chain ``hashes``), longest block first."""
        for k in range(len(hashes) - 1, -1, -1):
            for key in self._index.get(hashes[k], ()):
                if len(key) <= len(tokens) and tokens[: len(key)] == key:
                    yield key

    def lookup(self, tokens: list[int] | tuple[int, ...], version: int) -> PrefixEntry | None:
        """The longest stored prompt (of weights ``version``) that ``tokens`` starts with,
        marked most recently used; None if there is none."""
        self._use_version(version)
        best = self._longest(tuple(tokens))
        if best is None:
            return None
        self._entries.move_to_end(best)
        return self._entries[best]

    def hit_tokens(self, tokens: list[int] | tuple[int, ...], version: int) -> int:
        """Tokens of ``tokens`` that :meth:`lookup` would find, without using the entry (its
        recency and the stored version are left as they are): for estimating a prefill."""
        if version != self.version:
            return 0
        best = self._longest(tuple(tokens))
        return 0 if best is None else len(best)

    def _longest(self, tokens: tuple[int, ...]) -> tuple[int, ...] | None:
        best = None
        for key in self._stored_prefixes(tokens, block_hashes(tokens)):
            if best is not None and len(key) // BLOCK < len(best) // BLOCK:
                break  # a shorter block boundary: no longer key below
            if best is None or len(key) > len(best):
                best = key
        return best

    def insert(self, entry: PrefixEntry) -> None:
        """Store ``entry`` (if it fits at all); drop the stored prompts it extends and the
        least recently used ones beyond ``max_tokens``."""
        self._use_version(entry.version)
        if len(entry) > self.max_tokens:
            return
        hashes = block_hashes(entry.tokens)
        for key in list(self._stored_prefixes(entry.tokens, hashes)):
            self._drop(key)
        self._entries[entry.tokens] = entry
        h = hashes[len(entry) // BLOCK]
        self._filed[entry.tokens] = h
        self._index.setdefault(h, set()).add(entry.tokens)
        self.tokens += len(entry)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
