"""Checkpoints: the model in Hugging Face format (safetensors) plus the tokenizer and the
trainer state (optimizer, scheduler, RNG, data cursor, policy version), written atomically
(a temporary directory renamed into place) and pruned to the last N.

Layout: ``OUT/checkpoints/step-000123/{model/, tokenizer/, trainer_state.pt, meta.json}``.
``meta.json`` is written last and records every file's size and SHA-256: a checkpoint
without it is incomplete, one whose files differ from it is damaged (``verify``).
Resuming from a run directory skips damaged checkpoints for the newest intact one.

``trainer_state.pt`` holds only tensors and plain data (dicts, lists, tuples, numbers,
strings, bytes: the NumPy RNG state is stored as a list), and is read with
``torch.load(weights_only=True)``: reading a checkpoint never runs code from it. A file that
needs anything else (a checkpoint of an older treerl, whose NumPy RNG state is an array, or
a crafted one) is refused with one line, unless the caller passes ``trust=True``
(``treerl train --resume ... --trust-checkpoint``, ``train.trust_checkpoint=true``), which
unpickles it in full: only for files one trusts.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

META = "meta.json"
STATE = "trainer_state.pt"
FORMAT = "treerl-checkpoint-1"


class CheckpointError(ValueError):
    pass


def rng_state() -> dict:
    """The RNG states of Python, NumPy, torch (and CUDA) as tensors and plain data."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (str(kind), key.tolist(), int(pos), int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def _no_progress_bars():
    """Transformers' progress bars off while a checkpoint is written (its per-shard "Writing model shards" bar on
    every save of a run is noise in the run's output, and a bar cut by an interrupt leaves a line without its end,
    which the interrupt's message would then follow on the same line); restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def save_checkpoint(
    root: str | Path, step: int, model: torch.nn.Module, tokenizer: Any, state: dict, keep_last: int = 2
) -> Path:
    """Write ``root/step-{step}`` atomically; keep the newest ``keep_last`` checkpoints.

    Refused (:class:`CheckpointError`, nothing written) if a weight is not finite. A
    failed write (a full disk, a read-only mount) removes its temporary and raises one
    line; the previous checkpoints are untouched. Pruning removes only checkpoints older
    than this one (never a later step left by a run resumed from an earlier checkpoint)."""
    root = Path(root)
    bad = _non_finite_weight(model)
    if bad is not None:
        raise CheckpointError(f"refusing to save step {step}: the weight {bad} holds NaN or inf; the previous "
                              f"checkpoint under {root} is kept")
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        with _no_progress_bars():
            model.save_pretrained(tmp / "model", safe_serialization=True)
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(tmp / "tokenizer")
        torch.save(state, tmp / STATE)
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(tmp / STATE)
        if unsafe:  # would be refused on resume: a value that is not a tensor or plain data
            raise CheckpointError(f"the trainer state holds objects other than tensors and plain data "
                                  f"({', '.join(unsafe)}); convert them before saving (treerl.checkpoint) so that "
                                  f"the checkpoint loads without code")
        files = {str(f.relative_to(tmp)): _file_record(f) for f in sorted(tmp.rglob("*")) if f.is_file()}
        _write_synced(tmp / META, json.dumps({"step": step, "format": FORMAT, "files": files}, indent=1))
        _fsync_dir(tmp)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as err:  # noqa: BLE001 - any failed write: one line, the previous checkpoint kept
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {final}: {_write_failure(err, root)}; the previous "
                              f"checkpoints under {root} are kept") from err
    if final.exists():  # the same step saved again: retire the old copy first (unlisted, then gone)
        _remove_checkpoint(final)
    os.replace(tmp, final)  # atomic on one filesystem: readers see the old or the new
    _fsync_dir(root)
    for stale in root.glob(".tmp-step-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last > 0:
        older = [p for p in list_checkpoints(root) if p.name < final.name]
        for old in older[: max(0, len(older) - (keep_last - 1))]:
            _remove_checkpoint(old)
    return final


def _non_finite_weight(model: Any) -> str | None:
    """The name of the first weight of ``model`` holding NaN or inf, else None."""
    weights = model.state_dict() if hasattr(model, "state_dict") else {}
    return next((name for name, t in weights.items()
                 if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())), None)


def _write_failure(err: BaseException, root: Path) -> str:
    """Why a checkpoint write failed, in words with the fix (a full disk is named as such,
    whatever the writer's own message)."""
    import errno

    try:
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    except OSError:
        free = None
    if getattr(err, "errno", None) == errno.ENOSPC or (free is not None and free < (16 << 20)):
        return "the disk is full (no space left on device): free space or set train.out_dir on another disk"
    if getattr(err, "errno", None) in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"{err.strerror} ({getattr(err, 'filename', '') or root}): choose a writable train.out_dir"
    return f"{type(err).__name__}: {err}"


def verify(path: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the file and the problem unless every file
    recorded in ``meta.json`` is present with its size and SHA-256 (older checkpoints
    without records pass if their meta.json reads)."""
    path = Path(path)
    try:
        meta = json.loads((path / META).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path} is damaged: {path / META} is unreadable ({err})") from None
    files = meta.get("files") if isinstance(meta, dict) else None
    if files is None:
        if not isinstance(meta, dict) or "step" not in meta:
            raise CheckpointError(f"checkpoint {path} is damaged: {path / META} has no step")
        return
    for name, rec in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: {f} is missing")
        size = f.stat().st_size
        if size != rec["size"]:
            raise CheckpointError(f"checkpoint {path} is damaged: {f} has {size} bytes, "
                                  f"{rec['size']} were written (truncated or overwritten)")
        if _sha256(f) != rec["sha256"]:
            raise CheckpointError(f"checkpoint {path} is damaged: {f} does not match its checksum")


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporaries are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / META).is_file())


def resolve_checkpoint(path: str | Path, *, skip_damaged: bool = False) -> Path:
    """A checkpoint directory, or a run / checkpoints directory (its newest checkpoint),
    verified (:func:`verify`). With ``skip_damaged`` a run directory's damaged newest
    checkpoints are passed over, with a note on stderr, for the newest intact one."""
    path = Path(path)
    if (path / META).is_file():
        _verify_once(path)
        return path
    for root in (path / "checkpoints", path):
        found = list_checkpoints(root)
        if not found:
            continue
        errors = []
        for candidate in reversed(found):
            try:
                _verify_once(candidate)
            except CheckpointError as err:
                if not skip_damaged:
                    raise CheckpointError(f"{err}{_intact_hint(found[:-1])}") from None
                errors.append(err)
                continue
            for err in errors:
                print(f"treerl: skipping a damaged checkpoint: {err}; using {candidate}", file=sys.stderr)
            return candidate
        raise CheckpointError(f"every checkpoint under {root} is damaged: " + "; ".join(map(str, errors)))
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    raise CheckpointError(f"{path} is not a treerl checkpoint (no {META}) and holds none")


def load_state(checkpoint: str | Path, *, trust: bool = False) -> dict:
    """The trainer state of a checkpoint (verified), read without running code from it
    (``torch.load(weights_only=True)``). A file that holds other objects raises
    :class:`CheckpointError` (one line) unless ``trust``: then it is unpickled in full,
    which runs whatever code the file names (module docstring)."""
    path = resolve_checkpoint(checkpoint)
    f = path / STATE
    try:
        with warnings.catch_warnings():  # torch warns about pickle protocols it may not read: the error says it
            warnings.simplefilter("ignore")
            return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if not trust:
            raise CheckpointError(
                f"{f} holds objects other than tensors and plain data ({_unpickling_reason(f, err)}), and loading it "
                f"could run code from the file, so it is refused. A checkpoint of an older treerl looks like this: if "
                f"you trust the file, pass --trust-checkpoint (train.trust_checkpoint=true)") from None
    print(f"treerl: loading {f} with full unpickling (--trust-checkpoint): this runs any code the file names",
          file=sys.stderr)
    return torch.load(f, map_location="cpu", weights_only=False)


def _unpickling_reason(f: Path, err: Exception) -> str:
    """What a weights-only load refused in ``f``: the globals it names (found without
    running them), else the refusal's own words."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(f)
    except Exception:  # noqa: BLE001 - not a zip checkpoint: fall back to the message
        names = []
    if names:
        return "it names " + ", ".join(names[:4])
    text = " ".join(str(err).split())
    found = re.search(r"GLOBAL ([\w.]+)|(Unsupported operand \d+)|WeightsUnpickler error: ([^.]+)", text)
    return next(g for g in found.groups() if g) if found else type(err).__name__


def _intact_hint(older: list[Path]) -> str:
    for candidate in reversed(older):
        try:
            _verify_once(candidate)
        except CheckpointError:
            continue
        return f"; the newest intact checkpoint is {candidate} (pass it instead)"
    return "; no older intact checkpoint is left"


def _verify_once(path: Path) -> None:
    """:func:`verify`, remembered per (path, meta.json mtime) so a resume hashes once."""
    try:
        key = (str(path.resolve()), (path / META).stat().st_mtime_ns)
    except OSError:
        key = None
    if key is not None and key in _VERIFIED:
        return
    verify(path)
    if key is not None:
        _VERIFIED.add(key)


_VERIFIED: set[tuple[str, int]] = set()


def _remove_checkpoint(path: Path) -> None:
    """Unlist first (meta.json), then delete: a kill midway leaves no half checkpoint listed."""
    (path / META).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def _file_record(f: Path) -> dict:
    return {"size": f.stat().st_size, "sha256": _sha256(f)}


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with f.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with path.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


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
