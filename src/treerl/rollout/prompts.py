"""The prompt source of a streaming generation (:class:`PromptQueue`): thread-safe, so
other threads may add prompts while :meth:`RolloutEngine.generate_stream
<treerl.rollout.RolloutEngine.generate_stream>` runs."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterable

from .params import SamplingParams


@dataclass
class Waiting:
    """A prompt in the queue: its group ``key``, token ids, its own sampling settings
    (None: the stream's) and the listener of its tokens (None: none)."""

    key: Hashable
    prompt: Any
    params: SamplingParams | None = None
    listener: Callable | None = None


class PromptQueue:
    """A thread-safe source of prompt groups for ``generate_stream``.

    ``put(prompt, key)`` adds a prompt (token ids; ``key`` names its group in the output,
    default 0, 1, 2, ... in order of ``put``), with ``params``: its own sampling settings
    (see :meth:`put`); ``close()`` says no more will come: the
    stream ends once every admitted group is done. While the stream has nothing to
    generate it waits for prompts; with ``idle_timeout`` (seconds) it ends after waiting
    that long (0: as soon as it is idle), atomically with respect to ``put``: a prompt is
    either taken by this stream or refused (``put`` returns False; start a new stream).
    """

    def __init__(self, prompts: Iterable[Any] = (), *, close: bool = False, idle_timeout: float | None = None):
        self._cond = threading.Condition()
        self._items: deque = deque()
        self._closed = False
        self._ended = False
        self._next_key = 0
        self._cancelled: set = set()  # keys to stop, for the stream (not waiting any more)
        self.idle_timeout = idle_timeout
        for p in prompts:
            self.put(p)
        if close:
            self.close()

    def put(self, prompt: Any, key: Hashable | None = None, *, params: SamplingParams | None = None,
            listener: Callable | None = None) -> bool:
        """Queue one prompt; False if the queue is closed or its stream has ended.

        ``params``: this group's own sampling settings (temperature, top-p, top-k, min-p,
        ``max_new_tokens`` up to the stream's, stops, ``seed``, ``n`` up to the stream's,
        ``top_logprobs``), sampled in the same running batch as the others; the tree-rollout
        fields (``branch_*``) must equal the stream's (checked when the stream takes it).
        ``listener``: called from the stream's thread with a
        :class:`~treerl.rollout.types.TokenDelta` whenever new tokens of the group's rows
        reach the host, and once per row with its ``finish_reason``."""
        return self.put_many([(key, prompt, params, listener)])

    def put_many(self, items: Iterable[tuple]) -> bool:
        """Queue ``(key, prompt)`` pairs (or ``(key, prompt, params[, listener])``; a None key:
        the next integer) all together or none (False: closed or ended)."""
        items = [Waiting(*item) for item in items]
        with self._cond:
            if self._closed or self._ended:
                return False
            for item in items:
                if item.key is None:
                    item.key = self._next_key
                if isinstance(item.key, int):
                    self._next_key = max(self._next_key, item.key + 1)
                self._items.append(item)
            self._cond.notify_all()
            return True

    def cancel(self, key: Hashable) -> bool:
        """Cancel group ``key``: True if it was waiting (removed; the stream never yields it).
        Otherwise False, and the stream stops it if it holds it: its rows stop at the next
        sync, free their blocks, and the group is yielded with ``finish_reason="abort"`` on
        its unfinished completions (a key the stream no longer holds is ignored)."""
        with self._cond:
            for i, item in enumerate(self._items):
                if item.key == key:
                    del self._items[i]
                    return True
            self._cancelled.add(key)
            self._cond.notify_all()
            return False

    def take_cancelled(self) -> set:
        """(The stream.) The keys cancelled since the last call."""
        with self._cond:
            out, self._cancelled = self._cancelled, set()
            return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed or self._ended

    def items(self) -> list[Waiting]:
        """The prompts waiting (a snapshot)."""
        with self._cond:
            return list(self._items)

    def take(self, n: int, timeout: float = 0.0) -> list[Waiting]:
        """Up to ``n`` waiting prompts; waits up to ``timeout`` s if none is waiting."""
        with self._cond:
            if not self._items and timeout > 0 and not self.closed and not self._cancelled:
                self._cond.wait_for(lambda: self._items or self.closed or self._cancelled, timeout)
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def end_if_empty(self) -> bool:
        """End the stream (refuse further prompts) unless prompts are waiting."""
        with self._cond:
            if self._items:
                return False
            self._ended = True
            return True
