"""Which rank does what in the synchronous trainer (README, "Multi-GPU").

Joining the process group (on ``train.device``'s kind), FSDP2 sharding of the policy and critic, each
rank's slice of a step's prompts, its tree-aware share of a batch every rank holds, and
the gathering of every rank's samples. ``dist`` is the
:class:`~treerl.distributed.data_parallel.DistContext`, or ``None`` in one process (where
every function here is the identity).
"""

from __future__ import annotations

from typing import Sequence, TypeVar

import torch

from ..config import ConfigError
from ..engine.tree_engine import TreeEngine
from ..samples import Sample
from ..engine.tree import PrefixTree
from . import data_parallel as dp
from .partitioner import partition

T = TypeVar("T")


def setup(device: str, store=None) -> dp.DistContext | None:
    """Under torchrun (WORLD_SIZE > 1): join the process group, one rank per GPU (NCCL)
    when ``device`` (``train.device``) is CUDA, gloo on CPU otherwise. One process: ``None``.
    ``store``: the rendezvous store, when the launcher holds one (see :func:`dp.setup`)."""
    if not dp.launched():
        return None
    cuda = torch.device(device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ConfigError(f"train.device={device} but CUDA is not available")
    return dp.setup("nccl" if cuda else "gloo", store=store)


def shard(engines: Sequence[TreeEngine], device: torch.device, autocast_bf16: bool) -> None:
    """FSDP2 on each engine's model (the policy, the critic): bf16 compute from float32
    shards with float32 gradient reduction on CUDA when ``autocast_bf16``; the model's
    dtype otherwise. (A frozen reference stays whole on every rank: forward only.)"""
    dtype = next(engines[0].model.parameters()).dtype
    param_dtype = reduce_dtype = None
    if device.type == "cuda" and dtype != torch.float64:
        reduce_dtype = torch.float32
        if autocast_bf16 and dtype == torch.float32:
            param_dtype = torch.bfloat16
    for engine in engines:
        dp.shard(engine, param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def my_slice(dist: dp.DistContext | None, items: list[T]) -> tuple[list[T], int]:
    """This rank's contiguous slice of ``items`` (a step's prompts) and where it starts."""
    if not dist:
        return items, 0
    w, r, n = dist.world_size, dist.rank, len(items)
    start, end = r * n // w, (r + 1) * n // w
    return items[start:end], start


def share(dist: dp.DistContext | None, seqs: list) -> list[int]:
    """This rank's sequences (indices into ``seqs``) of a batch every rank holds: the
    tree-aware partition (:func:`treerl.distributed.partition`, equal predicted time per
    rank), computed on rank 0 and broadcast (every rank must use the same one)."""
    if not dist:
        return list(range(len(seqs)))
    ranks = partition(PrefixTree.from_sequences(seqs), dist.world_size).ranks if dist.is_main and seqs else None
    ranks = dp.broadcast_object(ranks)
    return ranks[dist.rank] if ranks else []


def gather_samples(samples: list[Sample]) -> list[Sample]:
    """Every rank's samples, in rank order (= the order of the step's prompts), with
    group and episode ids renumbered to be global."""
    out, groups, episodes = [], {}, {}
    for rank, part in enumerate(dp.all_gather_objects(samples)):
        for s in part:
            s.group = groups.setdefault((rank, s.group), len(groups))
            s.episode = episodes.setdefault((rank, s.episode), len(episodes))
            out.append(s)
    return out


def gather_list(values: list) -> list:
    """The concatenation of every rank's ``values``, in rank order."""
    return [v for part in dp.all_gather_objects(values) for v in part]
