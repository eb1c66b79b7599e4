"""The process pool with real spawned processes: a worker that dies half way through writing
a message leaves the trainer an end of file (the worker then counts as dead), never a poll
that waits forever for the rest of the message."""

import threading
from types import SimpleNamespace

from helpers.pool import dies_mid_message
from treerl.async_rl import pool as pool_module
from treerl.async_rl.pool import ProcessPool


def test_a_worker_dying_mid_message_does_not_hang_the_poll(monkeypatch):
    monkeypatch.setattr(pool_module, "worker_main", dies_mid_message)  # the child imports no torch
    pool = ProcessPool()
    pool.start(SimpleNamespace(index=0, incarnation=0))
    pool.slots[0].process.join(60)
    assert not pool.alive(0)
    got, returned = [], threading.Event()

    def poll():
        got.extend(pool.poll())
        returned.set()

    threading.Thread(target=poll, daemon=True).start()
    try:
        assert returned.wait(60), "poll waited for the rest of a dead worker's message"
        assert got == []
    finally:
        pool.kill(0)
