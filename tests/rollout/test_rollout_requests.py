"""Per-group (per-request) sampling settings in one running batch (float64 tiny Qwen3, CPU):
mixed temperatures, max_new_tokens, stops and n decode together; greedy groups equal
per-prompt full forwards; a seeded group's samples do not depend on its batch mates; the
tree-rollout fields must match the stream's."""

import dataclasses

import pytest
import torch

from helpers.models import tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import random_prompts
from treerl.rollout import PromptQueue, RolloutEngine, SamplingParams


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def greedy(model, prompt, max_new, stop=None):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] == stop:
                break
    return ids[len(prompt):]


def test_mixed_settings_in_one_batch(model):
    """Greedy groups of different lengths and stops beside sampled ones (top-k, top-p,
    min-p, temperatures) in one stream of fixed-shape steps: greedy completions equal full
    forwards; every logprob is the temperature-scaled log-softmax of a full forward."""
    prompts = random_prompts([7, 3, 11, 5, 9, 4], seed=40)
    ref3 = greedy(model, prompts[3], 12)
    per = [SamplingParams(temperature=0, max_new_tokens=5),
           SamplingParams(temperature=0.8, top_k=5, max_new_tokens=12, n=2),
           SamplingParams(temperature=0, max_new_tokens=12),
           SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=[ref3[4]]),
           SamplingParams(temperature=1.3, top_p=0.7, min_p=0.05, max_new_tokens=9),
           SamplingParams(temperature=0.5, max_new_tokens=3, n=2)]
    engine = RolloutEngine(model, sync_every=3, static_kv=True)
    groups = engine.generate(prompts, per)
    for g, p, prompt in zip(groups, per, prompts):
        assert len(g) == p.n
        for c in g:
            ids = c.completion_ids.tolist()
            if p.greedy:
                stop = p.stop_token_ids[0] if p.stop_token_ids else None
                assert ids == greedy(model, prompt, p.max_new_tokens, stop)
            else:
                assert len(ids) == p.max_new_tokens and c.finish_reason == "length"
            lp = completion_logprobs(model, prompt, ids, temperature=p.temperature or 1.0)
            assert torch.allclose(c.logprobs, lp, rtol=1e-9, atol=1e-12)
    assert groups[3][0].finish_reason == "stop" and len(groups[3][0]) == ref3.index(ref3[4]) + 1
    assert engine.stats.admissions == 1  # no group waited for another


def test_seed_gives_the_same_sample_whatever_the_batch(model):
    prompts = random_prompts([6, 9, 4, 8], seed=41)
    seeded = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=10, n=2, seed=123)
    q = PromptQueue()
    q.put(prompts[0], params=seeded)
    q.close()
    [alone] = RolloutEngine(model, sync_every=2).generate_stream(q, SamplingParams(n=2, max_new_tokens=10))
    others = [SamplingParams(temperature=0.9, max_new_tokens=14, n=2), SamplingParams(temperature=0, n=1),
              SamplingParams(temperature=1.2, max_new_tokens=6, n=2, seed=5)]
    engine = RolloutEngine(model, sync_every=3, static_kv=True)
    mixed = engine.generate(prompts[1:3] + [prompts[0]] + prompts[3:], others[:2] + [seeded] + others[2:])[2]
    assert [c.completion_ids.tolist() for c in mixed] == [c.completion_ids.tolist() for c in alone]
    assert mixed[0].completion_ids.tolist() != mixed[1].completion_ids.tolist()  # the two samples differ
    again = RolloutEngine(model).generate([prompts[0]], [dataclasses.replace(seeded, seed=124)])[0]
    assert [c.completion_ids.tolist() for c in again] != [c.completion_ids.tolist() for c in alone]


def test_shared_seed_of_a_list_seeds_the_stream(model):
    """One seed for every group of a list: the stream's generator (the trainer's seeded
    rollouts): reproducible, as with a single SamplingParams."""
    prompts = random_prompts([6, 9], seed=42)
    p = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=9)
    a = RolloutEngine(model).generate(prompts, [p, dataclasses.replace(p, max_new_tokens=6)])
    b = RolloutEngine(model).generate(prompts, [p, dataclasses.replace(p, max_new_tokens=6)])
    assert [[c.completion_ids.tolist() for c in g] for g in a] == [[c.completion_ids.tolist() for c in g] for g in b]
    assert {len(c) for c in a[1]} == {6}


@pytest.mark.parametrize("own, match", [
    (dict(branch_points=[4]), "branch_points"),
    (dict(n=3), "n=3"),
    (dict(max_new_tokens=20), "max_new_tokens"),
    (dict(min_p=1.5), "min_p"),
])
def test_group_settings_checked_against_the_stream(model, own, match):
    engine = RolloutEngine(model)
    stream = SamplingParams(temperature=0, n=2, max_new_tokens=8)
    q = PromptQueue([[1, 2, 3]], close=False)
    assert q.put([4, 5], params=SamplingParams(**{"temperature": 0, "max_new_tokens": 8, **own}))
    q.close()
    with pytest.raises(ValueError, match=match):
        list(engine.generate_stream(q, stream))


def test_listener_deltas_concatenate_to_the_completions(model):
    """Deltas come at the host syncs; a row's deltas concatenate to its completion (tokens,
    logprobs, versions) and its last one carries the finish reason; a listener that raises
    is dropped without stopping the stream."""
    prompts = random_prompts([5, 8, 3], seed=43)
    deltas = {}

    def listen(d):
        deltas.setdefault((d.prompt_index, d.branch), []).append(d)

    def bad(d):
        raise RuntimeError("client gone")

    q = PromptQueue()
    q.put(prompts[0], params=SamplingParams(temperature=0.9, n=2, max_new_tokens=11, seed=1), listener=listen)
    q.put(prompts[1], params=SamplingParams(temperature=0, max_new_tokens=7), listener=bad)
    q.put(prompts[2], params=SamplingParams(temperature=0, max_new_tokens=9, n=2), listener=listen)
    q.close()
    groups = {g.prompt_index: g for g in RolloutEngine(model, sync_every=3).generate_stream(
        q, SamplingParams(n=2, max_new_tokens=12))}
    assert sorted(groups) == [0, 1, 2] and len(groups[1][0]) == 7
    for key in (0, 2):
        for c in groups[key]:
            ds = deltas[(key, c.branch)]
            assert len(ds) > 1 and [d.finish_reason for d in ds] == [None] * (len(ds) - 1) + [c.finish_reason]
            assert sum((d.token_ids for d in ds), []) == c.completion_ids.tolist()
            assert sum((d.logprobs for d in ds), []) == c.logprobs.tolist()
            assert sum((d.versions for d in ds), []) == c.versions.tolist()


def test_cancel_waiting_and_running_groups(model):
    """A waiting prompt is removed; a running group stops at the next sync, frees its
    blocks and is yielded with "abort" (its tokens so far); the others run to the end."""
    prompts = random_prompts([5, 8, 3, 6], seed=44)
    long = SamplingParams(temperature=0, max_new_tokens=40)
    q = PromptQueue()
    seen = []

    def listen(d):
        seen.append(d)
        if len(seen) == 2:  # the long group has run for two syncs: cancel it
            assert not q.cancel("long")

    q.put(prompts[0], "long", params=long, listener=listen)
    q.put(prompts[1], "short", params=SamplingParams(temperature=0, max_new_tokens=6))
    q.put(prompts[2], "gone", params=long)
    assert q.cancel("gone") and len(q) == 2
    q.put(prompts[3], "late", params=SamplingParams(temperature=0, max_new_tokens=30))
    q.close()
    engine = RolloutEngine(model, sync_every=2)
    groups = {g.prompt_index: g for g in engine.generate_stream(q, SamplingParams(max_new_tokens=40), max_rows=3)}
    assert sorted(groups) == ["late", "long", "short"]
    [c] = groups["long"]
    assert c.finish_reason == "abort" and 4 <= len(c) < 40 and seen[-1].finish_reason == "abort"
    assert c.completion_ids.tolist() == greedy(model, prompts[0], len(c))
    assert sum((d.token_ids for d in seen), []) == c.completion_ids.tolist()
    assert groups["short"][0].finish_reason == "length" and len(groups["late"][0]) == 30


def test_top_logprobs(model):
    """Groups asking for k alternatives get ``[T, k]`` ids and logprobs: the k most likely
    tokens under the temperature-scaled distribution of a full forward (the sampled token's
    logprob among them when it is one of them); others get None; deltas carry them too."""
    prompts = random_prompts([6, 9, 4], seed=45)
    deltas = []
    q = PromptQueue()
    q.put(prompts[0], params=SamplingParams(temperature=0.7, max_new_tokens=7, n=2, top_logprobs=3),
          listener=deltas.append)
    q.put(prompts[1], params=SamplingParams(temperature=0, max_new_tokens=5))
    q.put(prompts[2], params=SamplingParams(temperature=0, max_new_tokens=6, top_logprobs=1))
    q.close()
    groups = {g.prompt_index: g for g in RolloutEngine(model, sync_every=3).generate_stream(
        q, SamplingParams(n=2, max_new_tokens=8))}
    assert groups[1][0].top_logprobs is None
    for key, k, t in ((0, 3, 0.7), (2, 1, 1.0)):
        for c in groups[key]:
            ids, lps = c.top_logprobs
            assert ids.shape == lps.shape == (len(c), k)
            seq = prompts[key] + c.completion_ids.tolist()
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, len(prompts[key]) - 1 : -1]
            ref = torch.log_softmax(logits / t, -1).topk(k)
            assert torch.equal(ids, ref.indices)
            assert torch.allclose(lps, ref.values, rtol=1e-9, atol=1e-12)
    assert torch.equal(groups[2][0].top_logprobs[0][:, 0], groups[2][0].completion_ids)  # greedy: the top token
    for c in groups[0]:
        mine = [d for d in deltas if d.branch == c.branch]
        tops = sum((d.top_logprobs for d in mine), [])
        assert tops == [list(zip(i.tolist(), x.tolist())) for i, x in zip(*c.top_logprobs)]
