"""The trainer side of asynchronous RL: launches work units on rollout workers within the
staleness bound, collects and admits their samples, trains on full batches with
``Trainer.train_on`` and publishes each new weight version; restarts workers that die or
hang and re-queues their work.

One thread, no locks: between training steps it drains the workers' messages, checks
their health, and launches work; while ``train_on`` runs, messages wait in the queues.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from ..config import Config, ConfigError
from ..samples import Sample
from ..learner import check_proximal
from ..trainer import Trainer
from .buffer import SampleBuffer
from .controller import StalenessController
from .ledger import WorkLedger, WorkUnit
from .pool import ProcessPool, WorkerPool
from .weights import FilePublisher, SharedMemoryPublisher, WeightPublisher, choose_transfer
from .worker import FaultPlan, Heartbeat, Ready, Result, WorkerFailed, WorkerSpec


def make_pool(launcher: str, **kwargs: Any) -> WorkerPool:
    """``process`` (this machine) or ``ray`` (Ray actors; needs ``pip install ray``)."""
    if launcher == "process":
        return ProcessPool()
    if launcher == "ray":
        from .ray_pool import RayPool  # imports ray

        return RayPool(**kwargs)
    raise ValueError(f"unknown launcher {launcher!r}: choose process or ray")


class AsyncWorkerError(RuntimeError):
    """A rollout worker raised (its traceback is in the message), or kept failing."""


@dataclass
class AsyncOptions:
    """Settings of an asynchronous run beyond ``Config.async_`` (candidates for config fields).

    prompts_per_unit: prompt groups per work unit; must divide ``rollout.prompts_per_step``.
        The staleness controller counts units (``batch_size = prompts_per_step / this``).
    worker_devices: one device per worker (default: ``train.device`` for every worker).
    worker_threads: torch threads per CPU worker process.
    launcher: ``process`` (this machine) or ``ray``.
    proximal: ``recompute`` (tree forward of the current weights, exact) or ``loglinear``
        (AReaL's interpolation between behaviour and current logprobs; no extra forward).
    linger_ratio: when a full batch is buffered and a worker is idle, train first (so the
        worker's next call gets more units) unless a training step is expected to take
        longer than ``linger_ratio`` x a generation call; then launch first.
    max_units_per_call: most units one worker generates in one call (None: no limit).
    heartbeat_s: seconds between worker heartbeats; max_restarts: restarts per worker
        before the run fails; weights_dir: for file transfer (default OUT/weights).
    faults: {worker: FaultPlan} injected into first incarnations (tests, drills).
    setup: ``"module:function"`` run first in every worker (e.g. register a custom task).
    poll_s: sleep between polls when there is nothing to do.
    start_timeout_s: how long a worker may take to build its model and report ready.
    deadline_s: fail the run (TimeoutError) after this many seconds (None: no limit).
    ray_worker: Ray actor options of each rollout worker under ``launcher="ray"``
        (``num_cpus``, ``num_gpus``, ``resources``: e.g. ``{"resources": {"rollout": 1}}``).
    """

    prompts_per_unit: int = 1
    worker_devices: list[str] | None = None
    worker_threads: int = 1
    launcher: str = "process"
    proximal: str = "recompute"
    linger_ratio: float = 0.5
    max_units_per_call: int | None = None
    heartbeat_s: float = 0.5
    max_restarts: int = 3
    weights_dir: str | None = None
    faults: dict[int, FaultPlan] = field(default_factory=dict)
    setup: str | None = None
    poll_s: float = 0.002
    start_timeout_s: float = 600.0
    deadline_s: float | None = None
    ray_worker: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: Config, **overrides: Any) -> "AsyncOptions":
        """Options from ``cfg.async_``: every field of this class that the config section
        has (so new ``AsyncConfig`` fields of the same names take effect), then ``overrides``."""
        names = {f for f in cls.__dataclass_fields__ if f not in ("faults", "ray_worker")}
        values = {k: getattr(cfg.async_, k) for k in names if hasattr(cfg.async_, k)}
        values.update(overrides)
        return cls(**values)


@dataclass
class WorkerInfo:
    index: int
    device: str
    incarnation: int = 0
    ready: bool = False
    streaming: bool = False  # takes new units while generating (continuous batching)
    last_heard: float = 0.0
    restarts: int = 0


@dataclass
class _Ema:
    value: float | None = None
    rate: float = 0.3

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.rate) * self.value + self.rate * x


class AsyncRunner:
    """Runs RL steps of ``trainer`` on samples from asynchronous rollout workers.

    ``run(steps, on_step)`` trains until ``trainer.step_count == steps``, calling
    ``on_step(metrics, samples)`` after each step (logging, evaluation, checkpoints), then
    goes on launching work. Always ``close()`` it (stops the workers).
    """

    def __init__(self, cfg: Config, trainer: Trainer, options: AsyncOptions | None = None,
                 ledger: WorkLedger | None = None, out_dir: str | Path | None = None):
        self.cfg, self.trainer = cfg, trainer
        self.options = o = options or AsyncOptions()
        a = cfg.async_
        P = cfg.rollout.prompts_per_step
        if o.prompts_per_unit < 1 or P % o.prompts_per_unit:
            raise ConfigError(f"prompts_per_unit={o.prompts_per_unit} must divide rollout.prompts_per_step={P}")
        if a.workers < 1:
            raise ConfigError("async.workers must be at least 1")
        check_proximal(o.proximal, cfg.algorithm.advantage)
        devices = list(o.worker_devices or [cfg.train.device] * a.workers)
        if len(devices) != a.workers:
            raise ConfigError(f"{len(devices)} worker devices given for async.workers={a.workers}")
        self.controller = StalenessController(a.max_staleness, P // o.prompts_per_unit, version=trainer.sampler.rollout.version)
        self.buffer: SampleBuffer[tuple[WorkUnit, list[Sample]]] = SampleBuffer()
        self.ledger = ledger or WorkLedger()
        self.transfer = choose_transfer(a.weight_transfer, cfg.train.device, devices, o.launcher)
        self.out_dir = Path(out_dir or cfg.train.out_dir)
        # the whole weights to publish: data parallel, the policy is sharded and each rank's
        # rollout copy holds them (gathered after every optimizer step)
        self.weights = trainer.sampler.rollout.model if trainer.dist else trainer.model
        self.publisher = self._publisher()
        self.pool: WorkerPool = make_pool(o.launcher, **(o.ray_worker if o.launcher == "ray" else {}))
        self.workers = {i: WorkerInfo(i, d) for i, d in enumerate(devices)}
        self.train_time, self.call_time = _Ema(), _Ema()
        self.counters = {"restarts": 0, "gen_tokens": 0, "gen_seconds": 0.0, "recomputes": 0, "ignored_messages": 0}
        self._last_step_end = time.perf_counter()
        self._t0 = time.monotonic()
        self._started = False

    # ----------------------------------------------------------------- set-up
    def _publisher(self) -> WeightPublisher:
        version = self.trainer.sampler.rollout.version
        if self.transfer == "shared":
            return SharedMemoryPublisher(self.weights, version, mp.get_context("spawn"))
        if self.transfer in ("nccl", "gloo"):
            from .nccl import CollectivePublisher

            return CollectivePublisher(self.weights, version, backend=self.transfer,
                                       timeout_s=self.cfg.async_.worker_timeout_s)
        return FilePublisher(self.options.weights_dir or self.out_dir / "weights")

    def start(self) -> None:
        """Publish the current weights and start every worker."""
        if self.transfer not in ("nccl", "gloo"):  # push transports send on each worker's Ready
            self.publisher.publish(self.weights, self.trainer.sampler.rollout.version)
        for i in self.workers:
            self._start_worker(i)
        self._started = True

    def _start_worker(self, i: int) -> None:
        info, o = self.workers[i], self.options
        spec = WorkerSpec(index=i, incarnation=info.incarnation, config=self.cfg.to_dict(), device=info.device,
                          weights=self.publisher.source(i), threads=o.worker_threads, heartbeat_s=o.heartbeat_s,
                          weights_timeout_s=self.cfg.async_.worker_timeout_s, fault=o.faults.get(i), setup=o.setup)
        info.ready = False
        info.last_heard = time.monotonic()
        self.pool.start(spec)

    def close(self) -> None:
        """Stop the workers (their in-flight units stay pending in the ledger)."""
        try:
            self.pool.stop()
        finally:
            for unit, _ in list(self.ledger.in_flight.values()):
                self.controller.cancel()
                self.ledger.requeue(unit)
            self.publisher.close()

    # ----------------------------------------------------------------- the loop
    def run(self, steps: int, on_step: Callable[[dict, list[Sample]], None] | None = None) -> None:
        if not self._started:
            self.start()
        while self.trainer.step_count < steps:
            self.pump()
            if self.buffer.ready(self.controller):
                if self._launch_first():
                    self.launch()
                result = self.train_step()
                if result is not None and on_step is not None:
                    on_step(*result)
                continue
            if not self.launch():
                time.sleep(self.options.poll_s)

    def pump(self) -> None:
        """Handle every waiting message, then restart dead or silent workers."""
        for msg in self.pool.poll():
            self._handle(msg)
        now = time.monotonic()
        if self.options.deadline_s is not None and now - self._t0 > self.options.deadline_s:
            raise TimeoutError(f"asynchronous run exceeded its deadline of {self.options.deadline_s} s")
        for i, info in self.workers.items():
            silent = now - info.last_heard
            if not self.pool.alive(i):
                self._lose_worker(i, "died")
            elif not info.ready and silent > self.options.start_timeout_s:
                self._lose_worker(i, f"did not start within {self.options.start_timeout_s:.0f} s")
            elif info.ready and self.ledger.in_flight_on(i) and silent > self.cfg.async_.worker_timeout_s:
                self._lose_worker(i, f"sent nothing for {silent:.1f} s while generating (timeout)")

    def _handle(self, msg: Any) -> None:
        info = self.workers.get(msg.worker)
        if info is None or msg.incarnation != info.incarnation:
            self.counters["ignored_messages"] += 1  # from an incarnation given up on
            return
        info.last_heard = time.monotonic()
        if isinstance(msg, Ready):
            info.ready = True
            info.streaming = msg.streaming
            self.publisher.worker_ready(msg.worker, self.weights, self.trainer.sampler.rollout.version)
        elif isinstance(msg, Result):
            self._collect(msg)
        elif isinstance(msg, WorkerFailed):
            raise AsyncWorkerError(f"rollout worker {msg.worker} failed:\n{msg.error}")
        elif not isinstance(msg, Heartbeat):
            raise TypeError(f"unexpected message {type(msg).__name__}")

    def _collect(self, msg: Result) -> None:
        self.call_time.add(msg.seconds)
        self.counters["gen_tokens"] += msg.tokens
        self.counters["gen_seconds"] += msg.seconds
        self.counters["recomputes"] += msg.recomputes
        for uid, attempt, samples in msg.units:
            unit = self.ledger.complete(uid, attempt, msg.worker)
            if unit is None:
                continue
            oldest = min((min(s.versions) for s in samples if s.versions), default=self.controller.version)
            if self.controller.finish(oldest):
                self.ledger.buffer(unit)
                self.buffer.add(uid, oldest, (unit, samples))
            else:
                self.ledger.requeue(unit)

    def _lose_worker(self, i: int, why: str) -> None:
        info = self.workers[i]
        lost = self.ledger.fail_worker(i)
        for unit in lost:
            self.controller.cancel()
            self.ledger.requeue(unit)
        info.restarts += 1
        self.counters["restarts"] += 1
        print(f"treerl async: rollout worker {i} {why}; {len(lost)} unit(s) re-queued; restarting "
              f"({info.restarts}/{self.options.max_restarts})", file=sys.stderr)
        if info.restarts > self.options.max_restarts:
            raise AsyncWorkerError(f"rollout worker {i} {why} after {self.options.max_restarts} restarts")
        self.pool.kill(i)
        self.publisher.worker_gone(i)
        info.incarnation += 1
        self._start_worker(i)

    # --------------------------------------------------------------- launching
    def _launch_first(self) -> bool:
        """With a full batch buffered: launch before training if a worker would otherwise
        idle through a training step that is long compared to a generation call (a
        streaming worker takes new units into its running batch: always launch first)."""
        workers = self._idle_workers()
        if self.controller.capacity() <= 0 or not workers:
            return False
        if any(self.workers[i].streaming for i in workers):
            return True
        t, c = self.train_time.value, self.call_time.value
        return t is None or c is None or t > self.options.linger_ratio * c

    def _idle_workers(self) -> list[int]:
        """Workers that take units now: idle ones, and streaming ones (fewest in flight first)."""
        ready = [(len(self.ledger.in_flight_on(i)), i) for i, info in self.workers.items() if info.ready]
        return [i for n, i in sorted(ready) if n == 0 or self.workers[i].streaming]

    def launch(self) -> bool:
        """Give idle (or streaming) workers as many units as the staleness bound allows
        (split evenly)."""
        idle = self._idle_workers()
        capacity = self.controller.capacity()
        launched = False
        for k, i in enumerate(idle):
            n = math.ceil(capacity / (len(idle) - k))
            if self.options.max_units_per_call:
                n = min(n, self.options.max_units_per_call)
            if n <= 0:
                break
            version = self.controller.launch(n)
            units = [self.ledger.launch(self._next_unit(), i, version) for _ in range(n)]
            self.pool.send(i, units)
            capacity -= n
            launched = True
        return launched

    def _next_unit(self) -> WorkUnit:
        if self.ledger.queued:
            return self.ledger.queued.popleft()
        # The RNG state the synchronous trainer's generate would start from; advance ours
        # by the one draw its generate would make (eta = 0 reproduces synchronous samples).
        state = torch.get_rng_state().numpy().tobytes()
        torch.randint(0, 2**62, ())
        problems = self.trainer.sampler.next_problems(self.options.prompts_per_unit)
        return self.ledger.new_unit(problems, self.cfg.rollout.group_size, state)

    # ---------------------------------------------------------------- training
    def train_step(self) -> tuple[dict, list[Sample]] | None:
        """Train on one batch if a full fresh one is buffered; returns (metrics, samples)."""
        batch, evicted = self.buffer.take_batch(self.controller)
        for f in evicted:
            self.ledger.requeue(f.payload[0])
        if not batch:
            return None
        samples = batch_samples([f.payload[1] for f in batch])
        waited = time.perf_counter() - self._last_step_end
        t0 = time.perf_counter()
        metrics = self.trainer.train_on(samples, rollout_seconds=waited, proximal=self.options.proximal)
        version = self.controller.step()
        if version != self.trainer.sampler.rollout.version:
            raise RuntimeError(f"controller version {version} != trainer version {self.trainer.sampler.rollout.version}")
        self.ledger.mark_trained([f.uid for f in batch])
        publish_s = self.publisher.publish(self.weights, version)
        self.train_time.add(time.perf_counter() - t0)
        self._last_step_end = time.perf_counter()
        metrics.update(self.metrics())
        metrics.update({"async/wait_s": waited, "async/publish_s": publish_s,
                        "async/batch_oldest_version": min(f.oldest_version for f in batch)})
        return metrics, samples

    def metrics(self) -> dict[str, float]:
        c = self.counters
        out = {**self.controller.metrics(), **self.ledger.metrics(), "async/restarts": c["restarts"],
               "async/kv_recomputes": c["recomputes"], "async/ignored_messages": c["ignored_messages"],
               "async/gen_tokens_per_s": c["gen_tokens"] / max(c["gen_seconds"], 1e-9)}
        return out


def batch_samples(units: list[list[Sample]]) -> list[Sample]:
    """The samples of several units as one batch: groups and episodes renumbered 0, 1, ...
    in order of appearance (unique across units; one unit alone keeps its numbers)."""
    out = []
    groups: dict[tuple[int, int], int] = {}
    episodes: dict[tuple[int, int], int] = {}
    for k, samples in enumerate(units):
        for s in samples:
            g = groups.setdefault((k, s.group), len(groups))
            e = episodes.setdefault((k, s.episode), len(episodes))
            out.append(Sample(token_ids=s.token_ids, loss_mask=s.loss_mask, behaviour_logprobs=s.behaviour_logprobs,
                              versions=s.versions, reward=s.reward, group=g, episode=e, completion=s.completion))
    return out
