"""Shared pieces of the rollout tests (their model: :func:`helpers.models.tiny_model`): prompts,
greedy references by full forwards, and completion-length rules that end every greedy
completion with a stop string at a length set by its first token (so the stops are exercised
without a trained model)."""

from __future__ import annotations

import torch

from treerl.rollout import SamplingParams

VOCAB = 512  # the `tiny` shape's vocabulary
STOP = "#" * 10  # long enough that the stop-string search always decodes the whole completion


def target_length(ids):
    """Completion length set by its first token: 2..18 (a stop string appears there)."""
    return 2 + (int(ids[0]) * 7) % 17


def long_target_length(ids):
    """Completion length set by its first token: 4..40 (long rows need several K/V blocks)."""
    return 4 + (int(ids[0]) * 7) % 37


def decoder(length=target_length):
    """A ``decode`` that writes the stop string once a completion reaches ``length(ids)``."""

    def decode(ids):
        ids = list(ids)
        return "x" * len(ids) + (STOP if ids and len(ids) >= length(ids) else "")

    return decode


decode = decoder()


def sampling(max_new: int, length=target_length, **kw) -> SamplingParams:
    """Greedy, ``n=2``, the stop string of the length rule ``length``; ``kw`` overrides."""
    base = dict(n=2, temperature=0, max_new_tokens=max_new, stop_strings=[STOP], decode=decoder(length))
    base.update(kw)
    return SamplingParams(**base)


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def greedy_reference(model, prompt, max_new, length=target_length):
    """Greedy continuation by full forwards (no cache, no padding) until the length rule.

    A pure function of the model's weights and forward, the prompt, ``max_new`` and the rule:
    remembered for the session (the parametrizations of a rollout test ask for the same
    continuations of the same prompts again: ~60% of this function's time) under a key that
    holds all of them (:func:`_forward_key`); never for a model whose forward could do
    something the key does not hold (forward hooks, which may count or act on the reference's
    forwards; a patched ``forward``; PEFT adapters)."""
    key = _forward_key(model)
    if key is not None:
        key = (key, tuple(int(t) for t in prompt), max_new, length)
        if key in _GREEDY:
            return list(_GREEDY[key])
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if len(ids) - len(prompt) >= length(ids[len(prompt):]):
                break
    if key is not None:
        _GREEDY[key] = tuple(ids[len(prompt):])
    return ids[len(prompt):]


_GREEDY: dict = {}  # greedy_reference's continuations, by (_forward_key, prompt, max_new, length rule)


def _forward_key(model: torch.nn.Module):
    """What a plain forward of ``model`` computes from: its class, config (with the attention
    implementation), every module's class and train/eval mode, and every parameter's and
    buffer's name, dtype, shape and bytes (a digest), and any instance-level ``forward`` (a
    module-level function bound to its module, as :func:`treerl.models.rmsnorm_in_input_precision`
    sets). None when a forward hook (global or on any module), another instance-level
    ``forward`` or a PEFT adapter (enabled and disabled by flags) could make a forward do
    something else."""
    import hashlib

    from torch.nn.modules import module as nn_module

    if any(getattr(nn_module, name, None) for name in ("_global_forward_hooks", "_global_forward_pre_hooks",
                                                         "_global_forward_hooks_always_called")):
        return None
    config = getattr(model, "config", None)
    if config is None:
        return None
    digest = hashlib.sha1()
    for name, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks:
            return None
        if type(m).__module__.startswith("peft"):  # adapters switched on and off by flags, not weights
            return None
        forward = m.__dict__.get("forward")  # an instance-level forward: a module function bound to m only
        if forward is not None:
            func = getattr(forward, "__func__", None)
            if getattr(forward, "__self__", None) is not m or func is None or "<" in func.__qualname__:
                return None
            forward = f"{func.__module__}.{func.__qualname__}"  # (rmsnorm_in_input_precision's)
        digest.update(f"{name}:{type(m).__module__}.{type(m).__qualname__}:{m.training}:{forward};".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # (buffers: non-persistent ones too)
        t = t.detach().cpu().contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    digest.update((config.to_json_string(use_diff=False) + str(config._attn_implementation)).encode())
    return digest.hexdigest()
