"""The running batch's K/V in float8 (``RolloutEngine(kv_cache_dtype="fp8")``): not exact, but
exactly what it says it is. Every completion's logprobs equal a per-sequence float64 forward
in which the decode positions (the completion's tokens, fed one per step) attend to keys and
values rounded to float8 e4m3 and the prompt's positions (prefilled) to the exact ones."""

import pytest
import torch

from treerl.rollout import RolloutEngine, SamplingParams

from helpers.fp8 import FP8, fp8_completion_logprobs
from helpers.models import tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import random_prompts


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
