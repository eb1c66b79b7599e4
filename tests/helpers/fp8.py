"""The float8 K/V reference of the rollout tests (``kv_cache_dtype="fp8"``): a per-sequence
float64 forward whose queries attend to keys and values rounded to float8 e4m3 where the
engine's reads are rounded."""

from __future__ import annotations

import torch

from treerl.hf_attention import attention_routed, register
from treerl.rollout.types import stored

FP8 = torch.float8_e4m3fn
_ROUNDED_BELOW: list[torch.Tensor] = []  # [T]: query t of the reference forward sees keys j < this rounded


def _fp8_reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention of one sequence ``query [1, Hq, T, D]``, ``key/value [1, Hkv, T, D]``:
    query ``t`` sees keys and values ``j < _ROUNDED_BELOW[0][t]`` rounded to float8."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    T = query.shape[2]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    rounded = torch.arange(T)[None, :] < _ROUNDED_BELOW[0][:, None]  # [T, T]: (query, key) pairs read in float8
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    k8, v8 = stored(key, FP8).to(key.dtype), stored(value, FP8).to(value.dtype)
    s = torch.where(rounded, query @ k8.transpose(-1, -2), query @ key.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
    out = torch.where(rounded, p, 0) @ v8 + torch.where(rounded, 0, p) @ value
    return out.transpose(1, 2).contiguous(), None


register("treerl_test_fp8_reference", _fp8_reference_attention)


def fp8_completion_logprobs(model, prompt, completion, rounded_below: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`completion_logprobs` with query ``t`` attending to float8 K/V below
    ``rounded_below[t]`` (default: the decode positions, ``t >= len(prompt)``, to all of it)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    T = ids.shape[1]
    if rounded_below is None:
        rounded_below = torch.where(torch.arange(T) >= len(prompt), T, 0)
    _ROUNDED_BELOW[:] = [rounded_below]
    with torch.no_grad(), attention_routed(model, "treerl_test_fp8_reference"):
        logits = model(input_ids=ids).logits[0].to(torch.float64)
    logp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    return logp[len(prompt) - 1:]
