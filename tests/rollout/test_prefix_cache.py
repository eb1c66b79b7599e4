"""The prefix cache's index against a linear scan over its entries (random inserts over a
small alphabet: many shared prefixes, supersessions and evictions)."""

from __future__ import annotations

import random

import torch

from treerl.rollout.prefix_cache import BLOCK, PrefixCache, PrefixEntry, common_prefix


def naive_hit(entries: list[PrefixEntry], tokens: tuple[int, ...]) -> int:
    """Tokens of ``tokens`` a prefill reuses, by scanning every entry: an entry the prompt starts
    with counts whole, any other from one shared block on; the prompt's last token is computed
    unless an entry is the prompt itself and has its logits."""
    best, whole = 0, False
    for e in entries:
        n = common_prefix(e.tokens, tokens)
        if n == len(e) or n >= BLOCK:
            if n > best:
                best, whole = n, n == len(e) == len(tokens) and e.logits is not None
            elif n == best and n == len(e) == len(tokens) and e.logits is not None:
                whole = True
    return best - 1 if best == len(tokens) and best and not whole else best


def test_index_agrees_with_a_scan_of_the_entries():
    rng = random.Random(0)
    c = PrefixCache(max_tokens=400)
    stored: list[PrefixEntry] = []  # least recently inserted first (no lookups reorder it here)
    for step in range(600):
        base = rng.choice(stored).tokens if stored and rng.random() < 0.7 else ()
        cut = rng.randint(0, len(base))
        tokens = base[:cut] + tuple(rng.choice((0, 1, 2)) for _ in range(rng.randint(0 if cut else 1, 40)))
        if rng.random() < 0.6:
            z = torch.zeros(1, 1, len(tokens), 1)
            e = PrefixEntry(tokens, z, z, torch.zeros(2) if rng.random() < 0.5 else None, 0)
            c.insert(e)
            if len(tokens) <= c.max_tokens:
                stored = [s for s in stored if common_prefix(s.tokens, tokens) < len(s)] + [e]
                while sum(len(s) for s in stored) > c.max_tokens:
                    stored.pop(0)
        assert sorted(c._entries) == sorted(s.tokens for s in stored), step
        assert c.tokens == sum(len(s) for s in stored)
        assert c.hit_tokens(tokens, 0) == naive_hit(stored, tokens), (step, tokens)
        probe = tokens[: rng.randint(0, len(tokens))] + (rng.choice((0, 1, 2)),)
        assert c.hit_tokens(probe, 0) == naive_hit(stored, probe), (step, probe)
    assert c.lookup([1], 1) is None and len(c) == 0 and not (c._index or c._shared or c._chains or c._ids or c._keys)
