"""Reads of the decode log to the host, without waiting.

Each sample call logs the rows' tokens and logprobs on the device (``DeviceBatch.log_tok``,
``log_lp``; the host notes which rows at which token index: ``Scheduler.log_rows``). A read
copies the log to the host (:class:`LogRead`: on CUDA into pinned memory, with an event)
while the next decode steps run; once :data:`READ_LAG` decode steps have been queued after
it, the read is finished (waiting for the copy if needed: the device is busy with the
steps queued meanwhile, so its queue does not drain while the host records the tokens,
finishes rows and admits new ones): :func:`record` puts the tokens into the rows' host
arrays and :func:`check_stops` finishes the rows that stopped or ended. When a read is
finished depends on step counts only, never on the device's timing, so a stream's samples
stay a function of its seed, and the CPU runs the schedule CUDA runs. :class:`LogReader`
keeps at most :data:`READ_LAG` reads in flight for the running batch, and does the
blocking sync where a row's whole history is needed. Functions of the
:class:`~treerl.rollout.scheduler.Scheduler`'s state, as :mod:`~treerl.rollout.requests`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .requests import emit

# decode steps queued after a read starts before it is finished. 1 kept one step queued while the host finished rows
# and admitted prompts: on the H200 serving 64 agents the device idled ~0.4-1.1 ms of a ~4.5 ms step there
# (bench/profile_serve_phases.py, session 20). 2 keeps two; a row that stopped decodes one more step (dropped).
READ_LAG = 2

if TYPE_CHECKING:  # pragma: no cover
    from .batch import DeviceBatch
    from .scheduler import Scheduler


class LogRead:
    """A copy of the decode log to the host (:meth:`DeviceBatch.start_read
    <treerl.rollout.batch.DeviceBatch.start_read>`) in flight."""

    def __init__(self, host: list[torch.Tensor], event: "torch.cuda.Event | None"):
        self.host, self.event = host, event

    def result(self) -> tuple:
        """(Waits for the copy.) ``(tokens, logprobs[, (top ids, top logprobs)])`` as numpy arrays."""
        if self.event is not None:
            self.event.synchronize()
        out = tuple(x.numpy() for x in self.host)
        return out[:2] + ((out[2:],) if len(out) > 2 else ())


def record(s: "Scheduler", log_rows: list[tuple[np.ndarray, np.ndarray]], tok: np.ndarray, lp: np.ndarray,
           top: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """The device's logged tokens and logprobs ``[k, S]`` of the calls ``log_rows`` (taken by
    ``Scheduler.take_log``; with ``top``: the top tokens' ids and logprobs ``[k, S, 20]``)
    into the rows' host arrays."""
    for j, (rows, idx) in enumerate(log_rows):
        s.host_tok[rows, idx] = tok[j, rows]
        s.host_lp[rows, idx] = lp[j, rows]
        s.recorded[rows] = np.maximum(s.recorded[rows], idx + 1)
        if top is not None and s.top_id.shape[2]:
            kk = s.top_id.shape[2]
            s.top_id[rows, idx] = top[0][j, rows, :kk]
            s.top_lp[rows, idx] = top[1][j, rows, :kk]


def check_stops(s: "Scheduler") -> bool:
    """Finish the rows whose tokens on the host (``recorded``) hold a stop or reach
    ``max_new``; give the others' new tokens to their listeners. Whether any finished."""
    finished = False
    for r in np.flatnonzero(s.live | s.ending):
        n = int(s.recorded[r])
        found = s.groups[s.key[r]].stopper.find(s.host_tok[r, :n], int(s.checked[r]))
        if found is not None:
            s.finish(r, found[0], "stop", found[1])
            finished = True
        elif n >= s.max_new_g[r // s.G]:
            s.finish(r, n, "length", None)
            finished = True
        else:
            s.checked[r] = n
            if n > s.emitted[r] and s.groups[s.key[r]].listener is not None:
                emit(s, r, n, None)
    return finished


class LogReader:
    """The running batch's reads of its decode log: at most :data:`READ_LAG` in flight, oldest
    first (``flight``: each read and the decode steps queued before it started; the
    ``(rows, step index)`` of its calls are in ``host.in_flight``, where ``Scheduler.finish``
    drops a finished row's). ``on_finished()``: called when rows finished, before any other
    device work is queued."""

    def __init__(self, host: "Scheduler", dev: "DeviceBatch", on_finished=None):
        self.host, self.dev, self.on_finished = host, dev, on_finished
        self.flight: list[tuple[LogRead, int]] = []

    def unsynced(self) -> bool:
        """Whether logged tokens are not on the host yet (in the log, or being read)."""
        return bool(self.host.log_rows) or bool(self.flight)

    def start(self, steps: int) -> None:
        """Start reading the calls logged so far, after ``steps`` decode steps (the log
        restarts; the oldest read is finished first if :data:`READ_LAG` are in flight)."""
        h = self.host
        while len(self.flight) >= READ_LAG:
            self._finish_oldest()
        self.flight.append((self.dev.start_read(len(h.log_rows), top=h.top_id.shape[2] > 0), steps))
        h.in_flight.append(h.take_log())

    def due(self, steps: int) -> None:
        """Finish the reads in flight that :data:`READ_LAG` decode steps have been queued after
        (``steps``: decode steps so far)."""
        while self.flight and steps >= self.flight[0][1] + READ_LAG:
            self._finish_oldest()

    def finish(self) -> None:
        """Wait for every read in flight, record their tokens, finish the rows that stopped or
        ended. Rows still decoding may have run past a stop meanwhile: their later tokens are
        dropped as they finish (``Scheduler.finish``)."""
        while self.flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        h = self.host
        read, _ = self.flight.pop(0)
        out = read.result()
        record(h, h.in_flight.pop(0), *out)
        self._stops()

    def sync(self) -> None:
        """Bring every logged token to the host (a host sync); finish rows that stopped or ended."""
        h = self.host
        self.finish()
        if h.log_rows:
            k = len(h.log_rows)
            record(h, h.take_log(), *self.dev.start_read(k, top=h.top_id.shape[2] > 0).result())
        self._stops()

    def _stops(self) -> None:
        """Finish the rows whose recorded tokens stop or end them."""
        if check_stops(self.host):
            if self.on_finished is not None:
                self.on_finished()
            self.dev.set_live(self.host.live)
