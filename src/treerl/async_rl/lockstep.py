"""Asynchronous training with a data-parallel trainer (torchrun, FSDP2; issue 15).

Rank 0 runs the asynchronous loop (rollout workers, staleness control, ledger, logs) with
a :class:`Leader` in place of its :class:`~treerl.trainer.Trainer`; every other rank runs
:func:`follow`. Each call of rank 0's that is a collective of the data-parallel trainer
(``train_on``, ``sft_step``, ``evaluate``, ``state_dict``) is first broadcast, with its
arguments (a training batch travels as its samples), and the followers make the same
call, so the FSDP2 collectives of all ranks meet: forwards and minibatch updates are split
over the ranks with the synchronous path's global normalisers, and after each optimizer
step every rank's rollout copy gets the whole weights (gathered in buckets), which rank 0
publishes to the workers.
"""

from __future__ import annotations

from typing import Any

from ..distributed.data_parallel import broadcast_object

COLLECTIVE = ("train_on", "sft_step", "evaluate", "state_dict")
_STOP = "stop"


class Leader:
    """Rank 0's trainer: attribute access goes to ``trainer``; collective calls are
    announced to the followers first."""

    def __init__(self, trainer: Any):
        object.__setattr__(self, "_trainer", trainer)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._trainer, name)
        if name not in COLLECTIVE:
            return value

        def call(*args, **kwargs):
            if name == "sft_step" and not args and kwargs.get("problems") is None:
                # the leader picks the batch: the followers' data order is not advanced
                kwargs["problems"] = self._trainer.sampler.next_problems(self._trainer.cfg.sft.batch_size)
            broadcast_object((name, args, kwargs))
            return value(*args, **kwargs)

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._trainer, name, value)

    def stop(self) -> None:
        """Release the followers (they return from :func:`follow`)."""
        broadcast_object((_STOP, (), {}))


def follow(trainer: Any) -> None:
    """Repeat rank 0's collective calls until it stops."""
    while True:
        name, args, kwargs = broadcast_object(None)
        if name == _STOP:
            return
        if name not in COLLECTIVE:
            raise RuntimeError(f"rank 0 sent an unknown call {name!r}")
        getattr(trainer, name)(*args, **kwargs)
