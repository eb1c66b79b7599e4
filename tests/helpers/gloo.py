"""Spawned gloo workers of the data-parallel tests: how a worker starts. A worker leaves
through :func:`treerl.distributed.data_parallel.leave`, as a rank of ``treerl train`` does
(barrier, group destroyed, ``os._exit(0)``: a clean-clone CI run saw rank 1 abort while
finalizing, and an isolated loop 1 run in 11)."""

import os

import torch
import torch.distributed as dist


def start_worker(rank: int, world: int, init_file: str) -> None:
    """Rank ``rank`` of ``world`` on the CPU: one thread, the gloo group from a shared file."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
