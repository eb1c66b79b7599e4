"""Data-parallel training of a TreeEngine with FSDP2 (``fully_shard``), launched by torchrun.

Ranks hold different trees, so their engines make different numbers of model calls per
step (more segments, depth-first chains, two-phase recomputes). FSDP's per-call
all-gathers and reduce-scatters would then pair up wrongly across ranks. A step therefore
runs inside :func:`gradient_step`: parameters are all-gathered once when it opens,
every call of the step accumulates unsharded gradients locally (no collectives), and
when it closes one zero-loss call — identical on every rank — reduce-scatters the
accumulated gradients once (then scaled from FSDP's mean to the sum). Parameters stay sharded between steps (and the optimizer
state is sharded), gradients are summed over ranks (the loss is normalised over the
global batch, see ``treerl.rl.Normalisers.all_reduce``), so the result does not depend
on the number of ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from ..engine.tree_engine import TreeEngine


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(backend: str | None = None, timeout_s: float = 600.0, store: dist.Store | None = None) -> DistContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*):
    NCCL with one GPU per process when CUDA is there, gloo on CPU otherwise.

    ``store``: rendezvous through this store (a ``TCPStore`` whose server rank 0 already
    holds, e.g. :mod:`treerl.async_rl.ray_launch`) instead of ``MASTER_ADDR``/``MASTER_PORT``."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (shared hosts)
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        where = {} if store is None else {"store": store, "rank": int(os.environ["RANK"]),
                                           "world_size": int(os.environ["WORLD_SIZE"])}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None, **where)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device)


def leave() -> None:
    """The end of a rank of a finished multi-process run (the counterpart of :func:`setup`):
    every rank waits for the others (no rank leaves while another still writes its files),
    the group is destroyed, logs and streams are flushed, and the process exits at once with
    status 0 (``os._exit``) instead of through interpreter finalization. A rank that ran FSDP2
    over gloo aborted now and then while finalizing, after its run had finished ("terminate
    called without an active exception", SIGABRT: 1 in 13 runs of the torchrun test on a
    2-core CPU), and torchrun then stopped the other ranks, which may still have been
    writing, and reported the run failed. Call it once everything is written (``train`` has
    closed its metrics, logs and checkpoints when it returns). Without a group of two or more
    ranks it returns and the process goes on."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    dist.barrier()
    dist.destroy_process_group()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launched() -> bool:
    """True when this process is one of several data-parallel ranks: torchrun set
    WORLD_SIZE > 1, or a process group of more than one rank is already initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _fsdp_modules(engine: TreeEngine) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in engine.runner.modules() if isinstance(m, FSDPModule)]


def shard(engine: TreeEngine, *, param_dtype: torch.dtype | None = None,
          reduce_dtype: torch.dtype | None = None) -> None:
    """Shard ``engine``'s model with FSDP2: one unit per decoder layer, the engine's
    segment runner (embeddings, final norm, LM or value head) as the root unit.

    ``param_dtype=torch.bfloat16`` computes in bf16 from float32 shards (mixed precision);
    gradients are reduced in ``reduce_dtype`` (default: the parameters' dtype; pass float32
    with bf16 compute). Gradients are summed over ranks.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in engine.base.layers:  # the decoder stack (a PEFT model unwrapped: treerl.models.decoder_of)
        fully_shard(layer, mp_policy=policy)
    fully_shard(engine.runner, mp_policy=policy)


@contextlib.contextmanager
def gradient_step(engine: TreeEngine) -> Iterator[None]:
    """Run any number of engine calls (forward, forward_backward, any mode) whose
    gradients are summed over all ranks when the block ends."""
    modules = _fsdp_modules(engine)
    if not modules:
        raise RuntimeError("gradient_step needs an engine sharded with treerl.distributed.shard(engine)")
    for m in modules:
        m.set_reshard_after_forward(False)
        m.set_reshard_after_backward(False)
        m.set_requires_gradient_sync(False, recurse=False)
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True)
            m.set_reshard_after_forward(True)
        if not _reduce_now(engine):
            _reduce_call(engine)
        # FSDP averages over ranks; the loss is already normalised over the global batch,
        # so the gradient is the sum. (A divide factor of 1 needs PREMUL_SUM, which gloo lacks.)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in engine.runner.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, float(dist.get_world_size()))


def _reduce_now(engine: TreeEngine) -> bool:
    """Reduce-scatter the step's accumulated gradients without a model call: run FSDP2's
    own end-of-backward callback (which reduces every parameter group that did not reduce
    during backward) on the root. A model call for this costs ~0.2 s of host time on a
    1.7B model (launches for 28 layers forward and backward); this costs the collectives.

    Every unsharded parameter first gets a gradient (zeros where this rank's calls made
    none, e.g. a rank with no work), so every rank reduce-scatters the same tensors.
    Returns False where this torch's FSDP2 lacks the private hooks used (then the caller
    falls back to a zero-loss model call)."""
    state = getattr(engine.runner, "_get_fsdp_state", lambda: None)()
    final = getattr(state, "_root_post_backward_final_callback", None)
    if final is None or not hasattr(state, "_lazy_init") or not hasattr(state, "_state_ctx"):
        return False
    with torch.no_grad():
        for p in engine.runner.parameters():  # the unsharded parameters while unsharded
            if p.requires_grad and p.grad is None and not hasattr(p, "to_local"):
                p.grad = torch.zeros_like(p)
    state._lazy_init()
    state._state_ctx.is_last_backward = True
    final()
    return True


@contextlib.contextmanager
def gathered(engine: TreeEngine) -> Iterator[None]:
    """Run any number of no-grad engine calls (``forward``, ``logprobs``, ``values``) on
    a sharded engine: parameters are all-gathered once when the block opens and resharded
    when it closes, so ranks may make different numbers of calls (none at all included).
    An engine that is not sharded runs as is."""
    modules = _fsdp_modules(engine)
    for m in modules:
        m.set_reshard_after_forward(False)
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True)


def _reduce_call(engine: TreeEngine) -> None:
    """One call, the same on every rank, whose zero loss carries the accumulated
    gradients into FSDP's reduce-scatter."""
    from .. import PrefixTree

    tree = PrefixTree.from_sequences([[0, 0]])
    engine.forward_backward(tree, lambda outs, *rest: 0.0 * outs[0].sum())


def all_reduce_sum(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(value, dtype=torch.float64, device=device).clone()
    dist.all_reduce(t)
    return t


def full_gradients(engine: TreeEngine) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient (gathered from its shards), for checks."""
    out = {}
    for name, p in engine.model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def full_state_dict(module: torch.nn.Module, bucket_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every sharded (DTensor) entry gathered to the whole
    tensor. A collective: every rank calls it (same order). Tied entries are gathered once.

    FSDP2 shards (dim-0 ``Shard`` on a 1-D mesh) smaller than ``bucket_bytes`` are gathered
    together, up to ``bucket_bytes`` per collective (each rank packs its shards of a bucket
    into one flat buffer: one ``all_gather`` instead of one per parameter); a larger one
    is gathered alone, straight into its whole tensor. Default ``bucket_bytes``: 1 MB on
    the CPU, where the copy in and out of a bucket costs more than a gloo message (measured:
    bench/bench_weight_gather.py, bench/RESULTS.md); 16 MB on GPUs, where a 16 MB copy
    (~5 us) is cheaper than launching a collective (not measured yet)."""
    state = module.state_dict()
    if bucket_bytes is None:
        cuda = any(t.device.type == "cuda" for t in state.values())
        bucket_bytes = (16 if cuda else 1) << 20
    whole: dict[int, torch.Tensor] = {}  # id(DTensor) -> gathered tensor
    bucket: list[torch.Tensor] = []
    queued: set[int] = set()
    size = 0
    for t in state.values():
        if not hasattr(t, "full_tensor") or id(t) in whole or id(t) in queued:
            continue
        nbytes = t.numel() * t.element_size()
        if not _fsdp_dim0(t) or nbytes >= bucket_bytes:
            whole[id(t)] = t.full_tensor()
            continue
        if bucket and (t.dtype != bucket[0].dtype or t.device != bucket[0].device or size + nbytes > bucket_bytes):
            whole.update(_gather_bucket(bucket))
            bucket, size = [], 0
        bucket.append(t)
        queued.add(id(t))
        size += nbytes
    if bucket:
        whole.update(_gather_bucket(bucket))
    return {name: (whole[id(t)] if hasattr(t, "full_tensor") else t).detach() for name, t in state.items()}


def _fsdp_dim0(t) -> bool:
    """A DTensor sharded on dim 0 over a 1-D mesh (FSDP2's layout)."""
    from torch.distributed.tensor import Shard

    return t.device_mesh.ndim == 1 and len(t.placements) == 1 and t.placements[0] == Shard(0) and t.dim() > 0


def _dim0_rows(n: int, world: int) -> list[int]:
    """Rows of each rank's dim-0 shard of ``n`` rows (torch.chunk: ceil(n / world) each)."""
    chunk = -(-n // world)
    return [max(0, min(n, (r + 1) * chunk) - r * chunk) for r in range(world)]


def _gather_bucket(bucket: list) -> dict[int, torch.Tensor]:
    """Whole tensors of dim-0-sharded DTensors (same dtype, device, mesh) with one
    ``all_gather_into_tensor`` of a flat buffer per rank (padded to the largest rank's):
    one copy in, one collective, one copy out per tensor."""
    group = bucket[0].device_mesh.get_group()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = [_dim0_rows(t.shape[0], world) for t in bucket]
    per_row = [math.prod(t.shape[1:]) for t in bucket]
    sizes = [sum(r[k] * w for r, w in zip(rows, per_row)) for k in range(world)]
    width = max(sizes)
    local = bucket[0].to_local()
    gathered = torch.empty(world * width, dtype=local.dtype, device=local.device)
    mine = gathered[rank * width: (rank + 1) * width]  # gathered in place: rank r's slot holds its shards
    offset = 0
    for t, r, w in zip(bucket, rows, per_row):
        n = r[rank] * w
        mine[offset: offset + n].copy_(t.to_local().reshape(-1))
        offset += n
    dist.all_gather_into_tensor(gathered, mine, group=group)
    parts = gathered.view(world, width)
    out, offsets = {}, [0] * world
    for t, r, w in zip(bucket, rows, per_row):
        whole = torch.empty(t.shape, dtype=local.dtype, device=local.device)
        flat, at = whole.view(-1), 0
        for k in range(world):
            n = r[k] * w
            flat[at: at + n].copy_(parts[k, offsets[k]: offsets[k] + n])
            offsets[k] += n
            at += n
        out[id(t)] = whole
    return out


def _local_shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` cut like the DTensor ``like`` (no communication: every rank has ``full``)."""
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=like.device, dtype=like.dtype)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


@torch.no_grad()
def load_full_state_dict(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors (every rank holds them) into a possibly sharded ``module``;
    each rank keeps its own shard. Keys missing from ``state`` are left as they are."""
    for name, t in module.state_dict().items():
        if name not in state:
            continue
        src = state[name]
        if hasattr(t, "full_tensor"):
            t.to_local().copy_(_local_shard(src, t).to_local())
        else:
            t.copy_(src)


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with sharded state gathered: the same layout as the
    state dict of the optimizer of an unsharded model (checkpoints move between one
    process and many). A collective: every rank calls it."""
    sd = optimizer.state_dict()
    state = {}
    for key in sorted(sd["state"]):
        state[key] = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd["state"][key].items()}
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, full: dict) -> None:
    """Load a state dict written by :func:`full_optimizer_state` (or by the optimizer of an
    unsharded model) into the optimizer of a sharded model: each rank keeps its shards."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for key, entry in full["state"].items():
        p = params[int(key)]
        state[key] = {k: (_local_shard(v, p) if hasattr(p, "device_mesh") and torch.is_tensor(v) and v.dim() > 0
                          and v.shape == p.shape else v) for k, v in entry.items()}
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})


def all_gather_objects(obj):
    """Every rank's ``obj``, in rank order (pickled; for small, infrequent data)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """``obj`` of rank ``src`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
