"""Token-keyed prefix cache (LRU) of prompt K/V across ``generate`` calls.

Multi-turn episodes and agents send prompts that extend earlier ones. The streaming path
stores each prompt it prefills (K/V of every layer, ``[layers, Hkv, P, D]``, post-RoPE at
positions ``0..P-1``, and the logits after its last token) under its token ids, and each
finished row's context (prompt + completion, :mod:`~treerl.rollout.kept_contexts`: no
logits); a later prompt whose first ``m`` tokens equal a stored entry reuses that K/V and
prefills only its tokens from ``m`` on. A prompt that shares only a prefix with an entry (a
retry of a turn, another continuation of a prompt) reuses that prefix, a view of the
entry's K/V. The logits after a prompt's last token come from an entry only where the
prompt is the whole entry and the entry has them; otherwise at least that last token is
computed. Entries hold the weight version they were computed with; a lookup or
insert under other weights drops them all. A stored prompt that a newer one extends is
superseded (dropped): the newer entry covers it. Least recently used entries are evicted to
stay within ``max_tokens``.

Lookups cost ``O(prompt length)``, not ``O(entries x length)``: each entry is indexed by a
hash chained over its full blocks of :data:`BLOCK` tokens (``h_0 = 0``,
``h_k = hash((h_{k-1}, block_k))``); a lookup computes the chain of the prompt and, from the
longest block boundary down, compares the prompt only with the entries filed under its hash
there (an entry of ``l`` tokens is filed under ``h_{l // BLOCK}`` of its own tokens, so a
stored prefix of the prompt is always found under the prompt's chain, and under each of
``h_1 .. h_{l // BLOCK}`` for prefixes it shares with prompts; a hash collision costs one
comparison, never a wrong answer). The index files entries by a small integer id: a set of
token tuples would hash a whole tuple (thousands of tokens) at every add and discard, once
per block of the entry (measured on the H200 serving 64 agents: 10% of the engine thread).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per hashed block of the index


@dataclass
class PrefixEntry:
    """One stored sequence (a prompt, or a finished row's context): ``keys``/``values``
    ``[layers, Hkv, P, D]``, ``logits [V]`` (after its last token; None: a kept context's,
    see the module docstring)."""

    tokens: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    logits: torch.Tensor | None
    version: int

    def prefix(self, m: int) -> "PrefixEntry":
        """Its first ``m`` tokens (itself if all): views of its K/V, no logits."""
        if m == len(self):
            return self
        return PrefixEntry(self.tokens[:m], self.keys[:, :, :m], self.values[:, :, :m], None, self.version)

    def __len__(self) -> int:
        return len(self.tokens)


def block_hashes(tokens: tuple[int, ...]) -> list[int]:
    """``[h_0, ..., h_n]``, ``n = len(tokens) // BLOCK``: ``h_k`` identifies ``tokens[:k * BLOCK]``."""
    h = [0]
    for k in range(len(tokens) // BLOCK):
        h.append(hash((h[-1], tokens[k * BLOCK : (k + 1) * BLOCK])))
    return h


def common_prefix(a: tuple[int, ...], b: tuple[int, ...], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b`` (taken as equal before ``start``)."""
    n, end = start, min(len(a), len(b))
    while n < end and a[n] == b[n]:
        n += 1
    return n


class PrefixCache:
    """LRU of :class:`PrefixEntry`, at most ``max_tokens`` stored tokens in all, all of one
    weight version."""

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()  # least recent first
        self._index: dict[int, set[int]] = {}  # chain hash -> ids of the entries filed under it
        self._shared: dict[int, set[int]] = {}  # h_k (k >= 1) -> ids of the entries whose first k blocks it hashes
        self._chains: dict[int, list[int]] = {}  # id -> the entry's h_0 .. h_{l // BLOCK} (filed under the last)
        self._ids: dict[tuple[int, ...], int] = {}  # entry tokens -> id
        self._keys: dict[int, tuple[int, ...]] = {}  # id -> entry tokens
        self._next_id = 0
        self.tokens = 0  # stored tokens
        self.version: int | None = None  # the weights of the stored entries

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self._shared.clear()
        self._chains.clear()
        self._ids.clear()
        self._keys.clear()
        self.tokens = 0

    def _use_version(self, version: int) -> None:
        if version != self.version:
            self.clear()
            self.version = version

    def _drop(self, key: tuple[int, ...]) -> None:
        self.tokens -= len(self._entries.pop(key))
        i = self._ids.pop(key)
        del self._keys[i]
        chain = self._chains.pop(i)
        bucket = self._index[chain[-1]]
        bucket.discard(i)
        if not bucket:
            del self._index[chain[-1]]
        for h in set(chain[1:]):  # (a chain may repeat a hash: a collision)
            bucket = self._shared[h]
            bucket.discard(i)
            if not bucket:
                del self._shared[h]

    def _stored_prefixes(self, tokens: tuple[int, ...], hashes: list[int]):
        """Stored keys that ``tokens`` starts with (its chain ``hashes``), longest block first."""
        for k in range(len(hashes) - 1, -1, -1):
            for i in self._index.get(hashes[k], ()):
                key = self._keys[i]
                if len(key) <= len(tokens) and tokens[: len(key)] == key:
                    yield key

    def lookup(self, tokens: list[int] | tuple[int, ...], version: int) -> PrefixEntry | None:
        """The stored K/V (of weights ``version``) of the longest prefix of ``tokens`` that a
        stored entry holds (that entry, or a view of its first tokens: see the module
        docstring), the entry marked most recently used; None if there is none."""
        self._use_version(version)
        key, m = self._reusable(tuple(tokens))
        if not m:
            return None
        self._entries.move_to_end(key)
        return self._entries[key].prefix(m)

    def hit_tokens(self, tokens: list[int] | tuple[int, ...], version: int) -> int:
        """Tokens of ``tokens`` that :meth:`lookup` would find, without using the entry (its
        recency and the stored version are left as they are): for estimating a prefill."""
        if version != self.version:
            return 0
        return self._reusable(tuple(tokens))[1]

    def holds(self, tokens: tuple[int, ...]) -> bool:
        """Whether a stored entry starts with ``tokens`` (any version)."""
        return self._match(tokens)[1] == len(tokens)

    def _reusable(self, tokens: tuple[int, ...]) -> tuple[tuple[int, ...] | None, int]:
        """The entry sharing the longest prefix with ``tokens`` and how many of its tokens a
        prefill of ``tokens`` reuses (0: none; the logits after the last token are computed
        unless the entry is ``tokens`` and has them)."""
        key, m = self._match(tokens)
        if key is not None and m == len(tokens) and not (m == len(key) and self._entries[key].logits is not None):
            m -= 1
        return key, m

    def _match(self, tokens: tuple[int, ...]) -> tuple[tuple[int, ...] | None, int]:
        """The entry sharing the longest prefix with ``tokens``, and that prefix's length."""
        hashes = block_hashes(tokens)
        key = self._longest(tokens, hashes)  # an entry that tokens starts with
        m = 0 if key is None else len(key)
        for k in range(len(hashes) - 1, 0, -1):  # entries that share tokens' first k blocks (and < a block more)
            if (k + 1) * BLOCK - 1 <= m:
                break
            shared = self._shared.get(hashes[k])
            if not shared:
                continue
            head = tokens[: k * BLOCK]
            others = (self._keys[i] for i in shared)
            for n, other in sorted(((common_prefix(o, tokens, k * BLOCK), o) for o in others), key=lambda t: -t[0]):
                if other[: k * BLOCK] == head:  # (a hash collision: the next one)
                    if n > m:
                        key, m = other, n
                    return key, m
        return key, m

    def _longest(self, tokens: tuple[int, ...], hashes: list[int]) -> tuple[int, ...] | None:
        best = None
        for key in self._stored_prefixes(tokens, hashes):
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
        i, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry.tokens] = entry
        self._ids[entry.tokens], self._keys[i] = i, entry.tokens
        self._index.setdefault(hashes[-1], set()).add(i)  # (hashes[-1]: h_{len // BLOCK})
        self._chains[i] = hashes
        for h in hashes[1:]:
            self._shared.setdefault(h, set()).add(i)
        self.tokens += len(entry)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
