"""Checks of a local Hugging Face model directory before anything loads it, so that a
wrong ``model.path`` is one clear line (what is wrong, what to do) and never a hub
traceback: treerl loads local directories only."""

from __future__ import annotations

import json
from pathlib import Path

from .config import FAMILIES, ConfigError

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelDirError(ConfigError):
    """A model directory that cannot be loaded, explained in one line."""


def check_model_dir(path: str | Path, *, what: str = "model directory", tokenizer: bool = False) -> dict:
    """Raise :class:`ModelDirError` unless ``path`` is a local directory with a readable
    ``config.json`` of a supported architecture and weights (and, with ``tokenizer``,
    tokenizer files). Returns the parsed config.json."""
    p = Path(path).expanduser()
    local_only = "treerl loads local Hugging Face model directories only (download the model first)"
    if not p.exists():
        raise ModelDirError(f"{what}: directory {str(path)!r} does not exist; {local_only}")
    if not p.is_dir():
        raise ModelDirError(f"{what}: {str(path)!r} is a file, not a directory; {local_only}")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise ModelDirError(f"{what}: {p} has no config.json, so it is not a Hugging Face model directory "
                            f"(one written by save_pretrained)")
    try:
        config = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise ModelDirError(f"{what}: {cfg_file} cannot be read ({err})") from None
    except json.JSONDecodeError as err:
        raise ModelDirError(f"{what}: {cfg_file} is not valid JSON (line {err.lineno}, column {err.colno}: "
                            f"{err.msg}); restore it from the model's source") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{what}: {cfg_file} must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    supported = ", ".join(FAMILIES)  # model_type in config.json: the families of treerl.models.FAMILIES
    if model_type is None:
        raise ModelDirError(f"{what}: {cfg_file} has no model_type; treerl supports {supported}")
    if model_type not in FAMILIES:
        arch = ", ".join(config.get("architectures") or []) or model_type
        raise ModelDirError(f"{what}: {p} holds a {arch} model (model_type {model_type!r}), which treerl does "
                            f"not support; supported model types: {supported}")
    if not any(next(p.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        raise ModelDirError(f"{what}: {p} has no weights (*.safetensors or pytorch_model*.bin)")
    if tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(f"{what}: {p} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                            f"save the tokenizer there with tokenizer.save_pretrained")
    return config
