"""Checkpoints: the model in Hugging Face format (safetensors) plus the tokenizer and the
trainer state (optimizer, scheduler, RNG, data cursor, policy version), written atomically
(a temporary directory renamed into place) and pruned to the last N.

Layout: ``OUT/checkpoints/step-000123/{model/, tokenizer/, trainer_state.pt, meta.json}``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

META = "meta.json"
STATE = "trainer_state.pt"


class CheckpointError(ValueError):
    pass


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path, step: int, model: torch.nn.Module, tokenizer: Any, state: dict, keep_last: int = 2
) -> Path:
    """Write ``root/step-{step}`` atomically; keep the newest ``keep_last`` checkpoints."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp / "tokenizer")
    torch.save(state, tmp / STATE)
    (tmp / META).write_text(json.dumps({"step": step, "format": "treerl-checkpoint-1"}))
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)  # atomic on one filesystem: readers see the old or the new
    _fsync_dir(root)
    if keep_last > 0:
        for old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporaries are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / META).is_file())


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run / checkpoints directory (its newest checkpoint)."""
    path = Path(path)
    if (path / META).is_file():
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    raise CheckpointError(f"{path} is not a treerl checkpoint (no {META}) and holds none")


def load_state(checkpoint: str | Path) -> dict:
    path = resolve_checkpoint(checkpoint)
    return torch.load(path / STATE, map_location="cpu", weights_only=False)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
