"""Worker processes on this machine (``torch.multiprocessing``, spawn): start, message
polling, liveness, kill and restart. :mod:`treerl.async_rl.ray_pool` offers the same
interface over Ray actors; :func:`treerl.async_rl.runner.make_pool` picks one."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

from .worker import WorkerSpec, worker_main


@dataclass
class _Slot:
    spec: WorkerSpec
    process: Any
    tasks: Any
    results: Any


class WorkerPool:
    """A worker pool (process or Ray): ``slots`` maps each worker to its slot, which
    holds a task queue and a result queue (``.tasks``, ``.results``)."""

    slots: dict[int, Any]

    def start(self, spec: WorkerSpec) -> None: ...

    def send(self, worker: int, units: list) -> None:
        self.slots[worker].tasks.put(units)

    def poll(self) -> list:
        """Every message waiting in any result queue (non-blocking)."""
        out = []
        for slot in list(self.slots.values()):
            while True:
                try:
                    out.append(slot.results.get_nowait())
                except (queue.Empty, EOFError, OSError):  # empty, or a dead process's broken queue
                    break
        return out

    def alive(self, worker: int) -> bool: ...
    def kill(self, worker: int) -> None: ...
    def stop(self, timeout: float = 10.0) -> None: ...


class ProcessPool(WorkerPool):
    """One spawned process per worker, each with its own task and result queue (a
    killed process can only damage its own queues, which are replaced on restart)."""

    def __init__(self) -> None:
        self.ctx = mp.get_context("spawn")
        self.slots: dict[int, _Slot] = {}

    def start(self, spec: WorkerSpec) -> None:
        if spec.index in self.slots:
            self.kill(spec.index)
        tasks, results = self.ctx.Queue(), self.ctx.Queue()
        process = self.ctx.Process(target=worker_main, args=(spec, tasks, results), daemon=True,
                                   name=f"treerl-rollout-{spec.index}.{spec.incarnation}")
        process.start()
        # The worker alone writes its messages: close this process's copy of the results pipe's
        # write end (a Queue's creator keeps it open). Killed in the middle of a message (one
        # over 16 KiB is two writes; a full pipe blocks a write half way), the worker then
        # leaves an end of file, which poll() reads as a dead queue, instead of half a message
        # whose rest poll() would wait for forever.
        writer = getattr(results, "_writer", None)
        if writer is not None:
            writer.close()
        self.slots[spec.index] = _Slot(spec, process, tasks, results)

    def alive(self, worker: int) -> bool:
        return self.slots[worker].process.is_alive()

    def exitcode(self, worker: int) -> int | None:
        return self.slots[worker].process.exitcode

    def kill(self, worker: int) -> None:
        slot = self.slots.pop(worker, None)
        if slot is None:
            return
        if slot.process.is_alive():
            slot.process.kill()
        slot.process.join(timeout=10)
        for q in (slot.tasks, slot.results):
            q.cancel_join_thread()
            q.close()

    def stop(self, timeout: float = 10.0) -> None:
        for slot in self.slots.values():
            try:
                slot.tasks.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for slot in self.slots.values():
            slot.process.join(timeout=max(0.0, deadline - time.monotonic()))
        for worker in list(self.slots):
            self.kill(worker)

