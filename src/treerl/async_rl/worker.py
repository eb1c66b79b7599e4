"""A rollout worker: its own model copy and :class:`~treerl.rollout.RolloutEngine`
(through a :class:`~treerl.sampler.Sampler` built as a synchronous trainer's is,
:func:`build_worker_sampler`, so samples are built and scored exactly as in synchronous
training), a weight-listener thread and a heartbeat thread.

Protocol (one task queue and one result queue per worker incarnation):

- trainer -> worker: a list of :class:`~treerl.async_rl.ledger.WorkUnit`, or ``None`` to stop.
- worker -> trainer: :class:`Ready` once the model is built (``streaming``: whether it
  takes new units while generating), :class:`Result` per unit (streaming) or per list,
  :class:`Heartbeat` every ``heartbeat_s`` seconds while generation makes progress (a
  forward hook counts model calls: a worker stuck inside a call stops beating),
  :class:`WorkerFailed` with the traceback if anything raises.

The listener thread applies every new weight version with
``RolloutEngine.update_weights``, which interrupts an in-flight ``generate``: unfinished
rows recompute their KV under the new weights and each token keeps the version that
produced it. Before generating a unit, the worker waits until its weights are at least
the unit's ``min_version`` (the trainer's version when it launched the unit).

Streaming (single-turn tasks, tree rollouts included): the worker generates with continuous
batching (:meth:`RolloutEngine.generate_stream <treerl.rollout.RolloutEngine.generate_stream>`).
A feeder thread takes unit lists from the task queue as the trainer sends them (the
trainer launches only what the staleness controller allows), waits for the unit's
``min_version`` and adds its prompts to the running stream, where they take the slots of
finished rows; each unit's :class:`Result` is sent as soon as all of its groups are done.
A *session* (one stream, one random generator seeded from its first unit's ``rng_state``
as the synchronous ``generate`` would be) ends when nothing is left to generate; units
arriving after that start a new one. So with ``eta = 0`` (one batch at a time) every step
is one session over exactly the prompts a synchronous step generates, with the same random
numbers: asynchronous training reproduces synchronous training.
"""

from __future__ import annotations

import importlib
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..build import build_task_policy, seed_all
from ..config import Config
from ..rollout.prompts import PromptQueue
from ..sampler import Sampler
from .ledger import WorkUnit
from .weights import WeightSource

FAULT_KINDS = ("exit", "hang")


@dataclass(frozen=True)
class FaultPlan:
    """Fault injection for tests and drills: after ``after_decode_steps`` model calls of
    generation, the worker's first incarnation exits abruptly (``exit``: ``os._exit``, no
    message) or hangs inside the model call (``hang``). Restarted incarnations are healthy.
    ``notify``: the name of a Ray actor whose ``set(node_id)`` is called first (Ray launcher
    drills: the test learns which node to kill, and when)."""

    kind: str
    after_model_calls: int
    notify: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")


@dataclass
class WorkerSpec:
    """Everything a worker process needs (picklable).

    ``config``: the run's ``Config.to_dict()``; ``device``: where this worker's model lives;
    ``threads``: torch intra-op threads (CPU); ``setup``: optional ``"module:function"``
    called first (e.g. to register a custom task); ``weights_timeout_s``: how long to wait
    for weights of a unit's ``min_version`` before failing.
    """

    index: int
    incarnation: int
    config: dict
    device: str
    weights: WeightSource
    threads: int = 1
    heartbeat_s: float = 0.5
    weights_timeout_s: float = 300.0
    fault: FaultPlan | None = None
    setup: str | None = None


@dataclass
class Ready:
    worker: int
    incarnation: int
    pid: int
    streaming: bool = False  # takes new units while generating (continuous batching)


@dataclass
class Heartbeat:
    worker: int
    incarnation: int
    version: int
    model_calls: int


@dataclass
class Result:
    """One generate call's output: per unit ``(uid, attempt, samples)``; ``seconds`` of
    generation, ``tokens`` generated, versions of the weights seen during the call."""

    worker: int
    incarnation: int
    units: list[tuple[int, int, list]]
    seconds: float
    tokens: int
    first_version: int
    last_version: int
    recomputes: int = 0


@dataclass
class WorkerFailed:
    worker: int
    incarnation: int
    error: str


@dataclass
class _State:
    model_calls: int = 0
    busy: bool = False
    stop: bool = False
    weights: threading.Condition = field(default_factory=threading.Condition)


TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def build_worker_sampler(cfg: Config, device: str) -> Sampler:
    """A worker's :class:`~treerl.sampler.Sampler` on ``device``: the run's task, tokenizer
    and policy (seeded as the trainer's: the same initial weights) and its rollout engine,
    from the same config sections as the trainer's sampler (no tree engines, optimizers or
    data-parallel group: a worker only generates)."""
    seed = cfg.train.seed
    seed_all(seed)
    task, tokenizer, model = build_task_policy(cfg.model, cfg.task, seed, torch.device(device))
    return Sampler(cfg.rollout, cfg.task, task, tokenizer, model, None, seed=seed,
                   eval_problems=cfg.train.eval_problems)


def run_setup(setup: str | None) -> None:
    """Call ``"module:function"`` (or just import ``"module"``)."""
    if not setup:
        return
    module, _, func = setup.partition(":")
    mod = importlib.import_module(module)
    if func:
        getattr(mod, func)()


def worker_main(spec: WorkerSpec, tasks: Any, results: Any) -> None:
    """Process entry point (``torch.multiprocessing`` spawn target, or a Ray actor call)."""
    try:
        RolloutWorker(spec, results).serve(tasks)
    except BaseException:  # noqa: BLE001 - report everything, then die
        # No wait for delivery is needed: a process does not end before its queues' feeder
        # threads have written what it put (multiprocessing's documented exit), and a Ray
        # queue's put returns once the item is stored.
        results.put(WorkerFailed(spec.index, spec.incarnation, traceback.format_exc()))
        raise


class RolloutWorker:
    """The worker's state: its sampler (``sampler``: model, rollout ``engine``), the weight
    receiver and threads."""

    def __init__(self, spec: WorkerSpec, results: Any):
        self.spec, self.results = spec, results
        self._session: _Session | None = None
        self._session_lock = threading.Lock()
        torch.set_num_threads(max(1, spec.threads))
        for name in TORCHRUN_ENV:  # started by a torchrun rank: a worker is not one of the ranks
            os.environ.pop(name, None)
        run_setup(spec.setup)
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        cfg = Config.from_dict(spec.config)
        self.sampler = build_worker_sampler(cfg, spec.device)
        self.engine = self.sampler.rollout
        self.engine.version = -1  # no published weights yet
        self.state = _State()
        # the input embedding runs once per forward: prefill (HF forward) and decode steps (own blocks) alike
        self.sampler.model.get_input_embeddings().register_forward_hook(self._on_model_call)
        self.receiver = spec.weights.open(device, self.sampler.model)
        self._threads = [threading.Thread(target=self._listen, name="weights", daemon=True),
                         threading.Thread(target=self._beat, name="heartbeat", daemon=True)]
        self.streaming = not self.sampler.multi_turn
        # the most prompt groups ever in flight: (eta + 1) batches, each group its rows (tree rollouts: leaves)
        leaves = self.sampler.sampling_params(cfg.rollout.group_size).max_leaves
        self.max_rows = (cfg.async_.max_staleness + 1) * cfg.rollout.prompts_per_step * leaves

    # ------------------------------------------------------------------ threads
    def _on_model_call(self, module, args, output) -> None:
        self.state.model_calls += 1
        fault = self.spec.fault
        if fault is not None and self.spec.incarnation == 0 and self.state.model_calls >= fault.after_model_calls:
            if fault.notify:
                import ray

                ray.get(ray.get_actor(fault.notify).set.remote(ray.get_runtime_context().get_node_id()))
            if fault.kind == "exit":
                os._exit(17)
            while True:  # hang: the model call never returns
                time.sleep(3600)

    def _listen(self) -> None:
        while not self.state.stop:
            if not self.receiver.wait(timeout=0.1):
                continue
            with self.engine.device_lock:  # the transfer and the update, between decode steps
                got = self.receiver.fetch()
                if got is None:
                    continue
                version, weights = got
                self.engine.update_weights(weights, version=version)
            with self.state.weights:
                self.state.weights.notify_all()

    def _beat(self) -> None:
        last = -1
        while not self.state.stop:
            calls = self.state.model_calls
            if not self.state.busy or calls != last:
                self.results.put(Heartbeat(self.spec.index, self.spec.incarnation, self.engine.version, calls))
                last = calls
            time.sleep(self.spec.heartbeat_s)

    # ------------------------------------------------------------------ serving
    def serve(self, tasks: Any) -> None:
        for t in self._threads:
            t.start()
        self.results.put(Ready(self.spec.index, self.spec.incarnation, os.getpid(), self.streaming))
        try:
            if self.streaming:
                self._serve_streaming(tasks)
                return
            while True:
                try:
                    units = tasks.get(timeout=0.2)
                except queue.Empty:
                    continue
                if units is None:
                    break
                self.results.put(self.generate(units))
        finally:
            self.state.stop = True
            self.receiver.close()

    # ------------------------------------------------------------ streaming
    def _serve_streaming(self, tasks: Any) -> None:
        """Main thread: run sessions; the feeder thread hands units over (see module doc)."""
        inbox: queue.Queue = queue.Queue()
        feeder = threading.Thread(target=self._feed, args=(tasks, inbox), name="feeder", daemon=True)
        feeder.start()
        stop = False
        while not stop:
            try:
                item = inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            session = _Session(self, item[0].group_size)
            session.add(item)
            with self._session_lock:  # units already waiting join this session
                while True:
                    try:
                        more = inbox.get_nowait()
                    except queue.Empty:
                        break
                    if more is None or isinstance(more, BaseException):
                        stop = more is None
                        if isinstance(more, BaseException):
                            raise more
                        break
                    if not session.add(more):
                        inbox.put(more)
                        break
                self._session = session
            try:
                self._run_session(session, item[0])
            finally:
                with self._session_lock:
                    self._session = None

    def _feed(self, tasks: Any, inbox: queue.Queue) -> None:
        """Feeder thread: units from the trainer go into the running session (once the
        weights are recent enough), else to the main thread for a new session."""
        try:
            while not self.state.stop:
                try:
                    units = tasks.get(timeout=0.2)
                except queue.Empty:
                    continue
                if units is None:
                    inbox.put(None)
                    return
                self._wait_for_version(max(max(u.min_version for u in units), 0))
                with self._session_lock:
                    if self._session is None or not self._session.add(units):
                        inbox.put(units)
        except BaseException as err:  # noqa: BLE001 - re-raised by the main thread
            err.add_note(traceback.format_exc())
            inbox.put(err)

    def _run_session(self, session: "_Session", first: WorkUnit) -> None:
        if first.rng_state:
            torch.set_rng_state(torch.from_numpy(np.frombuffer(first.rng_state, dtype=np.uint8).copy()))
        params = self.sampler.sampling_params(session.group_size)
        self.sampler.model.eval()
        self.state.busy = True
        mark, recomputes = time.perf_counter(), 0
        try:
            for group in self.engine.generate_stream(session.queue, params, max_rows=self.max_rows):
                done = session.complete(group)
                if done is None:
                    continue
                unit, samples, first_version = done
                now = time.perf_counter()
                tokens = sum(sum(s.loss_mask) for s in samples)
                self.results.put(Result(self.spec.index, self.spec.incarnation, [(unit.uid, unit.attempt, samples)],
                                        now - mark, tokens, first_version, self.engine.version,
                                        self.engine.stats.recomputes - recomputes))
                mark, recomputes = now, self.engine.stats.recomputes
        finally:
            self.state.busy = False
        if session.pending:
            raise RuntimeError(f"worker {self.spec.index}: the stream ended with units {sorted(session.pending)} unfinished")

    def _wait_for_version(self, version: int) -> None:
        deadline = time.monotonic() + self.spec.weights_timeout_s
        with self.state.weights:
            while self.engine.version < version:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"worker {self.spec.index}: no weights of version >= {version} "
                                       f"after {self.spec.weights_timeout_s} s (has {self.engine.version})")
                self.state.weights.wait(min(left, 0.1))

    def generate(self, units: list[WorkUnit]) -> Result:
        """Generate and score every unit of the list in one call."""
        self._wait_for_version(max(max(u.min_version for u in units), 0))
        if units[0].rng_state:
            torch.set_rng_state(torch.from_numpy(np.frombuffer(units[0].rng_state, dtype=np.uint8).copy()))
        if self.sampler.multi_turn:  # several generate calls per episode: a stream of their own
            torch.manual_seed(int(torch.randint(0, 2**62, ())) ^ 0x5EED)
        problems = [p for u in units for p in u.problems]
        first_version = self.engine.version
        self.state.busy = True
        t0 = time.perf_counter()
        try:
            samples = self.sampler.generate(problems, units[0].group_size)
        finally:
            self.state.busy = False
        seconds = time.perf_counter() - t0
        if self.sampler.multi_turn:
            # Sampler._episodes stamps every token with the version at the end of the
            # episode; the oldest version seen is the safe (never too fresh) stamp.
            for s in samples:
                s.versions = [first_version] * len(s.versions)
        out, start = [], 0
        for u in units:
            end = start + len(u.problems)
            mine = [s for s in samples if start <= s.group < end]
            out.append((u.uid, u.attempt, mine))
            start = end
        tokens = sum(sum(s.loss_mask) for s in samples)
        return Result(self.spec.index, self.spec.incarnation, out, seconds, tokens, first_version,
                      self.engine.version, self.engine.stats.recomputes)


@dataclass
class _UnitState:
    unit: WorkUnit
    first_version: int
    groups: dict = field(default_factory=dict)


class _Session:
    """One stream's bookkeeping: which prompt key belongs to which unit, and the groups of
    each unit done so far. ``add`` runs in the feeder thread, the rest in the main one."""

    def __init__(self, worker: RolloutWorker, group_size: int):
        self.worker, self.group_size = worker, group_size
        self.queue = PromptQueue(idle_timeout=0)  # the stream ends as soon as it is idle
        self.keys: dict[int, tuple[int, int]] = {}
        self.units: dict[int, _UnitState] = {}
        self.next_key = 0
        self.lock = threading.Lock()

    @property
    def pending(self) -> list[int]:
        with self.lock:
            return list(self.units)

    def add(self, units: list[WorkUnit]) -> bool:
        """Queue every prompt of ``units`` (all or none); False if this session's stream
        has ended (or the group size differs): they go to a new session."""
        if any(u.group_size != self.group_size for u in units):
            return False
        sampler = self.worker.sampler
        items = []
        with self.lock:
            for u in units:
                if u.uid in self.units:
                    raise RuntimeError(f"unit {u.uid} sent twice to the same worker")
                for j, problem in enumerate(u.problems):
                    items.append((self.next_key + len(items), sampler.format.prompt_ids(sampler.tokenizer, problem.prompt)))
            if not self.queue.put_many(items):
                return False
            version = self.worker.engine.version
            k = self.next_key
            for u in units:
                self.units[u.uid] = _UnitState(u, version)
                for j in range(len(u.problems)):
                    self.keys[k] = (u.uid, j)
                    k += 1
            self.next_key = k
        return True

    def complete(self, group) -> tuple[WorkUnit, list, int] | None:
        """Record a finished group; ``(unit, samples, first version)`` once its unit is done."""
        with self.lock:
            uid, j = self.keys.pop(group.prompt_index)
            st = self.units[uid]
            st.groups[j] = group
            if len(st.groups) < len(st.unit.problems):
                return None
            del self.units[uid]
        groups = [st.groups[i] for i in range(len(st.unit.problems))]
        # scored exactly as a synchronous step's samples are (Sampler.group_samples)
        samples = self.worker.sampler.group_samples(st.unit.problems, groups, self.worker.engine.version)
        return st.unit, samples, st.first_version
