"""Spawned gloo workers of the data-parallel tests: how a worker starts and how it leaves."""

import os
import sys

import torch
import torch.distributed as dist


def start_worker(rank: int, world: int, init_file: str) -> None:
    """Rank ``rank`` of ``world`` on the CPU: one thread, the gloo group from a shared file."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def end_worker() -> None:
    """Leave a worker whose results are on disk: a barrier (no rank tears gloo down while the
    other still has a collective in flight), the group destroyed, then the process ends at
    once (``os._exit(0)``) instead of through interpreter finalization. Finalizing a process
    that ran FSDP2 over gloo aborts now and then with ``terminate called without an active
    exception``, likely objects that gloo's threads still reference (work handles holding
    tensors) destroyed while the interpreter is torn down (pytorch/pytorch#179291 describes
    that for processes that never destroy their group; the abort's stack was not caught). A
    clean-clone CI run saw rank 1 die so after the barrier was added, and an isolated loop
    1 run in 11. The result files are written before this call and the test checks them, so
    nothing is lost; an exception before it still fails the worker with its traceback."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
