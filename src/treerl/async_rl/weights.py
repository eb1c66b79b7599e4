"""Weight transfer from the trainer to rollout workers, with a version number.

Three transports behind one interface (the trainer holds a :class:`WeightPublisher`; each
worker opens the picklable :class:`WeightSource` it was given and polls a
:class:`WeightReceiver`):

- ``shared``: one machine. A copy of every tensor in shared CPU memory plus a shared
  version counter; a worker copies them out (into a private staging dict) under its own
  lock when the counter changes, and :meth:`publish` copies them in under every worker's.
- ``files``: anywhere with a shared filesystem (the universal fallback, also used by the
  Ray launcher). ``DIR/weights-{version:08d}.safetensors``, written to a temporary name
  and renamed (atomic), the newest ``keep`` kept.
- ``nccl``: trainer and workers on different CUDA devices: a broadcast per worker over a
  two-rank NCCL group (:mod:`treerl.async_rl.nccl`).

``choose_transfer`` implements ``async.weight_transfer: auto``.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

TRANSFERS = ("auto", "shared", "files", "nccl", "gloo")  # gloo: the broadcast path on CPU
_FILE = re.compile(r"weights-(\d{8})\.safetensors$")


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without aliases (a tied ``lm_head.weight`` is dropped: the
    engine's ``update_weights`` accepts a state that provides each storage once)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.device)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach()
    return out


def choose_transfer(requested: str, trainer_device: str, worker_devices: list[str], launcher: str = "process") -> str:
    """``auto``: shared memory when everything is on CPU (one machine), NCCL when the
    trainer and every worker are on distinct CUDA devices, files otherwise (and always
    for the Ray launcher, whose workers may be on other machines)."""
    if requested not in TRANSFERS:
        raise ValueError(f"async.weight_transfer: unknown {requested!r}; choose one of {', '.join(TRANSFERS)}")
    if requested != "auto":
        if launcher == "ray" and requested in ("shared", "nccl", "gloo"):
            raise ValueError(f"async.weight_transfer={requested} needs the process launcher (Ray workers may be remote)")
        return requested
    if launcher == "ray":
        return "files"
    devices = [torch.device(d) for d in [trainer_device, *worker_devices]]
    if all(d.type == "cpu" for d in devices):
        return "shared"
    if all(d.type == "cuda" for d in devices) and len({(d.index or 0) for d in devices}) == len(devices):
        return "nccl"
    return "files"


class WeightReceiver(ABC):
    """Worker side: new weights as they are published. ``wait`` polls (no device work);
    ``fetch`` moves the newest weights onto the worker's device — the worker calls it
    under its rollout engine's device lock, so a transfer never overlaps a CUDA-graph
    capture or a decode step."""

    @abstractmethod
    def wait(self, timeout: float) -> bool:
        """Up to ``timeout`` seconds: True once a version newer than the last fetched one is published."""

    @abstractmethod
    def fetch(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``(version, state)`` of the newest published weights on the worker's device, or
        None if nothing newer can be read right now."""

    def receive(self, timeout: float) -> tuple[int, dict[str, torch.Tensor]] | None:
        """``wait`` then ``fetch``: the newest weights within ``timeout`` seconds, or None."""
        deadline = time.monotonic() + timeout
        while self.wait(max(0.0, deadline - time.monotonic())):
            got = self.fetch()
            if got is not None:
                return got
            if time.monotonic() >= deadline:
                break
        return None

    def close(self) -> None:
        pass


def _poll(ready, timeout: float, poll_s: float) -> bool:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


class WeightSource(ABC):
    """A picklable handle, given to a worker process, that opens its receiver there."""

    @abstractmethod
    def open(self, device: torch.device, model: torch.nn.Module) -> WeightReceiver:
        """The receiver for a worker whose model (same architecture) is on ``device``."""


class WeightPublisher(ABC):
    """Trainer side."""

    kind: str = ""

    @abstractmethod
    def publish(self, model: torch.nn.Module, version: int) -> float:
        """Make ``model``'s weights available as ``version``; returns the seconds it took."""

    @abstractmethod
    def source(self, worker: int) -> WeightSource:
        """The handle to give worker ``worker`` (each incarnation asks again)."""

    def worker_ready(self, worker: int, model: torch.nn.Module, version: int) -> None:
        """A worker (re)started and waits for its first weights (push transports send now)."""

    def worker_gone(self, worker: int) -> None:
        """A worker died or was stopped."""

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- shared memory
class SharedMemoryPublisher(WeightPublisher):
    """Weights in shared CPU memory (``Tensor.share_memory_``) and a version counter.

    ``ctx``: the multiprocessing context the workers are spawned from (for the locks).
    The handles must reach the workers as process arguments (inherited at spawn).

    Each worker incarnation copies the weights out under a lock of its own, and
    :meth:`publish` takes every live worker's lock. A worker killed while copying (an
    out-of-memory kill as it allocates its copy) never releases its lock; with one lock
    shared by all workers, every later publish then waited forever. The trainer calls
    :meth:`worker_gone` when it gives a worker up, which drops that worker's lock.
    """

    kind = "shared"

    def __init__(self, model: torch.nn.Module, version: int, ctx: Any):
        state = model_state(model)
        self.buffers = {k: v.to("cpu", copy=True).share_memory_() for k, v in state.items()}
        self.version = torch.full((1,), int(version), dtype=torch.int64).share_memory_()
        self.ctx = ctx
        self.locks: dict[int, Any] = {}  # worker -> the lock of its current incarnation

    def publish(self, model: torch.nn.Module, version: int) -> float:
        t0 = time.perf_counter()
        state = model_state(model)
        with contextlib.ExitStack() as held, torch.no_grad():
            for worker in sorted(self.locks):
                held.enter_context(self.locks[worker])
            for k, buf in self.buffers.items():
                buf.copy_(state[k])
            self.version[0] = int(version)
        return time.perf_counter() - t0

    def source(self, worker: int) -> "SharedMemorySource":
        self.locks[worker] = self.ctx.Lock()  # a new incarnation: a new lock
        return SharedMemorySource(self.buffers, self.version, self.locks[worker])

    def worker_gone(self, worker: int) -> None:
        self.locks.pop(worker, None)


class SharedMemorySource(WeightSource):
    def __init__(self, buffers: dict[str, torch.Tensor], version: torch.Tensor, lock: Any):
        self.buffers, self.version, self.lock = buffers, version, lock

    def open(self, device: torch.device, model: torch.nn.Module) -> "SharedMemoryReceiver":
        return SharedMemoryReceiver(self, torch.device(device))


class SharedMemoryReceiver(WeightReceiver):
    def __init__(self, source: SharedMemorySource, device: torch.device, poll_s: float = 0.002):
        self.source, self.device, self.poll_s = source, device, poll_s
        self.last = None

    def wait(self, timeout: float) -> bool:
        return _poll(lambda: int(self.source.version[0]) != self.last, timeout, self.poll_s)

    def fetch(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self.source.lock:
            version = int(self.source.version[0])
            state = {k: b.to(self.device, copy=True) for k, b in self.source.buffers.items()}
        self.last = version
        return version, state


# ------------------------------------------------------------------------------ files
class FilePublisher(WeightPublisher):
    """``directory/weights-{version:08d}.safetensors``, atomic (temporary file + rename);
    the newest ``keep`` files are kept (a reader may still be loading the previous one)."""

    kind = "files"

    def __init__(self, directory: str | Path, keep: int = 2):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, keep)

    def publish(self, model: torch.nn.Module, version: int) -> float:
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        state = {k: v.to("cpu").contiguous() for k, v in model_state(model).items()}
        final = self.directory / f"weights-{int(version):08d}.safetensors"
        tmp = self.directory / f".tmp-{os.getpid()}-{int(version)}.safetensors"
        save_file(state, str(tmp), metadata={"version": str(int(version))})
        os.replace(tmp, final)
        for old in list_weight_files(self.directory)[: -self.keep]:
            old[1].unlink(missing_ok=True)
        return time.perf_counter() - t0

    def source(self, worker: int) -> "FileSource":
        return FileSource(str(self.directory))


def list_weight_files(directory: str | Path) -> list[tuple[int, Path]]:
    """``(version, path)`` of the complete weight files, oldest first."""
    out = []
    for p in Path(directory).glob("weights-*.safetensors"):
        m = _FILE.search(p.name)
        if m:
            out.append((int(m[1]), p))
    return sorted(out)


class FileSource(WeightSource):
    def __init__(self, directory: str):
        self.directory = directory

    def open(self, device: torch.device, model: torch.nn.Module) -> "FileReceiver":
        return FileReceiver(self.directory, torch.device(device))


class FileReceiver(WeightReceiver):
    def __init__(self, directory: str, device: torch.device, poll_s: float = 0.02):
        self.directory, self.device, self.poll_s = directory, device, poll_s
        self.last = -1

    def _newest(self) -> tuple[int, Path] | None:
        files = list_weight_files(self.directory)
        return files[-1] if files and files[-1][0] > self.last else None

    def wait(self, timeout: float) -> bool:
        return _poll(lambda: self._newest() is not None, timeout, self.poll_s)

    def fetch(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        from safetensors.torch import load_file

        newest = self._newest()
        if newest is None:
            return None
        version, path = newest
        try:
            state = load_file(str(path), device=str(self.device))
        except (FileNotFoundError, OSError):  # pruned between listing and loading
            return None
        self.last = version
        return version, state
