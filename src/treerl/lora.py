"""LoRA adapters through PEFT: the ``model.lora`` settings, wrapping a model, the
merged weights the rollout's decode blocks use, and exporting a merged model.

``model.lora`` (a mapping; empty = full fine-tuning): ``rank`` (>= 1, default 16), ``alpha``
(> 0, default ``2 x rank``: the update is scaled by ``alpha / rank``), ``target_modules``
(projection names, default every attention and MLP projection, or ``"all-linear"``) and
``dropout`` (must be 0: the tree engine recomputes forwards, in its two-phase path and
under block recompute, and a random dropout mask would differ between them).

The base weights are frozen; only the adapters train (and only they are in the
optimizer); a checkpoint's ``model/`` directory holds the adapter (PEFT's
``save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors``) and
:func:`treerl.export.export_merged` (``treerl export --merge-lora RUN OUT``) writes the merged full model.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEYS = ("rank", "alpha", "target_modules", "dropout")
ADAPTER_CONFIG = "adapter_config.json"


def is_peft(model: torch.nn.Module) -> bool:
    """A PEFT model (its adapters train, its base is frozen)."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def peft_config(settings: dict) -> Any:
    """A ``peft.LoraConfig`` from ``model.lora`` (validated: a :class:`ConfigError` naming the key)."""
    from peft import LoraConfig

    unknown = [k for k in settings if k not in KEYS]
    if unknown:
        raise ConfigError(f"model.lora.{unknown[0]}: unknown key; the keys are {', '.join(KEYS)}")
    rank = settings.get("rank", 16)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"model.lora.rank must be a whole number >= 1, got {rank!r}")
    alpha = settings.get("alpha", 2 * rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ConfigError(f"model.lora.alpha must be a positive number (the update is scaled by alpha / rank), "
                          f"got {alpha!r}")
    targets = settings.get("target_modules", list(DEFAULT_TARGETS))
    if targets != "all-linear" and (not isinstance(targets, (list, tuple)) or not targets
                                    or not all(isinstance(t, str) and t for t in targets)):
        raise ConfigError(f"model.lora.target_modules must be a non-empty list of module names "
                          f"(e.g. [q_proj, v_proj]) or 'all-linear', got {targets!r}")
    dropout = settings.get("dropout", 0.0)
    if dropout != 0:
        raise ConfigError(f"model.lora.dropout must be 0, got {dropout!r}: the tree engine recomputes forwards "
                          f"(two-phase path, block recompute) and a random dropout mask would break exact gradients")
    return LoraConfig(r=rank, lora_alpha=float(alpha), target_modules=targets if targets == "all-linear" else list(targets),
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, settings: dict) -> torch.nn.Module:
    """``model`` wrapped by PEFT with fresh LoRA adapters of ``settings`` (``model.lora``);
    the base weights frozen. The adapters start at zero (B = 0): the policy is the base."""
    from peft import get_peft_model

    config = peft_config(settings)
    try:
        return get_peft_model(model, config)
    except ValueError as err:  # e.g. target modules not in the model
        raise ConfigError(f"model.lora.target_modules: {str(err).splitlines()[0]}") from None


def load_adapter(model: torch.nn.Module, adapter_dir: str | Path, trainable: bool = False) -> torch.nn.Module:
    """``model`` with the PEFT adapter saved in ``adapter_dir`` (a checkpoint's ``model/``)."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        raise ConfigError(f"{adapter_dir} is not a LoRA adapter directory (no {ADAPTER_CONFIG}; a checkpoint of a run "
                          f"with model.lora has one under model/)")
    return PeftModel.from_pretrained(model, adapter_dir, is_trainable=trainable)


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def effective_weight(linear: torch.nn.Module) -> torch.Tensor:
    """The weight a linear layer applies: a plain ``nn.Linear``'s, or a PEFT LoRA layer's
    base weight plus ``scaling x B @ A`` of each active adapter not merged into it."""
    base = getattr(linear, "base_layer", None)
    if base is None:
        return linear.weight
    if getattr(linear, "use_dora", {}) and any(linear.use_dora.values()):
        raise NotImplementedError("DoRA adapters are not supported by treerl's decode blocks")
    w = base.weight
    if getattr(linear, "disable_adapters", False):
        return w
    merged = set(getattr(linear, "merged_adapters", []))
    for name in linear.active_adapters:
        if name in linear.lora_A and name not in merged:
            w = w + linear.get_delta_weight(name).to(w.dtype)
    return w


def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A plain Hugging Face causal LM equal to the PEFT ``model`` (a merged copy; ``model``
    itself is left as it is)."""
    if not is_peft(model):
        raise ValueError("merged_model needs a PEFT model")
    return copy.deepcopy(model).merge_and_unload()
