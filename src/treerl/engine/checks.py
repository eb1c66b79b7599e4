"""What the training engine refuses, each in one line naming what is wrong: a model it
cannot run, token ids outside the vocabulary, sequences longer than the context, and a
loss function that does not return a scalar depending on its logprobs."""

from __future__ import annotations

import torch

from .tree import PrefixTree


def check_supported(model: torch.nn.Module, head: torch.nn.Module | None) -> None:
    """``model`` (a causal LM, ``head`` its output embedding) is one the engine computes exactly."""
    config = model.config
    if head is None or not hasattr(head, "weight"):
        raise TypeError(f"{type(model).__name__} has no output embedding (LM head): pass a causal LM")
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("LM heads with a bias are not supported")
    for name in ("final_logit_softcapping", "logit_scale", "attn_logit_softcapping"):
        if getattr(config, name, None) not in (None, 0, 1, 1.0):
            raise NotImplementedError(f"models with {name}={getattr(config, name)} are not supported yet")
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        raise NotImplementedError("models with sliding-window attention layers are not supported yet")


def check_inputs(tree: PrefixTree, vocab_size: int, max_positions: int | None) -> None:
    """Every token of ``tree`` in the vocabulary, every sequence within the context."""
    bad = tree.token_ids[tree.seq_index] >= vocab_size
    if bad.any():
        pos = int(bad.nonzero()[0, 0])
        seq = int(torch.searchsorted(tree.seq_offsets, pos, right=True)) - 1
        token = int(tree.token_ids[tree.seq_index[pos]])
        raise ValueError(
            f"sequence {seq}: token id {token} at position {pos - int(tree.seq_offsets[seq])} is "
            f"outside the model's vocabulary (size {vocab_size})"
        )
    if max_positions is not None:
        too_long = (tree.seq_lengths > max_positions).nonzero()
        if len(too_long):
            seq = int(too_long[0, 0])
            raise ValueError(
                f"sequence {seq} has {int(tree.seq_lengths[seq])} tokens, more than the model's "
                f"context of {max_positions} positions (max_position_embeddings): shorten it"
            )


def check_loss(loss: torch.Tensor) -> None:
    """``loss_fn``'s result: a scalar tensor that depends on the logprobs it was given."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise ValueError("loss_fn returned a tensor that does not depend on the logprobs it was given")
