"""The serve tests' model settings: :func:`served_config` gives :func:`helpers.models.tiny_model` a
float32 model over a tokenizer's vocabulary and special ids (the character tokenizer by
default) with :data:`CONTEXT` positions: ``tiny_model(seed=1, **served_config(tok))``."""

from __future__ import annotations

import torch

from treerl.tasks.tokenizer import CharTokenizer

CONTEXT = 64


def served_config(tok=None, context: int = CONTEXT) -> dict:
    """Config of a served tiny model: float32, ``context`` positions, ``tok``'s vocabulary and
    special token ids (``tok.hf_config_kwargs()``; default :class:`CharTokenizer`)."""
    return dict(dtype=torch.float32, max_position_embeddings=context, **(tok or CharTokenizer()).hf_config_kwargs())
