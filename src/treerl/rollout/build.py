"""The one place a rollout engine is built from the run's ``rollout`` config section:
:func:`build_rollout_engine`, used by training (:class:`treerl.sampler.Sampler`), the
asynchronous workers (through their sampler) and ``treerl serve``."""

from __future__ import annotations

import torch

from ..config import RolloutConfig
from .engine import RolloutEngine


def build_rollout_engine(cfg: RolloutConfig, model: torch.nn.Module, *, version: int = 0,
                         prefix_cache_tokens: int | None = None) -> RolloutEngine:
    """A :class:`RolloutEngine` over ``model`` (weights ``version``) with the section's engine
    settings (``max_batch_tokens``, ``kv_block_size``, ``kv_cache_dtype``, ``prefill_chunk_tokens``,
    ``prefill_graph_tokens``, ``cuda_graphs``, ``keep_stream_buffers``) and a prefix cache of ``prefix_cache_tokens``
    tokens (None: ``cfg.prefix_cache_tokens``, else 0: off)."""
    if prefix_cache_tokens is None:
        prefix_cache_tokens = cfg.prefix_cache_tokens or 0
    return RolloutEngine(model, version=version, prefix_cache_tokens=int(prefix_cache_tokens),
                         max_batch_tokens=cfg.max_batch_tokens, kv_block_size=cfg.kv_block_size,
                         kv_cache_dtype=cfg.kv_cache_dtype,
                         prefill_chunk_tokens=cfg.prefill_chunk_tokens,
                         prefill_graph_tokens=cfg.prefill_graph_tokens, cuda_graphs=cfg.cuda_graphs,
                         keep_stream_buffers=cfg.keep_stream_buffers)
