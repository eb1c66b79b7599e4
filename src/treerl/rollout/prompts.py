"""The prompt source of a streaming generation (:class:`PromptQueue`): thread-safe, so
other threads may add prompts while :meth:`RolloutEngine.generate_stream
<treerl.rollout.RolloutEngine.generate_stream>` runs."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Hashable, Iterable


class PromptQueue:
    """A thread-safe source of prompt groups for ``generate_stream``.

    ``put(prompt, key)`` adds a prompt (token ids; ``key`` names its group in the output,
    default 0, 1, 2, ... in order of ``put``); ``close()`` says no more will come: the
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
        self.idle_timeout = idle_timeout
        for p in prompts:
            self.put(p)
        if close:
            self.close()

    def put(self, prompt: Any, key: Hashable | None = None) -> bool:
        """Queue one prompt; False if the queue is closed or its stream has ended."""
        with self._cond:
            if self._closed or self._ended:
                return False
            if key is None:
                key = self._next_key
            if isinstance(key, int):
                self._next_key = max(self._next_key, key + 1)
            self._items.append((key, prompt))
            self._cond.notify_all()
            return True

    def put_many(self, items: Iterable[tuple[Hashable, Any]]) -> bool:
        """Queue ``(key, prompt)`` pairs all together or none (False: closed or ended)."""
        items = list(items)
        with self._cond:
            if self._closed or self._ended:
                return False
            for key, prompt in items:
                if isinstance(key, int):
                    self._next_key = max(self._next_key, key + 1)
                self._items.append((key, prompt))
            self._cond.notify_all()
            return True

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

    def items(self) -> list[tuple[Hashable, Any]]:
        """The prompts waiting (a snapshot)."""
        with self._cond:
            return list(self._items)

    def take(self, n: int, timeout: float = 0.0) -> list[tuple[Hashable, Any]]:
        """Up to ``n`` waiting prompts; waits up to ``timeout`` s if none is waiting."""
        with self._cond:
            if not self._items and timeout > 0 and not self.closed:
                self._cond.wait_for(lambda: self._items or self.closed, timeout)
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def end_if_empty(self) -> bool:
        """End the stream (refuse further prompts) unless prompts are waiting."""
        with self._cond:
            if self._items:
                return False
            self._ended = True
            return True
