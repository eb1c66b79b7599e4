"""Placement through Ray (issue 15): trainer ranks and rollout workers as Ray actors on a
Ray cluster (one machine or many: ``ray start`` on each node, the run given the address).

:func:`launch` starts ``trainer_ranks`` :class:`TrainerRank` actors (resource requests
``trainer``), which form a torch.distributed group (gloo on CPU, NCCL on GPUs; rank 0's
node is the rendezvous) and run :func:`~treerl.async_rl.driver.train_async` as torchrun
ranks would (:mod:`.lockstep`); rank 0 starts the rollout workers as Ray actors
(:class:`~.ray_pool.RayPool`, resource requests ``AsyncOptions.ray_worker``), restarts them
wherever the cluster has room when they or their node die, and publishes weights as files
(the run directory must be on a filesystem every node sees).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..config import Config
from .runner import AsyncOptions


class TrainerRank:
    """One trainer rank in a Ray actor (wrapped by ``ray.remote`` in :func:`launch`)."""

    store = None  # rank 0's rendezvous store (see rendezvous)

    def rendezvous(self, timeout_s: float = 600.0) -> tuple[str, int]:
        """Rank 0: this node's address and the port of the group's rendezvous store, which
        this actor now serves and keeps. The port is bound here (port 0: the system picks a
        free one) and never let go, so no other process can take it before the ranks join
        (picking a free port, closing it and binding it again later is a race under load)."""
        import datetime

        import ray
        import torch.distributed as dist

        host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        return host, self.store.port

    def run(self, config: dict, rank: int, world: int, master: tuple[str, int], options: AsyncOptions,
            resume: str | None) -> dict:
        import datetime

        import torch.distributed as dist

        from ..distributed import ranks
        from .driver import train_async

        cfg = Config.from_dict(config)
        if world > 1:
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")  # Ray gives a GPU actor cuda:0
            store = self.store if rank == 0 else dist.TCPStore(master[0], master[1], is_master=False,
                                                               timeout=datetime.timedelta(seconds=600))
            ranks.setup(cfg.train.device, store=store)  # the Trainer then finds the group joined
        try:
            return train_async(cfg, resume=resume, options=options)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


def launch(cfg: Config, *, trainer_ranks: int = 1, trainer: dict[str, Any] | None = None,
           options: AsyncOptions | None = None, address: str | None = None,
           resume: str | Path | None = None) -> dict:
    """Run ``cfg`` (asynchronous) on a Ray cluster; returns rank 0's final metrics.

    ``trainer``: Ray actor options of each trainer rank (``num_cpus``, ``num_gpus``,
    ``resources``; default one CPU). ``options``: the run's :class:`AsyncOptions`
    (``launcher`` is set to ``ray``; ``ray_worker`` places the rollout workers).
    ``address``: the cluster (default: the one ``ray.init`` joined, or a new local one)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)
    cfg = Config.from_dict(cfg.to_dict())  # a copy: the run directory made absolute for every node
    cfg.train.out_dir = str(Path(cfg.train.out_dir).resolve())
    o = options or AsyncOptions.from_config(cfg)
    o.launcher = "ray"
    if o.weights_dir is None:
        o.weights_dir = str(Path(cfg.train.out_dir) / "weights")
    Rank = ray.remote(TrainerRank)
    actors = [Rank.options(**{"num_cpus": 1, **(trainer or {})}, name=f"treerl-trainer-{r}").remote()
              for r in range(trainer_ranks)]
    master = ray.get(actors[0].rendezvous.remote())
    config = cfg.to_dict()
    refs = [a.run.remote(config, r, trainer_ranks, master, o, None if resume is None else str(resume))
            for r, a in enumerate(actors)]
    try:
        return ray.get(refs)[0]
    finally:
        for a in actors:
            ray.kill(a)
