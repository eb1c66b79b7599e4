"""Checks of a run's config that need more than its declared types and ranges (run before
the Trainer builds anything): the device, the model directory, family, shape and
overrides; and, once both exist, that the tokenizer fits the model's vocabulary. Each
problem is one :class:`~treerl.config.ConfigError` line naming the key and what to do."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from .config import Config, ConfigError
from .model_dir import check_model_dir


# model.overrides that must be whole numbers >= 1 (zero layers, heads, ... fail deep inside)
POSITIVE_MODEL_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                         "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings")


def check_device(device: str, what: str = "train.device") -> None:
    """Raise :class:`ConfigError` unless ``device`` names a device this machine has."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{what}: {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ConfigError(f"{what}={device} but CUDA is not available ({why}): use {what}=cpu, or run on a "
                              f"machine with a GPU and a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"{what}={device} but this machine has {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ConfigError(f"{what}: {device!r} is not supported; use cpu, cuda or cuda:N")


def check_tokenizer_fits(tokenizer, model, where: str = "model") -> None:
    """Raise :class:`ConfigError` if the tokenizer produces ids the model's embedding has no
    row for (a tokenizer and a model that do not belong together)."""
    size = max(int(getattr(tokenizer, "vocab_size", 0) or 0), len(tokenizer) if hasattr(tokenizer, "__len__") else 0)
    rows = model.get_input_embeddings().num_embeddings
    if size > rows:
        raise ConfigError(f"{where}: the tokenizer has {size} token ids but the model's vocabulary has {rows} "
                          f"(embedding rows): they do not belong together; use the model's own tokenizer, or a "
                          f"model with vocab_size >= {size} (model.overrides.vocab_size)")


def check_run_config(cfg: Config) -> None:
    """Raise :class:`ConfigError` for a setting that would fail later, deep inside."""
    check_device(cfg.train.device)
    m = cfg.model
    if m.path:
        check_model_dir(m.path, what="model.path", tokenizer=True)
        return
    from .models import FAMILIES, SHAPES

    if m.family not in FAMILIES:
        raise ConfigError(f"model.family: unknown {m.family!r}; choose one of {', '.join(FAMILIES)} "
                          f"(or set model.path to a local model directory)")
    if m.shape is not None and m.shape not in SHAPES:
        raise ConfigError(f"model.shape: unknown {m.shape!r}; choose one of {', '.join(SHAPES)} (or null)")
    unknown = _unknown_config_keys(FAMILIES[m.family].config, m.overrides)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(FAMILIES[m.family].config().to_dict()), n=1, cutoff=0.6)
        hint = f": did you mean 'model.overrides.{close[0]}'?" if close else ""
        raise ConfigError(f"model.overrides: {key!r} is not a {m.family} config field{hint}")
    for name in POSITIVE_MODEL_FIELDS:
        value = m.overrides.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"model.overrides.{name}: {value!r} is not allowed; allowed: a whole number >= 1")


def _unknown_config_keys(config_class: type, overrides: dict) -> list[str]:
    """Keys a Hugging Face config would keep as stray attributes (it accepts any name)."""
    if not overrides:
        return []
    base = set(config_class().to_dict())
    try:
        built = set(config_class(**overrides).to_dict())
    except Exception as err:  # noqa: BLE001 - HF's validation errors are not TypeError/ValueError
        detail = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConfigError(f"model.overrides: {detail}") from None
    return sorted(k for k in built - base if k in overrides)


# HF config fields that fix the weights' shapes (a checkpoint of another shape cannot load)
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "model_type")


def check_resume_shape(checkpoint: Path, saved_config: dict | None, cfg: Config, model) -> None:
    """Raise :class:`ConfigError` if ``checkpoint``'s model has another shape than ``model``
    (built from ``cfg``), naming the shape fields and the config keys that differ."""
    try:
        theirs = json.loads((Path(checkpoint) / "model" / "config.json").read_text())
    except (OSError, ValueError):
        return  # verify() has checked the files; an old layout loads or fails on its own
    ours = model.config.to_dict()
    diffs = [f"{k} {theirs[k]} vs {ours.get(k)}" for k in SHAPE_FIELDS if k in theirs and theirs[k] != ours.get(k)]
    if not diffs:
        return
    keys = []
    if isinstance(saved_config, dict) and isinstance(saved_config.get("model"), dict):
        saved, now = _flat(saved_config["model"], "model."), _flat(cfg.to_dict()["model"], "model.")
        keys = [f"{k}={saved.get(k)!r} vs {now.get(k)!r}" for k in sorted(set(saved) | set(now))
                if k != "model.dtype" and saved.get(k) != now.get(k)]
    differing = f"; the config keys that differ (checkpoint vs now): {', '.join(keys)}" if keys else ""
    raise ConfigError(f"--resume: checkpoint {checkpoint} holds a model of another shape ({'; '.join(diffs)}: "
                      f"checkpoint vs this config){differing}: resume with the run's own config "
                      f"({Path(checkpoint).parent.parent / 'config.yaml'})")


def _flat(mapping: dict, prefix: str) -> dict:
    out = {}
    for k, v in mapping.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))  # an empty mapping adds no key
        else:
            out[f"{prefix}{k}"] = v
    return out
