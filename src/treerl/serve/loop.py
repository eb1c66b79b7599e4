"""One engine loop for many clients: requests join one continuous batch.

:class:`EngineLoop` owns a :class:`~treerl.rollout.RolloutEngine` and one thread that runs
:meth:`RolloutEngine.generate_stream <treerl.rollout.RolloutEngine.generate_stream>` over a
:class:`~treerl.rollout.PromptQueue`. :meth:`EngineLoop.submit` (any thread) puts a
request's ``n`` samples into the running stream, where they take the slots of finished
rows; its future resolves once all ``n`` are done. Each sample is one row (``n = 1`` per
stream slot), so requests with different ``n`` share the batch. The requests admitted
together (those waiting when slots are free) are prefilled together, in batched forwards:
identical prompts once, and with the engine's prefix cache a prompt that extends an earlier
one (the next turn of a conversation) computes only its new tokens, in the same forward as
the others (:mod:`treerl.rollout.stream`).

A running batch has one set of sampling settings (:class:`SamplingKey`: temperature,
top-p, top-k, max tokens, stops). Requests with the running stream's key join it; a
request with another key waits, and from then on the running stream takes no new requests:
it drains and the oldest waiting key runs next (first come, first served across keys, no
starvation). Agents of one training run share one key, so they share one batch.

A stream ends after ``idle_timeout_s`` without work (its device buffers are freed; the
next request starts a new one, with new CUDA graphs: the timeout bridges the gaps between an
agent's turns). :meth:`drain` waits until nothing runs and ends an idle stream at once — the
trainer calls it before training on a model the engine shares. Weight updates
(:meth:`RolloutEngine.update_weights` from any thread) interrupt the running stream between
decode steps: unfinished rows recompute their K/V under the new weights, and every token
keeps the version of the weights that sampled it.

:meth:`EngineLoop.engine_stats` sums the engine's counters (admissions, prefill calls,
decode steps, ...: :class:`~treerl.rollout.RolloutStats`) over the loop's streams;
``treerl serve`` reports them in ``/health``.
"""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..rollout import Completion, PromptQueue, RolloutEngine, RolloutStats, SamplingParams


@dataclass(frozen=True)
class SamplingKey:
    """The sampling settings a running batch shares."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def params(self, decode: Any = None) -> SamplingParams:
        return SamplingParams(n=1, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_tokens, stop_token_ids=list(self.stop_token_ids),
                              stop_strings=list(self.stop_strings), decode=decode if self.stop_strings else None)


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    key: SamplingKey
    n: int
    future: Future
    submitted: float
    samples: list[Completion | None] = field(default_factory=list)
    left: int = 0


@dataclass
class LoopStats:
    """Counters since the loop started."""

    requests: int = 0  # submitted
    completed: int = 0  # futures resolved with results
    failed: int = 0  # futures resolved with an exception
    samples: int = 0  # completions returned
    tokens: int = 0  # generated tokens returned
    streams: int = 0  # generate_stream calls (running batches started)


class EngineLoop:
    """See the module docstring. ``max_rows``: most rows of a running batch (default: as
    many as the engine's ``max_batch_tokens`` allows); ``decode``: the tokenizer, for stop
    strings."""

    def __init__(self, engine: RolloutEngine, *, decode: Any = None, max_rows: int | None = None,
                 idle_timeout_s: float = 1.0):
        self.engine, self.decode, self.max_rows = engine, decode, max_rows
        self.idle_timeout_s = float(idle_timeout_s)
        self.stats = LoopStats()
        self._engine_total = RolloutStats()  # the engine's counters of the streams that ended
        self._engine_added = engine.stats  # the last stream's counters, already in the total (or not ours)
        self._cond = threading.Condition()
        self._pending: list[_Request] = []  # waiting for a stream of their key
        self._inflight: dict[int, _Request] = {}  # in the running stream
        self._current: tuple[SamplingKey, PromptQueue] | None = None
        self._next_rid = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="treerl-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ clients
    def submit(self, prompt: list[int], key: SamplingKey, n: int = 1) -> Future:
        """Generate ``n`` samples of ``prompt`` (token ids, already validated against the
        model's vocabulary and context). The future's result: ``n`` :class:`Completion`."""
        fut: Future = Future()
        with self._cond:
            if self._stopped:
                fut.set_exception(RuntimeError("the engine loop is stopped"))
                return fut
            r = _Request(self._next_rid, list(prompt), key, int(n), fut, time.monotonic(), [None] * n, n)
            self._next_rid += 1
            self.stats.requests += 1
            cur = self._current
            if cur is not None and cur[0] == key and not self._pending:
                self._inflight[r.rid] = r
                if cur[1].put_many([((r.rid, j), r.prompt) for j in range(n)]):
                    return fut
                del self._inflight[r.rid]
            self._pending.append(r)
            if cur is not None and cur[0] != key:
                cur[1].close()  # let the running batch drain; the oldest waiting key runs next
            self._cond.notify_all()
        return fut

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no request is waiting or running and no stream is open (an idle stream
        is ended at once, without its idle timeout); False on timeout."""

        def drained() -> bool:
            if self._current is not None and not self._pending and not self._inflight:
                self._current[1].close()
            return self._stopped or (self._current is None and not self._pending and not self._inflight)

        with self._cond:
            return self._cond.wait_for(drained, timeout)

    @property
    def busy(self) -> int:
        """Requests waiting or running."""
        with self._cond:
            return len(self._pending) + len(self._inflight)

    def engine_stats(self) -> RolloutStats:
        """The engine's counters (:class:`~treerl.rollout.RolloutStats`: admissions, prefill
        calls, decode steps, ...) summed over this loop's streams, the running one so far."""
        with self._cond:
            total = copy.copy(self._engine_total)
            if self.engine.stats is not self._engine_added:  # a stream is running (or starting)
                total.add(self.engine.stats)
            return total

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop: waiting and running requests fail (their clients get an error)."""
        with self._cond:
            self._stopped = True
            if self._current is not None:
                self._current[1].close()
            for r in self._pending:
                self._fail(r, RuntimeError("the server is shutting down"))
            self._pending.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        with self._cond:
            for r in list(self._inflight.values()):
                self._fail(r, RuntimeError("the server is shutting down"))
            self._inflight.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ the loop
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._pending)
                if self._stopped:
                    return
                key = self._pending[0].key
                batch = [r for r in self._pending if r.key == key]
                self._pending = [r for r in self._pending if r.key != key]
                queue = PromptQueue(idle_timeout=self.idle_timeout_s)
                queue.put_many([((r.rid, j), r.prompt) for r in batch for j in range(r.n)])
                for r in batch:
                    self._inflight[r.rid] = r
                if self._pending:
                    queue.close()
                self._current = (key, queue)
                self.stats.streams += 1
            error: BaseException | None = None
            try:
                for group in self.engine.generate_stream(queue, key.params(self.decode), max_rows=self.max_rows):
                    self._deliver(group.prompt_index, group.completions[0])
            except BaseException as exc:  # noqa: BLE001 - every request of the stream gets the error
                error = exc
            with self._cond:
                queue.close()
                self._current = None
                if self.engine.stats is not self._engine_added:
                    self._engine_total.add(self.engine.stats)
                    self._engine_added = self.engine.stats
                if error is not None or self._stopped:
                    for r in list(self._inflight.values()):
                        self._fail(r, error or RuntimeError("the server is shutting down"))
                    self._inflight.clear()
                self._cond.notify_all()

    def _deliver(self, key: tuple[int, int], completion: Completion) -> None:
        rid, j = key
        with self._cond:
            r = self._inflight.get(rid)
            if r is None or r.samples[j] is not None:  # pragma: no cover - a bug, never an input
                raise RuntimeError(f"engine loop: sample {key} delivered twice or for an unknown request")
            r.samples[j] = completion
            r.left -= 1
            if r.left == 0:
                del self._inflight[rid]
                self.stats.completed += 1
                self.stats.samples += r.n
                self.stats.tokens += sum(len(c) for c in r.samples)
                r.future.set_result(list(r.samples))
                self._cond.notify_all()

    def _fail(self, r: _Request, error: BaseException) -> None:
        if not r.future.done():
            self.stats.failed += 1
            r.future.set_exception(error)
