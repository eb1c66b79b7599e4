"""The trainer side's health check (no processes: a scripted pool): a worker that fails
reports its traceback before its process ends, and the runner reads that report even when
it arrives between the runner's poll and its liveness check (under load the runner can be
descheduled right there: it then restarted the worker as if it had died without a word,
and the error was lost)."""

import pytest

from treerl.async_rl import StalenessController, WorkLedger
from treerl.async_rl.runner import AsyncOptions, AsyncRunner, AsyncWorkerError, WorkerInfo
from treerl.async_rl.worker import WorkerFailed


class _ScriptedPool:
    """Worker 0 writes its WorkerFailed and exits right after the runner's first poll."""

    def __init__(self):
        self.polls = 0
        self.restarts = 0

    def poll(self):
        self.polls += 1
        return [] if self.polls == 1 else [WorkerFailed(0, 0, "Traceback ...\nValueError: bad setup")]

    def alive(self, worker):
        return self.polls == 0

    def kill(self, worker):
        pass

    def start(self, spec):
        self.restarts += 1


def test_a_failure_written_just_before_the_worker_ends_is_reported_not_restarted():
    runner = AsyncRunner.__new__(AsyncRunner)
    runner.options = AsyncOptions(max_restarts=3)
    runner.controller = StalenessController(max_staleness=0, batch_size=1)
    runner.ledger = WorkLedger()
    runner.workers = {0: WorkerInfo(0, "cpu", ready=True)}
    runner.counters = {"restarts": 0, "ignored_messages": 0}
    runner._t0 = float("inf")  # no deadline
    runner.pool = _ScriptedPool()
    runner.publisher = type("P", (), {"worker_gone": lambda self, worker: None})()
    runner._start_worker = runner.pool.start
    with pytest.raises(AsyncWorkerError, match="(?s)rollout worker 0 failed:\nTraceback .*ValueError: bad setup"):
        runner.pump()
    assert runner.pool.restarts == 0 and runner.counters["restarts"] == 0
