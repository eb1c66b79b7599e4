"""Calls handed from the engine thread to the event loop, one wake-up per batch.

``loop.call_soon_threadsafe`` wakes the event loop by writing to its self-pipe: a system call
that releases the GIL in the calling thread. Called from the engine thread once per finished
request or streamed delta, each write lets the event loop's thread take the GIL in the middle
of the engine's step (a handoff both ways: two thread wake-ups), and a sync that delivers the
deltas of 64 streaming rows did it 64 times. :class:`Handoff` queues the calls and wakes the
loop only when its queue was empty: the calls posted while the loop has not yet run the
queue ride on the same wake-up, in the order they were posted.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from typing import Any, Callable


class Handoff:
    """Calls posted from any thread, run on ``aloop`` in order (one wake-up per batch)."""

    def __init__(self, aloop: asyncio.AbstractEventLoop):
        self.aloop = aloop
        self._calls: deque = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop soon (dropped if the loop is closed: nobody waits)."""
        with self._lock:
            self._calls.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.aloop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the event loop is closed
            with self._lock:
                self._calls.clear()
                self._scheduled = False

    def _run(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, deque()
            self._scheduled = False
        for fn, args in calls:
            try:
                fn(*args)
            except Exception as err:  # noqa: BLE001 - one call's error does not drop the others
                self.aloop.call_exception_handler({"message": "treerl serve: a handed-off call failed",
                                                   "exception": err})


_HANDOFFS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Handoff]" = weakref.WeakKeyDictionary()
_HANDOFFS_LOCK = threading.Lock()


def handoff(aloop: asyncio.AbstractEventLoop | None = None) -> Handoff:
    """The :class:`Handoff` of ``aloop`` (default: the running loop)."""
    aloop = aloop or asyncio.get_running_loop()
    with _HANDOFFS_LOCK:
        h = _HANDOFFS.get(aloop)
        if h is None:
            h = _HANDOFFS[aloop] = Handoff(aloop)
        return h


__all__ = ["Handoff", "handoff"]
