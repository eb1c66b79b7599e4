"""Weights on disk for a serving engine: read a checkpoint into a running engine, and
write the trainer's weights where a remote server can read them.

A *weights path* is a treerl checkpoint (``meta.json``: verified, its ``model/`` read), a
run or ``checkpoints`` directory (its newest checkpoint) or a Hugging Face model directory
(``*.safetensors``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from ..checkpoint import META, resolve_checkpoint


def weights_dir(path: str | Path) -> Path:
    """The directory holding the ``*.safetensors`` of a weights path (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"weights path not found: {path}")
    if (path / META).is_file() or (path / "checkpoints").is_dir() or any(path.glob("step-*")):
        path = resolve_checkpoint(path) / "model"
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} holds no *.safetensors weights (nor is it a treerl checkpoint)")
    return path


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(weights_dir(path).glob("*.safetensors")):
        state.update(load_file(f))
    return state


def load_weights_into(engine, path: str | Path, version: int | None = None) -> int:
    """Copy the weights at ``path`` into ``engine`` (interrupting its generation; see
    :meth:`RolloutEngine.update_weights <treerl.rollout.RolloutEngine.update_weights>`).
    Returns the new version (default: current + 1)."""
    return engine.update_weights(read_weights(path), version=version)


def save_weights(model: torch.nn.Module, root: str | Path, version: int, keep_last: int = 2) -> Path:
    """Write ``model``'s weights to ``root/v{version}`` (a temporary renamed into place, so a
    reader never sees half a directory); keep the newest ``keep_last``. Returns the directory."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version:08d}"
    tmp = root / f".tmp-v{version:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in sorted(root.glob("v*"))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final
