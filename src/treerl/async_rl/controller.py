"""Staleness control (AReaL): when may a rollout be launched, when may a finished one be
trained on.

Counting unit: one *work unit* (a prompt group by default, see
:class:`~treerl.async_rl.ledger.WorkUnit`); ``batch_size`` is the number of units the
trainer consumes per step. With ``eta = max_staleness``:

- **launch**: a new unit may start only while
  ``(eta + version + 1) * batch_size - (accepted + running) > 0``, where ``version``
  counts the training steps taken since the controller started, ``accepted`` the units
  admitted since then (buffered or already trained) and ``running`` the units launched
  and not yet finished. So at most ``(eta + 1)`` batches are buffered or in flight.
- **admit**: a finished unit whose oldest token was produced by policy version ``v`` may
  be trained on at trainer version ``V`` only if ``V - v <= eta``; this is checked when
  it arrives and again when a batch is formed (the trainer may have moved on meanwhile).

``eta = 0`` is synchronous RL: a batch is launched only once the previous one has been
trained on, and every token of every trained unit comes from the current weights.

The class is pure bookkeeping (no processes, no clocks): the async driver calls it, and
the property tests drive it with random event interleavings.
"""

from __future__ import annotations

from dataclasses import dataclass


class StalenessError(RuntimeError):
    """The controller was asked to do something its rules forbid."""


@dataclass
class StalenessController:
    """Counters and decisions of bounded-staleness asynchronous RL.

    ``max_staleness``: eta (training steps). ``batch_size``: units per training step.
    ``version``: the trainer's policy version (weights version; it may start above 0 after
    SFT or a resume, ``base_version`` records where counting began).
    """

    max_staleness: int
    batch_size: int
    version: int = 0
    running: int = 0
    accepted: int = 0
    rejected: int = 0  # finished units refused as too stale (at arrival or at batch time)
    cancelled: int = 0  # launched units whose worker died (re-queued)
    launched: int = 0
    base_version: int | None = None

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.base_version is None:
            self.base_version = self.version

    # ----------------------------------------------------------------- decisions
    @property
    def steps(self) -> int:
        """Training steps taken since the controller started."""
        return self.version - self.base_version

    def capacity(self) -> int:
        """Units that may be launched now: ``(eta + steps + 1) * B - (accepted + running)``."""
        return (self.max_staleness + self.steps + 1) * self.batch_size - (self.accepted + self.running)

    def is_fresh(self, oldest_version: int) -> bool:
        """Whether a unit whose oldest token has ``oldest_version`` may be trained on now."""
        return self.version - oldest_version <= self.max_staleness

    # -------------------------------------------------------------------- events
    def launch(self, n: int = 1) -> int:
        """Record ``n`` launches; returns the version they must be generated with (at least)."""
        if n < 0 or n > self.capacity():
            raise StalenessError(f"cannot launch {n} units: capacity is {self.capacity()}")
        self.running += n
        self.launched += n
        return self.version

    def finish(self, oldest_version: int) -> bool:
        """A launched unit finished; admit it (True) unless it is already too stale."""
        self._check_running()
        self.running -= 1
        if oldest_version > self.version:
            raise StalenessError(f"a unit reports version {oldest_version}, newer than the trainer's {self.version}")
        if self.is_fresh(oldest_version):
            self.accepted += 1
            return True
        self.rejected += 1
        return False

    def cancel(self) -> None:
        """A launched unit will never finish (its worker died); it is re-queued."""
        self._check_running()
        self.running -= 1
        self.cancelled += 1

    def evict(self) -> None:
        """An admitted unit became too stale before it was trained on; it is re-queued."""
        if self.accepted <= self.steps * self.batch_size:
            raise StalenessError("no buffered unit to evict")
        self.accepted -= 1
        self.rejected += 1

    def step(self) -> int:
        """The trainer consumed one batch and published new weights; returns the new version."""
        if self.accepted - self.steps * self.batch_size < self.batch_size:
            raise StalenessError("a training step needs a full batch of admitted units")
        self.version += 1
        return self.version

    def _check_running(self) -> None:
        if self.running <= 0:
            raise StalenessError("no unit is running")

    # ------------------------------------------------------------------- metrics
    @property
    def buffered(self) -> int:
        """Admitted units not trained on yet."""
        return self.accepted - self.steps * self.batch_size

    def metrics(self) -> dict[str, float]:
        """Counters for the metrics log (``async/*``)."""
        return {
            "async/version": self.version, "async/running": self.running, "async/accepted": self.accepted,
            "async/buffered": self.buffered, "async/rejected": self.rejected, "async/cancelled": self.cancelled,
            "async/launched": self.launched, "async/capacity": self.capacity(),
        }
