"""One engine loop for many clients: requests join one continuous batch.

:class:`EngineLoop` owns a :class:`~treerl.rollout.RolloutEngine` and one thread that runs
:meth:`RolloutEngine.generate_stream <treerl.rollout.RolloutEngine.generate_stream>` over a
:class:`~treerl.rollout.PromptQueue`. :meth:`EngineLoop.submit` (any thread) puts a
request's ``n`` samples into the running stream, each with the request's own
:class:`~treerl.rollout.SamplingParams` (temperature, top-p, top-k, min-p, max tokens,
stops, seed): rows of different settings decode in the same batch, so no request waits for
another to finish. Each sample is one row (``n = 1`` per stream slot), so requests with
different ``n`` share the batch; its future resolves once all ``n`` are done. The requests
admitted together (those waiting when slots are free) are prefilled together, in batched
forwards: identical prompts once, and with the engine's prefix cache a prompt that extends
an earlier one (the next turn of a conversation) computes only its new tokens, in the same
forward as the others (:mod:`treerl.rollout.stream`).

Streaming: ``submit(..., listener=f)`` calls ``f`` (from the loop's thread) with a
:class:`~treerl.rollout.TokenDelta` whenever new tokens of one of the request's samples
reach the host (``delta.branch[0]``: the sample's index in the request, ``prompt_index``:
the request's id), and once per sample with its ``finish_reason``. :meth:`cancel` stops a
request: waiting samples are dropped, running ones stop at the next host sync and free
their rows; the future resolves with the tokens so far (``finish_reason="abort"``).

Seeds: a request's ``seed`` gives its sample ``j`` the seed ``seed`` (``j = 0``) or one
derived from ``(seed, j)``; each token is drawn from that seed, the sample's index and the
token's index alone, so the same request gives the same samples whatever else is running.

A stream ends after ``idle_timeout_s`` without work (its device buffers are freed; the
next request starts a new one, with new CUDA graphs: the timeout bridges the gaps between an
agent's turns). :meth:`drain` waits until nothing runs and ends an idle stream at once — the
trainer calls it before training on a model the engine shares. Weight updates
(:meth:`RolloutEngine.update_weights` from any thread) interrupt the running stream between
decode steps: unfinished rows recompute their K/V under the new weights, and every token
keeps the version of the weights that sampled it.

:meth:`EngineLoop.engine_stats` sums the engine's counters (admissions, prefill calls,
decode steps, ...: :class:`~treerl.rollout.RolloutStats`) over the loop's streams, and
:meth:`EngineLoop.host_stats` gives the process's garbage-collector time and the engine
thread's CPU time (:mod:`treerl.serve.hoststats`); ``treerl serve`` reports both in ``/health``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..rollout import Completion, PromptQueue, RolloutEngine, RolloutStats, SamplingParams
from ..rollout.sampling import row_seed
from ..rollout.types import TokenDelta
from .hoststats import gc_timer, host_stats

_log = logging.getLogger(__name__)


@dataclass
class _Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    n: int
    future: Future
    submitted: float
    listener: Callable | None = None
    samples: list[Completion | None] = field(default_factory=list)
    left: int = 0

    def items(self) -> list[tuple]:
        """The queue items of its samples: ``((rid, j), prompt, params of sample j, listener)``."""
        out = []
        for j in range(self.n):
            seed = self.params.seed
            if seed is not None and j:
                seed = row_seed(seed, (j,), -1)
            params = dataclasses.replace(self.params, n=1, seed=seed)
            out.append(((self.rid, j), self.prompt, params, None if self.listener is None else self._listen(j)))
        return out

    def _listen(self, j: int) -> Callable[[TokenDelta], None]:
        return lambda d: self.listener(dataclasses.replace(d, prompt_index=self.rid, branch=(j,) + d.branch[1:]))


@dataclass
class LoopStats:
    """Counters since the loop started."""

    requests: int = 0  # submitted
    completed: int = 0  # futures resolved with results
    failed: int = 0  # futures resolved with an exception
    cancelled: int = 0  # requests cancelled (their futures resolved with "abort" samples)
    samples: int = 0  # completions returned
    tokens: int = 0  # generated tokens returned
    streams: int = 0  # generate_stream calls (running batches started)


class EngineLoop:
    """See the module docstring. ``max_rows``: most rows of a running batch (default: as
    many as the engine's ``max_batch_tokens`` allows); ``decode``: the tokenizer, for stop
    strings; ``max_new_tokens``: the most tokens a request may ask for (default: the
    model's context, else 16,384): each row's own K/V capacity."""

    def __init__(self, engine: RolloutEngine, *, decode: Any = None, max_rows: int | None = None,
                 idle_timeout_s: float = 1.0, max_new_tokens: int | None = None):
        self.engine, self.decode, self.max_rows = engine, decode, max_rows
        self.idle_timeout_s = float(idle_timeout_s)
        cap = max_new_tokens or engine.max_positions or 1 << 14
        self.stream_params = SamplingParams(n=1, max_new_tokens=int(cap))
        self.stats = LoopStats()
        self._engine_total = RolloutStats()  # the engine's counters of the streams that ended
        self._engine_added = engine.stats  # the last stream's counters, already in the total (or not ours)
        self._cond = threading.Condition()
        self._pending: list[_Request] = []  # waiting for a stream
        self._inflight: dict[int, _Request] = {}  # in the running stream
        self._by_future: dict[int, _Request] = {}  # id(future) -> request, until it resolves
        self._queue: PromptQueue | None = None
        self._next_rid = 0
        self._stopped = False
        gc_timer()  # (the collector's passes are timed from here on: host_stats)
        self._thread = threading.Thread(target=self._run, name="treerl-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ clients
    def submit(self, prompt: list[int], params: SamplingParams, *,
               listener: Callable[[TokenDelta], None] | None = None) -> Future:
        """Generate ``params.n`` samples of ``prompt`` (token ids, already validated against
        the model's vocabulary and context) with ``params``, in the running batch. The
        future's result: ``n`` :class:`Completion`. ``ValueError`` (naming the field) for
        settings the engine cannot honour."""
        if params.stop_strings and params.decode is None:
            params = dataclasses.replace(params, decode=self.decode)
        params.validate(self.engine.vocab_size)
        dataclasses.replace(params, n=1).check_group(self.stream_params)
        fut: Future = Future()
        with self._cond:
            if self._stopped:
                fut.set_exception(RuntimeError("the engine loop is stopped"))
                return fut
            n = params.n
            r = _Request(self._next_rid, list(prompt), params, n, fut, time.monotonic(), listener, [None] * n, n)
            self._next_rid += 1
            self.stats.requests += 1
            self._by_future[id(fut)] = r
            if self._queue is not None and not self._pending:
                self._inflight[r.rid] = r
                if self._queue.put_many(r.items()):
                    return fut
                del self._inflight[r.rid]
            self._pending.append(r)
            self._cond.notify_all()
        return fut

    def cancel(self, future: Future) -> None:
        """Stop the request of ``future`` (a no-op once it resolved): its waiting samples are
        dropped, its running ones stop at the next host sync (their rows freed); the future
        resolves with every sample's tokens so far, ``finish_reason="abort"``."""
        with self._cond:
            r = self._by_future.get(id(future))
            if r is None or future.done():
                return
            self.stats.cancelled += 1
            if r in self._pending:
                self._pending.remove(r)
                for j in range(r.n):
                    self._abort_sample(r, j)
                return
            queue = self._queue
        for j in range(r.n):
            if queue is not None and queue.cancel((r.rid, j)):
                with self._cond:
                    self._abort_sample(r, j)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no request is waiting or running and no stream is open (an idle stream
        is ended at once, without its idle timeout); False on timeout."""

        def drained() -> bool:
            if self._queue is not None and not self._pending and not self._inflight:
                self._queue.close()
            return self._stopped or (self._queue is None and not self._pending and not self._inflight)

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

    def host_stats(self) -> dict:
        """The process's garbage-collector passes and seconds and the engine thread's CPU
        seconds and seconds waiting for a CPU, cumulative (:mod:`treerl.serve.hoststats`)."""
        return host_stats(self._thread)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop: waiting and running requests fail (their clients get an error)."""
        with self._cond:
            self._stopped = True
            if self._queue is not None:
                self._queue.close()
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
        try:  # before the first stream: no prefill of a running batch waits for a compile (RolloutEngine.warm_prefill)
            self.engine.warm_prefill()
        except Exception as exc:  # noqa: BLE001 - the first stream meets it again and fails its requests with it
            _log.warning("the prefill's warm-up failed (%s: %s); the first prefill will raise it", type(exc).__name__, exc)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or self._pending)
                if self._stopped:
                    return
                batch, self._pending = self._pending, []
                queue = PromptQueue(idle_timeout=self.idle_timeout_s)
                queue.put_many([item for r in batch for item in r.items()])
                for r in batch:
                    self._inflight[r.rid] = r
                self._queue = queue
                self.stats.streams += 1
            error: BaseException | None = None
            try:
                for group in self.engine.generate_stream(queue, self.stream_params, max_rows=self.max_rows):
                    self._deliver(group.prompt_index, group.completions[0])
            except BaseException as exc:  # noqa: BLE001 - every request of the stream gets the error
                error = exc
            with self._cond:
                queue.close()
                self._queue = None
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
            self._put_sample(r, j, dataclasses.replace(completion, prompt_index=rid, branch=(j,)))

    def _abort_sample(self, r: _Request, j: int) -> None:
        """(Holding the lock.) Sample ``j`` of ``r`` never ran: an empty "abort" completion."""
        if r.samples[j] is not None:
            return
        empty = torch.zeros(0, dtype=torch.int64)
        c = Completion(r.rid, torch.tensor(r.prompt, dtype=torch.int64), empty,
                       torch.zeros(0, dtype=self.engine.logit_dtype), empty, "abort", None, (j,))
        if r.listener is not None:
            try:
                r.listener(TokenDelta(r.rid, (j,), [], [], [], None, "abort"))
            except Exception:  # noqa: BLE001 - the client's callback does not break the loop
                pass
        self._put_sample(r, j, c)

    def _put_sample(self, r: _Request, j: int, c: Completion) -> None:
        r.samples[j] = c
        r.left -= 1
        if r.left == 0:
            self._inflight.pop(r.rid, None)
            self._by_future.pop(id(r.future), None)
            self.stats.completed += 1
            self.stats.samples += r.n
            self.stats.tokens += sum(len(s) for s in r.samples)
            r.future.set_result(list(r.samples))
            self._cond.notify_all()

    def _fail(self, r: _Request, error: BaseException) -> None:
        self._by_future.pop(id(r.future), None)
        if not r.future.done():
            self.stats.failed += 1
            r.future.set_exception(error)
