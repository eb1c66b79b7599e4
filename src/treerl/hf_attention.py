"""The Hugging Face attention hook: a model's attention routed through a function of
treerl's for the duration of a block. The one home of the hook for the training engine's
tree attention (:mod:`treerl.engine.attention`) and the rollout's attention
(:mod:`treerl.rollout.kv`).

A function is registered once with ``transformers.AttentionInterface`` under a name
(:func:`register`); :func:`attention_routed` sets ``_attn_implementation`` to that name on
every config of the model (the model's and any other its modules hold) and restores what
was there on leaving, so the model is unchanged outside the block.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch
from transformers import AttentionInterface

# model -> the distinct configs of it and its modules (read by their attention modules)
_CONFIGS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple]" = weakref.WeakKeyDictionary()


def register(name: str, fn: Callable) -> str:
    """Register ``fn`` as the attention implementation ``name``; returns ``name``."""
    AttentionInterface.register(name, fn)
    return name


def _configs(model: torch.nn.Module) -> tuple:
    configs = _CONFIGS.get(model)
    if configs is None:
        found = [model.config] + [getattr(m, "config", None) for m in model.modules()]
        configs = _CONFIGS[model] = tuple({id(c): c for c in found if c is not None}.values())
    return configs


@contextlib.contextmanager
def attention_routed(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Route every attention module of ``model`` through the function registered as
    ``name`` (:func:`register`) inside the block."""
    configs = _configs(model)
    previous = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = name
    try:
        yield
    finally:
        for c, impl in zip(configs, previous):
            c._attn_implementation = impl
