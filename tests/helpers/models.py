"""Tiny models: :func:`tiny_model`, the one builder (every family and shape, the family's
initialisation or O(1) random weights, float64 norms); :func:`get_model`, the cached model
variants of the exactness tests (random weights large enough that attention is sharp and
logits are far from uniform, so a wrong mask or position shows up clearly); and
:func:`after_each_forward`, a hook on every forward whichever path runs it."""

from __future__ import annotations

import functools

import torch

from helpers.seed import SESSION_SEED
from treerl.models import build_model, rmsnorm_in_input_precision

VOCAB = 64  # vocabulary of the exactness tests' models (get_model) and forests

# name -> (family, config overrides). The `tiny` shape: hidden 64, 2 layers, 4 query heads,
# 2 KV heads (grouped-query attention), head_dim 16.
VARIANTS: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3", dict(tie_word_embeddings=False)),
    "qwen3-tied": ("qwen3", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(tie_word_embeddings=False)),  # q/k/v biases
    "qwen2-tied-mqa": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    "llama": ("llama", dict(tie_word_embeddings=False)),
    "llama-tied-mha": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=4)),
}


def tiny_model(family: str = "qwen3", dtype: torch.dtype = torch.float64, *, seed: int = 0,
               randomise: int | None = None, precise_norm: bool | None = None, shape: str = "tiny",
               **overrides) -> torch.nn.Module:
    """A small model of ``family`` (``shape``, config fields ``overrides``) in ``dtype``, on the CPU.

    ``randomise=None``: the family's initialisation from ``seed`` (:func:`build_model`); an int:
    built in float64, its weights replaced by O(1) random ones from that seed (sharp in float64,
    soft otherwise: see :func:`_randomise`), then cast to ``dtype`` and set to eval mode.
    ``precise_norm`` (default: ``dtype`` is float64) makes RMSNorm compute in the input's
    precision (:func:`rmsnorm_in_input_precision`), as float64 exactness needs."""
    if randomise is None:
        model = build_model(family, shape, dtype=dtype, seed=seed, **overrides)
    else:
        model = build_model(family, shape, dtype=torch.float64, seed=seed, **overrides)
        _randomise(model, randomise, soft=dtype != torch.float64)
        model = model.to(dtype).train(False)  # no dropout anywhere
    if precise_norm if precise_norm is not None else dtype == torch.float64:
        model = rmsnorm_in_input_precision(model)
    return model


@functools.lru_cache(maxsize=None)
def get_model(variant: str = "qwen3", dtype: torch.dtype = torch.float64, vocab_size: int = VOCAB, **extra):
    """A cached tiny model of a :data:`VARIANTS` entry with random weights from the session
    seed (float64: sharp; other dtypes: soft, see _randomise) and precise norms. Tests only
    touch .grad."""
    family, overrides = VARIANTS[variant]
    model = tiny_model(family, dtype, randomise=SESSION_SEED + sum(map(ord, variant)), precise_norm=True,
                       vocab_size=vocab_size, **{**overrides, **extra})
    assert model.config._attn_implementation == "sdpa"
    return model


@torch.no_grad()
def _randomise(model: torch.nn.Module, seed: int, soft: bool = False) -> None:
    """Weights of O(1) effect: sharp attention, logits spread over several nats.

    float64 models are sharp: tied variants predict some tokens with p > 0.999 and some
    attention rows are nearly one-hot. In float32 such spots carry relative rounding errors
    ~1e-5..1e-3 in *any* float32 pipeline (1 - p of a near-certain token; the softmax
    backward of a sharp row), and the reference reduces its logits in float64, so float32
    models are ``soft``: smaller projections and norm weights (max p ~0.1 untied, ~0.8 tied)."""
    g = torch.Generator().manual_seed(seed)
    gain, norm_lo, norm_span = (1.0, 0.5, 0.5) if soft else (1.5, 0.5, 1.0)
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            new = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5
        elif name.endswith("bias"):
            new = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2
        elif p.dim() == 1:  # norm weights
            new = norm_lo + norm_span * torch.rand(p.shape, generator=g, dtype=torch.float64)
        else:
            new = torch.randn(p.shape, generator=g, dtype=torch.float64) * (gain / p.shape[1] ** 0.5)
        p.copy_(new.to(p.dtype))
    if soft and model.config.tie_word_embeddings:
        # the residual stream carries the input embedding, so a tied head predicts the
        # input token again with p ~ 0.99: soften the logits
        model.model.norm.weight.mul_(0.25)


class _Handles:
    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def after_each_forward(model: torch.nn.Module, fn) -> _Handles:
    """Call ``fn(query_length)`` at the end of every forward of ``model`` (after its LM head),
    whichever path ran it: the HF forward (prefill, decode of other families) or treerl's own
    decode blocks, which call the modules but not ``model.forward``. ``query_length`` is the
    length of the forward's input ids (1: a decode step). Returns a handle with ``remove()``."""
    seen = []
    pre = model.get_input_embeddings().register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[1]))
    post = model.get_output_embeddings().register_forward_hook(lambda module, args, output: fn(seen.pop()))
    return _Handles(pre, post)

