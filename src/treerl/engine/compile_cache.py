"""Compiled kernels reused across runs (issue 24 item 4).

The first ``forward_backward`` of a process compiles the decoder blocks (regional
``torch.compile``: forward, backward, with and without grad and block recompute), the flex
attention kernels and the loss head's chunk kernels: about a minute at the Qwen3-1.7B shape.
torch keeps what it compiled on disk by default — inductor's FX graph cache, the AOTAutograd
cache, autotuning results and Triton's kernels, all under ``TORCHINDUCTOR_CACHE_DIR``
(default ``/tmp/torchinductor_<user>``: lost with ``/tmp``) — so a second process skips code
generation and kernel compilation (dynamo still traces).

:func:`enable` moves those caches to a persistent directory (``engine.compile_cache_dir``,
default ``~/.cache/treerl/compile``, or ``$XDG_CACHE_HOME/treerl/compile``; an explicit
``TORCHINDUCTOR_CACHE_DIR`` in the environment is kept) and loads the *artifacts file* an
earlier run left there: :func:`torch.compiler.save_cache_artifacts` ("mega-cache"), one file
per torch version and device that carries every cache entry the run made — copy it to
another machine (or a fresh container) with the same torch and GPU and its first step reads
the compiled kernels from it. :func:`save` writes that file after a step that compiled
something new (the engine calls it after each ``forward_backward``).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import torch

from ..config import ConfigError

log = logging.getLogger("treerl")

_state: dict = {"dir": None, "graphs": None}


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "treerl" / "compile"


def artifacts_name(device: torch.device | None = None) -> str:
    """The artifacts file of this torch version and device kind (compiled kernels are
    specific to both)."""
    if device is not None and device.type == "cuda":
        kind = torch.cuda.get_device_name(device)
    else:
        kind = "cpu"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", f"artifacts-torch{torch.__version__}-{kind}") + ".bin"


def enable(directory: str | os.PathLike | None = None, device: torch.device | None = None) -> Path | None:
    """Keep torch's compile caches in ``directory`` (None: :func:`default_dir`; ``""``: leave
    torch's defaults and save nothing) and load the artifacts file saved there by an earlier
    run. Process-wide: the first call decides (later calls return its directory). Call before
    anything is compiled."""
    if _state["dir"] is not None:
        return _state["dir"]
    if directory is not None and str(directory) == "":
        return None
    path = Path(directory).expanduser() if directory is not None else default_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file there, a read-only mount: one line, not a traceback
        raise ConfigError(f"engine.compile_cache_dir: cannot use {str(path)!r} as the compile cache directory "
                          f"({err.strerror or err}); give a writable directory, or \"\" for torch's defaults") from None
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, _torch_default_dir()):  # (torch sets its default)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path / "inductor")
    _state["dir"], _state["device"] = path, device
    artifacts = path / artifacts_name(device)
    if artifacts.exists():
        try:
            info = torch.compiler.load_cache_artifacts(artifacts.read_bytes())
            log.info("compile cache: loaded %s (%s)", artifacts, _summary(info))
        except Exception as err:  # a stale or truncated file only costs the compilation
            log.warning("compile cache: could not load %s (%s: %s); compiling", artifacts, type(err).__name__, err)
    _state["graphs"] = _compiled_graphs()
    return path


def save(force: bool = False) -> Path | None:
    """Write this process's compile artifacts to the enabled directory if something was
    compiled since the last save (or ``force``); returns the file written, or None."""
    path = _state["dir"]
    if path is None:
        return None
    graphs = _compiled_graphs()
    if not force and graphs == _state["graphs"]:
        return None
    saved = torch.compiler.save_cache_artifacts()
    _state["graphs"] = graphs
    if saved is None:
        return None
    data, info = saved
    target = path / artifacts_name(_state.get("device"))
    with tempfile.NamedTemporaryFile(dir=path, delete=False, prefix=".artifacts-") as f:
        f.write(data)
    os.replace(f.name, target)  # atomic: a concurrent reader sees the old file or the new one
    log.info("compile cache: saved %s (%d bytes; %s)", target, len(data), _summary(info))
    return target


def reset() -> None:
    """Forget the enabled directory (tests: a process enables one directory)."""
    _state.update(dir=None, graphs=None, device=None)


def _torch_default_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _summary(info) -> str:
    artifacts = getattr(info, "artifacts", None)
    if not artifacts:
        return "no artifacts"
    return ", ".join(f"{kind}: {len(entries)}" for kind, entries in artifacts.items())
