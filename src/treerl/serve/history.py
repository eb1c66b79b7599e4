"""Token-exact histories: an assistant turn generated here re-enters later prompts as the
tokens the model produced, wherever the chat template renders it unchanged.

Re-tokenizing a rendered conversation does not give back the tokens the model sampled: a
byte-level BPE tokenizer encodes ``"Paris"`` as one token where the model may have written
``"Par" "is"``, and a tool call parsed into JSON and rendered again is new text. Then the next
turn's prompt does not extend the previous prompt + completion, and an agent episode's calls
do not form a chain in the prefix tree (nothing shared, and the model is trained on contexts
it never sampled).

:class:`TokenHistory` keeps, for each reply it returned, ``prompt ids + completion ids`` under
the key of the conversation that ends with that reply (a running hash of the canonical
messages, :func:`message_key`), bounded by ``max_tokens`` (least recently used first out).
For a new request with the rendered text ``T``: among the assistant turns of its history
found in the record (latest first), the first whose recorded ``prompt + completion`` decodes
to a prefix of ``T`` is spliced in: the prompt is those ids followed by the encoding of the
rest of ``T``. A turn the template renders differently (a template that drops earlier
reasoning, a reply cut at a stop string, text after the last tool call that the parser
dropped) does not decode to a prefix: the template's rendering is kept, and the turn is
counted as *rewritten*.

Counters (:class:`HistoryStats`): per assistant turn in request histories, whether it was
generated here (``turns``) or not (``unknown``), and of those whether its tokens are in the new
prompt token for token (``exact``) or not (``rewritten``).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np


@dataclass
class HistoryStats:
    """Counters of token-exact histories (thread-safe; ``snapshot()`` for /metrics)."""

    requests: int = 0  # chat requests whose history held an assistant turn
    turns: int = 0  # assistant turns in request histories that this server generated (still recorded)
    exact: int = 0  # of those, turns whose produced tokens are in the new prompt token for token
    rewritten: int = 0  # turns - exact: the template renders them differently from what was produced
    unknown: int = 0  # assistant turns not generated here (or no longer recorded)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for k, v in counts.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {"requests": self.requests, "turns": self.turns, "exact": self.exact,
                    "rewritten": self.rewritten, "unknown": self.unknown,
                    "exact_share": self.exact / self.turns if self.turns else 1.0}


def canonical(message: dict) -> list:
    """The parts of a template message (:func:`treerl.serve.chat.template_messages`) that
    identify it: role, content text, name, tool_call_id, calls (name, arguments)."""
    calls = [[c["function"]["name"], c["function"]["arguments"]] for c in message.get("tool_calls") or ()]
    return [message["role"], message.get("content") or "", message.get("name"), message.get("tool_call_id"), calls]


def message_key(previous: bytes, message: dict) -> bytes:
    """The key of a conversation: a running hash over its canonical messages."""
    text = json.dumps(canonical(message), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(previous + text.encode(), digest_size=16).digest()


def conversation_keys(messages: Sequence[dict]) -> list[bytes]:
    """``keys[i]``: the key of ``messages[: i + 1]``."""
    keys, h = [], b""
    for m in messages:
        h = message_key(h, m)
        keys.append(h)
    return keys


class TokenHistory:
    """The record of produced turns (module docstring). ``max_tokens``: the most token ids
    kept (4 bytes each); 0 turns splicing off (prompts are the template's tokens)."""

    def __init__(self, max_tokens: int = 1 << 22):
        if max_tokens < 0:
            raise ValueError(f"history max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.stats = HistoryStats()
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, key: bytes, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> None:
        """Remember ``prompt + completion`` as the tokens of the conversation ``key`` (which
        ends with the returned reply)."""
        if self.max_tokens == 0:
            return
        ids = np.asarray([*prompt_ids, *completion_ids], dtype=np.int32)
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._tokens -= len(old)
            self._entries[key] = ids
            self._tokens += len(ids)
            while self._tokens > self.max_tokens:
                _, gone = self._entries.popitem(last=False)
                self._tokens -= len(gone)

    def _get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
            return ids

    def prompt_ids(self, messages: Sequence[dict], text: str, encode: Callable[[str], list[int]],
                   decode: Callable[[list[int]], str], keys: Sequence[bytes] | None = None) -> list[int]:
        """Token ids of ``text`` (the rendering of ``messages`` with the generation prompt),
        with the latest recorded turn that the template renders unchanged spliced in.
        ``keys``: :func:`conversation_keys` of ``messages`` when the caller has them."""
        assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if self.max_tokens == 0 or not assistant:
            if assistant:
                self.stats.add(requests=1, unknown=len(assistant))
            return encode(text)
        keys = conversation_keys(messages) if keys is None else keys
        found = [ids for ids in (self._get(keys[i]) for i in assistant) if ids is not None]
        out = None
        for ids in reversed(found):
            seq = ids.tolist()
            done = decode(seq)
            if text.startswith(done):
                out = seq + encode(text[len(done):])
                break
        if out is None:
            out = encode(text)
        exact = sum(len(out) >= len(ids) and np.array_equal(np.asarray(out[: len(ids)]), ids) for ids in found)
        self.stats.add(requests=1, turns=len(found), exact=exact, rewritten=len(found) - exact,
                       unknown=len(assistant) - len(found))
        return out


__all__ = ["TokenHistory", "HistoryStats", "canonical", "message_key", "conversation_keys"]
