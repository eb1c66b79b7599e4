"""EngineLoop: requests with their own sampling settings share one running batch (float64
tiny Qwen3, CPU). A short request sent while a long one runs finishes first; mixed
settings; seeds independent of batch mates; cancel; streamed deltas; greedy outputs equal
per-prompt full forwards. Synchronised with listener events, never sleeps."""

import threading

import pytest
import torch

from helpers.models import tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import random_prompts
from treerl.rollout import RolloutEngine, SamplingParams
from treerl.serve import EngineLoop


@pytest.fixture(scope="module")
def model():
    """The references' model: the same weights as the loop's, another module (the running
    stream sets its own model's attention implementation)."""
    return tiny_model()


@pytest.fixture(scope="module")
def served():
    return tiny_model()


@pytest.fixture
def loop(served):
    loop = EngineLoop(RolloutEngine(served, sync_every=2), idle_timeout_s=30)
    yield loop
    loop.stop()


def greedy(model, prompt, max_new):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def started(n_deltas=1):
    """A listener that records deltas and sets an event after ``n_deltas`` of them."""
    event, deltas = threading.Event(), []

    def listen(d):
        deltas.append(d)
        if len(deltas) >= n_deltas:
            event.set()

    return listen, event, deltas


def test_short_request_finishes_while_a_long_one_runs(model, loop):
    prompts = random_prompts([6, 4], seed=50)
    listen, running, deltas = started()
    long = loop.submit(prompts[0], SamplingParams(temperature=0, max_new_tokens=80), listener=listen)
    assert running.wait(60)
    [short] = loop.submit(prompts[1], SamplingParams(temperature=0, max_new_tokens=3)).result(60)
    assert not long.done() and len(short) == 3
    assert short.completion_ids.tolist() == greedy(model, prompts[1], 3)
    [c] = long.result(120)
    assert c.completion_ids.tolist() == greedy(model, prompts[0], 80)
    assert torch.allclose(c.logprobs, completion_logprobs(model, prompts[0], c.completion_ids.tolist()),
                          rtol=1e-9, atol=1e-12)
    assert sum((d.token_ids for d in deltas), []) == c.completion_ids.tolist()
    assert deltas[-1].finish_reason == "length" and {d.branch for d in deltas} == {(0,)}
    assert loop.stats.streams == 1


def test_mixed_settings_and_n_in_one_batch(model, loop):
    prompts = random_prompts([5, 7, 3, 9], seed=51)
    settings = [SamplingParams(temperature=0, max_new_tokens=9),
                SamplingParams(temperature=0.7, top_k=20, max_new_tokens=5, n=3),
                SamplingParams(temperature=1.2, top_p=0.8, min_p=0.02, max_new_tokens=12, n=2),
                SamplingParams(temperature=0, max_new_tokens=4, n=2)]
    futures = [loop.submit(p, s) for p, s in zip(prompts, settings)]
    for f, p, s in zip(futures, prompts, settings):
        out = f.result(120)
        assert len(out) == s.n and [c.branch for c in out] == [(j,) for j in range(s.n)]
        for c in out:
            assert len(c) == s.max_new_tokens
            if s.greedy:
                assert c.completion_ids.tolist() == greedy(model, p, s.max_new_tokens)
            lp = completion_logprobs(model, p, c.completion_ids.tolist(), temperature=s.temperature or 1.0)
            assert torch.allclose(c.logprobs, lp, rtol=1e-9, atol=1e-12)
    assert loop.stats.completed == 4 and loop.stats.samples == 8


def test_seed_reproducible_whatever_runs_beside_it(loop):
    prompts = random_prompts([6, 8, 5], seed=52)
    seeded = SamplingParams(temperature=1.0, max_new_tokens=10, n=2, seed=77)
    alone = [c.completion_ids.tolist() for c in loop.submit(prompts[0], seeded).result(60)]
    assert alone[0] != alone[1]  # the two samples of one request differ
    listen, running, _ = started()
    other = loop.submit(prompts[1], SamplingParams(temperature=0.9, max_new_tokens=30, n=3), listener=listen)
    assert running.wait(60)  # the batch mates are running
    mixed = loop.submit(prompts[0], seeded)
    loop.submit(prompts[2], SamplingParams(temperature=1.3, max_new_tokens=6))
    assert [c.completion_ids.tolist() for c in mixed.result(60)] == alone
    other.result(60)


def test_cancel_frees_the_rows(model, loop):
    prompts = random_prompts([6, 4], seed=53)
    listen, running, deltas = started(2)
    fut = loop.submit(prompts[0], SamplingParams(temperature=0, max_new_tokens=200, n=2), listener=listen)
    assert running.wait(60)
    loop.cancel(fut)
    out = fut.result(60)
    assert [c.finish_reason for c in out] == ["abort", "abort"] and all(len(c) < 200 for c in out)
    for c in out:
        assert c.completion_ids.tolist() == greedy(model, prompts[0], len(c))
    [c] = loop.submit(prompts[1], SamplingParams(temperature=0, max_new_tokens=5)).result(60)
    assert len(c) == 5 and loop.busy == 0 and loop.stats.cancelled == 1
    assert loop.drain(60)
    loop.cancel(fut)  # resolved already: a no-op


def test_bad_settings_are_refused_by_name(loop):
    with pytest.raises(ValueError, match="min_p"):
        loop.submit([1, 2], SamplingParams(min_p=2.0))
    with pytest.raises(ValueError, match="branch_points"):
        loop.submit([1, 2], SamplingParams(branch_points=[2], max_new_tokens=8))
