"""Building what a trainer trains: the task, the tokenizer, the policy model, and the tree
engines over it (policy; a frozen reference for the KL term; a critic with a value head
for GAE); and loading a saved model with its tokenizer (:func:`load_saved`: a checkpoint's
or a Hugging Face directory's), the one way ``train``, ``serve``, ``eval`` and ``export`` load.

Each function takes the config section it reads: ``model`` (:class:`ModelConfig`: path /
family / shape / dtype / overrides / lora), ``task`` (:class:`TaskConfig`: which task),
``engine`` (:class:`EngineConfig`: the tree engines' settings); the cross-cutting values
(the seed, the sampling temperature, which extra engines exist) are passed explicitly.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import Config, EngineConfig, ModelConfig, TaskConfig
from .engine.tree_engine import TreeEngine
from .lora import is_adapter_dir, load_adapter
from .models import build_model, load_model
from .preflight import check_tokenizer_fits
from .tasks import get_task
from .tasks.base import Task
from .tasks.tokenizer import CharTokenizer


def seed_all(seed: int) -> None:
    """Seed torch, ``random`` and numpy: a trainer and its rollout workers start alike."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def build_task_policy(model_cfg: ModelConfig, task_cfg: TaskConfig, seed: int, device: torch.device, *,
                      task: Task | None = None, tokenizer: Any = None, model: torch.nn.Module | None = None
                      ) -> tuple[Task, Any, torch.nn.Module]:
    """The task (``task.name`` / ``task.kwargs``), its tokenizer (:func:`default_tokenizer`)
    and the policy on ``device`` (:func:`build_policy`), each unless given; the tokenizer is
    checked to fit the model's vocabulary. A trainer's and an asynchronous worker's."""
    task = task if task is not None else get_task(task_cfg.name, **task_cfg.kwargs)
    tokenizer = tokenizer if tokenizer is not None else default_tokenizer(model_cfg, task)
    model = (model if model is not None else build_policy(model_cfg, tokenizer, seed)).to(device)
    check_tokenizer_fits(tokenizer, model, "model.path" if model_cfg.path else "model")
    return task, tokenizer, model


def default_tokenizer(model_cfg: ModelConfig, task: Task) -> Any:
    """The model directory's tokenizer, else the task's character tokenizer, else a
    character tokenizer over printable ASCII (tasks of free text, e.g. JSONL math)."""
    if model_cfg.path:
        return load_tokenizer(model_cfg.path)
    return task.tokenizer() if task.alphabet else CharTokenizer()


def config_tokenizer(cfg: Config) -> Any:
    """A run's tokenizer from its config: ``model.path``'s, else its task's
    (:func:`default_tokenizer`); the task (which may read a dataset) is built only then."""
    if cfg.model.path:
        return load_tokenizer(cfg.model.path)
    return default_tokenizer(cfg.model, get_task(cfg.task.name, **cfg.task.kwargs))


def load_tokenizer(directory: str | Path) -> Any:
    """The tokenizer saved in ``directory``: treerl's character tokenizer, else a Hugging
    Face tokenizer (local files only)."""
    if CharTokenizer.is_saved_in(directory):
        return CharTokenizer.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def load_saved(model_dir: str | Path, cfg: Config, *, checkpoint: Path | None = None,
               device: str | torch.device = "cpu") -> tuple[torch.nn.Module, Any]:
    """A saved model and its tokenizer, in ``cfg.model.dtype``.

    ``model_dir``: a Hugging Face model directory (its tokenizer beside it), or with
    ``checkpoint`` that treerl checkpoint's ``model/`` (``cfg``: the checkpoint's run
    config): full weights, or the adapter of a run with ``model.lora``, which is applied
    to the base rebuilt from ``cfg`` and merged into it. A checkpoint's tokenizer is its
    ``tokenizer/``, else the run's own (:func:`default_tokenizer`)."""
    model_dir = Path(model_dir)
    if checkpoint is None:
        tokenizer = load_tokenizer(model_dir)
    else:
        saved = Path(checkpoint) / "tokenizer"
        if saved.is_dir():
            tokenizer = load_tokenizer(saved)
        else:
            tokenizer = config_tokenizer(cfg)
        if is_adapter_dir(model_dir):
            base = build_base(cfg.model, tokenizer, cfg.train.seed, device)
            # merged into a plain model, trainable as a loaded full model is (PEFT froze the base)
            return load_adapter(base, model_dir).merge_and_unload().requires_grad_(True), tokenizer
    return load_model(model_dir, dtype=cfg.model.dtype, device=device), tokenizer


def build_policy(model_cfg: ModelConfig, tokenizer: Any, seed: int) -> torch.nn.Module:
    """The policy: :func:`build_base`, wrapped with fresh LoRA adapters when ``model.lora``
    is set (a PEFT model: only the adapters train, :mod:`treerl.lora`)."""
    model = build_base(model_cfg, tokenizer, seed)
    if model_cfg.lora:
        from .lora import apply_lora

        model = apply_lora(model, model_cfg.lora)
    return model


def build_base(model_cfg: ModelConfig, tokenizer: Any, seed: int, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The model before any adapter, on ``device``: loaded from ``model.path``, else a fresh
    ``model.family``/``model.shape`` with the tokenizer's vocabulary (and special-token ids)
    and ``model.overrides`` (its weights seeded by ``seed``, the run's ``train.seed``:
    rebuilt identically)."""
    m = model_cfg
    if m.path:
        return load_model(m.path, dtype=m.dtype, device=device)
    extra = dict(tokenizer.hf_config_kwargs()) if hasattr(tokenizer, "hf_config_kwargs") else {}
    extra.update(vocab_size=tokenizer.vocab_size)
    extra.update(m.overrides)
    return build_model(m.family, m.shape, dtype=m.dtype, seed=seed, device=device, **extra)


@dataclass
class Engines:
    """The tree engines of one trainer (each wraps its own model)."""

    policy: TreeEngine  # trained
    reference: TreeEngine | None  # frozen copy of the initial policy (algorithm.kl_coef > 0)
    critic: TreeEngine | None  # copy of the policy with a zero-initialised value head (advantage=gae)


def build_engines(engine_cfg: EngineConfig, model: torch.nn.Module, device: torch.device, *, temperature: float,
                  reference: bool = False, critic: bool = False) -> Engines:
    """Tree engines over ``model`` (already on ``device``) and over copies of it: a frozen
    ``reference`` (a run with ``algorithm.kl_coef > 0``) and a ``critic`` (``algorithm.advantage
    = gae``). ``temperature``: ``rollout.temperature``, which the engines' logprobs use."""
    e = engine_cfg
    kw = dict(mode=e.mode, memory_budget=e.memory_budget, max_tokens=e.max_tokens, chunk_tokens=e.chunk_tokens,
              compile=e.compile, attention=e.attention, temperature=max(temperature, 1e-6),
              compile_cache_dir=e.compile_cache_dir)
    policy = TreeEngine(model, **kw)
    reference_engine = critic_engine = None
    if reference:
        reference_engine = TreeEngine(copy.deepcopy(model).eval().requires_grad_(False), **kw)
    if critic:
        critic_model = copy.deepcopy(model)
        head = torch.nn.Linear(model.config.hidden_size, 1, device=device, dtype=next(model.parameters()).dtype)
        torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)
        critic_model.value_head = head  # registered, so it moves and saves with the critic
        critic_engine = TreeEngine(critic_model, value_head=head, **kw)
    return Engines(policy, reference_engine, critic_engine)
