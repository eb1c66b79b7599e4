"""RolloutEngine on tiny random Qwen3 models (CPU): padding/batching equivalence, behaviour
logprobs against a separate full forward, shared prefill, stops, tree rollouts, weight
updates (also in the middle of a generation), input errors."""

import copy

import pytest
import torch

from helpers.models import after_each_forward, tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import VOCAB, random_prompts
from treerl import PrefixTree
from treerl.models import build_model
from treerl.rollout import RolloutEngine, SamplingParams

@pytest.fixture(scope="module")
def model():
    return tiny_model()


def greedy_reference(model, prompt, max_new):
    """Greedy continuation by full forwards, no cache, no padding."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_batched_greedy_equals_alone_and_reference(model):
    prompts = random_prompts([7, 1, 13, 4, 10])
    params = SamplingParams(n=2, temperature=0, max_new_tokens=12)
    # small prefill chunks, frequent syncs, and several admission rounds exercise every path
    engines = [
        RolloutEngine(model),
        RolloutEngine(model, prefill_chunk_tokens=8, sync_every=3),
        RolloutEngine(model, max_batch_tokens=60),
        RolloutEngine(model, static_kv=True, sync_every=3),  # fixed-shape steps (the CUDA-graph path)
    ]
    batched = [e.generate(prompts, params) for e in engines]
    assert engines[2].stats.admissions > 1 and engines[1].stats.prefill_calls > 1
    for i, p in enumerate(prompts):
        alone = RolloutEngine(model).generate([p], params)[0][0].completion_ids.tolist()
        assert alone == greedy_reference(model, p, 12)
        for groups in batched:
            assert [c.completion_ids.tolist() for c in groups[i]] == [alone, alone]
            assert groups[i].prompt_ids.tolist() == p


def test_float32_batched_greedy_matches_alone():
    model = tiny_model(dtype=torch.float32, seed=3)
    prompts = random_prompts([5, 17, 2], seed=4)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    batched = RolloutEngine(model).generate(prompts, params)
    for i, p in enumerate(prompts):
        assert batched[i][0].completion_ids.tolist() == greedy_reference(model, p, 8)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=1),
        SamplingParams(n=2, temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=9, seed=2,
                       branch_points=[3, 6], branch_factor=2, stop_token_ids=[7, 8, 9, 10, 11]),
        SamplingParams(n=1, temperature=0, max_new_tokens=6),
    ],
    ids=["plain", "truncated-tree-stops", "greedy"],
)
@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
def test_behaviour_logprobs_equal_full_forward(model, params, static_kv):
    prompts = random_prompts([9, 3, 14], seed=5)
    engine = RolloutEngine(model, sync_every=2, max_batch_tokens=200, static_kv=static_kv)
    groups = engine.generate(prompts, params)
    temperature = params.temperature or 1.0
    count = 0
    for g, p in zip(groups, prompts):
        for c in g:
            ref = completion_logprobs(model, p, c.completion_ids.tolist(), temperature)
            assert c.logprobs.dtype == torch.float64
            assert torch.allclose(c.logprobs, ref, rtol=1e-9, atol=1e-12), (c.logprobs - ref).abs().max()
            count += 1
    assert count == sum(len(g) for g in groups) >= len(prompts) * params.n


def test_prefill_runs_once_per_distinct_prompt(model):
    prompts = random_prompts([6, 11, 4])
    prompts.append(list(prompts[1]))  # a duplicate prompt is prefilled once too
    calls = []

    def hook(module, args):  # the input embedding: once per forward, decode steps too
        calls.append(tuple(args[0].shape))

    handle = model.get_input_embeddings().register_forward_pre_hook(hook)
    try:
        engine = RolloutEngine(model)
        groups = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=5, seed=0))
    finally:
        handle.remove()
    prefill = [s for s in calls if s[1] > 1]
    decode = [s for s in calls if s[1] == 1]
    assert prefill == [(3, 11)]  # one call: 3 distinct prompts, padded to the longest
    assert len(decode) == 4 and all(s == (16, 1) for s in decode)  # 4 prompts x 4 samples
    assert engine.stats.prefill_tokens == 6 + 11 + 4
    assert [len(g) for g in groups] == [4, 4, 4, 4]
    for g, p in zip(groups, prompts):
        assert all(c.prompt_ids.tolist() == p and len(c) == 5 for c in g)
        assert len({tuple(c.completion_ids.tolist()) for c in g}) > 1  # samples differ


def test_stop_tokens_trim_and_report(model):
    prompts = random_prompts([8, 5], seed=7)
    full = RolloutEngine(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=12))
    stop = full[0][0].completion_ids[4].item()
    first = full[0][0].completion_ids.tolist().index(stop)
    out = RolloutEngine(model, sync_every=5).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[stop])
    )
    c = out[0][0]
    assert c.completion_ids.tolist() == full[0][0].completion_ids.tolist()[: first + 1]
    assert c.finish_reason == "stop" and c.stop == stop and len(c.logprobs) == len(c.versions) == first + 1
    other = full[1][0].completion_ids.tolist()
    if stop in other:
        assert out[1][0].completion_ids.tolist() == other[: other.index(stop) + 1]
    else:
        assert out[1][0].completion_ids.tolist() == other and out[1][0].finish_reason == "length"


def test_stop_tokens_in_sampled_groups(model):
    stops = list(range(0, VOCAB, 23))  # ~4% of the vocabulary: most samples stop early
    groups = RolloutEngine(model, sync_every=4).generate(
        random_prompts([5, 9]), SamplingParams(n=16, max_new_tokens=30, stop_token_ids=stops, seed=3)
    )
    reasons = set()
    for g in groups:
        for c in g:
            ids = c.completion_ids.tolist()
            reasons.add(c.finish_reason)
            if c.finish_reason == "stop":
                assert ids[-1] == c.stop in stops and not set(ids[:-1]) & set(stops)
            else:
                assert len(ids) == 30 and not set(ids) & set(stops) and c.stop is None
    assert reasons == {"stop", "length"}


LETTERS = "abcdefghijklmnopqrstuvwxyz"


def decode(ids):
    return "".join(LETTERS[t % 26] for t in ids)


class Tok:
    def decode(self, ids):
        return decode(ids)


@pytest.mark.parametrize("decoder", [decode, Tok()], ids=["function", "tokenizer"])
def test_stop_strings(model, decoder):
    prompts = random_prompts([6, 10], seed=8)
    full = RolloutEngine(model).generate(prompts, SamplingParams(temperature=0, max_new_tokens=14))
    text = decode(full[0][0].completion_ids.tolist())
    target = text[5:8]
    end = text.index(target) + 3  # the token that completes the first occurrence
    out = RolloutEngine(model, sync_every=4).generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=14, stop_strings=[target], decode=decoder)
    )
    c = out[0][0]
    assert c.completion_ids.tolist() == full[0][0].completion_ids.tolist()[:end]
    assert c.finish_reason == "stop" and c.stop == target
    assert decode(c.completion_ids.tolist()).endswith(target)


def test_max_new_tokens(model):
    groups = RolloutEngine(model).generate(random_prompts([4, 7]), SamplingParams(n=3, max_new_tokens=7, seed=0))
    for g in groups:
        for c in g:
            assert len(c.completion_ids) == len(c.logprobs) == len(c.versions) == 7
            assert c.finish_reason == "length" and c.stop is None


def test_seeded_determinism(model):
    prompts = random_prompts([5, 8])
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, max_new_tokens=8, seed=11)
    ids = lambda gs: [[c.completion_ids.tolist() for c in g] for g in gs]  # noqa: E731
    a = ids(RolloutEngine(model).generate(prompts, params))
    b = ids(RolloutEngine(model).generate(prompts, params))
    params.seed = 12
    c = ids(RolloutEngine(model).generate(prompts, params))
    assert a == b and a != c


def test_tree_rollouts_share_prefixes(model):
    prompts = random_prompts([6, 9], seed=9)
    prompts[1][0] = (prompts[0][0] + 1) % VOCAB  # distinct roots
    params = SamplingParams(n=2, temperature=1.5, max_new_tokens=9, seed=4, branch_points=[3, 6], branch_factor=[2, 3])
    groups = RolloutEngine(model, sync_every=5).generate(prompts, params)
    for g, p in zip(groups, prompts):
        assert len(g) == 2 * 2 * 3
        assert sorted(c.branch for c in g) == [(i, j, k) for i in range(2) for j in range(2) for k in range(3)]
        for c in g:
            for d in g:
                shared = 0 if c.branch[0] != d.branch[0] else 3 if c.branch[1] != d.branch[1] else 6 if c.branch != d.branch else 9
                assert c.completion_ids[:shared].tolist() == d.completion_ids[:shared].tolist()
                if shared < 9:  # forks sampled differently here (seeded, high temperature)
                    assert c.completion_ids[shared] != d.completion_ids[shared]
        tree = PrefixTree.from_sequences(g.sequences())
        # prompt once, then 3 tokens per sample, 3 per first-level child, 3 per leaf
        assert tree.num_tree_tokens == len(p) + 3 * 2 + 3 * 4 + 3 * 12
        assert tree.num_leaves == 12
    forest = PrefixTree.from_sequences([s for g in groups for s in g.sequences()])
    assert forest.num_tree_tokens == sum(len(p) + 54 for p in prompts)
    flat = RolloutEngine(model).generate(prompts, SamplingParams(n=2, max_new_tokens=9, seed=4))
    assert PrefixTree.from_sequences(flat[0].sequences()).num_tree_tokens == len(prompts[0]) + 18


def test_tree_rollout_logprobs_and_early_stops(model):
    stops = list(range(0, VOCAB, 11))
    params = SamplingParams(n=4, max_new_tokens=12, seed=6, branch_every=4, branch_factor=2, stop_token_ids=stops)
    prompts = random_prompts([7], seed=10)
    groups = RolloutEngine(model, sync_every=3).generate(prompts, params)
    g = groups[0]
    assert 4 <= len(g) < 4 * 2 * 2 and any(c.finish_reason == "stop" for c in g)
    for c in g:
        # a completion that stopped before a fork was not copied at that fork
        forks_passed = sum(1 for point in (4, 8) if len(c) > point)
        assert len(c.branch) == 1 + forks_passed
        assert torch.allclose(c.logprobs, completion_logprobs(model, prompts[0], c.completion_ids.tolist()), rtol=1e-9)
    assert len({c.branch for c in g}) == len(g)


def test_update_weights_changes_outputs_and_versions():
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    prompts = random_prompts([5, 9], seed=2)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    engine = RolloutEngine(copy.deepcopy(a), version=3)
    before = engine.generate(prompts, params)
    assert all((c.versions == 3).all() for g in before for c in g)
    assert engine.update_weights(b) == 4
    after = engine.generate(prompts, params)
    for g, p in zip(after, prompts):
        assert g[0].completion_ids.tolist() == greedy_reference(b, p, 8)
        assert (g[0].versions == 4).all() and g[0].min_version == 4
    assert [g[0].completion_ids.tolist() for g in after] != [g[0].completion_ids.tolist() for g in before]
    # a state dict (other dtype) and an explicit version
    engine.update_weights({k: v.float() for k, v in a.state_dict().items()}, version=10)
    again = engine.generate(prompts, params)
    assert [g[0].completion_ids.tolist() for g in again] == [greedy_reference(a, p, 8) for p in prompts]
    assert engine.version == 10 and (again[0][0].versions == 10).all()
    with pytest.raises(KeyError, match="missing"):
        engine.update_weights({"model.norm.weight": a.model.norm.weight})
    with pytest.raises(KeyError, match="unexpected"):
        engine.update_weights({**a.state_dict(), "extra": torch.zeros(1)})


def test_weight_update_during_generation_recomputes_kv():
    a, b = tiny_model(seed=0), tiny_model(seed=1)
    prompts = random_prompts([5, 9, 3], seed=3)
    engine = RolloutEngine(copy.deepcopy(a), version=0, sync_every=100)
    decode_calls = []

    def hook(query_length):  # at the end of every forward
        if query_length == 1:
            decode_calls.append(1)
            if len(decode_calls) == 4:  # during the forward that samples token 4
                engine.update_weights(b, version=1)

    handle = after_each_forward(engine.model, hook)
    try:
        groups = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=10))
    finally:
        handle.remove()
    assert engine.stats.recomputes == 1
    for g, p in zip(groups, prompts):
        for c in g:
            ids = c.completion_ids.tolist()
            # tokens 0..4 were sampled from logits of weights version 0, the rest from version 1
            assert c.versions.tolist() == [0] * 5 + [1] * 5
            assert ids[:5] == greedy_reference(a, p, 5)
            assert ids[5:] == greedy_reference(b, p + ids[:5], 5)
            assert torch.allclose(c.logprobs[:5], completion_logprobs(a, p, ids)[:5], rtol=1e-9)
            assert torch.allclose(c.logprobs[5:], completion_logprobs(b, p, ids)[5:], rtol=1e-9)


def test_bad_inputs(model):
    engine = RolloutEngine(model)
    params = SamplingParams(max_new_tokens=96)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], [], [3]], params)
    long = [1] * (4096 - 96 + 1)
    with pytest.raises(ValueError, match=r"prompt 2 has 4001 tokens.*max_position_embeddings.*at most 4000"):
        engine.generate([[1], [2, 3], long], params)
    engine.generate([[1], long[:-1]], SamplingParams(max_new_tokens=96, temperature=0))  # exactly at the limit
    with pytest.raises(ValueError, match="prompt 0 has token ids outside"):
        engine.generate([[VOCAB]], params)
    with pytest.raises(ValueError, match="list of token-id sequences"):
        engine.generate([1, 2, 3], params)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], SamplingParams(top_p=0))
    assert model.config._attn_implementation == "sdpa"  # restored after generate


def test_refuses_sliding_window_models():
    model = build_model("qwen2", "tiny", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if all(t == "full_attention" for t in model.config.layer_types):
        pytest.skip("this transformers version builds no sliding layers here")
    with pytest.raises(NotImplementedError, match="full-attention"):
        RolloutEngine(model)


def test_weight_update_from_another_thread():
    import threading
    import time

    a, b = tiny_model(seed=0), tiny_model(seed=1)
    prompts = random_prompts([4, 8], seed=4)
    engine = RolloutEngine(copy.deepcopy(a), version=0)
    decode_calls = []

    def updater():
        engine.update_weights(b, version=7)

    thread = threading.Thread(target=updater)

    def hook(query_length):  # at the end of every forward
        if query_length == 1:
            decode_calls.append(1)
            if len(decode_calls) == 3:  # forward that samples token 3: the trainer pushes weights now
                thread.start()
                deadline = time.monotonic() + 10
                while not engine._pending_updates and time.monotonic() < deadline:
                    time.sleep(1e-4)

    handle = after_each_forward(engine.model, hook)
    try:
        groups = engine.generate(prompts, SamplingParams(temperature=0, max_new_tokens=9))
    finally:
        handle.remove()
        thread.join()
    for g, p in zip(groups, prompts):
        ids = g[0].completion_ids.tolist()
        # the update waited for the step in flight, then generation went on under the new weights
        assert g[0].versions.tolist() == [0] * 4 + [7] * 5
        assert ids[:4] == greedy_reference(a, p, 4)
        assert ids[4:] == greedy_reference(b, p + ids[:4], 5)


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, temperature=0, max_new_tokens=6),
    SamplingParams(n=3, temperature=0.9, max_new_tokens=6, seed=5),
    SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=6, seed=2, top_logprobs=3),
], ids=["greedy", "race", "truncated"])
def test_bf16_pending_logits_sample_as_a_float32_copy_would(params):
    """A bf16 model's running batch holds its pending logits in bf16 (the head writes them itself): every
    sampling path widens them first, so tokens, logprobs and top logprobs equal those of a float32 buffer
    holding the same values, bit for bit, the prompts' first samples (a prefill's logits) included."""
    model = tiny_model(seed=4, dtype=torch.bfloat16)
    prompts = random_prompts([5, 9, 3], seed=8)
    runs = []
    for pending in (None, torch.float32):
        engine = RolloutEngine(copy.deepcopy(model), version=0)
        assert engine.pending_logit_dtype == torch.bfloat16
        if pending is not None:
            engine.pending_logit_dtype = pending
        runs.append(engine.generate(prompts, params))
    for g16, g32 in zip(*runs):
        for a, b in zip(g16, g32):
            assert a.completion_ids.tolist() == b.completion_ids.tolist()
            assert torch.equal(a.logprobs, b.logprobs)
            if params.top_logprobs:
                assert all(torch.equal(x, y) for x, y in zip(a.top_logprobs, b.top_logprobs))
