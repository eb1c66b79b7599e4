"""Checks of a run's config that need more than its types (run before the Trainer builds
anything): the model directory, family, shape and overrides. Each problem is one
:class:`~treerl.config.ConfigError` line naming the key and the valid choices."""

from __future__ import annotations

import difflib

from .config import Config, ConfigError
from .model_dir import check_model_dir


def check_run_config(cfg: Config) -> None:
    """Raise :class:`ConfigError` for a model setting that would fail later, deep inside."""
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
    unknown = _unknown_config_keys(FAMILIES[m.family][0], m.overrides)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, list(FAMILIES[m.family][0]().to_dict()), n=1, cutoff=0.6)
        hint = f": did you mean 'model.overrides.{close[0]}'?" if close else ""
        raise ConfigError(f"model.overrides: {key!r} is not a {m.family} config field{hint}")


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
