"""Building and loading Hugging Face causal LMs for treerl (no downloads: configs or
local directories only), named model shapes, the families treerl supports and runs itself
(the one table, :data:`FAMILIES`), the unwrapping of PEFT (LoRA) models, and the float64 RMSNorm fix."""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2Model,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3MoeModel,
)

from .config import FAMILIES as FAMILY_NAMES
from .moe import install as install_moe


@dataclass(frozen=True)
class Family:
    """A model family treerl supports: its HF config and causal LM classes, and the class of
    its decoder stack (``model.base_model``), whose blocks treerl runs itself (the training
    engine's own, compiled block loop, :mod:`treerl.engine.decoder`; the rollout's own
    decode blocks, :mod:`treerl.rollout.blocks`). Any other HF causal LM handed to an
    engine goes through its own forward."""

    config: type
    causal_lm: type
    decoder: type


# The one table of families: config.json model_type -> Family. (treerl.config.FAMILIES, the
# config's choices, and treerl.model_dir's check read the names; checked equal below.)
FAMILIES: dict[str, Family] = {
    "qwen3": Family(Qwen3Config, Qwen3ForCausalLM, Qwen3Model),
    "qwen2": Family(Qwen2Config, Qwen2ForCausalLM, Qwen2Model),
    "llama": Family(LlamaConfig, LlamaForCausalLM, LlamaModel),
    "qwen3_moe": Family(Qwen3MoeConfig, Qwen3MoeForCausalLM, Qwen3MoeModel),  # mixture of experts (treerl.moe)
}
assert tuple(FAMILIES) == FAMILY_NAMES, "treerl.config.FAMILIES names the families of treerl.models.FAMILIES"
_DECODERS = tuple(f.decoder for f in FAMILIES.values())

# Named shapes (random weights): what the benchmarks use.
SHAPES: dict[str, dict] = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=4096,
    ),
    "small": dict(
        hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, vocab_size=4096, max_position_embeddings=16384,
    ),
    "qwen3-0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=True, rope_theta=1_000_000.0,
    ),
    "qwen3-1.7b": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        tie_word_embeddings=True, rope_theta=1_000_000.0,
    ),
    # mixture of experts (family qwen3_moe): every layer sparse
    "tiny-moe": dict(
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=512, max_position_embeddings=4096,
    ),
    # Qwen3-30B-A3B (48 layers: benchmarks override num_hidden_layers to fit one GPU)
    "qwen3-30b-a3b": dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1_000_000.0,
    ),
}

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_config(family: str = "qwen3", shape: str | None = "tiny", **overrides):
    """A config of ``family`` with a named ``shape`` and any overrides."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: choose one of {', '.join(FAMILIES)}")
    if shape is not None and shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}: choose one of {', '.join(SHAPES)}")
    kwargs = dict(SHAPES[shape]) if shape else {}
    kwargs.update(overrides)
    return FAMILIES[family].config(**kwargs)


def build_model(
    family: str = "qwen3",
    shape: str | None = "tiny",
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **overrides,
) -> torch.nn.Module:
    """A randomly initialised causal LM (deterministic for a seed)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = make_config(family, shape, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = FAMILIES[family].causal_lm(config)
    return install_moe(model.to(dtype=dtype))


def load_model(path: str | Path, *, dtype: torch.dtype | str = "bfloat16", device: str = "cpu") -> torch.nn.Module:
    """Load a causal LM saved with ``save_pretrained`` from a local directory; a missing,
    broken or unsupported directory is a :class:`treerl.model_dir.ModelDirError`."""
    from .model_dir import ModelDirError, check_model_dir

    path = Path(path)
    check_model_dir(path)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as err:  # noqa: BLE001 - damaged weights etc.: one line naming the directory
        detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelDirError(f"model directory {path} could not be loaded: {type(err).__name__}: {detail}") from err
    return install_moe(model.to(device))


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face causal LM of ``model``: itself, or the one a PEFT model wraps (its
    LoRA layers in place). The one place that unwraps PEFT models."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack (``embed_tokens``, ``layers``, ``norm``) of a causal LM or a PEFT
    model wrapping one: ``causal_lm(model).base_model`` (a PEFT model's own ``base_model``
    is its LoRA wrapper)."""
    return causal_lm(model).base_model


def runs_own_loop(model: torch.nn.Module) -> bool:
    """Whether treerl runs the decoder blocks of ``model`` (a causal LM or a PEFT model
    wrapping one) itself: its decoder stack is one of :data:`FAMILIES`'."""
    return is_own_loop_decoder(decoder_of(model))


def is_own_loop_decoder(decoder: torch.nn.Module) -> bool:
    """Whether ``decoder`` (a decoder stack, :func:`decoder_of`) is one of :data:`FAMILIES`'."""
    return isinstance(decoder, _DECODERS)


def rmsnorm_in_input_precision(model: torch.nn.Module) -> torch.nn.Module:
    """Make HF's RMSNorm compute in the input's precision when that is above float32.

    HF's RMSNorm always normalises in float32, even in a float64 model, which rounds
    every hidden state to float32 and hides float64 exactness. For float32/bf16 inputs
    the result is unchanged. Returns ``model`` (patched in place).
    """
    for module in model.modules():
        if is_rmsnorm(module):
            module.forward = types.MethodType(_rmsnorm_forward, module)
    return model


def is_rmsnorm(module: torch.nn.Module, *, own_forward: bool = False) -> bool:
    """Whether ``module`` is one of :data:`FAMILIES`' RMSNorms (``weight * round(h / rms(h))``, statistics in
    float32; ``variance_epsilon``); ``own_forward``: and it runs its class's forward or
    :func:`rmsnorm_in_input_precision`'s (the same math below float64), not another one set on it."""
    forward = getattr(vars(module).get("forward"), "__func__", _rmsnorm_forward)
    return (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
            and (not own_forward or forward is _rmsnorm_forward))


def _rmsnorm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    input_dtype = hidden_states.dtype
    x = hidden_states.to(torch.promote_types(input_dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x.to(input_dtype)
