"""Work units and the trainer's ledger of them: every prompt group is trained exactly once.

A :class:`WorkUnit` is one or more prompt groups generated together (``problems`` x
``group_size`` samples) with a unique ``uid``. The ledger knows, for every unit issued,
whether it is queued (new or re-queued), in flight on a worker (with an ``attempt``
number), buffered or trained. A worker that dies or hangs gives its in-flight units back
(:meth:`WorkLedger.fail_worker`); a result that arrives for an attempt that is no longer
current (from a worker presumed dead) is refused, so nothing is trained twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..tasks.base import Problem


class LedgerError(RuntimeError):
    """An accounting invariant would be broken (a bug, never a worker fault)."""


@dataclass
class WorkUnit:
    """One unit of rollout work.

    ``problems``: the prompts (``treerl.tasks.Problem``), ``group_size`` samples each.
    ``rng_state``: the trainer's torch RNG state (bytes) when the unit was created; the
    worker restores it before sampling, so a unit regenerated after a fault (or by another
    worker) draws the same random numbers. ``min_version``: the worker waits until its
    weights are at least this version before generating (set at each launch).
    """

    uid: int
    problems: list[Any]
    group_size: int
    rng_state: bytes = b""
    attempt: int = 0
    min_version: int = 0


@dataclass
class WorkLedger:
    """Accounting of work units from issue to training (single-threaded, trainer side)."""

    next_uid: int = 0
    queued: deque = field(default_factory=deque)  # WorkUnit, to (re)launch, FIFO
    in_flight: dict[int, tuple[WorkUnit, int]] = field(default_factory=dict)  # uid -> (unit, worker)
    buffered: dict[int, WorkUnit] = field(default_factory=dict)
    trained: set[int] = field(default_factory=set)
    requeues: int = 0
    stale_results: int = 0  # results refused because the attempt was no longer current

    # ------------------------------------------------------------------ issuing
    def new_unit(self, problems: list[Any], group_size: int, rng_state: bytes = b"") -> WorkUnit:
        unit = WorkUnit(self.next_uid, list(problems), group_size, rng_state)
        self.next_uid += 1
        return unit

    def requeue(self, unit: WorkUnit) -> None:
        """Give a unit back to the queue (front: it is older than any new unit)."""
        if unit.uid in self.trained:
            raise LedgerError(f"unit {unit.uid} was trained already")
        self.in_flight.pop(unit.uid, None)
        self.buffered.pop(unit.uid, None)
        self.queued.appendleft(unit)
        self.requeues += 1

    def launch(self, unit: WorkUnit, worker: int, min_version: int) -> WorkUnit:
        """Record that ``unit`` is sent to ``worker``; returns it with a fresh attempt number."""
        if unit.uid in self.in_flight or unit.uid in self.buffered or unit.uid in self.trained:
            raise LedgerError(f"unit {unit.uid} is already in flight, buffered or trained")
        unit.attempt += 1
        unit.min_version = min_version
        self.in_flight[unit.uid] = (unit, worker)
        return unit

    # ------------------------------------------------------------------ results
    def complete(self, uid: int, attempt: int, worker: int) -> WorkUnit | None:
        """A worker returned ``uid``: the unit if this attempt is the current one in
        flight on that worker, else None (a duplicate from a worker given up on)."""
        entry = self.in_flight.get(uid)
        if entry is None or entry[1] != worker or entry[0].attempt != attempt:
            self.stale_results += 1
            return None
        del self.in_flight[uid]
        return entry[0]

    def buffer(self, unit: WorkUnit) -> None:
        self.buffered[unit.uid] = unit

    def fail_worker(self, worker: int) -> list[WorkUnit]:
        """Every unit in flight on ``worker``, removed from flight (the caller re-queues them)."""
        lost = [u for u, w in self.in_flight.values() if w == worker]
        for u in lost:
            del self.in_flight[u.uid]
        return lost

    def in_flight_on(self, worker: int) -> list[WorkUnit]:
        return [u for u, w in self.in_flight.values() if w == worker]

    def mark_trained(self, uids: list[int]) -> None:
        for uid in uids:
            if uid in self.trained:
                raise LedgerError(f"unit {uid} would be trained twice")
            if self.buffered.pop(uid, None) is None:
                raise LedgerError(f"unit {uid} is trained but was never buffered")
            self.trained.add(uid)

    # ------------------------------------------------------------------ state
    def pending(self) -> list[WorkUnit]:
        """Units issued but not trained: queued, in flight or buffered (oldest first)."""
        units = list(self.queued) + [u for u, _ in self.in_flight.values()] + list(self.buffered.values())
        return sorted(units, key=lambda u: u.uid)

    def check(self) -> None:
        """Every issued uid is in exactly one place (trained, queued, in flight, buffered)."""
        places: dict[int, int] = {}
        for uid in list(self.trained) + [u.uid for u in self.queued] + list(self.in_flight) + list(self.buffered):
            places[uid] = places.get(uid, 0) + 1
        dup = [u for u, n in places.items() if n > 1]
        if dup:
            raise LedgerError(f"units in two places at once: {dup[:5]}")
        missing = set(range(self.next_uid)) - set(places)
        if missing:
            raise LedgerError(f"units lost: {sorted(missing)[:5]}")

    def state_dict(self) -> dict:
        """State for a checkpoint, plain data only (a :class:`~treerl.tasks.Problem` as a
        tagged dict, the RNG bytes as a uint8 tensor; see :mod:`treerl.checkpoint`): units not trained yet are re-queued on resume."""
        return {"next_uid": self.next_uid, "trained": sorted(self.trained),
                "pending": [dict(uid=u.uid, problems=[_problem_state(p) for p in u.problems],
                                 group_size=u.group_size,
                                 rng_state=torch.tensor(list(u.rng_state), dtype=torch.uint8))
                            for u in self.pending()]}

    @classmethod
    def from_state(cls, state: dict) -> "WorkLedger":
        ledger = cls(next_uid=state["next_uid"], trained=set(state["trained"]))
        for d in state["pending"]:
            problems = [_problem_from_state(p) for p in d["problems"]]
            rng = d["rng_state"]
            rng = rng.numpy().tobytes() if isinstance(rng, torch.Tensor) else bytes(rng)
            ledger.queued.append(WorkUnit(d["uid"], problems, d["group_size"], rng))
        return ledger

    def metrics(self) -> dict[str, float]:
        return {"async/requeued": self.requeues, "async/refused_results": self.stale_results,
                "async/queued": len(self.queued), "async/trained_units": len(self.trained)}


_PROBLEM_TAG = "__treerl_problem__"


def _problem_state(problem: Any) -> Any:
    if isinstance(problem, Problem):
        return {_PROBLEM_TAG: [problem.prompt, problem.answer, dict(problem.fields)]}
    return problem


def _problem_from_state(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_PROBLEM_TAG}:
        prompt, answer, fields = value[_PROBLEM_TAG]
        return Problem(prompt, answer, fields)
    return value
