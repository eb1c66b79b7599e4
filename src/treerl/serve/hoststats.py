"""Host figures of a serving process that bear on its engine thread's speed.

The engine thread's decode loop is host-bound on a GPU, and everything else in the process
shares its GIL. Two things can slow it down that its own counters do not show:

- the cyclic garbage collector: a pass holds the GIL throughout (a full pass walks every
  tracked object of the process: ~0.1 s at 400k objects on a CPU core), whichever thread's
  allocation triggered it;
- the other threads: time the engine thread spends neither running nor waiting for a CPU is
  time it waits (for the GIL, for the device, or for work).

:func:`host_stats` gives, cumulative since the process started timing (the first call),
the collector's passes and seconds per generation and the engine thread's CPU seconds and
seconds waiting for a CPU (Linux ``schedstat``; None elsewhere). ``treerl serve`` reports them in
``/health`` (``host``); ``bench/bench_serve.py`` prints them per mode over the timed run.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path


class _GCTimer:
    """Passes and seconds of the collector per generation (a ``gc.callbacks`` entry; the
    collector runs under the GIL, one pass at a time)."""

    def __init__(self):
        self.passes = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            g = min(int(info.get("generation", 2)), 2)
            self.passes[g] += 1
            self.seconds[g] += time.perf_counter() - self._start
            self._start = None


_TIMER: _GCTimer | None = None
_LOCK = threading.Lock()


def gc_timer() -> _GCTimer:
    """The process's collector timer (installed on first use)."""
    global _TIMER
    with _LOCK:
        if _TIMER is None:
            _TIMER = _GCTimer()
            gc.callbacks.append(_TIMER)
        return _TIMER


def thread_cpu_s(thread: threading.Thread) -> float | None:
    """CPU seconds of ``thread`` (None: not running, or the platform does not tell)."""
    if thread.ident is None or not thread.is_alive():
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError):
        return None


def thread_times(thread: threading.Thread) -> dict[str, float | None]:
    """``cpu_s`` (CPU seconds of ``thread``) and ``cpu_wait_s`` (seconds it was ready but
    waited for a CPU); None where the platform does not tell."""
    cpu, wait = thread_cpu_s(thread), None
    if cpu is not None:
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/schedstat").read_text().split()
            wait = int(fields[1]) / 1e9
        except (OSError, IndexError, ValueError):
            pass
    return {"cpu_s": cpu, "cpu_wait_s": wait}


def host_stats(engine_thread: threading.Thread) -> dict:
    """``{"gc": {"passes": [g0, g1, g2], "seconds": [...], "frozen": n}, "engine_thread": {"cpu_s",
    "cpu_wait_s"}, "other_threads_cpu_s": {name: s}}`` (``frozen``: objects :func:`freeze_startup_objects` took out
    of the collector's passes; ``other_threads_cpu_s``: the CPU seconds of the process's other Python threads, what
    competes with the engine thread for the GIL, such as the HTTP server's event loop, ``treerl-serve``)."""
    t = gc_timer()
    others: dict[str, float] = {}
    for th in threading.enumerate():
        cpu = None if th is engine_thread else thread_cpu_s(th)
        if cpu is not None:
            others[th.name] = others.get(th.name, 0.0) + cpu
    return {"gc": {"passes": list(t.passes), "seconds": list(t.seconds), "frozen": gc.get_freeze_count()},
            "engine_thread": thread_times(engine_thread), "other_threads_cpu_s": others}


def freeze_startup_objects() -> int:
    """Collect once, then move every object the process holds so far (the model, the tokenizer, the engine)
    to the collector's permanent generation: later full passes walk only what came after (a serving process's
    full pass took 0.39 s with every row waiting: session 17 call 3, ``bench_serve.py`` served). Returns the
    count frozen. For processes that own their heap (``treerl serve``): frozen objects are never collected."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


__all__ = ["freeze_startup_objects", "gc_timer", "host_stats", "thread_cpu_s", "thread_times"]
