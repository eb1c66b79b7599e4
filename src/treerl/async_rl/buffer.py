"""The trainer's buffer of finished, admitted work units, and how a batch is drawn from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .controller import StalenessController

T = TypeVar("T")


@dataclass
class Finished(Generic[T]):
    """One admitted unit: its payload (samples), the oldest token version, arrival order."""

    uid: int
    oldest_version: int
    payload: T
    arrival: int = 0


@dataclass
class SampleBuffer(Generic[T]):
    """Admitted units waiting to be trained on.

    :meth:`take_batch` first evicts every unit that has become too stale for the
    controller's current version (the caller re-queues them), then returns the
    ``batch_size`` units with the oldest tokens (ties: arrival order), so units that would
    be the next to go stale are trained first.
    """

    items: list[Finished[T]] = field(default_factory=list)
    _arrivals: int = 0

    def add(self, uid: int, oldest_version: int, payload: T) -> None:
        self.items.append(Finished(uid, oldest_version, payload, self._arrivals))
        self._arrivals += 1

    def __len__(self) -> int:
        return len(self.items)

    def evict_stale(self, controller: StalenessController) -> list[Finished[T]]:
        """Remove (and return) units too stale to train on at ``controller.version``."""
        stale = [f for f in self.items if not controller.is_fresh(f.oldest_version)]
        for _ in stale:
            controller.evict()
        self.items = [f for f in self.items if controller.is_fresh(f.oldest_version)]
        return stale

    def ready(self, controller: StalenessController) -> bool:
        """Whether a full batch of fresh units is buffered (no eviction done)."""
        return sum(controller.is_fresh(f.oldest_version) for f in self.items) >= controller.batch_size

    def take_batch(self, controller: StalenessController) -> tuple[list[Finished[T]], list[Finished[T]]]:
        """``(batch, evicted)``: a batch of ``controller.batch_size`` fresh units (empty if
        there are not enough) and the units evicted as too stale."""
        evicted = self.evict_stale(controller)
        if len(self.items) < controller.batch_size:
            return [], evicted
        order = sorted(self.items, key=lambda f: (f.oldest_version, f.arrival))
        batch = order[: controller.batch_size]
        chosen = {id(f) for f in batch}
        self.items = [f for f in self.items if id(f) not in chosen]
        return batch, evicted
