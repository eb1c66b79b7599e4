"""``treerl export --merge-lora RUN OUT``: a LoRA run's checkpoint (its adapter) merged into
its base model and written as a full Hugging Face model directory, the tokenizer beside it."""

from __future__ import annotations

from pathlib import Path

from .build import load_saved
from .checkpoint import CheckpointError, load_state, resolve_checkpoint
from .config import Config
from .lora import is_adapter_dir


def export_merged(checkpoint: str | Path, out: str | Path) -> Path:
    """``treerl export --merge-lora``: a checkpoint (or run directory) of a run with
    ``model.lora`` -> a full Hugging Face model directory ``out`` (base + merged adapter,
    the tokenizer beside it). The base is rebuilt from the run's config (``model.path``, or
    family/shape/seed)."""
    path = resolve_checkpoint(checkpoint)
    cfg = Config.from_dict(load_state(path)["config"])
    if not is_adapter_dir(path / "model"):
        raise CheckpointError(f"{path} holds a full model, not a LoRA adapter (its run had no model.lora): "
                              f"{path / 'model'} is already a Hugging Face model directory")
    model, tokenizer = load_saved(path / "model", cfg, checkpoint=path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)
    return out
