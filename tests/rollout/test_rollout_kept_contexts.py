"""Finished rows' contexts kept in the prefix cache (treerl.rollout.kept_contexts): an agent's
next turn (its prompt + completion + new tokens) prefills only its new tokens and the last
completion token, and its greedy output and logprobs equal a forward of the sequence alone
in float64; kept entries without logits; contexts of other weights are not kept."""

import pytest
import torch

from helpers.models import tiny_model
from helpers.reference import completion_logprobs
from helpers.rollout import greedy_reference, long_target_length, random_prompts, sampling, target_length
from treerl.rollout import PromptQueue, RolloutEngine
from treerl.rollout.prefix_cache import PrefixCache, PrefixEntry

MAX_NEW = 24
GRAPH_TOKENS = {False: 0, True: 512}  # fixed-shape variants prefill in buckets, as CUDA does


@pytest.fixture(scope="module")
def model():
    return tiny_model(max_position_embeddings=256)  # a known context: groups of one row keep prompts in own blocks


def check(model, prompt, completion):
    ref = greedy_reference(model, prompt, MAX_NEW)
    assert completion.completion_ids.tolist() == ref
    assert completion.finish_reason == ("stop" if target_length(ref) <= MAX_NEW else "length")
    lp = completion_logprobs(model, prompt, ref)
    assert torch.allclose(completion.logprobs.double(), lp, rtol=1e-9, atol=1e-12), (completion.logprobs - lp).abs().max()


@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
def test_next_turn_prefills_only_what_follows_the_kept_context(model, static_kv):
    """Turn 1's finished row leaves prompt + completion (but its last token) in the prefix
    cache; turn 2 (prompt + completion + 3 tokens) prefills 4 tokens; a prompt equal to the
    kept context reuses all but its last token."""
    engine = RolloutEngine(model, sync_every=3, prefix_cache_tokens=4000, static_kv=static_kv, kv_block_size=16,
                           prefill_graph_tokens=GRAPH_TOKENS[static_kv])
    p1 = random_prompts([21], seed=3)[0]
    [[c1]] = engine.generate_stream([p1], sampling(MAX_NEW, n=1))
    check(model, p1, c1)
    s = engine.stats
    assert (s.contexts_kept, s.prefill_tokens, s.prefix_cache_hit_tokens) == (1, 21, 0)
    done = p1 + c1.completion_ids.tolist()
    p2 = done + [5, 6, 7]
    [[c2]] = engine.generate_stream([p2], sampling(MAX_NEW, n=1))
    check(model, p2, c2)
    s = engine.stats
    assert (s.prefill_tokens, s.prefix_cache_hit_tokens) == (4, len(done) - 1)
    p3 = p2 + c2.completion_ids.tolist()[:-1]  # exactly turn 2's kept context
    [[c3]] = engine.generate_stream([p3], sampling(MAX_NEW, n=1))
    check(model, p3, c3)
    assert (engine.stats.prefill_tokens, engine.stats.prefix_cache_hit_tokens) == (1, len(p3) - 1)


@pytest.mark.parametrize("sync_every", [1, 4])
def test_agents_in_one_stream_reuse_their_contexts_while_blocks_are_reused(model, sync_every):
    """Six conversations of three turns through one stream, each next turn queued as its
    last finishes: finished rows' blocks go to other rows at once (a pool of few blocks), and
    every turn's greedy output still equals a forward of its sequence alone; each turn after
    the first prefills only its new tokens and its last turn's last token."""
    engine = RolloutEngine(model, sync_every=sync_every, prefix_cache_tokens=8000, static_kv=True, kv_block_size=16,
                           prefill_graph_tokens=512, max_batch_tokens=1024)
    first = random_prompts([9, 30, 17, 44, 12, 25], seed=8)
    queue = PromptQueue()
    queue.put_many([((a, 0), p) for a, p in enumerate(first)])
    prompts, turns, new, expected_hits = {(a, 0): p for a, p in enumerate(first)}, 3, 0, 0
    out = {}
    for group in engine.generate_stream(queue, sampling(MAX_NEW, n=1), max_rows=3):
        (a, t), [c] = group.prompt_index, group
        out[(a, t)] = c
        if t + 1 < turns:
            done = prompts[(a, t)] + c.completion_ids.tolist()
            extra = random_prompts([1 + (a + t) % 5], seed=100 * a + t)[0]
            prompts[(a, t + 1)] = done + extra
            expected_hits += len(done) - 1
            new += 1 + len(extra)
            queue.put(prompts[(a, t + 1)], key=(a, t + 1))
            if len(prompts) == len(first) * turns:  # every last turn queued
                queue.close()
    for key, c in out.items():  # (the model's own forward, after the stream)
        check(model, prompts[key], c)
    s = engine.stats
    assert s.contexts_kept == len(first) * turns
    assert s.prefix_cache_hit_tokens == expected_hits
    assert s.prefill_tokens == sum(map(len, first)) + new


@torch.no_grad()
def assert_entries_equal_a_prefill(engine) -> int:
    """Every stored entry's K/V (and logits, where it has them) equals a prefill of its
    tokens alone, in float64. Returns how many entries."""
    for tokens, e in list(engine.prefix_cache._entries.items()):
        cache, _, logits = engine.prefiller([list(tokens)], None, None)
        C = cache.length
        for got, want in ((e.keys, cache.all_keys[:, 0, :, C - len(tokens):]),
                          (e.values, cache.all_values[:, 0, :, C - len(tokens):])):
            assert got.shape == want.shape and torch.allclose(got, want, rtol=1e-9, atol=1e-12), len(tokens)
        if e.logits is not None:
            assert torch.allclose(e.logits, logits[0].to(e.logits.dtype), rtol=1e-9, atol=1e-12)
    return len(engine.prefix_cache)


@pytest.mark.parametrize("static_kv", [False, True], ids=["sliced-kv", "static-kv"])
def test_kept_contexts_under_preemption_equal_a_prefill(model, static_kv):
    """Eight conversations of three turns through a pool too small for them (groups are
    preempted and recomputed): every turn equals the greedy reference, and every entry the
    cache holds afterwards (prompts and kept contexts) equals a prefill of its tokens."""
    engine = RolloutEngine(model, sync_every=1, prefix_cache_tokens=100_000, static_kv=static_kv, kv_block_size=16,
                           max_batch_tokens=16 * 16, prefill_graph_tokens=GRAPH_TOKENS[static_kv])
    first = random_prompts([40, 70, 33, 90, 21, 55, 60, 17], seed=11)
    p = sampling(40, length=long_target_length, n=1)
    queue = PromptQueue()
    queue.put_many([((a, 0), q) for a, q in enumerate(first)])
    prompts, out = {(a, 0): q for a, q in enumerate(first)}, {}
    for g in engine.generate_stream(queue, p, max_rows=6):
        (a, t), [c] = g.prompt_index, g
        out[(a, t)] = c
        if t < 2:
            prompts[(a, t + 1)] = prompts[(a, t)] + c.completion_ids.tolist() + [3 + a, 4]
            queue.put(prompts[(a, t + 1)], key=(a, t + 1))
            if len(prompts) == 3 * len(first):
                queue.close()
    assert engine.stats.preemptions > 0 and engine.stats.contexts_kept > 0, engine.stats
    for key, c in out.items():
        assert c.completion_ids.tolist() == greedy_reference(model, prompts[key], 40, long_target_length), key
    assert assert_entries_equal_a_prefill(engine) >= len(first)


def test_contexts_of_other_weights_are_not_kept(model):
    """A row whose K/V predates a weight update (not recomputed yet when it finished) leaves
    nothing; rows of groups of several rows (prompt store, not own blocks) leave nothing."""
    engine = RolloutEngine(model, sync_every=2, prefix_cache_tokens=4000)
    p = random_prompts([15], seed=5)[0]
    [g] = engine.generate_stream([p], sampling(MAX_NEW, n=2))
    assert engine.stats.contexts_kept == 0 and len(g) == 2
    from treerl.rollout.kept_contexts import KeptContext, keep

    class Host:
        kept = [KeptContext((1, 2, 3), torch.zeros(1, dtype=torch.int64).numpy(), version=0)]

    assert keep(Host, None, engine.prefix_cache, version=1) == 0 and Host.kept == []


def test_a_shared_prefix_is_reused_up_to_where_the_prompt_needs_logits():
    """Prompts that share only a prefix (at least one block) with an entry reuse that prefix;
    a prompt that is a strict prefix of an entry reuses all but its last token."""
    c = PrefixCache(max_tokens=1000)
    tokens = tuple(range(100, 150))  # 50 tokens: 3 full blocks of 16
    k = torch.arange(50.0).view(1, 1, 50, 1)
    c.insert(PrefixEntry(tokens, k, k.clone(), torch.zeros(3), 0))
    retry = list(tokens[:40]) + [7, 7, 7]
    e = c.lookup(retry, 0)
    assert e.tokens == tokens[:40] and e.keys[0, 0, :, 0].tolist() == list(range(40)) and e.logits is None
    assert c.hit_tokens(retry, 0) == 40
    assert c.lookup(list(tokens[:33]), 0).tokens == tokens[:32]  # the prompt's last token: computed
    assert c.lookup(list(tokens), 0).logits is not None  # the whole entry, with its logits
    assert c.lookup(list(tokens[:15]) + [1], 0) is None  # less than a block shared: not indexed
    assert c.lookup(list(tokens[:16]) + [1], 0).tokens == tokens[:16]
    c.insert(PrefixEntry(tokens[:20] + (9,) * 30, k, k.clone(), torch.zeros(3), 0))  # shares 20 tokens
    assert c.lookup(list(tokens[:20]) + [9] * 10 + [5], 0).tokens == tokens[:20] + (9,) * 10
    assert c.lookup(list(tokens[:45]) + [5], 0).tokens == tokens[:45]
    c.insert(PrefixEntry(tokens + (1,), k, k.clone(), None, 0))  # supersedes the first: its prefixes still reused
    assert len(c) == 2 and c.lookup(retry, 0).tokens == tokens[:40] and c.tokens == 51 + 50
    assert c.lookup([3, 3], 1) is None and len(c) == 0 and not c._shared and not c._chains


def test_an_entry_without_logits_is_reused_up_to_its_last_token():
    c = PrefixCache(max_tokens=100)
    k = torch.arange(5.0).view(1, 1, 5, 1)
    c.insert(PrefixEntry((1, 2, 3, 4, 5), k, k.clone(), None, 0))
    longer = c.lookup([1, 2, 3, 4, 5, 6], 0)
    assert longer.tokens == (1, 2, 3, 4, 5) and c.hit_tokens([1, 2, 3, 4, 5, 6], 0) == 5
    same = c.lookup([1, 2, 3, 4, 5], 0)
    assert same.tokens == (1, 2, 3, 4) and same.keys.shape[2] == 4 and same.logits is None
    assert c.hit_tokens([1, 2, 3, 4, 5], 0) == 4 and len(c) == 1 and c.tokens == 5
    c.insert(PrefixEntry((9,), k[:, :, :1], k[:, :, :1], None, 0))
    assert c.lookup([9], 0) is None and c.hit_tokens([9], 0) == 0


def test_a_one_token_completion_keeps_the_prompt_entry_and_its_logits(model):
    """A row that finishes after one token has its prompt as context: nothing is kept (the
    prompt's entry, with its logits, stays), and the same prompt again prefills nothing."""
    engine = RolloutEngine(model, prefix_cache_tokens=4000, kv_block_size=16)
    p = random_prompts([21], seed=3)[0]
    [[c]] = engine.generate_stream([p], sampling(1, n=1))
    assert engine.stats.contexts_kept == 0 and engine.prefix_cache.lookup(p, engine.version).logits is not None
    [[again]] = engine.generate_stream([p], sampling(1, n=1))
    assert engine.stats.prefill_tokens == 0 and again.completion_ids.tolist() == c.completion_ids.tolist()


def test_the_longest_shared_prefix_is_found_past_a_block_boundary():
    """An entry that shares a few tokens past the prompt's last full shared block beats one
    that the prompt merely starts with (the boundary search goes on while a longer one can
    be there)."""
    c = PrefixCache(max_tokens=1000)
    k = torch.zeros(1, 1, 57, 1)
    c.insert(PrefixEntry(tuple(range(47)) + (900,) * 10, k, k, torch.zeros(3), 0))
    c.insert(PrefixEntry(tuple(range(40)), k[:, :, :40], k[:, :, :40], torch.zeros(3), 0))
    query = list(range(47)) + [1, 2, 3]
    assert c.lookup(query, 0).tokens == tuple(range(47)) and c.hit_tokens(query, 0) == 47
    assert c.holds(tuple(range(47))) and not c.holds(tuple(range(48)))
