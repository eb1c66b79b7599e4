"""Weight transfer by broadcast over a two-rank process group per worker: NCCL between
GPUs (trainer on one CUDA device, each worker on another), Gloo on CPU (same code path,
used by the CPU tests).

One group per worker *incarnation* (rank 0 the trainer, rank 1 the worker), built
directly from a ``TCPStore`` (no global ``init_process_group``), so a restarted worker
gets a fresh group and the others are not disturbed. Each push: the trainer copies its
weights into one flat buffer per dtype, writes ``push{k} = version`` in the store, and
broadcasts the buffers; the worker's listener waits for that key, receives into its own
flat buffers and hands views of them to ``RolloutEngine.update_weights``.

NVLink multicast (NVLS) stays off: ``NCCL_NVLS_ENABLE=0`` is set before any group is
made (it is inherited by spawned workers). A worker that dies in the middle of a push
stalls that push until the group's timeout.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .weights import WeightPublisher, WeightReceiver, WeightSource, _poll, model_state

Layout = list[tuple[str, list[tuple[str, tuple[int, ...]]]]]  # per dtype name: [(param, shape)]


def _layout(state: dict[str, torch.Tensor]) -> Layout:
    by_dtype: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, t in state.items():
        by_dtype.setdefault(str(t.dtype).removeprefix("torch."), []).append((name, tuple(t.shape)))
    return sorted(by_dtype.items())


def _flat_buffers(layout: Layout, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(sum(_numel(s) for _, s in entries), dtype=getattr(torch, d), device=device)
            for d, entries in layout]


def _views(layout: Layout, flats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for (_, entries), flat in zip(layout, flats):
        offset = 0
        for name, shape in entries:
            n = _numel(shape)
            out[name] = flat[offset: offset + n].view(shape)
            offset += n
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _group(backend: str, store: dist.Store, rank: int, timeout: datetime.timedelta):
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = False
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _broadcast(group, flats: list[torch.Tensor]) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    works = [group.broadcast([f], opts) for f in flats]
    for w in works:
        w.wait()
    if flats and flats[0].is_cuda:
        torch.cuda.synchronize(flats[0].device)


@dataclass
class CollectiveSource(WeightSource):
    host: str
    port: int
    prefix: str
    backend: str
    layout: Layout
    timeout_s: float

    def open(self, device: torch.device, model: torch.nn.Module) -> "CollectiveReceiver":
        return CollectiveReceiver(self, torch.device(device))


class CollectiveReceiver(WeightReceiver):
    def __init__(self, source: CollectiveSource, device: torch.device):
        self.source, self.device = source, device
        timeout = datetime.timedelta(seconds=source.timeout_s)
        self.timeout = timeout
        self.store = dist.TCPStore(source.host, source.port, is_master=False, timeout=timeout)
        self.group = None  # made at the first push: the trainer makes its side on the worker's Ready
        self.flats = _flat_buffers(source.layout, device)
        self.views = _views(source.layout, self.flats)
        self.pushes = 0

    def _key(self) -> str:
        return f"{self.source.prefix}/push{self.pushes}"

    def wait(self, timeout: float) -> bool:
        return _poll(lambda: self.store.check([self._key()]), timeout, 0.002)

    def fetch(self) -> tuple[int, dict[str, torch.Tensor]]:
        version = int(self.store.get(self._key()))
        if self.group is None:
            self.group = _group(self.source.backend, dist.PrefixStore(self.source.prefix + "/pg", self.store), 1,
                                self.timeout)
        _broadcast(self.group, self.flats)
        self.pushes += 1
        return version, self.views


class CollectivePublisher(WeightPublisher):
    """Trainer side: one group per worker incarnation, a push per publish and per (re)start.

    ``backend``: ``nccl`` (CUDA tensors) or ``gloo`` (CPU). ``timeout_s``: a push to a
    worker that does not take part fails after this long.
    """

    kind = "nccl"

    def __init__(self, model: torch.nn.Module, version: int, backend: str = "nccl", host: str = "127.0.0.1",
                 timeout_s: float = 300.0):
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        self.backend, self.host, self.timeout_s = backend, host, timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        state = model_state(model)
        self.layout = _layout(state)
        device = next(iter(state.values())).device
        self.flats = _flat_buffers(self.layout, device)
        self.views = _views(self.layout, self.flats)
        self.generation: dict[int, int] = {}
        self.groups: dict[int, tuple[str, object, int]] = {}  # worker -> (prefix, group, pushes)
        self.kind = backend

    def _prefix(self, worker: int) -> str:
        return f"w{worker}.{self.generation[worker]}"

    def source(self, worker: int) -> CollectiveSource:
        self.generation[worker] = self.generation.get(worker, -1) + 1
        self.groups.pop(worker, None)
        return CollectiveSource(self.host, self.store.port, self._prefix(worker), self.backend, self.layout,
                                self.timeout_s)

    def worker_ready(self, worker: int, model: torch.nn.Module, version: int) -> None:
        prefix = self._prefix(worker)
        self._fill(model)
        self.store.set(f"{prefix}/push0", str(int(version)))  # the worker joins the group on this key
        group = _group(self.backend, dist.PrefixStore(prefix + "/pg", self.store), 0, self.timeout)
        _broadcast(group, self.flats)
        self.groups[worker] = (prefix, group, 1)

    def worker_gone(self, worker: int) -> None:
        self.groups.pop(worker, None)

    def publish(self, model: torch.nn.Module, version: int) -> float:
        t0 = time.perf_counter()
        if self.groups:
            self._fill(model)
            for worker in list(self.groups):
                self._push(worker, version)
        return time.perf_counter() - t0

    def _fill(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for name, t in model_state(model).items():
                self.views[name].copy_(t)

    def _push(self, worker: int, version: int) -> None:
        prefix, group, pushes = self.groups[worker]
        self.store.set(f"{prefix}/push{pushes}", str(int(version)))
        _broadcast(group, self.flats)
        self.groups[worker] = (prefix, group, pushes + 1)


NcclPublisher = CollectivePublisher
