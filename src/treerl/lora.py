"""LoRA adapters through PEFT: the ``model.lora`` settings, wrapping a model, the
merged weights the rollout's decode blocks use, and exporting a merged model.

``model.lora`` (a mapping; empty = full fine-tuning): ``rank`` (>= 1, default 16), ``alpha``
(> 0, default ``2 x rank``: the update is scaled by ``alpha / rank``), ``target_modules``
(projection names, default every attention and MLP projection, or ``"all-linear"``) and
``dropout`` (must be 0: the tree engine recomputes forwards, in its two-phase path and
under block recompute, and a random dropout mask would differ between them).

The base weights are frozen; only the adapters train (and only they are in the
optimizer). The adapters are kept in the model's dtype, like every other trainable weight
of a full fine-tuning run (a bf16 model trains bf16 weights, with no float32 master copy;
for float32 adapters use a float32 model with ``train.autocast_bf16``): PEFT's default
would upcast them to float32 under a bf16 base, and then every adapter product runs in
float32 on an input cast to float32 (measured on an H100, 1.7B shape, r=64: training 1.5x
slower than full fine-tuning). A checkpoint's ``model/`` directory holds the adapter (PEFT's
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
        return get_peft_model(model, config, autocast_adapter_dtype=False)  # adapters in the model's dtype
    except ValueError as err:  # e.g. target modules not in the model
        raise ConfigError(f"model.lora.target_modules: {str(err).splitlines()[0]}") from None


def load_adapter(model: torch.nn.Module, adapter_dir: str | Path, trainable: bool = False) -> torch.nn.Module:
    """``model`` with the PEFT adapter saved in ``adapter_dir`` (a checkpoint's ``model/``)."""
    from peft import PeftModel

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / ADAPTER_CONFIG).is_file():
        raise ConfigError(f"{adapter_dir} is not a LoRA adapter directory (no {ADAPTER_CONFIG}; a checkpoint of a run "
                          f"with model.lora has one under model/)")
    return PeftModel.from_pretrained(model, adapter_dir, is_trainable=trainable,
                                     autocast_adapter_dtype=False)  # adapters in the model's dtype


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


@torch.no_grad()
def effective_weight(linear: torch.nn.Module, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``[out_features, in_features]`` a linear layer applies: a plain
    ``nn.Linear``'s, or a PEFT LoRA layer's base weight plus ``scaling x B @ A`` of each
    active adapter not merged into it (one ``addmm`` per adapter, in the base weight's
    dtype). ``out``: a tensor of that shape and dtype (e.g. rows of a fused copy) the
    weight is written into, in place; returned. No autograd (the decode blocks' copies)."""
    base = getattr(linear, "base_layer", None)
    w = linear.weight if base is None else base.weight
    deltas = [] if base is None else _unmerged_adapters(linear)
    if not deltas:
        return w if out is None else out.copy_(w)
    for i, (m1, m2, scaling) in enumerate(deltas):
        m1, m2 = m1.to(w.dtype), m2.to(w.dtype)
        if i == 0:
            out = torch.addmm(w, m1, m2, alpha=scaling, out=out)
        else:
            out.addmm_(m1, m2, alpha=scaling)
    return out


def _unmerged_adapters(linear: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """``(m1, m2, scaling)`` per active adapter of a PEFT LoRA layer not merged into its base
    weight, with ``m1 @ m2`` that adapter's ``B @ A`` in the base weight's layout."""
    if getattr(linear, "disable_adapters", False):
        return []
    if (getattr(linear, "use_dora", {}) and any(linear.use_dora.values())) or getattr(linear, "lora_variant", {}):
        raise NotImplementedError("DoRA and other LoRA variants are not supported by treerl's decode blocks")
    merged = set(getattr(linear, "merged_adapters", []))
    deltas = []
    for name in linear.active_adapters:
        if name in linear.lora_A and name not in merged:
            a, b = linear.lora_A[name], linear.lora_B[name]
            if b.bias is not None:
                raise NotImplementedError("LoRA adapters with a bias (lora_bias) are not supported by treerl's decode blocks")
            pair = (a.weight.T, b.weight.T) if getattr(linear, "fan_in_fan_out", False) else (b.weight, a.weight)
            deltas.append((*pair, float(linear.scaling[name])))
    return deltas


def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A plain Hugging Face causal LM equal to the PEFT ``model`` (a merged copy; ``model``
    itself is left as it is)."""
    if not is_peft(model):
        raise ValueError("merged_model needs a PEFT model")
    return copy.deepcopy(model).merge_and_unload()
