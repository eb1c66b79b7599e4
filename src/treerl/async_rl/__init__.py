"""Asynchronous RL: rollout workers generate continuously under a staleness bound while
the trainer consumes batches and publishes versioned weights (DESIGN.md, "Asynchronous
system").

- :func:`train_async` — a whole run (what ``treerl train ... async.enabled=true`` calls).
- :class:`StalenessController`, :class:`SampleBuffer` — the pure launch/admit rules.
- :class:`WorkLedger`, :class:`WorkUnit` — exactly-once accounting of prompt groups.
- :class:`AsyncRunner`, :class:`AsyncOptions` — the trainer-side loop and its options.
- weight transfer: :mod:`.weights` (shared memory, files), :mod:`.nccl` (GPU broadcast).
- the log-linear proximal-logprob approximation (AReaL) lives in :mod:`treerl.rl.proximal`
  (`Trainer.train_on(..., proximal="loglinear")`).
"""

from .buffer import Finished, SampleBuffer
from .controller import StalenessController, StalenessError
from .driver import train_async
from .ledger import LedgerError, WorkLedger, WorkUnit
from .runner import AsyncOptions, AsyncRunner, AsyncWorkerError, batch_samples
from .weights import choose_transfer
from .worker import FaultPlan

__all__ = [
    "AsyncOptions", "AsyncRunner", "AsyncWorkerError", "FaultPlan", "Finished", "LedgerError", "SampleBuffer",
    "StalenessController", "StalenessError", "WorkLedger", "WorkUnit", "batch_samples", "choose_transfer",
    "train_async",
]

