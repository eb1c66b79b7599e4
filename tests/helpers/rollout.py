"""Shared pieces of the rollout tests (their model: :func:`helpers.models.tiny_model`): prompts,
greedy references by full forwards, and completion-length rules that end every greedy
completion with a stop string at a length set by its first token (so the stops are exercised
without a trained model)."""

from __future__ import annotations

import torch

from helpers.reference import forward_key
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
    holds all of them (:func:`helpers.reference.forward_key`); never for a model whose forward could do
    something the key does not hold (forward hooks, which may count or act on the reference's
    forwards; a patched ``forward``; PEFT adapters)."""
    key = forward_key(model)
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


_GREEDY: dict = {}  # greedy_reference's continuations, by (forward_key, prompt, max_new, length rule)
