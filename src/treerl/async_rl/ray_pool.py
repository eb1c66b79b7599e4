"""The same rollout workers as Ray actors, so a Ray cluster places them across machines.

Each worker is an actor running :func:`~treerl.async_rl.worker.worker_main` with two
``ray.util.queue.Queue`` s (tasks in, messages out) instead of process queues; liveness is
the state of the actor's ``serve`` call, a kill is ``ray.kill``. Items cross the queues
pickled (:class:`_Pickled`): a queue actor holds bytes, so it never imports treerl and
torch to unpickle a work unit or a message (seconds of a fresh queue actor's first ``put``,
at the niceness of a Ray worker, while the worker and the trainer wait). Weights travel as
safetensors files (``async.weight_transfer`` resolves to ``files`` under Ray), so workers on
other machines need the weights directory on a shared filesystem.

Placement: ``num_cpus`` / ``num_gpus`` per actor. Ray sets ``CUDA_VISIBLE_DEVICES`` inside a
GPU actor, so its device is ``cuda:0`` there. Connects to a running cluster when
``ray.init`` was called (or ``address`` is given), else starts a local instance.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from .pool import WorkerPool
from .worker import WorkerSpec, worker_main


class _Pickled:
    """A Ray queue whose items travel as pickled bytes (put/get/get_nowait, as the worker
    and the pool use them; picklable, so it is handed to the worker actor as it is). Items
    are pickled as Ray would pickle them (cloudpickle)."""

    def __init__(self, queue: Any):
        self.queue = queue

    def put(self, item: Any) -> None:
        from ray import cloudpickle

        self.queue.put(cloudpickle.dumps(item))

    def get(self, timeout: float | None = None) -> Any:
        return pickle.loads(self.queue.get(timeout=timeout))

    def get_nowait(self) -> Any:
        return pickle.loads(self.queue.get_nowait())

    def shutdown(self, force: bool = False) -> None:
        self.queue.shutdown(force=force)


def _actor_class(ray):
    @ray.remote
    class RolloutActor:
        """Hosts one worker incarnation; ``serve`` returns when the worker stops."""

        def serve(self, spec: WorkerSpec, tasks: Any, results: Any) -> None:
            worker_main(spec, tasks, results)

    return RolloutActor


@dataclass
class _RaySlot:
    actor: Any
    ref: Any
    tasks: Any
    results: Any


class RayPool(WorkerPool):
    """Rollout workers as Ray actors (``num_cpus``, ``num_gpus`` and custom ``resources``
    each); their queues live on this process's node, so losing a worker's node loses only
    the worker."""

    def __init__(self, address: str | None = None, num_cpus: float = 1, num_gpus: float = 0,
                 resources: dict[str, float] | None = None):
        import ray
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False)
        self.ray, self.Queue = ray, Queue
        self.num_cpus, self.num_gpus, self.resources = num_cpus, num_gpus, dict(resources or {})
        self.here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self.Actor = _actor_class(ray)
        self.slots: dict[int, _RaySlot] = {}

    def start(self, spec: WorkerSpec) -> None:
        if spec.index in self.slots:
            self.kill(spec.index)
        opts = {"num_cpus": 0, "scheduling_strategy": self.here}
        tasks, results = _Pickled(self.Queue(actor_options=opts)), _Pickled(self.Queue(actor_options=opts))
        actor = self.Actor.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources,
                                   name=f"treerl-rollout-{spec.index}.{spec.incarnation}").remote()
        self.slots[spec.index] = _RaySlot(actor, actor.serve.remote(spec, tasks, results), tasks, results)

    def alive(self, worker: int) -> bool:
        ready, _ = self.ray.wait([self.slots[worker].ref], timeout=0)
        return not ready

    def kill(self, worker: int) -> None:
        slot = self.slots.pop(worker, None)
        if slot is None:
            return
        self.ray.kill(slot.actor, no_restart=True)
        for q in (slot.tasks, slot.results):
            q.shutdown(force=True)

    def stop(self, timeout: float = 10.0) -> None:
        for slot in self.slots.values():
            slot.tasks.put(None)
        refs = [s.ref for s in self.slots.values()]
        if refs:
            self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for worker in list(self.slots):
            self.kill(worker)
