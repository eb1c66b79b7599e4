"""Weights on disk for a serving engine: read a checkpoint into a running engine, and
write the trainer's weights where a remote server can read them.

A *weights path* is a treerl checkpoint (``meta.json``: verified, its ``model/`` read), a
run or ``checkpoints`` directory (its newest checkpoint) or a Hugging Face model directory
(``*.safetensors``).

Reloads into a running server (:func:`reload_weights`, ``POST /update_weights_from_disk``)
are checked before the engine is touched: the path must lie under the server's weights root
(``treerl serve --weights-root``; symlinks and ``..`` resolved; else 403 naming the root),
the files must be readable safetensors (else 400 naming the damaged file), and the weights
must be of the served architecture (else 400 naming the config keys that differ, or the
first tensors whose shapes differ) — a refused reload leaves the served weights as they were.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import META, resolve_checkpoint
from .protocol import APIError

# config.json keys that fix the shapes of a model's tensors
ARCHITECTURE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings")


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


def load_weights_into(engine, path: str | Path, version: int | None = None, root: Path | None = None) -> int:
    """Copy the weights at ``path`` into ``engine`` (interrupting its generation; see
    :meth:`RolloutEngine.update_weights <treerl.rollout.RolloutEngine.update_weights>`) once
    they are checked (module docstring; :class:`APIError` otherwise): readable, of the
    engine's architecture and, with ``root``, under it. Returns the new version (default:
    current + 1)."""
    directory = weights_dir(path)
    files = sorted(directory.glob("*.safetensors"))
    if root is not None:
        for f in [*files, directory / "config.json"]:
            if f.exists():
                allowed_path(f, root)  # a file may be a symlink out of the root
    check_architecture(engine.model, directory, files)
    return engine.update_weights(_read_files(files), version=version)


def default_weights_root(weights: str | Path | None) -> Path | None:
    """The weights root of ``treerl serve --weights PATH`` when ``--weights-root`` is not given:
    the run directory of a checkpoint (or of a ``checkpoints`` directory), else ``PATH``
    itself; None without ``--weights`` (reloads are then refused)."""
    if weights is None:
        return None
    path = Path(weights).resolve()
    if (path / META).is_file() and path.parent.name == "checkpoints":
        return path.parent.parent
    if path.name == "checkpoints":
        return path.parent
    return path


def allowed_path(path: str | Path, root: Path | None) -> Path:
    """``path`` resolved (symlinks, ``..``), or :class:`APIError` 403 unless it lies under ``root``."""
    if root is None:
        raise APIError("this server reloads no weights: it was started without a weights root "
                       "(treerl serve --weights-root DIR, or --weights)", "model_path", status=403,
                       type="permission_error", code="outside_weights_root")
    root = Path(root).resolve()
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root):
        raise APIError(f"model_path {path} is outside this server's weights root {root} (symlinks and '..' "
                       f"resolved): it reads weights only under it (treerl serve --weights-root)", "model_path",
                       status=403, type="permission_error", code="outside_weights_root")
    return resolved


def reload_weights(engine, path: str | Path, version: int | None, root: Path | None) -> int:
    """``/update_weights_from_disk``: :func:`load_weights_into` of ``path`` if it lies under
    ``root`` (403 otherwise, and always without a root). Returns the new version."""
    return load_weights_into(engine, allowed_path(path, root), version, root=Path(root).resolve())


def check_architecture(model: torch.nn.Module, directory: Path, files: list[Path]) -> None:
    """:class:`APIError` 400 unless the weights in ``files`` (their headers: nothing is
    loaded) are readable and fit ``model``; the message names the differing config keys
    (``directory/config.json``) or tensors."""
    from safetensors import safe_open

    served = model.config.to_dict() if hasattr(model, "config") else {}
    config = directory / "config.json"
    if config.is_file():
        try:
            theirs = json.loads(config.read_text())
        except (OSError, ValueError) as err:
            raise APIError(f"{config} is damaged: {err}", "model_path") from None
        diff = [f"{k} {theirs.get(k)!r} (served: {served.get(k)!r})" for k in ARCHITECTURE_KEYS
                if k in theirs and k in served and theirs.get(k) != served.get(k)]
        if diff:
            raise APIError(f"the weights at {directory} are of another architecture than the served model: "
                           f"{', '.join(diff)}; serve them with their own treerl serve", "model_path")
    own = model.state_dict()
    shapes: dict[str, tuple] = {}
    for f in files:
        try:
            with safe_open(f, framework="pt") as h:
                for k in h.keys():
                    shapes[k] = tuple(h.get_slice(k).get_shape())
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error type
            raise APIError(f"weights file {f} is damaged or not a safetensors file ({_one_line(err)})",
                           "model_path") from None
    unexpected = [k for k in shapes if k not in own]
    wrong = [f"{k} {list(shapes[k])} (served: {list(own[k].shape)})" for k in shapes
             if k in own and tuple(own[k].shape) != shapes[k]]
    provided = {own[k].data_ptr() for k in shapes if k in own}
    missing = [k for k in own if k not in shapes and own[k].data_ptr() not in provided]
    if wrong or unexpected or missing:
        parts = [f"{len(wrong)} tensors of other shapes, e.g. {', '.join(wrong[:2])}" if wrong else "",
                 f"{len(unexpected)} tensors the served model lacks, e.g. {unexpected[0]}" if unexpected else "",
                 f"{len(missing)} of its tensors missing, e.g. {missing[0]}" if missing else ""]
        raise APIError(f"the weights at {directory} do not fit the served model (another architecture): "
                       + "; ".join(p for p in parts if p), "model_path")


def _read_files(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except Exception as err:  # noqa: BLE001
            raise APIError(f"weights file {f} is damaged ({_one_line(err)})", "model_path") from None
    return state


def _one_line(err: Any) -> str:
    return " ".join(str(err).split())[:200] or type(err).__name__


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
