"""A streaming rollout worker (continuous batching, in this process): units sent while it
generates join the running stream; each unit's Result comes back as soon as its groups
are done, exactly once, with the samples a synchronous step would build for its prompts;
a worker idle between sends starts a new session seeded from the unit's RNG state; and
the trainer-side launch rule gives a streaming worker units while it is busy, never more
than the staleness controller allows."""

import queue
import threading
import time

import numpy as np
import torch
import torch.multiprocessing as mp

from treerl.async_rl import StalenessController, WorkLedger
from treerl.async_rl.ledger import WorkUnit
from treerl.async_rl.runner import AsyncRunner, WorkerInfo
from treerl.async_rl.weights import SharedMemoryPublisher
from treerl.async_rl.worker import Ready, Result, RolloutWorker, WorkerSpec, _Session, build_worker_sampler
from helpers.configs import run_config
from helpers.models import after_each_forward


RUN = ("rollout.max_new_tokens=24", "rollout.temperature=1.0", "rollout.group_size=3", "rollout.prompts_per_step=2",
       "async.max_staleness=2")  # run_config(None, *RUN, ..., layers=2, context=128)


class _Sink:
    def __init__(self):
        self.items = queue.Queue()

    def put(self, item):
        self.items.put(item)


def rng_state(seed):
    torch.manual_seed(seed)
    return torch.get_rng_state().numpy().tobytes()


def results_until(sink, n, timeout=120):
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        msg = sink.items.get(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(msg, Result):
            out.append(msg)
        elif not isinstance(msg, Ready) and type(msg).__name__ == "WorkerFailed":
            raise AssertionError(msg.error)
    return out


def test_streaming_worker_admits_units_while_generating_and_returns_each_once(monkeypatch):
    cfg = run_config(None, *RUN, layers=2, context=128)
    sampler = build_worker_sampler(cfg, "cpu")
    pub = SharedMemoryPublisher(sampler.model, 0, mp.get_context("spawn"))
    sink, tasks = _Sink(), queue.Queue()
    worker = RolloutWorker(WorkerSpec(0, 0, cfg.to_dict(), "cpu", pub.source(0), heartbeat_s=0.05), sink)
    assert worker.streaming
    sessions = []
    run_session = worker._run_session
    stream_ended = threading.Event()

    def tracked_session(session, first):
        sessions.append(first.uid)
        try:
            return run_session(session, first)
        finally:
            stream_ended.set()  # the stream has ended: its queue refuses new prompts

    worker._run_session = tracked_session
    decode_calls = []
    sent, joined = threading.Event(), threading.Event()
    session_add = _Session.add

    def tracked_add(self, units):
        added = session_add(self, units)
        if added and any(u.uid == 1 for u in units):
            joined.set()
        return added

    monkeypatch.setattr(_Session, "add", tracked_add)
    problems = sampler.task.train_problems(7, seed=2)

    def hook(query_length):  # at the end of every forward
        if query_length == 1:
            decode_calls.append(1)
            if len(decode_calls) == 3:  # the trainer launches two more units mid-generation
                tasks.put([WorkUnit(1, problems[2:4], 3, rng_state(1)), WorkUnit(2, problems[4:5], 3, rng_state(2))])
                sent.set()
                # hold this decode step until the feeder has queued them into the running stream
                assert joined.wait(60), "units 1 and 2 did not reach the running stream"

    handle = after_each_forward(worker.sampler.model, hook)
    thread = threading.Thread(target=worker.serve, args=(tasks,), daemon=True)
    try:
        thread.start()
        tasks.put([WorkUnit(0, problems[:2], 3, rng_state(0))])
        first = results_until(sink, 3)
        assert sent.is_set()
        # later, after the stream has ended (its last Result is sent before the stream
        # notices it is idle, so wait for the session itself to return): a new session
        assert stream_ended.wait(60), "the stream of units 0-2 did not end"
        tasks.put([WorkUnit(3, problems[5:7], 3, rng_state(3))])
        last = results_until(sink, 1)
    finally:
        handle.remove()
        tasks.put(None)
        thread.join(timeout=30)
        pub.close()
    assert not thread.is_alive()
    results = first + last
    assert sorted(uid for r in results for uid, _, _ in r.units) == [0, 1, 2, 3]
    assert all(len(r.units) == 1 for r in results)
    assert sessions == [0, 3], "units 1 and 2 should join the running stream of unit 0"
    for r in results:
        (uid, attempt, samples), = r.units
        unit_problems = {0: problems[:2], 1: problems[2:4], 2: problems[4:5], 3: problems[5:7]}[uid]
        assert len(samples) == 3 * len(unit_problems)
        assert [s.group for s in samples] == [g for g in range(len(unit_problems)) for _ in range(3)]
        assert [s.episode for s in samples] == list(range(len(samples)))
        for s in samples:
            prompt = sampler.format.prompt_ids(sampler.tokenizer, unit_problems[s.group].prompt)
            assert s.token_ids[: len(prompt)] == prompt
            assert len(s.loss_mask) == len(s.token_ids) - 1 == len(s.versions) == len(s.behaviour_logprobs)
            assert sum(s.loss_mask) == len(s.token_ids) - len(prompt)
            assert set(s.versions) == {0}
        assert r.tokens == sum(sum(s.loss_mask) for s in samples)


def test_streaming_session_reproduces_a_synchronous_generate():
    """One session over the prompts of one unit, seeded from the unit's RNG state, gives
    exactly the samples that a synchronous ``Sampler.generate`` gives from the same RNG state
    (what eta = 0 relies on)."""
    cfg = run_config(None, *RUN, "rollout.prompts_per_step=3", "async.max_staleness=0", layers=2, context=128)
    sampler = build_worker_sampler(cfg, "cpu")
    problems = sampler.task.train_problems(3, seed=5)
    state = rng_state(11)
    torch.set_rng_state(torch.from_numpy(np.frombuffer(state, dtype=np.uint8).copy()))
    expected = sampler.generate(problems, 3)
    pub = SharedMemoryPublisher(sampler.model, 0, mp.get_context("spawn"))
    sink, tasks = _Sink(), queue.Queue()
    worker = RolloutWorker(WorkerSpec(0, 0, cfg.to_dict(), "cpu", pub.source(0)), sink)
    thread = threading.Thread(target=worker.serve, args=(tasks,), daemon=True)
    try:
        thread.start()
        tasks.put([WorkUnit(0, problems, 3, state)])
        (result,) = results_until(sink, 1)
    finally:
        tasks.put(None)
        thread.join(timeout=30)
        pub.close()
    (_, _, samples), = result.units
    key = lambda s: (s.token_ids, s.behaviour_logprobs, s.versions, s.reward, s.group, s.episode)  # noqa: E731
    assert [key(s) for s in samples] == [key(s) for s in expected]


class _FakePool:
    def __init__(self):
        self.sent = []

    def send(self, worker, units):
        self.sent.append((worker, [u.uid for u in units]))


def test_launch_gives_streaming_workers_units_while_busy():
    """The runner's launch rule (no processes): a streaming worker with units in flight
    still gets new ones, up to the controller's capacity and never beyond; a
    non-streaming busy worker gets none."""
    runner = AsyncRunner.__new__(AsyncRunner)
    runner.controller = StalenessController(max_staleness=1, batch_size=2)
    runner.ledger = WorkLedger()
    runner.workers = {0: WorkerInfo(0, "cpu", ready=True, streaming=True),
                      1: WorkerInfo(1, "cpu", ready=True, streaming=False)}
    runner.options = type("O", (), {"max_units_per_call": None})()
    runner.pool = _FakePool()
    runner._next_unit = lambda: runner.ledger.new_unit([object()], 2)
    assert runner.launch()
    assert runner.pool.sent == [(0, [0, 1]), (1, [2, 3])]
    assert runner.controller.running == 4 and runner.controller.capacity() == 0
    assert not runner.launch()  # the bound holds

    def finish(*uids):
        for uid in uids:
            unit, w = runner.ledger.in_flight[uid]
            assert runner.ledger.complete(uid, unit.attempt, w) is unit
            assert runner.controller.finish(0)
            runner.ledger.buffer(unit)

    finish(2, 3)  # worker 1's units; a training step frees capacity for 2 more
    assert not runner.launch()
    runner.controller.step()
    assert runner.launch()
    assert runner.pool.sent[2:] == [(1, [4]), (0, [5])]  # worker 0 gets one while busy
    finish(0, 1)
    runner.controller.step()
    assert runner.launch()
    # worker 1 is busy and does not stream; worker 0 (still generating unit 5) takes both
    assert runner.pool.sent[4:] == [(0, [6, 7])]
    assert runner.controller.capacity() == 0 and not runner.launch()
