"""Building what a trainer trains: the tokenizer, the policy model, and the tree engines
over it (policy; a frozen reference for the KL term; a critic with a value head for GAE).

Reads config sections ``model`` (path / family / shape / dtype / overrides / lora), ``engine``
(the tree engines' settings), ``algorithm`` (which extra engines exist) and
``rollout.temperature`` (the engines' logprobs use the sampling temperature).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from .config import Config
from .engine.tree_engine import TreeEngine
from .models import build_model, load_model
from .tasks.base import Task


def default_tokenizer(cfg: Config, task: Task) -> Any:
    """The model directory's tokenizer, else the task's character tokenizer, else a
    character tokenizer over printable ASCII (tasks of free text, e.g. JSONL math)."""
    if cfg.model.path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(cfg.model.path, local_files_only=True)
    if task.alphabet:
        return task.tokenizer()
    from .tasks.tokenizer import CharTokenizer

    return CharTokenizer()


def build_policy(cfg: Config, tokenizer: Any) -> torch.nn.Module:
    """The policy: :func:`build_base`, wrapped with fresh LoRA adapters when ``model.lora``
    is set (a PEFT model: only the adapters train, :mod:`treerl.lora`)."""
    model = build_base(cfg, tokenizer)
    if cfg.model.lora:
        from .lora import apply_lora

        model = apply_lora(model, cfg.model.lora)
    return model


def build_base(cfg: Config, tokenizer: Any) -> torch.nn.Module:
    """The model before any adapter: loaded from ``model.path``, else a fresh
    ``model.family``/``model.shape`` with the tokenizer's vocabulary (and special-token ids)
    and ``model.overrides`` (seeded by ``train.seed``: rebuilt identically)."""
    m = cfg.model
    if m.path:
        return load_model(m.path, dtype=m.dtype)
    extra = dict(tokenizer.hf_config_kwargs()) if hasattr(tokenizer, "hf_config_kwargs") else {}
    extra.update(vocab_size=tokenizer.vocab_size)
    extra.update(m.overrides)
    return build_model(m.family, m.shape, dtype=m.dtype, seed=cfg.train.seed, **extra)


@dataclass
class Engines:
    """The tree engines of one trainer (each wraps its own model)."""

    policy: TreeEngine  # trained
    reference: TreeEngine | None  # frozen copy of the initial policy (algorithm.kl_coef > 0)
    critic: TreeEngine | None  # copy of the policy with a zero-initialised value head (advantage=gae)


def build_engines(cfg: Config, model: torch.nn.Module, device: torch.device) -> Engines:
    """Tree engines over ``model`` (already on ``device``) and over copies of it."""
    e = cfg.engine
    kw = dict(mode=e.mode, memory_budget=e.memory_budget, max_tokens=e.max_tokens, chunk_tokens=e.chunk_tokens,
              compile=e.compile, attention=e.attention, temperature=max(cfg.rollout.temperature, 1e-6),
              compile_cache_dir=e.compile_cache_dir)
    policy = TreeEngine(model, **kw)
    reference = critic = None
    if cfg.algorithm.kl_coef > 0:
        reference = TreeEngine(copy.deepcopy(model).eval().requires_grad_(False), **kw)
    if cfg.algorithm.advantage == "gae":
        critic_model = copy.deepcopy(model)
        head = torch.nn.Linear(model.config.hidden_size, 1, device=device, dtype=next(model.parameters()).dtype)
        torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
        critic_model.value_head = head  # registered, so it moves and saves with the critic
        critic = TreeEngine(critic_model, value_head=head, **kw)
    return Engines(policy, reference, critic)
