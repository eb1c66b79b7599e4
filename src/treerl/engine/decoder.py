"""The decoder stack of one engine call, run block by block.

For the supported families (:data:`treerl.models.FAMILIES`: Qwen2, Qwen3, Llama,
Qwen3-MoE; embed -> rotary -> blocks -> norm) treerl runs the stack itself, which lets it

- **compile each decoder block** on its own (regional ``torch.compile``, dynamic shapes):
  RMSNorm, RoPE, SwiGLU and the residual adds become a few fused kernels instead of ~40
  eager ones per block; the tree attention call stays outside the graph (it runs its own
  compiled flex kernel). All blocks share one compiled graph (parameters are graph inputs).
- **recompute blocks in the backward** (activation checkpointing): only each block's
  input survives the forward, so a call's activation memory is ~``2 x hidden`` bytes per
  token and layer instead of tens of times that (plus, in layers that keep their
  attention, its output: :mod:`treerl.engine.kept_attention`).

The modules and weights are the model's own (nothing is copied or renamed), so Hugging
Face checkpoints load and save unchanged and the model stays usable elsewhere (the rollout
engine shares it). A PEFT (LoRA) model's blocks hold its LoRA layers in place of the
projections, so the same loop runs them (base weight + adapter, each call). Qwen3-MoE
blocks run their sparse MLP through :mod:`treerl.moe` (installed here: routing in the
input precision, grouped expert GEMMs), inside the compiled block. Any other causal LM
runs through its own base model's forward, without either option.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from ..compiled import ENGINE_OFF, LazyCompiled
from .attention import TreeAttention, active_tree_attention, tree_attention_enabled
from ..models import FAMILIES, is_own_loop_decoder
from ..moe import install as install_moe

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover - torch without distributed
    FSDPModule = None


def _run_block(layer: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               position_ids: torch.Tensor) -> torch.Tensor:
    out = layer(hidden, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin),
                use_cache=False)
    return out[0] if isinstance(out, tuple) else out


# The tree attention inside a block is a graph break (torch.compiler.disable). By default dynamo
# bubbles a break inside inlined calls up to the compiled frame, then traces each frame below it
# on its own (the layer's checkpointing __call__, transformers' deprecate_kwarg wrapper of the
# layer's and of the attention's forward, both forwards, their resume functions): 4 graphs over
# 9 frames per variant (grad mode, shapes), the wrapper's shared code object recompiling between
# the layer and the attention. ``nested_graph_breaks`` resumes inside the nested frame instead:
# one graph before the attention, one after it, over 2 frames (the same operations).
_BLOCK = LazyCompiled(_run_block, "training engine's decoder blocks", ENGINE_OFF,
                      dynamo=dict(nested_graph_breaks=True))


def _run_block_in(base: torch.nn.Module, ctx: TreeAttention, run, *args) -> torch.Tensor:
    """``run(*args)`` with ``ctx`` as the tree attention: a recomputed block runs again in
    the backward, after the engine's call has left its ``tree_attention_enabled``."""
    with tree_attention_enabled(base, ctx):
        return run(*args)


def _is_sharded(layer: torch.nn.Module) -> bool:
    return FSDPModule is not None and isinstance(layer, FSDPModule)


class DecoderStack:
    """``base(input_ids, position_ids) -> last hidden states`` with per-block options.

    Args:
        base: the causal LM's decoder stack (:func:`treerl.models.decoder_of`).
        compile: compile each decoder block (CUDA; ignored for FSDP-sharded blocks, whose
            all-gather hooks run eagerly, and for families treerl does not run itself).
    """

    def __init__(self, base: torch.nn.Module, compile: bool):
        self.base = install_moe(base)
        self.own_loop = is_own_loop_decoder(base)
        self.compile = compile and self.own_loop

    @property
    def sharded(self) -> bool:
        """Blocks wrapped by FSDP2 (applied after the engine is built)."""
        return any(_is_sharded(layer) for layer in self.base.layers) if self.own_loop else False

    @property
    def can_checkpoint(self) -> bool:
        """Block recompute: treerl's own loop, and no FSDP2 blocks (their all-gather hooks
        would run again inside the recompute)."""
        return self.own_loop and not self.sharded

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, *, checkpoint_blocks: bool = False
                 ) -> torch.Tensor:
        """input_ids/position_ids [1, n] -> hidden states [1, n, hidden]."""
        base = self.base
        if not self.own_loop:
            if checkpoint_blocks:
                raise ValueError(f"activation checkpointing needs a model of a family treerl runs itself "
                                 f"({', '.join(FAMILIES)}), got {type(base).__name__}")
            return base(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        hidden = base.embed_tokens(input_ids)
        cos, sin = base.rotary_emb(hidden, position_ids)
        recompute = checkpoint_blocks and torch.is_grad_enabled()
        ctx = active_tree_attention()
        if self.compile and position_ids._base is not None:
            # A view's base is a graph input too: a slice of the batch's positions (a call after a
            # prefix) and the memory probe's own positions would guard on the base's length and
            # compile the blocks twice. A copy of its own (n integers) is one variant.
            position_ids = position_ids.clone()
        for layer in base.layers:
            run = _BLOCK if self.compile and not _is_sharded(layer) else _run_block
            if recompute:
                if ctx is None:
                    raise RuntimeError("recomputed blocks need the tree attention of the call (tree_attention_enabled)")
                hidden = checkpoint(functools.partial(_run_block_in, base, ctx, run), layer, hidden, cos, sin,
                                    position_ids, use_reentrant=False)
            else:
                hidden = run(layer, hidden, cos, sin, position_ids)
        return base.norm(hidden)
