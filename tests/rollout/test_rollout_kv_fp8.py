"""The running batch's K/V in float8 (``RolloutEngine(kv_cache_dtype="fp8")``): not exact, but
exactly what it says it is. Every completion's logprobs equal a per-sequence float64 forward
in which the decode positions (the completion's tokens, fed one per step) attend to keys and
values rounded to float8 e4m3 and the prompt's positions (prefilled) to the exact ones."""

import pytest
import torch

from treerl.hf_attention import attention_routed, register
from treerl.rollout import RolloutEngine, SamplingParams

from helpers.models import tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import random_prompts

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
    k8, v8 = key.to(FP8).to(key.dtype), value.to(FP8).to(value.dtype)
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


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("hf_path", [False, True], ids=["treerl-blocks", "hf-forward"])
@pytest.mark.parametrize("n", [1, 3], ids=["served-rows", "groups"])
def test_fp8_kv_logprobs_equal_a_forward_over_rounded_kv(model, n, hf_path):
    """Groups of one row (prompts in the rows' own blocks) and of 3 (a prompt store): every
    logprob as the rounded-K/V reference gives it (float64, 1e-9), and visibly not the exact one."""
    engine = RolloutEngine(model, kv_cache_dtype="fp8", sync_every=3, kv_block_size=16)
    if hf_path:
        engine.decode_blocks = None  # the model's own forward through the two-level cache
    prompts = random_prompts([5, 11, 23], seed=3)
    groups = engine.generate(prompts, SamplingParams(n=n, max_new_tokens=20, seed=1))
    assert engine.kv_dtype == FP8
    far = 0.0
    for prompt, group in zip(prompts, groups):
        for c in group:
            ids = c.completion_ids.tolist()
            want = fp8_completion_logprobs(model, prompt, ids)
            assert torch.allclose(c.logprobs, want, rtol=1e-9, atol=1e-10), (c.logprobs - want).abs().max()
            far = max(far, float((c.logprobs - completion_logprobs(model, prompt, ids)).abs().max()))
    assert far > 1e-4, "float8 K/V changed nothing: the stores are not float8"


def test_fp8_tree_rollouts_and_auto(model):
    """Tree rollouts (fork segments in float8 too) follow the same rule; ``auto`` keeps the
    model's dtype and stays exact."""
    prompts = random_prompts([7, 13], seed=5)
    params = SamplingParams(n=4, max_new_tokens=12, seed=2, branch_every=4, branch_factor=2)
    for c in RolloutEngine(model, kv_cache_dtype="fp8", sync_every=3).generate(prompts, params)[1]:
        want = fp8_completion_logprobs(model, prompts[1], c.completion_ids.tolist())
        assert torch.allclose(c.logprobs, want, rtol=1e-9, atol=1e-10)
    exact = RolloutEngine(model)
    assert exact.kv_dtype == torch.float64
    c = exact.generate(prompts[:1], SamplingParams(max_new_tokens=6, seed=0))[0][0]
    assert torch.allclose(c.logprobs, completion_logprobs(model, prompts[0], c.completion_ids.tolist()), rtol=1e-9)


def test_fp8_kept_contexts_feed_later_prefills(model):
    """A finished row's float8 K/V kept in the prefix cache comes back widened to the model's
    dtype: the next turn (prompt + completion + new tokens) prefills only its new tokens,
    attending to the kept float8 K/V, then decodes over float8 K/V; every logprob as the
    reference with those reads gives it."""
    engine = RolloutEngine(model, kv_cache_dtype="fp8", prefix_cache_tokens=4096, kv_block_size=16)
    prompt = random_prompts([9], seed=7)[0]
    first = engine.generate([prompt], SamplingParams(max_new_tokens=8, temperature=0))[0][0].completion_ids.tolist()
    assert engine.stats.contexts_kept == 1
    turn = prompt + first + random_prompts([4], seed=8)[0]
    kept = len(prompt) + len(first) - 1  # (the last completion token was sampled, never fed)
    entry = engine.prefix_cache.lookup(turn, engine.version)
    assert len(entry) == kept and entry.keys.dtype == entry.values.dtype == torch.float64
    hits = engine.stats.prefix_cache_hit_tokens
    out = engine.generate([turn], SamplingParams(max_new_tokens=6, temperature=0))[0][0]
    assert engine.stats.prefix_cache_hit_tokens - hits == kept
    T = len(turn) + 6
    t = torch.arange(T)
    bound = torch.where(t < len(prompt), 0, torch.where(t < kept, T, torch.where(t < len(turn), kept, T)))
    want = fp8_completion_logprobs(model, turn, out.completion_ids.tolist(), bound)
    assert torch.allclose(out.logprobs, want, rtol=1e-9, atol=1e-10), (out.logprobs - want).abs().max()


def test_bad_kv_cache_dtype_is_refused(model):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'fp8'\], got 'int8'"):
        RolloutEngine(model, kv_cache_dtype="int8")
